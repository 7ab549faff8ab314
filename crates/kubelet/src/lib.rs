//! Rustlet's node library: everything a provider embeds to become a Kubernetes
//! node.
//!
//! Today it holds the plugin system's foundation:
//! - [`plugin_manager`]: the plugin registration service. It watches
//!   `<root-dir>/plugins_registry`, asks every plugin socket who it is
//!   (`GetInfo`), hands it to the handler for its type, and tells the plugin the
//!   verdict (`NotifyRegistrationStatus`).
//! - [`csi`]: the handler for `CSIPlugin` and the CSI driver registry that the
//!   volume stages will resolve drivers from.
//!
//! The device manager, pod lifecycle, node status and providers come next
//! (see `docs/architecture.md`).

pub mod csi;
pub mod device_manager;
pub mod health;
pub mod node;
pub mod plugin_manager;
