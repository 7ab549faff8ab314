//! The node's pressure: which of `MemoryPressure`, `DiskPressure` and
//! `PIDPressure` hold, shared by the eviction manager (which sets them),
//! admission (which refuses pods under them, as upstream) and the Node's
//! conditions.

use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use tokio::sync::watch;

/// The conditions of one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PressureState {
    /// `MemoryPressure`.
    pub memory: bool,
    /// `DiskPressure`.
    pub disk: bool,
    /// `PIDPressure`.
    pub pid: bool,
}

impl PressureState {
    /// The conditions that hold, by name, in upstream's order.
    pub fn conditions(&self) -> Vec<&'static str> {
        [("MemoryPressure", self.memory), ("DiskPressure", self.disk), ("PIDPressure", self.pid)]
            .into_iter()
            .filter_map(|(name, on)| on.then_some(name))
            .collect()
    }

    /// Sets condition `name`.
    pub(crate) fn set(&mut self, name: &str, on: bool) {
        match name {
            "MemoryPressure" => self.memory = on,
            "DiskPressure" => self.disk = on,
            "PIDPressure" => self.pid = on,
            _ => {}
        }
    }
}

/// The node's pressure, cheap to clone; a node without an eviction manager
/// is never under any.
#[derive(Clone, Debug)]
pub struct Pressure(Arc<watch::Sender<PressureState>>);

impl Default for Pressure {
    fn default() -> Self {
        Pressure(Arc::new(watch::channel(PressureState::default()).0))
    }
}

/// Upstream's node condition texts: (type, status, reason, message).
pub const CONDITION_TEXTS: [(&str, bool, &str, &str); 6] = [
    ("MemoryPressure", false, "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
    ("MemoryPressure", true, "KubeletHasInsufficientMemory", "kubelet has insufficient memory available"),
    ("DiskPressure", false, "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
    ("DiskPressure", true, "KubeletHasDiskPressure", "kubelet has disk pressure"),
    ("PIDPressure", false, "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
    ("PIDPressure", true, "KubeletHasInsufficientPID", "kubelet has insufficient PID available"),
];

/// Why a pod was refused under pressure: the node's conditions that hold.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("The node had condition: [{}]. ", conditions.join(" "))]
pub(crate) struct UnderPressure {
    /// `MemoryPressure`, `DiskPressure`, `PIDPressure`: those that hold.
    pub conditions: Vec<&'static str>,
}

impl Pressure {
    /// What holds now.
    pub fn now(&self) -> PressureState {
        *self.0.borrow()
    }

    /// Changes to it.
    pub fn subscribe(&self) -> watch::Receiver<PressureState> {
        self.0.subscribe()
    }

    /// Sets it (watchers wake only on a change).
    pub(crate) fn set(&self, state: PressureState) {
        self.0.send_if_modified(|now| {
            let changed = *now != state;
            *now = state;
            changed
        });
    }

    /// Whether `pod` may start under the pressure now, as upstream's
    /// eviction admission decides: critical pods always; under memory
    /// pressure alone, every pod but a BestEffort one that does not
    /// tolerate `node.kubernetes.io/memory-pressure`; under any other, none.
    /// `Err` names the conditions; its text is upstream's message.
    pub(crate) fn admit(&self, pod: &Pod) -> Result<(), UnderPressure> {
        let state = self.now();
        let conditions = state.conditions();
        if conditions.is_empty() || kubelet_provider::qos::is_critical(pod) {
            return Ok(());
        }
        if conditions == ["MemoryPressure"] {
            let best_effort = kubelet_provider::qos::qos_class(pod) == kubelet_provider::qos::QosClass::BestEffort;
            if !best_effort || tolerates_memory_pressure(pod) {
                return Ok(());
            }
        }
        Err(UnderPressure { conditions })
    }
}

/// Whether `pod` tolerates the `node.kubernetes.io/memory-pressure:NoSchedule` taint.
fn tolerates_memory_pressure(pod: &Pod) -> bool {
    let tolerations = pod.spec.as_ref().and_then(|s| s.tolerations.as_ref());
    tolerations.into_iter().flatten().any(|t| {
        let key = t.key.as_deref().unwrap_or_default();
        let effect_ok = t.effect.as_deref().is_none_or(|e| e.is_empty() || e == "NoSchedule");
        let exists = t.operator.as_deref() == Some("Exists");
        effect_ok && ((key.is_empty() && exists) || key == "node.kubernetes.io/memory-pressure")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(spec: serde_json::Value) -> Pod {
        serde_json::from_value(serde_json::json!({"metadata": {"name": "p"}, "spec": spec})).expect("pod")
    }

    #[test]
    fn admission_under_pressure_follows_upstream() {
        let pressure = Pressure::default();
        let best_effort = pod(serde_json::json!({"containers": [{"name": "c"}]}));
        let burstable =
            pod(serde_json::json!({"containers": [{"name": "c", "resources": {"requests": {"memory": "1Mi"}}}]}));
        assert_eq!(pressure.admit(&best_effort), Ok(()));
        pressure.set(PressureState { memory: true, ..PressureState::default() });
        assert_eq!(
            pressure.admit(&best_effort).map_err(|e| e.to_string()),
            Err("The node had condition: [MemoryPressure]. ".into())
        );
        assert_eq!(pressure.admit(&burstable), Ok(()));
        let tolerant = pod(serde_json::json!({
            "containers": [{"name": "c"}],
            "tolerations": [{"key": "node.kubernetes.io/memory-pressure", "operator": "Exists", "effect": "NoSchedule"}],
        }));
        assert_eq!(pressure.admit(&tolerant), Ok(()));
        pressure.set(PressureState { memory: true, disk: true, pid: false });
        assert_eq!(
            pressure.admit(&burstable),
            Err(UnderPressure { conditions: vec!["MemoryPressure", "DiskPressure"] })
        );
        assert_eq!(
            pressure.admit(&burstable).map_err(|e| e.to_string()),
            Err("The node had condition: [MemoryPressure DiskPressure]. ".into())
        );
        let mut critical = burstable.clone();
        critical.spec.as_mut().expect("spec").priority = Some(2_000_000_000);
        assert_eq!(pressure.admit(&critical), Ok(()));
    }
}
