//! The seam between the registration service and what a plugin is for.
//!
//! A [`PluginHandler`] is told about plugins of one [`PluginType`]. The
//! manager keeps handlers in a map keyed by type, so adding a new kind of
//! plugin is adding a handler: the manager does not change.

use std::fmt;
use std::path::PathBuf;

use async_trait::async_trait;
use kubelet_api::constants::{CSI_PLUGIN_TYPE, DEVICE_PLUGIN_TYPE, DRA_PLUGIN_TYPE};

/// The error a handler returns; its message is sent to the plugin in
/// `RegistrationStatus.error`, so it should say what the plugin got wrong.
pub type HandlerError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// What kind of plugin a socket serves (`PluginInfo.type` on the wire).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PluginType {
    /// `CSIPlugin`: a CSI node driver.
    Csi,
    /// `DevicePlugin`: a device plugin registered through the plugin watcher.
    DevicePlugin,
    /// `DRAPlugin`: a dynamic resource allocation driver.
    Dra,
    /// Any other type string. Handlers may be registered for it too.
    Other(String),
}

impl PluginType {
    /// The type string as it appears on the wire.
    pub(crate) fn as_str(&self) -> &str {
        match self {
            PluginType::Csi => CSI_PLUGIN_TYPE,
            PluginType::DevicePlugin => DEVICE_PLUGIN_TYPE,
            PluginType::Dra => DRA_PLUGIN_TYPE,
            PluginType::Other(s) => s,
        }
    }
}

impl From<&str> for PluginType {
    fn from(s: &str) -> Self {
        match s {
            CSI_PLUGIN_TYPE => PluginType::Csi,
            DEVICE_PLUGIN_TYPE => PluginType::DevicePlugin,
            DRA_PLUGIN_TYPE => PluginType::Dra,
            other => PluginType::Other(other.to_owned()),
        }
    }
}

impl fmt::Display for PluginType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A plugin as the handler sees it: what `GetInfo` said, with the endpoint
/// already defaulted to the registration socket when the plugin left it empty.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PluginInfo {
    /// The plugin's type.
    #[serde(serialize_with = "serialize_display")]
    pub plugin_type: PluginType,
    /// The plugin's name (never empty: the manager rejects empty names).
    pub name: String,
    /// Where the plugin's own service listens.
    pub endpoint: String,
    /// Versions the plugin says it speaks, as sent.
    pub supported_versions: Vec<String>,
    /// The registration socket this plugin was found at.
    pub socket_path: PathBuf,
}

fn serialize_display<S: serde::Serializer>(v: &PluginType, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(v.as_str())
}

/// Reacts to plugins of one type being registered and deregistered.
///
/// Calls for one socket never overlap (the manager runs one operation per
/// socket at a time), but calls for different sockets do, so a handler must be
/// safe to call concurrently and must itself guard invariants that span
/// plugins (such as "one driver per name").
#[async_trait]
pub trait PluginHandler: Send + Sync + 'static {
    /// Checks that the plugin can be registered. An error is sent back to the
    /// plugin and the registration is retried later with backoff.
    async fn validate(&self, plugin: &PluginInfo) -> Result<(), HandlerError>;

    /// Registers the plugin. On error the manager calls [`deregister`] to undo
    /// any partial work, tells the plugin, and retries later with backoff.
    ///
    /// [`deregister`]: PluginHandler::deregister
    async fn register(&self, plugin: &PluginInfo) -> Result<(), HandlerError>;

    /// Forgets the plugin. It must only undo what `register` did for this
    /// (name, endpoint) pair, must tolerate plugins it never registered, and
    /// should not wait on remote calls: the manager awaits it before starting
    /// the registrations of the same batch.
    async fn deregister(&self, plugin: &PluginInfo);
}
