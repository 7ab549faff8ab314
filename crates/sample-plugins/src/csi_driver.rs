//! A CSI driver serving Identity and Node, with a configurable `NodeGetInfo`.
//! Volume RPCs answer `Unimplemented` until the volume stages need them.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use kubelet_api::csi::v1::identity_server::{Identity, IdentityServer};
use kubelet_api::csi::v1::node_server::{Node, NodeServer};
use kubelet_api::csi::v1::*;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::registration::{self, Behaviour, RegistrationPlugin};
use crate::report::{Report, Reporter};

/// How the driver answers `NodeGetInfo`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum NodeGetInfoBehaviour {
    /// Answer with the configured node facts.
    #[default]
    Normal,
    /// Never answer.
    Hang,
    /// Answer with an error status.
    Fail,
}

/// What the driver says about itself and the node.
#[derive(Clone, Debug, Default)]
pub struct CsiDriverConfig {
    /// Driver name (`GetPluginInfo.name`).
    pub name: String,
    /// Node ID returned by `NodeGetInfo`.
    pub node_id: String,
    /// `max_volumes_per_node` (0: no limit).
    pub max_volumes_per_node: i64,
    /// Topology segments.
    pub topology: HashMap<String, String>,
    /// How `NodeGetInfo` behaves.
    pub node_get_info: NodeGetInfoBehaviour,
}

/// A fake CSI driver on one endpoint socket.
#[derive(Clone)]
pub struct FakeCsiDriver {
    endpoint: PathBuf,
    config: Arc<CsiDriverConfig>,
    reporter: Reporter,
}

impl FakeCsiDriver {
    /// A driver serving on `endpoint`.
    pub fn new(endpoint: impl Into<PathBuf>, config: CsiDriverConfig, reporter: Reporter) -> Self {
        FakeCsiDriver { endpoint: endpoint.into(), config: Arc::new(config), reporter }
    }

    /// Binds the endpoint now and serves until `shutdown`.
    pub fn spawn(self, shutdown: CancellationToken) -> std::io::Result<tokio::task::JoinHandle<()>> {
        let listener = kubelet_api::uds::bind(&self.endpoint).map_err(std::io::Error::other)?;
        let endpoint = self.endpoint.clone();
        Ok(tokio::spawn(async move {
            let router = tonic::transport::Server::builder()
                .add_service(IdentityServer::new(self.clone()))
                .add_service(NodeServer::new(self));
            if let Err(error) = kubelet_api::uds::serve(router, listener, shutdown.cancelled_owned()).await {
                tracing::warn!(endpoint = %endpoint.display(), %error, "fake CSI driver stopped");
            }
        }))
    }
}

/// A fake CSI driver together with its registration socket, as a driver with
/// the node-driver-registrar sidecar presents itself: type `CSIPlugin`, the
/// driver's name, `endpoint` pointing at the driver.
pub struct RegisteredCsiDriver {
    /// Registration socket (usually in `<root-dir>/plugins_registry`).
    pub registration: PathBuf,
    /// The driver's CSI endpoint.
    pub endpoint: PathBuf,
    /// The driver's configuration (its name is also the registered name).
    pub config: CsiDriverConfig,
    /// Versions sent in `GetInfo` (default `["1.0.0"]`).
    pub versions: Vec<String>,
    /// How the registration side behaves.
    pub behaviour: Behaviour,
    /// Where an exit behaviour sends its exit code (see
    /// [`RegistrationPlugin::exit_requests`]).
    pub exit_requests: Option<tokio::sync::mpsc::UnboundedSender<i32>>,
}

impl RegisteredCsiDriver {
    /// A well-behaved driver speaking CSI 1.0.0.
    pub fn new(registration: impl Into<PathBuf>, endpoint: impl Into<PathBuf>, config: CsiDriverConfig) -> Self {
        RegisteredCsiDriver {
            registration: registration.into(),
            endpoint: endpoint.into(),
            config,
            versions: vec!["1.0.0".into()],
            behaviour: Behaviour::Normal,
            exit_requests: None,
        }
    }

    /// Binds the endpoint, then the registration socket (so the driver is
    /// ready when the node learns of it), and serves both until `shutdown`.
    pub fn spawn(
        self,
        reporter: Reporter,
        shutdown: CancellationToken,
    ) -> std::io::Result<[tokio::task::JoinHandle<()>; 2]> {
        let identity = registration::Identity {
            plugin_type: kubelet_api::constants::CSI_PLUGIN_TYPE.into(),
            name: self.config.name.clone(),
            endpoint: self.endpoint.display().to_string(),
            versions: self.versions,
        };
        let driver = FakeCsiDriver::new(&self.endpoint, self.config, reporter.clone()).spawn(shutdown.clone())?;
        let mut registration = RegistrationPlugin::new(&self.registration, identity, self.behaviour, reporter);
        if let Some(exits) = self.exit_requests {
            registration = registration.exit_requests(exits);
        }
        let registration = registration.spawn(shutdown)?;
        Ok([driver, registration])
    }
}

#[tonic::async_trait]
impl Identity for FakeCsiDriver {
    async fn get_plugin_info(
        &self,
        _: Request<GetPluginInfoRequest>,
    ) -> Result<Response<GetPluginInfoResponse>, Status> {
        Ok(Response::new(GetPluginInfoResponse {
            name: self.config.name.clone(),
            vendor_version: env!("CARGO_PKG_VERSION").to_owned(),
            manifest: HashMap::new(),
        }))
    }

    async fn get_plugin_capabilities(
        &self,
        _: Request<GetPluginCapabilitiesRequest>,
    ) -> Result<Response<GetPluginCapabilitiesResponse>, Status> {
        Ok(Response::new(GetPluginCapabilitiesResponse { capabilities: vec![] }))
    }

    async fn probe(&self, _: Request<ProbeRequest>) -> Result<Response<ProbeResponse>, Status> {
        Ok(Response::new(ProbeResponse { ready: Some(true) }))
    }
}

fn unimplemented<T>(rpc: &str) -> Result<Response<T>, Status> {
    Err(Status::unimplemented(format!("{rpc} is not implemented by the fake CSI driver yet")))
}

#[tonic::async_trait]
impl Node for FakeCsiDriver {
    async fn node_stage_volume(
        &self,
        _: Request<NodeStageVolumeRequest>,
    ) -> Result<Response<NodeStageVolumeResponse>, Status> {
        unimplemented("NodeStageVolume")
    }

    async fn node_unstage_volume(
        &self,
        _: Request<NodeUnstageVolumeRequest>,
    ) -> Result<Response<NodeUnstageVolumeResponse>, Status> {
        unimplemented("NodeUnstageVolume")
    }

    async fn node_publish_volume(
        &self,
        _: Request<NodePublishVolumeRequest>,
    ) -> Result<Response<NodePublishVolumeResponse>, Status> {
        unimplemented("NodePublishVolume")
    }

    async fn node_unpublish_volume(
        &self,
        _: Request<NodeUnpublishVolumeRequest>,
    ) -> Result<Response<NodeUnpublishVolumeResponse>, Status> {
        unimplemented("NodeUnpublishVolume")
    }

    async fn node_get_volume_stats(
        &self,
        _: Request<NodeGetVolumeStatsRequest>,
    ) -> Result<Response<NodeGetVolumeStatsResponse>, Status> {
        unimplemented("NodeGetVolumeStats")
    }

    async fn node_expand_volume(
        &self,
        _: Request<NodeExpandVolumeRequest>,
    ) -> Result<Response<NodeExpandVolumeResponse>, Status> {
        unimplemented("NodeExpandVolume")
    }

    async fn node_get_capabilities(
        &self,
        _: Request<NodeGetCapabilitiesRequest>,
    ) -> Result<Response<NodeGetCapabilitiesResponse>, Status> {
        Ok(Response::new(NodeGetCapabilitiesResponse { capabilities: vec![] }))
    }

    async fn node_get_info(&self, _: Request<NodeGetInfoRequest>) -> Result<Response<NodeGetInfoResponse>, Status> {
        self.reporter.report(Report::NodeGetInfo { endpoint: self.endpoint.clone() });
        match self.config.node_get_info {
            NodeGetInfoBehaviour::Hang => std::future::pending().await,
            NodeGetInfoBehaviour::Fail => Err(Status::internal("fake CSI driver told to fail NodeGetInfo")),
            NodeGetInfoBehaviour::Normal => Ok(Response::new(NodeGetInfoResponse {
                node_id: self.config.node_id.clone(),
                max_volumes_per_node: self.config.max_volumes_per_node,
                accessible_topology: (!self.config.topology.is_empty())
                    .then(|| Topology { segments: self.config.topology.clone() }),
            })),
        }
    }
}
