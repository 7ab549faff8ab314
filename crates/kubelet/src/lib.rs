//! Rustlet's node library: everything a provider embeds to become a
//! Kubernetes node.
//!
//! This crate is the facade. Its own module, [`node`], is the entry point:
//! a [`node::NodeBuilder`] takes a [`node::NodeConfig`] and starts every
//! component plus the health port and the local socket; the running
//! [`node::Node`] hands out their handles. It re-exports the crates it
//! wires under one name, so `kubelet::pod::Pods` and
//! `kubelet_pods::pod::Pods` are the same item:
//!
//! - [`provider`] (`kubelet-provider`): the [`provider::Provider`] trait and
//!   what it speaks, with [`health`], [`supervisor`], [`durable`] and
//!   [`retry`]. A provider
//!   author needs this crate alone.
//! - `kubelet-plugins`: the plugin registration service
//!   ([`plugin_manager`]), who may offer plugins ([`plugin_trust`]), device
//!   plugins ([`device_manager`]), CSI drivers ([`csi`]) and DRA drivers
//!   ([`dra`]).
//! - `kubelet-pods`: the pod lifecycle ([`pod`]), pod volumes ([`volume`]),
//!   static manifests ([`static_pods`]), several providers behind one node
//!   ([`runtime_class`]), [`events`] and the PodResources API
//!   ([`pod_resources`]).
//! - [`cluster`] (`kubelet-cluster`): cluster mode (the Node and its Lease,
//!   pods and their statuses, API volumes, certificates) and [`pki`].
//! - [`server`] (`kubelet-server`): the kubelet API on :10250, the health
//!   port, the local socket, container logs and streaming.
//!
//! `docs/architecture.md` has the crate graph and the data flow between
//! them.

pub mod node;

pub use kubelet_cluster::{self as cluster, KUBERNETES_VERSION, VERSION, pki};

pub use kubelet_plugins::{csi, device_manager, dra, plugin_manager, plugin_trust};
pub use kubelet_pods::{
    events, eviction, gc, log_rotation, pod, pod_resources, pressure, runtime_class, static_pods, volume,
};
pub use kubelet_provider as provider;
pub use kubelet_server as server;
pub use kubelet_support::{self as support, cgroups, durable, health, metrics, retry, supervisor};

/// The examples in `docs/providers.md`, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../../../docs/providers.md")]
mod providers_md {}

#[cfg(test)]
mod docs_tests {
    use std::collections::{BTreeMap, BTreeSet};
    use std::path::{Path, PathBuf};

    fn workspace_root() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
    }

    /// The workspace's members, as `Cargo.toml` lists them.
    fn members() -> Vec<String> {
        let workspace = std::fs::read_to_string(workspace_root().join("Cargo.toml")).expect("Cargo.toml");
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
        members
    }

    /// The top-level modules a crate's `lib.rs` (or a binary's `main.rs`)
    /// declares.
    fn modules(member: &str) -> Vec<String> {
        let src = workspace_root().join(member).join("src");
        let lib = std::fs::read_to_string(src.join("lib.rs"))
            .or_else(|_| std::fs::read_to_string(src.join("main.rs")))
            .expect("lib.rs or main.rs");
        lib.lines()
            .filter_map(|line| ["pub mod ", "pub(crate) mod ", "mod "].iter().find_map(|p| line.strip_prefix(p)))
            .filter_map(|rest| rest.strip_suffix(';'))
            .map(str::to_owned)
            .collect()
    }

    /// Every crate and provider with source of its own (not the test kit
    /// and xtask, which docs/testing.md describes).
    fn library_crates() -> Vec<String> {
        members().into_iter().filter(|m| m.starts_with("crates/") || m.starts_with("providers/")).collect()
    }

    /// docs/architecture.md names every workspace crate and every top-level
    /// module of each crate and provider (as `name/` or `name.rs`).
    #[test]
    fn architecture_doc_names_every_crate_and_module() {
        let doc = std::fs::read_to_string(workspace_root().join("docs/architecture.md")).expect("architecture.md");
        let mut missing: Vec<String> = members()
            .iter()
            .filter(|m| !doc.lines().any(|l| l.starts_with(m.as_str()) || l.starts_with(&format!("{m}/"))))
            .map(|m| format!("crate {m}"))
            .collect();
        for member in library_crates() {
            for name in modules(&member) {
                if !doc.contains(&format!("{name}/")) && !doc.contains(&format!("{name}.rs")) {
                    missing.push(format!("module {name} of {member}"));
                }
            }
        }
        assert!(missing.is_empty(), "docs/architecture.md does not name: {missing:?}");
    }

    /// The source files of module `name` of the crate at `src`.
    fn module_files(src: &Path, name: &str) -> Vec<PathBuf> {
        let file = src.join(format!("{name}.rs"));
        if file.exists() {
            return vec![file];
        }
        let mut files = Vec::new();
        let mut dirs = vec![src.join(name)];
        while let Some(dir) = dirs.pop() {
            for entry in std::fs::read_dir(&dir).expect("module dir").flatten() {
                let path = entry.path();
                if path.is_dir() {
                    dirs.push(path);
                } else if path.extension().is_some_and(|e| e == "rs") {
                    files.push(path);
                }
            }
        }
        files
    }

    /// No two top-level modules of a crate or provider use each other, even
    /// through others: what `crate::<module>` (and, at a module's top,
    /// `super::<module>`) names makes the graph, and it has no cycle.
    #[test]
    fn the_library_crates_have_no_module_cycles() {
        for member in library_crates() {
            let src = workspace_root().join(&member).join("src");
            let names = modules(&member);
            let mut uses: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
            for name in &names {
                let mut used = BTreeSet::new();
                for file in module_files(&src, name) {
                    let text = std::fs::read_to_string(&file).expect("source");
                    let top = file.parent() == Some(src.as_path()) || file.ends_with(format!("{name}/mod.rs"));
                    for prefix in ["crate::", "super::"] {
                        if prefix == "super::" && !top {
                            continue;
                        }
                        for (at, _) in text.match_indices(prefix) {
                            let rest = &text[at + prefix.len()..];
                            let word: String =
                                rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
                            if word != *name && names.contains(&word) {
                                used.insert(word);
                            }
                        }
                    }
                }
                uses.insert(name.clone(), used);
            }
            // Depth-first search; a module met again on the current path is a cycle.
            fn visit(
                module: &str,
                uses: &BTreeMap<String, BTreeSet<String>>,
                path: &mut Vec<String>,
                done: &mut BTreeSet<String>,
            ) -> Option<Vec<String>> {
                if let Some(at) = path.iter().position(|m| m == module) {
                    let mut cycle = path[at..].to_vec();
                    cycle.push(module.to_owned());
                    return Some(cycle);
                }
                if done.contains(module) {
                    return None;
                }
                path.push(module.to_owned());
                for next in uses.get(module).into_iter().flatten() {
                    if let Some(cycle) = visit(next, uses, path, done) {
                        return Some(cycle);
                    }
                }
                path.pop();
                done.insert(module.to_owned());
                None
            }
            let mut done = BTreeSet::new();
            for name in &names {
                let cycle = visit(name, &uses, &mut Vec::new(), &mut done);
                assert!(cycle.is_none(), "{member}: modules use each other: {}", cycle.unwrap_or_default().join(" → "));
            }
            assert!(names.len() == uses.len());
        }
    }
}
