//! A pod's quality-of-service class and its containers' OOM score
//! adjustment, computed as the kubelet of the release Rustlet implements
//! computes them.
//!
//! **The class** ([`qos_class`]) reads cpu and memory only, of the app and
//! init containers (ephemeral containers have no resources). A request or
//! limit counts when it is above zero; a container's missing request is
//! its limit (what the API server's defaulting does). The pod is
//! BestEffort when nothing counts; Guaranteed when every container has
//! both a cpu and a memory limit and the pod's summed requests equal its
//! summed limits; Burstable otherwise.
//!
//! **The OOM score adjustment** ([`oom_score_adj`]): -997 for Guaranteed
//! and node-critical pods (critical — static, mirror, or priority at least
//! 2,000,000,000 — with the priority class `system-node-critical`), 1000 for
//! BestEffort, and for Burstable `1000 - 1000 × memory request / memory
//! capacity`, kept between 3 and 999 so that a Burstable container is
//! never killed after a Guaranteed one nor before a BestEffort one.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Container, Pod};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use crate::quantity::{parse_milli, parse_units};

/// A pod's quality-of-service class (`status.qosClass`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum QosClass {
    /// Every container's cpu and memory limits equal its requests.
    Guaranteed,
    /// Some requests or limits, not Guaranteed.
    Burstable,
    /// No cpu or memory request or limit at all.
    BestEffort,
}

impl QosClass {
    /// The API's name of the class.
    pub fn as_str(self) -> &'static str {
        match self {
            QosClass::Guaranteed => "Guaranteed",
            QosClass::Burstable => "Burstable",
            QosClass::BestEffort => "BestEffort",
        }
    }
}

impl std::fmt::Display for QosClass {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The OOM score adjustment of Guaranteed and node-critical containers.
pub(crate) const GUARANTEED_OOM_SCORE_ADJ: i64 = -997;
/// The OOM score adjustment of BestEffort containers.
pub(crate) const BEST_EFFORT_OOM_SCORE_ADJ: i64 = 1000;
/// The priority from which a pod is critical (`system-cluster-critical`'s).
pub(crate) const SYSTEM_CRITICAL_PRIORITY: i32 = 2_000_000_000;

/// A quantity of `resource` (`cpu` in millicores, `memory` in bytes), if
/// it parses and is above zero.
fn positive(resource: &str, quantity: &Quantity) -> Option<u128> {
    let value = match resource {
        "cpu" => parse_milli(&quantity.0).ok()?,
        _ => parse_units(&quantity.0).ok()?,
    };
    (value > 0).then_some(value)
}

/// The class of `pod`.
pub fn qos_class(pod: &Pod) -> QosClass {
    let Some(spec) = pod.spec.as_ref() else { return QosClass::BestEffort };
    let containers = spec.containers.iter().chain(spec.init_containers.iter().flatten());
    let mut requests: BTreeMap<&str, u128> = BTreeMap::new();
    let mut limits: BTreeMap<&str, u128> = BTreeMap::new();
    let mut guaranteed = true;
    for container in containers {
        let resources = container.resources.as_ref();
        let container_limits = resources.and_then(|r| r.limits.as_ref());
        let container_requests = resources.and_then(|r| r.requests.as_ref());
        let mut limited = 0;
        for resource in ["cpu", "memory"] {
            let limit = container_limits.and_then(|l| l.get(resource)).and_then(|q| positive(resource, q));
            // A missing request is the limit, as the API server defaults it.
            let request = match container_requests.and_then(|r| r.get(resource)) {
                Some(q) => positive(resource, q),
                None => limit,
            };
            if let Some(request) = request {
                *requests.entry(resource).or_default() += request;
            }
            if let Some(limit) = limit {
                *limits.entry(resource).or_default() += limit;
                limited += 1;
            }
        }
        guaranteed &= limited == 2;
    }
    if requests.is_empty() && limits.is_empty() {
        return QosClass::BestEffort;
    }
    if guaranteed && requests == limits { QosClass::Guaranteed } else { QosClass::Burstable }
}

/// Whether `pod` is critical: a static pod, a mirror pod, or one of
/// priority [`SYSTEM_CRITICAL_PRIORITY`] or more.
pub fn is_critical(pod: &Pod) -> bool {
    let annotations = pod.metadata.annotations.as_ref();
    let source = annotations.and_then(|a| a.get("kubernetes.io/config.source"));
    let is_static = source.is_some_and(|s| s != "api");
    let is_mirror = annotations.is_some_and(|a| a.contains_key("kubernetes.io/config.mirror"));
    let priority = pod.spec.as_ref().and_then(|s| s.priority).unwrap_or(0);
    is_static || is_mirror || priority >= SYSTEM_CRITICAL_PRIORITY
}

/// Whether `pod` is node-critical: critical, with the priority class
/// `system-node-critical`.
pub(crate) fn is_node_critical(pod: &Pod) -> bool {
    let class = pod.spec.as_ref().and_then(|s| s.priority_class_name.as_deref());
    is_critical(pod) && class == Some("system-node-critical")
}

/// The OOM score adjustment of `container` of `pod` on a node with
/// `memory_capacity` bytes of memory.
pub fn oom_score_adj(pod: &Pod, container: &Container, memory_capacity: u64) -> i64 {
    if is_node_critical(pod) {
        return GUARANTEED_OOM_SCORE_ADJ;
    }
    match qos_class(pod) {
        QosClass::Guaranteed => return GUARANTEED_OOM_SCORE_ADJ,
        QosClass::BestEffort => return BEST_EFFORT_OOM_SCORE_ADJ,
        QosClass::Burstable => {}
    }
    let resources = container.resources.as_ref();
    let request = resources
        .and_then(|r| r.requests.as_ref())
        .and_then(|r| r.get("memory"))
        .or_else(|| resources.and_then(|r| r.limits.as_ref()).and_then(|l| l.get("memory")))
        .and_then(|q| parse_units(&q.0).ok())
        .unwrap_or(0);
    let capacity = u128::from(memory_capacity.max(1));
    let share = i64::try_from(1000 * request / capacity).unwrap_or(i64::MAX);
    let adj = 1000_i64.saturating_sub(share);
    if adj < 1000 + GUARANTEED_OOM_SCORE_ADJ {
        1000 + GUARANTEED_OOM_SCORE_ADJ
    } else if adj == BEST_EFFORT_OOM_SCORE_ADJ {
        BEST_EFFORT_OOM_SCORE_ADJ - 1
    } else {
        adj
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(spec: serde_json::Value) -> Pod {
        let mut pod = serde_json::json!({"metadata": {"name": "p", "namespace": "ns"}, "spec": spec});
        if let Some(annotations) = pod["spec"].as_object_mut().and_then(|s| s.remove("annotations")) {
            pod["metadata"]["annotations"] = annotations;
        }
        serde_json::from_value(pod).expect("pod")
    }

    fn with(resources: serde_json::Value) -> Pod {
        pod(serde_json::json!({"containers": [{"name": "c", "resources": resources}]}))
    }

    #[test]
    fn the_class_follows_upstreams_rules() {
        assert_eq!(qos_class(&with(serde_json::json!({}))), QosClass::BestEffort);
        // Other resources and zero quantities do not count.
        let extended = serde_json::json!({"limits": {"example.com/gpu": "1", "cpu": "0"}, "requests": {"memory": "0"}});
        assert_eq!(qos_class(&with(extended)), QosClass::BestEffort);
        // Limits alone: the requests default to them.
        let limits = serde_json::json!({"limits": {"cpu": "500m", "memory": "64Mi"}});
        assert_eq!(qos_class(&with(limits)), QosClass::Guaranteed);
        // Equal values in other spellings.
        let spelled = serde_json::json!({"limits": {"cpu": "1", "memory": "1Gi"}, "requests": {"cpu": "1000m", "memory": "1073741824"}});
        assert_eq!(qos_class(&with(spelled)), QosClass::Guaranteed);
        let below = serde_json::json!({"limits": {"cpu": "1", "memory": "1Gi"}, "requests": {"cpu": "500m"}});
        assert_eq!(qos_class(&with(below)), QosClass::Burstable);
        let cpu_only = serde_json::json!({"limits": {"cpu": "1"}});
        assert_eq!(qos_class(&with(cpu_only)), QosClass::Burstable);
        // Every container needs both limits, init containers included.
        let init = pod(serde_json::json!({
            "initContainers": [{"name": "i"}],
            "containers": [{"name": "c", "resources": {"limits": {"cpu": "1", "memory": "1Gi"}}}],
        }));
        assert_eq!(qos_class(&init), QosClass::Burstable);
        assert_eq!(QosClass::Burstable.to_string(), "Burstable");
    }

    #[test]
    fn oom_scores_follow_the_class_and_the_memory_request() {
        const GIB: u64 = 1 << 30;
        let best_effort = with(serde_json::json!({}));
        assert_eq!(oom_score_adj(&best_effort, &best_effort.spec.as_ref().expect("spec").containers[0], 4 * GIB), 1000);
        let guaranteed = with(serde_json::json!({"limits": {"cpu": "1", "memory": "1Gi"}}));
        assert_eq!(oom_score_adj(&guaranteed, &guaranteed.spec.as_ref().expect("spec").containers[0], 4 * GIB), -997);
        let burstable = |memory: &str| {
            let pod = with(serde_json::json!({"requests": {"memory": memory}, "limits": {"memory": "8Gi"}}));
            let container = pod.spec.as_ref().expect("spec").containers[0].clone();
            oom_score_adj(&pod, &container, 4 * GIB)
        };
        assert_eq!(burstable("1Gi"), 750);
        assert_eq!(burstable("64Mi"), 985, "1000 - 15 (integer division)");
        assert_eq!(burstable("1Ki"), 999, "never BestEffort's 1000");
        assert_eq!(burstable("4Gi"), 3, "never Guaranteed's -997 or below 3");
        // Node-critical static pods are kept like Guaranteed ones.
        let critical = pod(serde_json::json!({
            "annotations": {"kubernetes.io/config.source": "file"},
            "priorityClassName": "system-node-critical",
            "containers": [{"name": "c"}],
        }));
        assert!(is_node_critical(&critical));
        assert_eq!(oom_score_adj(&critical, &critical.spec.as_ref().expect("spec").containers[0], 4 * GIB), -997);
        let api = pod(serde_json::json!({"priorityClassName": "system-node-critical", "containers": [{"name": "c"}]}));
        assert!(!is_critical(&api), "a pod from the API needs the priority too");
    }
}
