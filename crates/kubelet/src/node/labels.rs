//! Which labels a node may give its own Node (`--node-labels`), by
//! upstream's rule: labels in the `kubernetes.io` and `k8s.io` namespaces
//! (and their subdomains) are reserved, except the kubelet's own: those
//! under `kubelet.kubernetes.io` or `node.kubernetes.io`, and a fixed set
//! of well-known labels. The API server's NodeRestriction admission
//! refuses the others (`node-role.kubernetes.io/worker`, say) with 403, so
//! a node that asked for one could never register; it is refused at start
//! instead, with the rule in the message.

use std::collections::BTreeMap;

/// Namespaces whose labels the kubelet may set.
pub(crate) const KUBELET_LABEL_NAMESPACES: [&str; 2] = ["kubelet.kubernetes.io", "node.kubernetes.io"];

/// Labels in reserved namespaces the kubelet may set.
pub(crate) const KUBELET_LABELS: [&str; 11] = [
    "beta.kubernetes.io/arch",
    "beta.kubernetes.io/instance-type",
    "beta.kubernetes.io/os",
    "failure-domain.beta.kubernetes.io/region",
    "failure-domain.beta.kubernetes.io/zone",
    "kubernetes.io/arch",
    "kubernetes.io/hostname",
    "kubernetes.io/os",
    "node.kubernetes.io/instance-type",
    "topology.kubernetes.io/region",
    "topology.kubernetes.io/zone",
];

/// `--node-labels` asked for reserved labels.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown 'kubernetes.io' or 'k8s.io' labels specified with --node-labels: [{}]; --node-labels in the \
     'kubernetes.io' namespace must begin with an allowed prefix ({}) or be in the specifically allowed set ({})",
    .labels.join(" "),
    KUBELET_LABEL_NAMESPACES.join(", "),
    KUBELET_LABELS.join(", ")
)]
pub struct ReservedLabels {
    /// The refused label keys, sorted.
    pub labels: Vec<String>,
}

fn namespace_of(key: &str) -> &str {
    key.split_once('/').map_or("", |(namespace, _)| namespace)
}

fn in_namespace(namespace: &str, parent: &str) -> bool {
    namespace == parent || namespace.strip_suffix(parent).is_some_and(|rest| rest.ends_with('.'))
}

/// Whether a node may put label `key` on its own Node.
pub fn kubelet_may_set(key: &str) -> bool {
    let namespace = namespace_of(key);
    let reserved = in_namespace(namespace, "kubernetes.io") || in_namespace(namespace, "k8s.io");
    !reserved
        || KUBELET_LABELS.contains(&key)
        || KUBELET_LABEL_NAMESPACES.iter().any(|allowed| in_namespace(namespace, allowed))
}

/// Checks `--node-labels`: every reserved label the node may not set is
/// named in the error.
pub fn check_node_labels(labels: &BTreeMap<String, String>) -> Result<(), ReservedLabels> {
    let refused: Vec<String> = labels.keys().filter(|k| !kubelet_may_set(k)).cloned().collect();
    if refused.is_empty() { Ok(()) } else { Err(ReservedLabels { labels: refused }) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kubelets_own_labels_are_allowed_and_node_roles_refused() {
        for allowed in [
            "example.com/gpu",
            "plain",
            "kubernetes.io/hostname",
            "node.kubernetes.io/instance-type",
            "node.kubernetes.io/anything",
            "kubelet.kubernetes.io/x",
            "sub.node.kubernetes.io/x",
            "notkubernetes.io/x",
        ] {
            assert!(kubelet_may_set(allowed), "{allowed}");
        }
        for refused in [
            "node-role.kubernetes.io/worker",
            "kubernetes.io/role",
            "beta.kubernetes.io/metadata-proxy-ready",
            "node-restriction.kubernetes.io/x",
            "example.k8s.io/x",
        ] {
            assert!(!kubelet_may_set(refused), "{refused}");
        }
    }

    #[test]
    fn the_error_names_every_refused_label_and_the_rule() {
        let labels = BTreeMap::from([
            ("node-role.kubernetes.io/worker".to_owned(), String::new()),
            ("zone".to_owned(), "a".to_owned()),
            ("kubernetes.io/role".to_owned(), "x".to_owned()),
        ]);
        let error = check_node_labels(&labels).expect_err("refused");
        assert_eq!(error.labels, ["kubernetes.io/role", "node-role.kubernetes.io/worker"]);
        let text = error.to_string();
        assert!(text.starts_with(
            "unknown 'kubernetes.io' or 'k8s.io' labels specified with --node-labels: [kubernetes.io/role node-role.kubernetes.io/worker]"
        ), "{text}");
        assert!(text.contains("allowed prefix (kubelet.kubernetes.io, node.kubernetes.io)"), "{text}");
        assert!(check_node_labels(&BTreeMap::from([("zone".to_owned(), "a".to_owned())])).is_ok());
    }
}
