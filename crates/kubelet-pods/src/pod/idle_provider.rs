//! A provider for unit tests that run nothing: it has no containers and
//! takes the trait's defaults for everything else (no exec, no listing).

use std::time::Duration;

use k8s_openapi::api::core::v1::{Container, Pod};

use crate::provider::{
    ContainerExit, ContainerId, ContainerLaunch, PreparedImage, Provider, ProviderError, RunningContainer,
};

/// Runs nothing; a test that makes it start a container panics.
pub(crate) struct IdleProvider;

#[async_trait::async_trait]
impl Provider for IdleProvider {
    async fn prepare_image(&self, _: &Pod, _: &Container) -> Result<PreparedImage, ProviderError> {
        unimplemented!("not used")
    }
    async fn start_container(&self, _: &ContainerLaunch) -> Result<ContainerId, ProviderError> {
        unimplemented!("not used")
    }
    async fn wait_container(&self, _: &ContainerId) -> Result<ContainerExit, ProviderError> {
        unimplemented!("not used")
    }
    async fn stop_container(&self, _: &ContainerId, _: Duration) -> Result<(), ProviderError> {
        unimplemented!("not used")
    }
    async fn running_containers(&self) -> Result<Vec<RunningContainer>, ProviderError> {
        Ok(Vec::new())
    }
}
