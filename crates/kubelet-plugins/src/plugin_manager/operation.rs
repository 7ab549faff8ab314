//! The register sequence for one socket, as upstream runs it:
//!
//! 1. dial the socket (deadline);
//! 2. `GetInfo` (deadline);
//! 3. find the handler for the reported type, else tell the plugin;
//! 4. default an empty endpoint to the socket path;
//! 5. `validate`, else tell the plugin;
//! 6. `register`, else undo (`deregister`) and tell the plugin;
//! 7. tell the plugin it is registered, else undo.
//!
//! Any failure is returned for backoff and retry.
//!
//! Upstream's rule ("add to actual state before register, so a delete during
//! register becomes a deregister") holds here by construction: the reconciler
//! runs one operation per socket at a time and looks at the socket again when
//! this operation ends, so a socket deleted meanwhile is deregistered then.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::Instrument;

use kubelet_api::pluginregistration::registration_client::RegistrationClient;
use kubelet_api::pluginregistration::{InfoRequest, RegistrationStatus};
use kubelet_api::uds::UdsChannel;

use super::error::RegistrationError;
use super::handler::{PluginHandler, PluginInfo, PluginType};

/// Handlers by plugin type.
pub(crate) type HandlerMap = HashMap<PluginType, Arc<dyn PluginHandler>>;

/// Deadlines of the RPCs a registration makes.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Deadlines {
    pub(crate) dial: Duration,
    pub(crate) get_info: Duration,
    pub(crate) notify: Duration,
    /// For each of the handler's `validate` and `register`.
    pub(crate) handler: Duration,
    /// For the handler's `deregister` when a failed registration is undone.
    pub(crate) deregister: Duration,
}

/// A registration that went through: what the plugin is and who holds it.
pub(crate) struct Registered {
    pub(crate) info: PluginInfo,
    pub(crate) handler: Arc<dyn PluginHandler>,
}

const ERROR_PREFIX: &str = "RegisterPlugin error -- ";

/// Runs the register sequence against the socket at `socket`.
pub(crate) async fn register(
    socket: &Path,
    handlers: &HandlerMap,
    deadlines: Deadlines,
    trust: &crate::plugin_trust::PluginTrust,
) -> Result<Registered, RegistrationError> {
    let mut steps = Steps::start();
    let mut client = RegistrationClient::new(dial(socket, deadlines.dial, trust).await?);
    steps.dial = steps.lap();
    let (plugin, handler) = identify(&mut client, socket, handlers, deadlines).await?;
    steps.get_info = steps.lap();
    handler_step(&mut client, &plugin, handler.as_ref(), deadlines, HandlerStep::Validate).await?;
    steps.validate = steps.lap();
    handler_step(&mut client, &plugin, handler.as_ref(), deadlines, HandlerStep::Register).await?;
    steps.register = steps.lap();
    let notified =
        notify(&mut client, true, String::new(), deadlines.notify).instrument(tracing::debug_span!("notify"));
    if let Err(reason) = notified.await {
        // The plugin never learnt it is registered (it may be gone): undo, so
        // the next attempt starts from a clean slate.
        rollback(handler.as_ref(), &plugin, deadlines.deregister).await;
        return Err(RegistrationError::Notify { socket: socket.to_path_buf(), reason });
    }
    steps.notify = steps.lap();
    steps.report();
    Ok(Registered { info: plugin, handler })
}

/// Dials the socket, refusing a peer the trust policy does not allow.
async fn dial(
    socket: &Path,
    deadline: Duration,
    trust: &crate::plugin_trust::PluginTrust,
) -> Result<UdsChannel, RegistrationError> {
    let (checked_socket, checker) = (socket.to_path_buf(), trust.clone());
    let check = move |peer| checker.check_socket(&checked_socket, peer).map_err(|e| e.to_string());
    kubelet_api::uds::dial_checked(socket, deadline, check).instrument(tracing::debug_span!("dial")).await.map_err(
        |source| match source {
            kubelet_api::uds::UdsError::Untrusted { reason, .. } => {
                RegistrationError::Untrusted { socket: socket.to_path_buf(), reason }
            }
            source => RegistrationError::Dial { socket: socket.to_path_buf(), source },
        },
    )
}

/// `GetInfo`, then the handler of the type the plugin reports (an empty
/// endpoint defaulted to the socket); a plugin of a type no handler takes,
/// or with no name, is told why.
async fn identify(
    client: &mut RegistrationClient<UdsChannel>,
    socket: &Path,
    handlers: &HandlerMap,
    deadlines: Deadlines,
) -> Result<(PluginInfo, Arc<dyn PluginHandler>), RegistrationError> {
    let get_info = client.get_info(InfoRequest {}).instrument(tracing::debug_span!("get_info"));
    let info = match tokio::time::timeout(deadlines.get_info, get_info).await {
        Ok(Ok(response)) => response.into_inner(),
        Ok(Err(status)) => return Err(RegistrationError::GetInfo { socket: socket.to_path_buf(), status }),
        Err(_) => {
            let timeout = deadlines.get_info;
            return Err(RegistrationError::GetInfoTimeout { socket: socket.to_path_buf(), timeout });
        }
    };
    let Some(handler) = handlers.get(&PluginType::from(info.r#type.as_str())).cloned() else {
        let err = RegistrationError::UnknownType { plugin_type: info.r#type, socket: socket.to_path_buf() };
        notify_rejection(client, socket, format!("{ERROR_PREFIX}{err}"), deadlines.notify).await;
        return Err(err);
    };
    let plugin = PluginInfo {
        plugin_type: PluginType::from(info.r#type.as_str()),
        endpoint: if info.endpoint.is_empty() { socket.display().to_string() } else { info.endpoint },
        name: info.name,
        supported_versions: info.supported_versions,
        socket_path: socket.to_path_buf(),
    };
    if plugin.name.is_empty() {
        let err = RegistrationError::EmptyName { plugin_type: plugin.plugin_type, socket: socket.to_path_buf() };
        let reason = format!("{ERROR_PREFIX}plugin validation failed with err: plugin name is empty");
        notify_rejection(client, socket, reason, deadlines.notify).await;
        return Err(err);
    }
    Ok((plugin, handler))
}

/// The two handler calls of a registration.
#[derive(Clone, Copy, PartialEq, Eq)]
enum HandlerStep {
    Validate,
    Register,
}

/// The handler's `validate` or `register`, within its deadline; one that
/// fails (or does not end in time) is told to the plugin, and a failed
/// `register` is undone first.
async fn handler_step(
    client: &mut RegistrationClient<UdsChannel>,
    plugin: &PluginInfo,
    handler: &dyn PluginHandler,
    deadlines: Deadlines,
    step: HandlerStep,
) -> Result<(), RegistrationError> {
    // Each call in its own span, named as before the steps were one function.
    let (call, span, name, failed) = match step {
        HandlerStep::Validate => {
            (handler.validate(plugin), tracing::debug_span!("validate"), "validate", "plugin validation failed")
        }
        HandlerStep::Register => {
            (handler.register(plugin), tracing::debug_span!("register"), "register", "plugin registration failed")
        }
    };
    let (reason, err) = match tokio::time::timeout(deadlines.handler, call.instrument(span)).await {
        Ok(Ok(())) => return Ok(()),
        Ok(Err(source)) => {
            let (plugin_type, name, socket) =
                (plugin.plugin_type.clone(), plugin.name.clone(), plugin.socket_path.clone());
            let reason = format!("{ERROR_PREFIX}{failed} with err: {source}");
            (
                reason,
                match step {
                    HandlerStep::Validate => RegistrationError::Validation { plugin_type, name, socket, source },
                    HandlerStep::Register => RegistrationError::Register { plugin_type, name, socket, source },
                },
            )
        }
        // An unfinished `register` was dropped; the rollback undoes
        // whatever it did.
        Err(_) => {
            let err = RegistrationError::HandlerTimeout {
                plugin_type: plugin.plugin_type.clone(),
                name: plugin.name.clone(),
                socket: plugin.socket_path.clone(),
                step: name,
                timeout: deadlines.handler,
            };
            (format!("{ERROR_PREFIX}{err}"), err)
        }
    };
    if step == HandlerStep::Register {
        rollback(handler, plugin, deadlines.deregister).await;
    }
    notify_rejection(client, &plugin.socket_path, reason, deadlines.notify).await;
    Err(err)
}

/// How long each step of a registration took: reported at debug level
/// ("registration steps", in microseconds) for the benchmark's breakdown.
#[derive(Debug)]
struct Steps {
    last: Instant,
    dial: Duration,
    get_info: Duration,
    validate: Duration,
    register: Duration,
    notify: Duration,
}

impl Steps {
    fn start() -> Steps {
        Steps {
            last: Instant::now(),
            dial: Duration::ZERO,
            get_info: Duration::ZERO,
            validate: Duration::ZERO,
            register: Duration::ZERO,
            notify: Duration::ZERO,
        }
    }

    /// The time since the previous lap.
    fn lap(&mut self) -> Duration {
        let now = Instant::now();
        let lap = now - self.last;
        self.last = now;
        lap
    }

    fn report(&self) {
        tracing::debug!(
            dial_us = self.dial.as_micros() as u64,
            get_info_us = self.get_info.as_micros() as u64,
            validate_us = self.validate.as_micros() as u64,
            register_us = self.register.as_micros() as u64,
            notify_us = self.notify.as_micros() as u64,
            "registration steps"
        );
    }
}

/// Undoes a registration with the handler's `deregister`, within
/// `deadline`: a handler that hangs there must not keep the socket's
/// operation (and so its retries and its removal) waiting forever. Past the
/// deadline the call is dropped and the failure reported as usual; the
/// handler may keep partial state, which the retry's `register` replaces.
async fn rollback(handler: &dyn PluginHandler, plugin: &PluginInfo, deadline: Duration) {
    if tokio::time::timeout(deadline, handler.deregister(plugin)).await.is_err() {
        tracing::warn!(
            socket = %plugin.socket_path.display(),
            plugin = %plugin.name,
            ?deadline,
            "handler did not finish undoing a failed registration in time; gave up waiting"
        );
    }
}

/// Tells the plugin it was turned down. Failing to deliver that is only worth
/// a debug line: the registration failed anyway and will be retried.
async fn notify_rejection(
    client: &mut RegistrationClient<UdsChannel>,
    socket: &Path,
    reason: String,
    deadline: Duration,
) {
    if let Err(error) = notify(client, false, reason, deadline).await {
        tracing::debug!(socket = %socket.display(), %error, "could not deliver the rejection to the plugin");
    }
}

async fn notify(
    client: &mut RegistrationClient<UdsChannel>,
    registered: bool,
    error: String,
    deadline: Duration,
) -> Result<(), String> {
    let status = RegistrationStatus { plugin_registered: registered, error };
    match tokio::time::timeout(deadline, client.notify_registration_status(status)).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(status)) => Err(status.to_string()),
        Err(_) => Err(format!("no answer within {deadline:?}")),
    }
}
