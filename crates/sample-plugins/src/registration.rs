//! A configurable plugin-registration server (`pluginregistration.Registration`).

use std::path::PathBuf;
use std::sync::Arc;

use kubelet_api::pluginregistration::registration_server::{Registration, RegistrationServer};
use kubelet_api::pluginregistration::{InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::report::{Report, Reporter};

/// How the plugin misbehaves, if at all.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Behaviour {
    /// Answer everything.
    #[default]
    Normal,
    /// Never answer `GetInfo`.
    HangGetInfo,
    /// Answer `GetInfo` with an error status.
    FailGetInfo,
    /// Never answer `NotifyRegistrationStatus`.
    HangNotify,
    /// Never answer `NotifyRegistrationStatus` and ask to exit with code 3
    /// (the plugin dies between GetInfo and notify); see
    /// [`RegistrationPlugin::exit_requests`].
    ExitBeforeNotify,
    /// Ask to exit with code 0 after being told `plugin_registered=false`,
    /// without answering, leaving the socket behind (as the CSI
    /// node-driver-registrar does); see [`RegistrationPlugin::exit_requests`].
    ExitOnRejection,
}

/// What the plugin says in `GetInfo`.
#[derive(Clone, Debug, Default)]
pub struct Identity {
    /// `PluginInfo.type`.
    pub plugin_type: String,
    /// `PluginInfo.name`.
    pub name: String,
    /// `PluginInfo.endpoint` (empty: the registration socket itself).
    pub endpoint: String,
    /// `PluginInfo.supported_versions`.
    pub versions: Vec<String>,
}

/// A registration server for one socket.
#[derive(Clone)]
pub struct RegistrationPlugin {
    socket: PathBuf,
    identity: Arc<Identity>,
    behaviour: Behaviour,
    reporter: Reporter,
    exits: Option<mpsc::UnboundedSender<i32>>,
}

impl RegistrationPlugin {
    /// A plugin at `socket` that says `identity` and behaves as `behaviour`.
    pub fn new(socket: impl Into<PathBuf>, identity: Identity, behaviour: Behaviour, reporter: Reporter) -> Self {
        RegistrationPlugin { socket: socket.into(), identity: Arc::new(identity), behaviour, reporter, exits: None }
    }

    /// Where the exit behaviours send their exit code. The library never
    /// ends the process: a plugin binary receives the code and exits with
    /// it; without a receiver the plugin only stops answering.
    pub fn exit_requests(mut self, exits: mpsc::UnboundedSender<i32>) -> Self {
        self.exits = Some(exits);
        self
    }

    fn request_exit(&self, code: i32) {
        if let Some(exits) = &self.exits {
            let _ = exits.send(code);
        }
    }

    /// Binds the socket now (so the caller knows it exists when this returns)
    /// and serves until `shutdown`. The socket file is left in place on exit,
    /// as real plugins often do.
    pub fn spawn(self, shutdown: CancellationToken) -> std::io::Result<tokio::task::JoinHandle<()>> {
        let listener = kubelet_api::uds::bind(&self.socket).map_err(std::io::Error::other)?;
        let socket = self.socket.clone();
        // Not supervised: a sample plugin's server, returned to its caller (a plugin process or a test).
        Ok(tokio::spawn(async move {
            let router = tonic::transport::Server::builder().add_service(RegistrationServer::new(self));
            if let Err(error) = kubelet_api::uds::serve(router, listener, shutdown.cancelled_owned()).await {
                tracing::warn!(socket = %socket.display(), %error, "registration plugin stopped");
            }
        }))
    }
}

#[tonic::async_trait]
impl Registration for RegistrationPlugin {
    async fn get_info(&self, _: Request<InfoRequest>) -> Result<Response<PluginInfo>, Status> {
        self.reporter.report(Report::GetInfo { socket: self.socket.clone() });
        match self.behaviour {
            Behaviour::HangGetInfo => std::future::pending().await,
            Behaviour::FailGetInfo => Err(Status::unavailable("test plugin told to fail GetInfo")),
            _ => Ok(Response::new(PluginInfo {
                r#type: self.identity.plugin_type.clone(),
                name: self.identity.name.clone(),
                endpoint: self.identity.endpoint.clone(),
                supported_versions: self.identity.versions.clone(),
            })),
        }
    }

    async fn notify_registration_status(
        &self,
        request: Request<RegistrationStatus>,
    ) -> Result<Response<RegistrationStatusResponse>, Status> {
        let status = request.into_inner();
        if self.behaviour == Behaviour::ExitBeforeNotify {
            self.request_exit(3);
            return std::future::pending().await;
        }
        self.reporter.report(Report::Notified {
            socket: self.socket.clone(),
            registered: status.plugin_registered,
            error: status.error.clone(),
        });
        match self.behaviour {
            Behaviour::HangNotify => std::future::pending().await,
            Behaviour::ExitOnRejection if !status.plugin_registered => {
                self.request_exit(0);
                std::future::pending().await
            }
            _ => Ok(Response::new(RegistrationStatusResponse {})),
        }
    }
}
