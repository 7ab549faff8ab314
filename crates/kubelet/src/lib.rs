//! Rustlet's node library: everything a provider embeds to become a
//! Kubernetes node.
//!
//! This crate is the facade. It wires the crates below into a node and
//! re-exports them under one name, so `kubelet::pod::Pods` and
//! `kubelet_pods::pod::Pods` are the same item:
//!
//! - [`provider`] (`kubelet-provider`): the [`provider::Provider`] trait and
//!   what it speaks, with [`health`], [`durable`] and [`retry`]. A provider
//!   author needs this crate alone.
//! - `kubelet-plugins`: the plugin registration service
//!   ([`plugin_manager`]), who may offer plugins ([`plugin_trust`]), device
//!   plugins ([`device_manager`]), CSI drivers ([`csi`]) and DRA drivers
//!   ([`dra`]).
//! - `kubelet-pods`: the pod lifecycle ([`pod`]), pod volumes ([`volume`]),
//!   static manifests ([`static_pods`]), several providers behind one node
//!   ([`runtime_class`]), [`events`] and the PodResources API
//!   ([`pod_resources`]).
//!
//! Its own modules:
//!
//! - [`node`]: the entry point. A [`node::NodeBuilder`] takes a
//!   [`node::NodeConfig`] and starts every component plus the health port
//!   and the local socket; the running [`node::Node`] hands out their
//!   handles.
//! - [`cluster`]: cluster mode (the Node and its Lease, pods and their
//!   statuses, API volumes, certificates).
//! - [`server`]: the kubelet API on :10250, the health port, the local
//!   socket, container logs.
//! - [`pki`]: keys and certificates.
//!
//! `docs/architecture.md` has the crate graph and the data flow between
//! them.

/// The Kubernetes release whose node behaviour Rustlet implements (what
/// the upstream node-conformance suite of that release checks).
pub const KUBERNETES_VERSION: &str = "v1.28.7";

/// Rustlet's version as the Node reports it (`status.nodeInfo.kubeletVersion`)
/// and `rustlet --version` prints it: the Kubernetes release it implements,
/// with Rustlet's own version as semver build metadata, so that version
/// skew checks (kubeadm's, the API server's) read the Kubernetes version.
pub const VERSION: &str = concat!("v1.28.7+rustlet.", env!("CARGO_PKG_VERSION"));

pub mod cluster;
pub mod node;
pub mod pki;
pub mod server;

pub use kubelet_plugins::{csi, device_manager, dra, plugin_manager, plugin_trust};
pub use kubelet_pods::{events, pod, pod_resources, runtime_class, static_pods, volume};
pub use kubelet_provider as provider;
#[doc(hidden)]
pub use kubelet_provider::fuzz;
pub use kubelet_provider::{durable, health, retry};

/// The examples in `docs/providers.md`, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../../../docs/providers.md")]
mod providers_md {}

#[cfg(test)]
mod docs_tests {
    /// docs/architecture.md names every workspace crate and every top-level
    /// module of the `kubelet*` crates (as `name/` or `name.rs`).
    #[test]
    fn architecture_doc_names_every_crate_and_module() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let doc = std::fs::read_to_string(root.join("docs/architecture.md")).expect("docs/architecture.md");
        let workspace = std::fs::read_to_string(root.join("Cargo.toml")).expect("Cargo.toml");
        let members = workspace
            .lines()
            .find(|l| l.trim_start().starts_with("members"))
            .expect("the workspace's members")
            .split('"')
            .skip(1)
            .step_by(2)
            .map(str::to_owned)
            .collect::<Vec<_>>();
        assert!(members.len() >= 5, "{members:?}");
        let mut missing: Vec<String> = members
            .iter()
            .filter(|m| !doc.lines().any(|l| l.starts_with(m.as_str()) || l.starts_with(&format!("{m}/"))))
            .map(|m| format!("crate {m}"))
            .collect();
        let library_crates = members.iter().filter(|m| m.starts_with("crates/kubelet"));
        for member in library_crates {
            let lib = std::fs::read_to_string(root.join(member).join("src/lib.rs")).expect("lib.rs");
            for line in lib.lines() {
                let declared = line.strip_prefix("pub mod ").or_else(|| line.strip_prefix("mod "));
                let Some(name) = declared.and_then(|rest| rest.strip_suffix(';')) else { continue };
                if !doc.contains(&format!("{name}/")) && !doc.contains(&format!("{name}.rs")) {
                    missing.push(format!("module {name} of {member}"));
                }
            }
        }
        assert!(missing.is_empty(), "docs/architecture.md does not name: {missing:?}");
    }
}
