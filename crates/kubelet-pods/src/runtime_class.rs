//! One node, several runtimes: a [`Provider`] that hands each pod to the
//! provider of its RuntimeClass's handler, and every other pod to a default
//! one (the kubelet's `--container-runtime-endpoint` with RuntimeClass
//! handlers).
//!
//! A pod's handler comes from its `spec.runtimeClassName`: standalone, the
//! class name is the handler; in cluster mode the RuntimeClass objects of
//! the API name the handlers (cluster mode follows them into the
//! [`ClassHandlers`] table given in its settings), and a class the API does
//! not have fails the pod (`RuntimeClass "x" not found`). A class that maps
//! to no provider fails the pod's container with a clear reason
//! (`CreateContainerConfigError`).
//!
//! A RuntimeClass's `scheduling` (node selector, tolerations) and
//! `overhead` are applied before the pod reaches the node (the scheduler
//! and the RuntimeClass admission plugin); the node reads only `handler`.
//!
//! Containers are routed back by their ids: each id is remembered with the
//! provider that started it (and, after a restart of the node, with the one
//! that listed it running). The node's labels and taints are the default
//! provider's.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use async_trait::async_trait;
use k8s_openapi::api::core::v1::{Container, Pod, Taint};

use crate::provider::{
    ContainerExit, ContainerGcReport, ContainerId, ContainerLaunch, ContainerStats, ExecOutput, ImageGcPolicy,
    ImageGcReport, PreparedImage, Provider, ProviderError, ProviderErrorKind, PullSecrets, RunningContainer,
    StreamRequest, StreamingEndpoint,
};

/// The pod UID and the provider of a container.
type Owner = (String, Arc<dyn Provider>);

/// RuntimeClass name → handler. Standalone (the default) a class missing
/// from the table is its own handler; once [`ClassHandlers::from_api`] is
/// called, the table is the API's and a missing class is not found. Cheap
/// to clone; clones share the table.
#[derive(Clone, Debug, Default)]
pub struct ClassHandlers {
    inner: Arc<RwLock<ClassTable>>,
}

#[derive(Debug, Default)]
struct ClassTable {
    /// Whether the table is the API's (cluster mode).
    from_api: bool,
    /// Whether the API's objects were listed once.
    listed: bool,
    handlers: BTreeMap<String, String>,
}

impl ClassHandlers {
    fn read(&self) -> std::sync::RwLockReadGuard<'_, ClassTable> {
        self.inner.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, ClassTable> {
        self.inner.write().unwrap_or_else(|p| p.into_inner())
    }

    /// From now on the table holds the API's RuntimeClass objects.
    pub fn from_api(&self) {
        self.write().from_api = true;
    }

    /// The API's objects were listed (a class missing now is not found).
    pub fn listed(&self) {
        self.write().listed = true;
    }

    /// RuntimeClass `class` names handler `handler`.
    pub fn set(&self, class: &str, handler: &str) {
        self.write().handlers.insert(class.to_owned(), handler.to_owned());
    }

    /// RuntimeClass `class` is gone.
    pub fn remove(&self, class: &str) {
        self.write().handlers.remove(class);
    }

    /// The classes in the table.
    pub fn names(&self) -> Vec<String> {
        self.read().handlers.keys().cloned().collect()
    }

    /// The handler of `class`, or why there is none.
    pub(crate) fn handler_of(&self, class: &str) -> Result<String, RuntimeClassError> {
        let table = self.read();
        match table.handlers.get(class) {
            Some(handler) => Ok(handler.clone()),
            None if !table.from_api => Ok(class.to_owned()),
            None if !table.listed => Err(RuntimeClassError::NotListedYet(class.to_owned())),
            None => Err(RuntimeClassError::NotFound(class.to_owned())),
        }
    }
}

/// Why a pod's RuntimeClass has no handler.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum RuntimeClassError {
    /// The API's RuntimeClasses are still being listed.
    #[error("RuntimeClass {0:?} not known yet: the API's are being listed")]
    NotListedYet(String),
    /// The API has no RuntimeClass of that name.
    #[error("RuntimeClass {0:?} not found")]
    NotFound(String),
}

/// Providers by RuntimeClass handler, and a default.
pub struct RuntimeClasses {
    default: Arc<dyn Provider>,
    default_name: String,
    handlers: BTreeMap<String, Arc<dyn Provider>>,
    /// RuntimeClass name → handler.
    classes: ClassHandlers,
    /// Which provider started (or runs) each container, and its pod's UID
    /// (forgotten when the pod is removed).
    owners: Mutex<HashMap<ContainerId, Owner>>,
}

impl std::fmt::Debug for RuntimeClasses {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RuntimeClasses")
            .field("default", &self.default_name)
            .field("handlers", &self.handlers.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

impl RuntimeClasses {
    /// Pods without a runtime class run on `default` (named `name` in
    /// messages).
    pub fn new(name: &str, default: Arc<dyn Provider>) -> RuntimeClasses {
        RuntimeClasses {
            default,
            default_name: name.to_owned(),
            handlers: BTreeMap::new(),
            classes: ClassHandlers::default(),
            owners: Mutex::default(),
        }
    }

    /// Pods whose runtime class has handler `handler` run on `provider`.
    pub fn with_handler(mut self, handler: &str, provider: Arc<dyn Provider>) -> RuntimeClasses {
        self.handlers.insert(handler.to_owned(), provider);
        self
    }

    /// The class → handler table (cluster mode fills it from the API).
    pub fn class_handlers(&self) -> ClassHandlers {
        self.classes.clone()
    }

    fn provider_for(&self, pod: &Pod) -> Result<Arc<dyn Provider>, ProviderError> {
        let Some(class) = pod.spec.as_ref().and_then(|s| s.runtime_class_name.as_deref()) else {
            return Ok(Arc::clone(&self.default));
        };
        let handler =
            self.classes.handler_of(class).map_err(|e| ProviderError::new(ProviderErrorKind::Config, e.to_string()))?;
        if handler == self.default_name {
            return Ok(Arc::clone(&self.default));
        }
        self.handlers.get(&handler).cloned().ok_or_else(|| {
            let known: Vec<&str> =
                std::iter::once(self.default_name.as_str()).chain(self.handlers.keys().map(String::as_str)).collect();
            ProviderError::new(
                ProviderErrorKind::Config,
                format!(
                    "RuntimeClass {class:?} (handler {handler:?}) has no runtime on this node; it runs {}",
                    known.join(", ")
                ),
            )
        })
    }

    fn owner(&self, id: &ContainerId) -> Result<Arc<dyn Provider>, ProviderError> {
        self.owners
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)
            .map(|(_, provider)| Arc::clone(provider))
            .ok_or_else(|| ProviderError::new(ProviderErrorKind::NotFound, format!("no runtime knows container {id}")))
    }

    fn all(&self) -> impl Iterator<Item = &Arc<dyn Provider>> {
        std::iter::once(&self.default).chain(self.handlers.values())
    }
}

#[async_trait]
impl Provider for RuntimeClasses {
    async fn prepare_image(&self, pod: &Pod, container: &Container) -> Result<PreparedImage, ProviderError> {
        self.provider_for(pod)?.prepare_image(pod, container).await
    }

    async fn prepare_image_with_secrets(
        &self,
        pod: &Pod,
        container: &Container,
        secrets: &PullSecrets,
    ) -> Result<PreparedImage, ProviderError> {
        self.provider_for(pod)?.prepare_image_with_secrets(pod, container, secrets).await
    }

    async fn prepare_pod(
        &self,
        pod: &Pod,
        log_directory: &std::path::Path,
    ) -> Result<Vec<std::net::IpAddr>, ProviderError> {
        self.provider_for(pod)?.prepare_pod(pod, log_directory).await
    }

    fn mounts_files(&self, pod: &Pod) -> bool {
        self.provider_for(pod).is_ok_and(|p| p.mounts_files(pod))
    }

    fn reads_cdi(&self, pod: &Pod) -> bool {
        self.provider_for(pod).is_ok_and(|p| p.reads_cdi(pod))
    }

    async fn update_container_resources(
        &self,
        pod: &Pod,
        id: &ContainerId,
        container: &Container,
    ) -> Result<(), ProviderError> {
        self.provider_for(pod)?.update_container_resources(pod, id, container).await
    }

    async fn update_pod_resources(&self, pod: &Pod) -> Result<(), ProviderError> {
        self.provider_for(pod)?.update_pod_resources(pod).await
    }

    fn runtime_version(&self) -> String {
        self.default.runtime_version()
    }

    fn supports_strict_supplemental_groups(&self) -> bool {
        self.default.supports_strict_supplemental_groups()
    }

    fn network_readiness(&self, pod: &Pod) -> Option<tokio::sync::watch::Receiver<Option<String>>> {
        self.provider_for(pod).ok()?.network_readiness(pod)
    }

    async fn start_container(&self, launch: &ContainerLaunch) -> Result<ContainerId, ProviderError> {
        let provider = self.provider_for(&launch.pod)?;
        let id = provider.start_container(launch).await?;
        let uid = launch.pod.metadata.uid.clone().unwrap_or_default();
        self.owners.lock().unwrap_or_else(|p| p.into_inner()).insert(id.clone(), (uid, provider));
        Ok(id)
    }

    async fn wait_container(&self, id: &ContainerId) -> Result<ContainerExit, ProviderError> {
        self.owner(id)?.wait_container(id).await
    }

    async fn stop_container(&self, id: &ContainerId, grace: Duration) -> Result<(), ProviderError> {
        self.owner(id)?.stop_container(id, grace).await
    }

    async fn exec_sync(
        &self,
        id: &ContainerId,
        command: &[String],
        timeout: Duration,
    ) -> Result<ExecOutput, ProviderError> {
        self.owner(id)?.exec_sync(id, command, timeout).await
    }

    async fn exec(&self, id: &ContainerId, request: &StreamRequest) -> Result<StreamingEndpoint, ProviderError> {
        self.owner(id)?.exec(id, request).await
    }

    async fn attach(&self, id: &ContainerId, request: &StreamRequest) -> Result<StreamingEndpoint, ProviderError> {
        self.owner(id)?.attach(id, request).await
    }

    async fn container_stats(&self, id: &ContainerId) -> Result<ContainerStats, ProviderError> {
        self.owner(id)?.container_stats(id).await
    }

    async fn started_at(&self, id: &ContainerId) -> Result<jiff::Timestamp, ProviderError> {
        self.owner(id)?.started_at(id).await
    }

    async fn pod_stats(&self, pod: &Pod) -> Result<kubelet_provider::PodStats, ProviderError> {
        self.provider_for(pod)?.pod_stats(pod).await
    }

    async fn port_forward(&self, pod_uid: &str, ports: &[u16]) -> Result<StreamingEndpoint, ProviderError> {
        // The provider of any of the pod's containers runs its network.
        let provider = self
            .owners
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .find(|(uid, _)| uid == pod_uid)
            .map(|(_, provider)| Arc::clone(provider));
        match provider {
            Some(provider) => provider.port_forward(pod_uid, ports).await,
            None => Err(ProviderError::new(ProviderErrorKind::NotFound, format!("no runtime runs pod {pod_uid}"))),
        }
    }

    async fn running_containers(&self) -> Result<Vec<RunningContainer>, ProviderError> {
        let mut running = Vec::new();
        for provider in self.all() {
            for container in provider.running_containers().await? {
                let owner = (container.pod_uid.clone(), Arc::clone(provider));
                self.owners.lock().unwrap_or_else(|p| p.into_inner()).insert(container.id.clone(), owner);
                running.push(container);
            }
        }
        Ok(running)
    }

    async fn list_running(&self) -> Result<Vec<(String, ContainerId)>, ProviderError> {
        let mut running = Vec::new();
        let mut supported = false;
        for provider in self.all() {
            match provider.list_running().await {
                Ok(listed) => {
                    supported = true;
                    running.extend(listed);
                }
                Err(error) if error.kind == ProviderErrorKind::Unsupported => {}
                Err(error) => return Err(error),
            }
        }
        if supported {
            Ok(running)
        } else {
            Err(ProviderError::new(ProviderErrorKind::Unsupported, "no runtime lists its running containers"))
        }
    }

    async fn pod_ips(&self, pod_uid: &str) -> Vec<std::net::IpAddr> {
        for provider in self.all() {
            let ips = provider.pod_ips(pod_uid).await;
            if !ips.is_empty() {
                return ips;
            }
        }
        Vec::new()
    }

    async fn remove_pod(&self, pod_uid: &str) -> Result<(), ProviderError> {
        self.owners.lock().unwrap_or_else(|p| p.into_inner()).retain(|_, (uid, _)| uid != pod_uid);
        let mut failures = Vec::new();
        for provider in self.all() {
            if let Err(error) = provider.remove_pod(pod_uid).await {
                failures.push(error.message);
            }
        }
        if failures.is_empty() {
            Ok(())
        } else {
            Err(ProviderError::new(ProviderErrorKind::Other, failures.join("; ")))
        }
    }

    fn runtime_type(&self, pod: &Pod) -> String {
        self.provider_for(pod).map(|p| p.runtime_type(pod)).unwrap_or_default()
    }

    fn node_labels(&self) -> BTreeMap<String, String> {
        self.default.node_labels()
    }

    fn node_taints(&self) -> Vec<Taint> {
        self.default.node_taints()
    }

    fn pod_overhead(&self, pod: &Pod) -> u128 {
        self.provider_for(pod).map(|p| p.pod_overhead(pod)).unwrap_or(0)
    }

    async fn collect_containers(&self, keep: usize) -> Result<ContainerGcReport, ProviderError> {
        let mut report = ContainerGcReport::default();
        for provider in self.all() {
            match provider.collect_containers(keep).await {
                Ok(one) => report.removed.extend(one.removed),
                Err(error) if error.kind == ProviderErrorKind::Unsupported => {}
                Err(error) => return Err(error),
            }
        }
        Ok(report)
    }

    async fn collect_images(&self, policy: &ImageGcPolicy, all_unused: bool) -> Result<ImageGcReport, ProviderError> {
        // The default runtime's images are the node's.
        self.default.collect_images(policy, all_unused).await
    }

    async fn reopen_container_log(&self, id: &ContainerId) -> Result<(), ProviderError> {
        self.owner(id)?.reopen_container_log(id).await
    }

    async fn image_fs_path(&self) -> Option<std::path::PathBuf> {
        // The default runtime's images are the node's.
        self.default.image_fs_path().await
    }

    async fn runtime_process(&self) -> Option<u32> {
        self.default.runtime_process().await
    }

    fn pod_ceiling(&self) -> Option<(usize, String)> {
        // All providers share the node's process: the lowest ceiling holds.
        std::iter::once(&self.default).chain(self.handlers.values()).filter_map(|p| p.pod_ceiling()).min_by_key(|c| c.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn standalone_a_class_is_its_handler_and_from_the_api_it_must_exist() {
        let classes = ClassHandlers::default();
        assert_eq!(classes.handler_of("wasmtime"), Ok("wasmtime".to_owned()));
        classes.from_api();
        assert_eq!(classes.handler_of("wasm"), Err(RuntimeClassError::NotListedYet("wasm".into())));
        assert!(classes.handler_of("wasm").expect_err("not listed").to_string().contains("not known yet"));
        classes.set("wasm", "wasmtime");
        classes.listed();
        assert_eq!(classes.handler_of("wasm"), Ok("wasmtime".to_owned()));
        assert_eq!(
            classes.handler_of("kata").map_err(|e| e.to_string()),
            Err("RuntimeClass \"kata\" not found".to_owned())
        );
        classes.remove("wasm");
        assert_eq!(classes.names(), Vec::<String>::new());
        assert_eq!(classes.handler_of("wasm"), Err(RuntimeClassError::NotFound("wasm".into())));
    }
}
