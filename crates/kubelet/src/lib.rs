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
//! - [`dra`] and [`pod_resources`]: DRA drivers and resource claims, the
//!   PodResources API.
//! - [`pod`], [`provider`], [`volume`], [`static_pods`], [`runtime_class`]:
//!   the pod lifecycle, what a provider implements, pod volumes, static
//!   manifests, several providers behind one node.
//! - [`cluster`], [`events`], [`server`]: cluster mode (the Node, Lease,
//!   pods and their statuses, certificates), events, the kubelet API on
//!   :10250.
//! - [`plugin_trust`], [`durable`], [`retry`]: who may offer plugins, the
//!   durable file write, retry backoff.
//!
//! `docs/architecture.md` has the data flow between them.

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

#[cfg(test)]
mod docs_tests {
    /// docs/architecture.md names every workspace crate and every top-level
    /// module of this crate (as `name/` or `name.rs`).
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
        let lib = std::fs::read_to_string(root.join("crates/kubelet/src/lib.rs")).expect("lib.rs");
        for line in lib.lines() {
            let declared = line.strip_prefix("pub mod ").or_else(|| line.strip_prefix("mod "));
            let Some(name) = declared.and_then(|rest| rest.strip_suffix(';')) else { continue };
            if !doc.contains(&format!("{name}/")) && !doc.contains(&format!("{name}.rs")) {
                missing.push(format!("module {name}"));
            }
        }
        assert!(missing.is_empty(), "docs/architecture.md does not name: {missing:?}");
    }
}
