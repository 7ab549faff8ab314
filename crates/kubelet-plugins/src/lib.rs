//! Rustlet's plugin system: how plugins offer themselves to the node and
//! what the node does with each kind.
//!
//! - [`plugin_manager`]: the plugin registration service. It watches
//!   `<root-dir>/plugins_registry`, asks every plugin socket who it is
//!   (`GetInfo`), hands it to the handler for its type, and tells the plugin
//!   the verdict (`NotifyRegistrationStatus`).
//! - [`plugin_trust`]: who may offer a plugin (the peer's uid, the socket's
//!   owner and mode).
//! - [`device_manager`]: device plugins (`kubelet.sock`, `ListAndWatch`,
//!   health and capacity), device allocation and its checkpoint.
//! - [`csi`]: the handler for `CSIPlugin` and the CSI driver registry the
//!   volume stages resolve drivers from.
//! - [`dra`]: DRA drivers and the resource claims prepared through them.
//!
//! The pod lifecycle (`kubelet-pods`) asks these for a pod's devices,
//! volumes and claims; nothing here knows about pods beyond those requests.

pub mod csi;
pub mod device_manager;
pub mod dra;
pub mod plugin_manager;
pub mod plugin_trust;

#[cfg(test)]
use kubelet_support::fuzz;
use kubelet_support::{durable, health, retry};
