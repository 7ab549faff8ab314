//! Events about pods, as the kubelet records them (`Pulling`, `Created`,
//! `Started`, `Killing`, `BackOff`, `Unhealthy`, `FailedMount`, …).
//!
//! Recording never stalls: it is a non-blocking send to a bounded queue
//! (1,000); a full queue drops the event (logged at debug level). In
//! cluster mode the node's `cluster` module takes the queue and writes the
//! events to the API (aggregated and spam-filtered as upstream does);
//! events still queued when the node shuts down are not written.
//!
//! Events are also logged at debug level
//! (`RUSTLET_LOG=kubelet_pods::events=debug`);
//! the node's own log lines say the same things in its words.

use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use tokio::sync::mpsc;

/// How many events wait for the API at most.
const QUEUE: usize = 1_000;

/// `Normal` or `Warning`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventType {
    /// Something happened as it should.
    Normal,
    /// Something went wrong.
    Warning,
}

/// One event.
#[derive(Clone, Debug, PartialEq)]
pub struct Event {
    /// What it is about (a pod, with the container's `fieldPath`).
    pub regarding: ObjectReference,
    /// Its type.
    pub type_: EventType,
    /// Upstream's reason (`Pulling`, `BackOff`, …).
    pub reason: String,
    /// The message.
    pub message: String,
}

/// Records events. Cheap to clone; a recorder made with
/// [`EventRecorder::log_only`] only logs.
#[derive(Clone, Debug)]
pub struct EventRecorder {
    queue: Option<mpsc::Sender<Event>>,
}

impl Default for EventRecorder {
    fn default() -> Self {
        EventRecorder::log_only()
    }
}

/// Where a recorder's events go (cluster mode takes it).
#[derive(Debug)]
pub struct EventQueue(pub mpsc::Receiver<Event>);

impl EventRecorder {
    /// A recorder that logs events and keeps nothing.
    pub fn log_only() -> EventRecorder {
        EventRecorder { queue: None }
    }

    /// A recorder that logs events and queues them for the API.
    pub fn queued() -> (EventRecorder, EventQueue) {
        let (tx, rx) = mpsc::channel(QUEUE);
        (EventRecorder { queue: Some(tx) }, EventQueue(rx))
    }

    /// Records an event about `pod` (its container `container`, if any).
    pub(crate) fn pod(&self, pod: &Pod, container: Option<&str>, type_: EventType, reason: &str, message: String) {
        let meta = &pod.metadata;
        let field_path = container.map(|name| {
            let spec = pod.spec.as_ref();
            let init = spec.and_then(|s| s.init_containers.as_ref());
            if init.is_some_and(|c| c.iter().any(|c| c.name == name)) {
                format!("spec.initContainers{{{name}}}")
            } else {
                format!("spec.containers{{{name}}}")
            }
        });
        let regarding = ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Pod".into()),
            namespace: meta.namespace.clone(),
            name: meta.name.clone(),
            uid: meta.uid.clone(),
            field_path,
            ..ObjectReference::default()
        };
        self.record(Event { regarding, type_, reason: reason.to_owned(), message });
    }

    /// Records an event about node `name` (upstream's node reference: the
    /// name as UID, in no namespace; the Event goes to `default`).
    pub fn node(&self, name: &str, type_: EventType, reason: &str, message: String) {
        let regarding = ObjectReference {
            kind: Some("Node".into()),
            name: Some(name.to_owned()),
            uid: Some(name.to_owned()),
            ..ObjectReference::default()
        };
        self.record(Event { regarding, type_, reason: reason.to_owned(), message });
    }

    /// Records `event`.
    pub(crate) fn record(&self, event: Event) {
        let object = format!(
            "{}/{}",
            event.regarding.namespace.as_deref().unwrap_or_default(),
            event.regarding.name.as_deref().unwrap_or_default()
        );
        // The node logs what happens in its own words; events are for the
        // API (a failing probe makes one a period).
        tracing::debug!(event = %event.reason, %object, type_ = ?event.type_, "{}", event.message);
        if let Some(queue) = &self.queue
            && queue.try_send(event).is_err()
        {
            tracing::debug!(%object, "the event queue is full; event dropped");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn container_events_name_their_field() {
        let (recorder, mut queue) = EventRecorder::queued();
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "namespace": "ns", "uid": "u"},
            "spec": {"initContainers": [{"name": "setup"}], "containers": [{"name": "main"}]}
        }))
        .expect("pod");
        recorder.pod(&pod, Some("main"), EventType::Normal, "Started", "Started container main".into());
        recorder.pod(&pod, Some("setup"), EventType::Normal, "Started", "Started container setup".into());
        let first = queue.0.try_recv().expect("queued");
        assert_eq!(first.regarding.field_path.as_deref(), Some("spec.containers{main}"));
        assert_eq!(first.regarding.uid.as_deref(), Some("u"));
        let second = queue.0.try_recv().expect("queued");
        assert_eq!(second.regarding.field_path.as_deref(), Some("spec.initContainers{setup}"));
    }
}
