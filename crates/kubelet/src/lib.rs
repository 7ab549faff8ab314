//! Rustlet's node library: everything a provider embeds to become a Kubernetes
//! node.
//!
//! - [`node`]: the entry point. A [`node::NodeBuilder`] takes a
//!   [`node::NodeConfig`] and starts every component below plus the HTTP
//!   endpoint; the running [`node::Node`] hands out their handles.
//! - [`plugin_manager`]: the plugin registration service. It watches
//!   `<root-dir>/plugins_registry`, asks every plugin socket who it is
//!   (`GetInfo`), hands it to the handler for its type, and tells the plugin the
//!   verdict (`NotifyRegistrationStatus`).
//! - [`csi`]: the handler for `CSIPlugin` and the CSI driver registry that the
//!   volume stages resolve drivers from.
//! - [`device_manager`]: device plugins (`kubelet.sock`, `ListAndWatch`,
//!   health and capacity), device allocation and its checkpoint.
//! - [`health`]: how long-running components report their health to
//!   `/healthz`.
//!
//! The pod lifecycle and the `Provider` trait come next (see
//! `docs/architecture.md`).

pub mod cluster;
pub mod csi;

/// The Kubernetes release whose node behaviour Rustlet implements (what
/// the upstream node-conformance suite of that release checks).
pub const KUBERNETES_VERSION: &str = "v1.28.7";

/// Rustlet's version as the Node reports it (`status.nodeInfo.kubeletVersion`)
/// and `rustlet --version` prints it: the Kubernetes release it implements,
/// with Rustlet's own version as semver build metadata, so that version
/// skew checks (kubeadm's, the API server's) read the Kubernetes version.
pub const VERSION: &str = concat!("v1.28.7+rustlet.", env!("CARGO_PKG_VERSION"));

pub mod device_manager;
pub mod dra;
pub mod durable;
pub mod events;
#[doc(hidden)]
pub mod fuzz;
pub mod health;
mod log_limit;
pub mod node;
pub mod plugin_manager;
pub mod plugin_trust;
pub mod pod;
pub mod pod_resources;
pub mod provider;
pub mod retry;
pub mod runtime_class;
pub mod server;
pub mod static_pods;
pub mod volume;

/// The examples in `docs/providers.md`, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../../../docs/providers.md")]
mod providers_md {}
