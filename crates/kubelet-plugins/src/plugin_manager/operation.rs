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
    let (checked_socket, checker) = (socket.to_path_buf(), trust.clone());
    let check = move |peer| checker.check_socket(&checked_socket, peer).map_err(|e| e.to_string());
    let channel = kubelet_api::uds::dial_checked(socket, deadlines.dial, check)
        .instrument(tracing::debug_span!("dial"))
        .await
        .map_err(|source| match source {
            kubelet_api::uds::UdsError::Untrusted { reason, .. } => {
                RegistrationError::Untrusted { socket: socket.to_path_buf(), reason }
            }
            source => RegistrationError::Dial { socket: socket.to_path_buf(), source },
        })?;
    let mut client = RegistrationClient::new(channel);
    steps.dial = steps.lap();

    let get_info = client.get_info(InfoRequest {}).instrument(tracing::debug_span!("get_info"));
    let info = match tokio::time::timeout(deadlines.get_info, get_info).await {
        Ok(Ok(response)) => response.into_inner(),
        Ok(Err(status)) => return Err(RegistrationError::GetInfo { socket: socket.to_path_buf(), status }),
        Err(_) => {
            return Err(RegistrationError::GetInfoTimeout {
                socket: socket.to_path_buf(),
                timeout: deadlines.get_info,
            });
        }
    };

    let Some(handler) = handlers.get(&PluginType::from(info.r#type.as_str())).cloned() else {
        let err = RegistrationError::UnknownType { plugin_type: info.r#type, socket: socket.to_path_buf() };
        notify_rejection(&mut client, socket, format!("{ERROR_PREFIX}{err}"), deadlines.notify).await;
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
        notify_rejection(&mut client, socket, reason, deadlines.notify).await;
        return Err(err);
    }
    let timed_out = |step| RegistrationError::HandlerTimeout {
        plugin_type: plugin.plugin_type.clone(),
        name: plugin.name.clone(),
        socket: socket.to_path_buf(),
        step,
        timeout: deadlines.handler,
    };
    steps.get_info = steps.lap();
    let validate = handler.validate(&plugin).instrument(tracing::debug_span!("validate"));
    match tokio::time::timeout(deadlines.handler, validate).await {
        Ok(Ok(())) => {}
        Ok(Err(source)) => {
            let reason = format!("{ERROR_PREFIX}plugin validation failed with err: {source}");
            notify_rejection(&mut client, socket, reason, deadlines.notify).await;
            return Err(RegistrationError::Validation {
                plugin_type: plugin.plugin_type,
                name: plugin.name,
                socket: socket.to_path_buf(),
                source,
            });
        }
        Err(_) => {
            let err = timed_out("validate");
            notify_rejection(&mut client, socket, format!("{ERROR_PREFIX}{err}"), deadlines.notify).await;
            return Err(err);
        }
    }
    steps.validate = steps.lap();
    let register = handler.register(&plugin).instrument(tracing::debug_span!("register"));
    match tokio::time::timeout(deadlines.handler, register).await {
        Ok(Ok(())) => {}
        Ok(Err(source)) => {
            rollback(handler.as_ref(), &plugin, deadlines.deregister).await;
            let reason = format!("{ERROR_PREFIX}plugin registration failed with err: {source}");
            notify_rejection(&mut client, socket, reason, deadlines.notify).await;
            return Err(RegistrationError::Register {
                plugin_type: plugin.plugin_type,
                name: plugin.name,
                socket: socket.to_path_buf(),
                source,
            });
        }
        Err(_) => {
            // The unfinished register was dropped; undo whatever it did.
            rollback(handler.as_ref(), &plugin, deadlines.deregister).await;
            let err = timed_out("register");
            notify_rejection(&mut client, socket, format!("{ERROR_PREFIX}{err}"), deadlines.notify).await;
            return Err(err);
        }
    }
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
