//! Health of the node's long-running components, with the kubelet's
//! `/healthz` semantics: the node is healthy when every check passes, and
//! each check can be asked for on its own.
//!
//! A component owns a [`HealthReporter`] and says how it is doing whenever
//! that changes (a server that cannot bind its socket reports `Failing` and
//! `Healthy` again once a retry worked). The node collects the components'
//! [`HealthCheck`]s in a [`Healthz`], which the HTTP endpoint reads.
//!
//! Reporting is a `watch` channel: it never blocks the component, and a
//! reader sees the newest state.

use std::sync::{Arc, Mutex};

use tokio::sync::watch;

/// How a component is doing.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "state")]
pub enum ComponentHealth {
    /// Working.
    Healthy,
    /// Not working; it may be retrying (the reason says so).
    Failing {
        /// What is wrong, for the operator.
        reason: String,
    },
}

impl ComponentHealth {
    /// Whether the component is working.
    pub fn is_healthy(&self) -> bool {
        matches!(self, ComponentHealth::Healthy)
    }
}

/// The writing side: owned by the component.
#[derive(Clone, Debug)]
pub struct HealthReporter {
    state: Arc<watch::Sender<ComponentHealth>>,
}

impl Default for HealthReporter {
    fn default() -> Self {
        HealthReporter::new()
    }
}

impl HealthReporter {
    /// A reporter that starts healthy.
    pub fn new() -> Self {
        HealthReporter { state: Arc::new(watch::channel(ComponentHealth::Healthy).0) }
    }

    /// The component works (again).
    pub fn healthy(&self) {
        self.set(ComponentHealth::Healthy);
    }

    /// The component does not work, for `reason`.
    pub fn failing(&self, reason: impl Into<String>) {
        self.set(ComponentHealth::Failing { reason: reason.into() });
    }

    fn set(&self, health: ComponentHealth) {
        self.state.send_if_modified(|current| {
            let changed = *current != health;
            *current = health;
            changed
        });
    }

    /// The reading side, for [`Healthz::add`].
    pub fn check(&self) -> HealthCheck {
        HealthCheck { state: self.state.subscribe() }
    }
}

/// The reading side of a component's health.
#[derive(Clone, Debug)]
pub struct HealthCheck {
    state: watch::Receiver<ComponentHealth>,
}

impl HealthCheck {
    /// The component's health now.
    pub fn get(&self) -> ComponentHealth {
        self.state.borrow().clone()
    }

    /// Changes from now on (for tests and watchers).
    pub fn watch(&self) -> watch::Receiver<ComponentHealth> {
        self.state.clone()
    }
}

/// One check's result in a [`Healthz`] report.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct CheckResult {
    /// The check's name (`/healthz/<name>`).
    pub name: String,
    /// Its health.
    pub health: ComponentHealth,
}

/// The node's named health checks. Cheap to clone; clones share the list.
#[derive(Clone, Debug, Default)]
pub struct Healthz {
    checks: Arc<Mutex<Vec<(String, HealthCheck)>>>,
}

impl Healthz {
    /// An empty list: healthy.
    pub fn new() -> Self {
        Healthz::default()
    }

    /// Adds (or replaces) the check called `name`.
    pub fn add(&self, name: impl Into<String>, check: HealthCheck) {
        let name = name.into();
        let mut checks = self.checks.lock().unwrap_or_else(|p| p.into_inner());
        checks.retain(|(n, _)| *n != name);
        checks.push((name, check));
    }

    /// Every check, in the order they were added.
    pub fn report(&self) -> Vec<CheckResult> {
        let checks = self.checks.lock().unwrap_or_else(|p| p.into_inner());
        checks.iter().map(|(name, check)| CheckResult { name: name.clone(), health: check.get() }).collect()
    }

    /// One check by name; `None` if there is no such check.
    pub fn get(&self, name: &str) -> Option<ComponentHealth> {
        let checks = self.checks.lock().unwrap_or_else(|p| p.into_inner());
        checks.iter().find(|(n, _)| n == name).map(|(_, check)| check.get())
    }

    /// Changes of one check from now on; `None` if there is no such check.
    pub fn watch(&self, name: &str) -> Option<watch::Receiver<ComponentHealth>> {
        let checks = self.checks.lock().unwrap_or_else(|p| p.into_inner());
        checks.iter().find(|(n, _)| n == name).map(|(_, check)| check.watch())
    }

    /// Whether every check passes.
    pub fn is_healthy(&self) -> bool {
        self.report().iter().all(|r| r.health.is_healthy())
    }
}

/// The text of a panic's payload (what `panic!` was given), for the
/// health checks and logs of components that caught it.
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failing_component_fails_the_node_until_it_recovers() {
        let healthz = Healthz::new();
        assert!(healthz.is_healthy(), "no checks: healthy");
        let server = HealthReporter::new();
        let watcher = HealthReporter::new();
        healthz.add("registration-server", server.check());
        healthz.add("plugin-watcher", watcher.check());
        assert!(healthz.is_healthy());
        server.failing("cannot bind kubelet.sock: address in use; retrying in 1s");
        assert!(!healthz.is_healthy());
        assert_eq!(
            healthz.get("registration-server"),
            Some(ComponentHealth::Failing {
                reason: "cannot bind kubelet.sock: address in use; retrying in 1s".into()
            })
        );
        assert_eq!(healthz.get("plugin-watcher"), Some(ComponentHealth::Healthy));
        assert_eq!(healthz.get("nope"), None);
        server.healthy();
        assert!(healthz.is_healthy());
        let names: Vec<String> = healthz.report().into_iter().map(|r| r.name).collect();
        assert_eq!(names, ["registration-server", "plugin-watcher"]);
    }

    #[test]
    fn adding_a_check_again_replaces_it() {
        let healthz = Healthz::new();
        let old = HealthReporter::new();
        old.failing("old");
        healthz.add("x", old.check());
        healthz.add("x", HealthReporter::new().check());
        assert_eq!(healthz.report().len(), 1);
        assert!(healthz.is_healthy());
    }
}
