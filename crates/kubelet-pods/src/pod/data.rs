//! What one pod's states share: its spec, what was prepared for it, and
//! where each of its containers stands.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Container, ContainerStatus, Pod};
use k8s_openapi::jiff::Timestamp;
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::backoff::Backoff;
use super::probe::ProbeKind;
use super::spec::{PodIdentity, containers};
use crate::device_manager::{ContainerKind, PodDevices};
use crate::provider::{ContainerExit, ContainerId, ProviderError};
use crate::volume::PodVolumes;

/// Where a container stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ContainerPhase {
    /// Not running: why, and what to tell the user.
    Waiting {
        /// `ContainerCreating`, `PodInitializing`, `CrashLoopBackOff`, …
        reason: String,
        /// Details.
        message: Option<String>,
    },
    /// Running since `started_at`.
    Running {
        /// When it started.
        started_at: Timestamp,
    },
    /// Ended.
    Terminated(Terminated),
}

/// How a container ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Terminated {
    /// Exit code.
    pub exit_code: i32,
    /// `Completed`, `Error`, `OOMKilled`, `ContainerCannotRun`.
    pub reason: String,
    /// Details.
    pub message: Option<String>,
    /// When it started (if it ran).
    pub started_at: Option<Timestamp>,
    /// When it ended.
    pub finished_at: Timestamp,
    /// The provider's id.
    pub container_id: Option<ContainerId>,
}

/// One container of the pod.
#[derive(Clone, Debug)]
pub(crate) struct ContainerRecord {
    /// Its spec.
    pub spec: Container,
    /// Init, sidecar or app.
    pub kind: ContainerKind,
    /// Now.
    pub phase: ContainerPhase,
    /// The previous termination, once it restarted.
    pub last_terminated: Option<Terminated>,
    /// Restarts so far.
    pub restart_count: u32,
    /// The running (or last) instance's id.
    pub id: Option<ContainerId>,
    /// The image id, once prepared.
    pub image_id: Option<String>,
    /// Restart backoff.
    pub backoff: Backoff,
    /// When the running instance started (monotonic, for the backoff reset).
    pub started: Option<Instant>,
    /// Whether the container should be started (again) when the pod starts
    /// containers next.
    pub wants_start: bool,
    /// What the API's status said of this container before the node took
    /// the pod on again (after a node restart): its next start continues
    /// that count unless the container is adopted.
    pub previous_run: Option<PreviousRun>,
    /// The running instance's probes.
    pub probes: ProbeState,
    /// The scheme of its IDs in the status (`containerd`), from its
    /// provider; empty: bare IDs.
    pub runtime: String,
    /// It ended and starts again: the restart counts when the next
    /// instance is made.
    pub restart_pending: bool,
    /// Where the running (or last) instance's termination message is read.
    pub message_source: MessageSource,
    /// An ephemeral container's `targetContainerName`: the container whose
    /// process namespace it joins.
    pub target: Option<String>,
    /// The resources the running instance was started or last updated
    /// with (in-place resize); `None` before its first start.
    pub actuated: Option<k8s_openapi::api::core::v1::ResourceRequirements>,
    /// It is being stopped to be started again with its new size (its
    /// resize policy says `RestartContainer`).
    pub resize_restart: bool,
}

/// Where a container's termination message comes from, as upstream reads
/// it: the file mounted at its `terminationMessagePath` (at most 4 KiB),
/// else, under `FallbackToLogsOnError` and a failed exit, the end of its
/// log (the last 80 lines, at most 2 KiB).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct MessageSource {
    /// The termination-message file on the host.
    pub file: Option<std::path::PathBuf>,
    /// The instance's log, when its policy falls back to it.
    pub log: Option<std::path::PathBuf>,
}

/// The most of a termination-message file that is read.
pub(crate) const MAX_TERMINATION_MESSAGE: u64 = 4096;
/// The most of a log's end that becomes a termination message…
pub(crate) const MAX_TERMINATION_LOG_BYTES: usize = 2048;
/// …and in lines.
pub(crate) const MAX_TERMINATION_LOG_LINES: usize = 80;

impl MessageSource {
    /// The termination message of an instance that exited with `exit_code`.
    pub(crate) fn read(&self, exit_code: i32) -> Option<String> {
        if let Some(file) = &self.file
            && let Ok(text) = read_end(file, MAX_TERMINATION_MESSAGE)
            && !text.is_empty()
        {
            return Some(String::from_utf8_lossy(&text).into_owned());
        }
        let log = self.log.as_ref().filter(|_| exit_code != 0)?;
        // Enough of the end for 80 lines of 2 KiB with their framing; the
        // first line read may be cut, and is dropped when more follow.
        let raw = read_end(log, 64 * 1024).ok()?;
        let raw = String::from_utf8_lossy(&raw);
        let raw = match raw.split_once('\n') {
            Some((_, rest)) if raw.len() as u64 == 64 * 1024 && !rest.is_empty() => rest,
            _ => &raw,
        };
        let lines = crate::provider::decode_cri_log(raw);
        let tail = lines[lines.len().saturating_sub(MAX_TERMINATION_LOG_LINES)..].concat();
        let mut end = tail.len().min(MAX_TERMINATION_LOG_BYTES);
        while !tail.is_char_boundary(end) {
            end -= 1;
        }
        Some(tail[..end].to_owned()).filter(|t| !t.is_empty())
    }
}

/// The last `most` bytes of the file at `path` (upstream reads a
/// termination message's end, not its start).
fn read_end(path: &std::path::Path, most: u64) -> std::io::Result<Vec<u8>> {
    use std::io::{Read as _, Seek as _};
    let mut file = std::fs::File::open(path)?;
    let size = file.metadata()?.len();
    file.seek(std::io::SeekFrom::Start(size.saturating_sub(most)))?;
    let mut text = Vec::new();
    file.take(most).read_to_end(&mut text)?;
    Ok(text)
}

/// A container's run as the API status recorded it before a node restart.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct PreviousRun {
    /// Its restart count then.
    pub restart_count: u32,
    /// Whether it had started (running, or ended).
    pub started: bool,
    /// When its last instance started.
    pub started_at: Option<Timestamp>,
    /// That instance's id.
    pub container_id: Option<ContainerId>,
}

impl PreviousRun {
    /// What `status` says of the run.
    pub(crate) fn of(status: &ContainerStatus) -> PreviousRun {
        let state = status.state.as_ref();
        let running = state.and_then(|s| s.running.as_ref());
        let terminated = state.and_then(|s| s.terminated.as_ref());
        PreviousRun {
            restart_count: u32::try_from(status.restart_count).unwrap_or(0),
            started: running.is_some() || terminated.is_some() || status.last_state.is_some(),
            started_at: running
                .and_then(|r| r.started_at.as_ref())
                .or_else(|| terminated.and_then(|t| t.started_at.as_ref()))
                .map(|t| t.0),
            container_id: status.container_id.clone().map(ContainerId),
        }
    }
}

impl ContainerRecord {
    /// A record for a container of `kind` that has not run yet.
    pub(crate) fn new(kind: ContainerKind, spec: &Container) -> Self {
        ContainerRecord {
            spec: spec.clone(),
            kind,
            phase: ContainerPhase::Waiting { reason: "ContainerCreating".into(), message: None },
            last_terminated: None,
            restart_count: 0,
            id: None,
            image_id: None,
            backoff: Backoff::default(),
            started: None,
            wants_start: true,
            previous_run: None,
            probes: ProbeState::default(),
            runtime: String::new(),
            restart_pending: false,
            message_source: MessageSource::default(),
            target: None,
            actuated: None,
            resize_restart: false,
        }
    }

    /// Whether it runs now.
    pub(crate) fn is_running(&self) -> bool {
        matches!(self.phase, ContainerPhase::Running { .. })
    }

    /// Whether it has started, as its startup probe says (a running
    /// container without one has).
    pub(crate) fn has_started(&self) -> bool {
        self.is_running() && self.probes.started != Some(false)
    }

    /// Whether it is ready: started, and its readiness probe (if any) passed.
    pub(crate) fn is_ready(&self) -> bool {
        self.kind != ContainerKind::Init && self.has_started() && self.probes.ready != Some(false)
    }

    /// Whether its readiness counts for the pod's (ephemeral containers'
    /// does not, nor does an init container's).
    pub(crate) fn counts_for_readiness(&self) -> bool {
        matches!(self.kind, ContainerKind::App | ContainerKind::RestartableInit)
    }

    /// Whether it ended with exit code 0.
    pub(crate) fn succeeded(&self) -> bool {
        matches!(&self.phase, ContainerPhase::Terminated(t) if t.exit_code == 0)
    }

    /// How long the running instance has run.
    pub(crate) fn ran_for(&self, now: Instant) -> Duration {
        self.started.map(|s| now.saturating_duration_since(s)).unwrap_or_default()
    }
}

/// One container exit as a waiter task reports it.
#[derive(Debug)]
pub(crate) struct ExitReport {
    /// The container's name.
    pub container: String,
    /// The instance that ended.
    pub id: ContainerId,
    /// How it ended (an error if the provider lost it).
    pub exit: Result<ContainerExit, ProviderError>,
}

/// A probe's counted result changed.
#[derive(Debug)]
pub(crate) struct ProbeReport {
    /// The container's name.
    pub container: String,
    /// The instance probed.
    pub id: ContainerId,
    /// Which probe.
    pub kind: ProbeKind,
    /// The counted result.
    pub healthy: bool,
    /// Why the last attempt failed (empty on success).
    pub message: String,
}

/// What the tasks watching a pod's containers tell its lifecycle.
#[derive(Debug)]
pub(crate) enum ContainerEvent {
    /// A container ended.
    Exit(ExitReport),
    /// A probe's result changed.
    Probe(ProbeReport),
    /// Ephemeral containers were added to the pod (`kubectl debug`), with
    /// the containers they target.
    Ephemeral(Vec<(Container, Option<String>)>),
    /// The pod's `activeDeadlineSeconds` ran out.
    DeadlineExceeded,
    /// The pod's containers may have a new size (`resize`), or resources
    /// a deferred resize waits for were given back: judge it again.
    Resize,
    /// The node evicts the pod.
    Evict(Eviction),
}

/// Why and how the node evicts a pod: its containers are stopped within
/// `grace` and it ends Failed with reason `Evicted` and `message`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Eviction {
    /// Upstream's message ("The node was low on resource: memory. …").
    pub message: String,
    /// The grace period its containers get.
    pub grace: std::time::Duration,
    /// For the node's pressure (a `DisruptionTarget` condition), not for
    /// the pod's own local storage limits.
    pub disruption: bool,
}

/// The reason of an evicted pod.
pub const EVICTED: &str = "Evicted";

/// The reason of a pod that ran past its `activeDeadlineSeconds`.
pub(crate) const DEADLINE_EXCEEDED: &str = "DeadlineExceeded";
/// …and its message (upstream's).
pub(crate) const DEADLINE_MESSAGE: &str = "Pod was active on the node longer than the specified deadline";

/// Where a running instance's probes stand.
#[derive(Clone, Debug, Default)]
pub(crate) struct ProbeState {
    /// The readiness probe's counted result; `None` without one.
    pub ready: Option<bool>,
    /// Whether the startup probe passed; `None` without one.
    pub started: Option<bool>,
    /// Why a probe killed this instance, for its termination message.
    pub killed_by: Option<String>,
    /// The probe tasks of this instance (aborted when it ends).
    pub tasks: Vec<tokio::task::AbortHandle>,
}

impl ProbeState {
    /// Stops the probe tasks.
    pub(crate) fn stop(&mut self) {
        for task in self.tasks.drain(..) {
            task.abort();
        }
    }
}

/// A pod-level verdict that overrides the computed phase (admission
/// rejections, a failed init container).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct PodVerdict {
    /// `Failed` or `Succeeded`.
    pub phase: &'static str,
    /// `OutOfcpu`, `UnexpectedAdmissionError`, …
    pub reason: Option<String>,
    /// Details.
    pub message: Option<String>,
    /// Rejected at admission: the status is phase, reason and message only
    /// (no container ever existed), as upstream reports a rejected pod.
    pub rejected: bool,
    /// Evicted for the node's pressure: the status carries upstream's
    /// `DisruptionTarget` condition (not for a local storage limit).
    pub disruption: bool,
}

/// What the states of one pod share.
pub struct PodData {
    /// The pod as last applied.
    pub pod: Arc<Pod>,
    /// Its identity.
    pub id: PodIdentity,
    /// Containers by name.
    pub(crate) containers: BTreeMap<String, ContainerRecord>,
    /// Container names in start order (init, then app).
    pub order: Vec<String>,
    /// Devices allocated at admission, by container.
    pub devices: PodDevices,
    /// Prepared volumes.
    pub(crate) volumes: PodVolumes,
    /// Whether admission let the pod in (its requests count against the node).
    pub admitted: bool,
    /// Whether the volumes are ready.
    pub volumes_ready: bool,
    /// Whether every init container has completed.
    pub initialized: bool,
    /// The pod's own IPs, from its provider (empty: the node's).
    pub pod_ips: Vec<std::net::IpAddr>,
    /// When the node took the pod on.
    pub start_time: Timestamp,
    /// A pod-level waiting message (a volume that cannot be prepared yet).
    pub pending_message: Option<String>,
    /// A final verdict.
    pub(crate) verdict: Option<PodVerdict>,
    /// The grace period the containers get when the verdict stops them
    /// (an eviction's); `None`: the pod's own.
    pub stop_grace: Option<std::time::Duration>,
    /// Container exits and probe results, from the waiter and probe tasks.
    pub(crate) events: mpsc::UnboundedReceiver<ContainerEvent>,
    /// Where those tasks send them.
    pub(crate) event_sender: mpsc::UnboundedSender<ContainerEvent>,
    /// Where the pod's events (Kubernetes Events) go.
    pub recorder: crate::events::EventRecorder,
    /// The waiter and probe tasks (aborted when the pod's data is dropped).
    pub waiters: JoinSet<()>,
    /// When the node first saw the pod, and whether its start was recorded
    /// (`kubelet_pod_start_duration_seconds`, once per pod).
    pub seen: (std::time::Instant, bool),
    /// Where the pod's probes are counted.
    pub probe_metrics: crate::metrics::ProbeMetrics,
    /// Where an in-place resize stands.
    pub(crate) resize: super::resize::ResizeState,
    /// A resize is to be judged when the pod next runs its containers.
    pub resize_due: bool,
}

impl PodData {
    /// Fresh data for `pod`.
    pub(crate) fn new(pod: Arc<Pod>) -> Self {
        let id = PodIdentity::of(&pod);
        let mut records = BTreeMap::new();
        let mut order = Vec::new();
        let status = pod.status.as_ref();
        let previous = status
            .into_iter()
            .flat_map(|s| s.init_container_statuses.iter().flatten().chain(s.container_statuses.iter().flatten()));
        let previous: BTreeMap<&str, PreviousRun> = previous.map(|c| (c.name.as_str(), PreviousRun::of(c))).collect();
        for (kind, container) in containers(&pod) {
            order.push(container.name.clone());
            let mut record = ContainerRecord::new(kind, container);
            record.previous_run = previous.get(container.name.as_str()).cloned();
            records.insert(container.name.clone(), record);
        }
        // A pod the API already showed started (the node restarted) keeps
        // its start time.
        let start_time = status.and_then(|s| s.start_time.as_ref()).map_or_else(Timestamp::now, |t| t.0);
        let (event_sender, events) = mpsc::unbounded_channel();
        PodData {
            pod,
            id,
            containers: records,
            order,
            devices: PodDevices::new(),
            volumes: PodVolumes::new(),
            admitted: false,
            volumes_ready: false,
            initialized: false,
            start_time,
            pod_ips: Vec::new(),
            pending_message: None,
            verdict: None,
            stop_grace: None,
            events,
            event_sender,
            recorder: crate::events::EventRecorder::log_only(),
            waiters: JoinSet::new(),
            seen: (std::time::Instant::now(), false),
            probe_metrics: crate::metrics::ProbeMetrics::default(),
            resize: super::resize::ResizeState::default(),
            resize_due: false,
        }
    }

    /// The containers in start order.
    pub(crate) fn ordered(&self) -> impl Iterator<Item = &ContainerRecord> {
        self.order.iter().filter_map(|name| self.containers.get(name))
    }

    /// Names of the containers of `kinds`, in start order.
    pub(crate) fn names_of(&self, kinds: &[ContainerKind]) -> Vec<String> {
        self.ordered().filter(|c| kinds.contains(&c.kind)).map(|c| c.spec.name.clone()).collect()
    }

    /// Sets every container that is not running or terminated to waiting with
    /// `reason`.
    pub(crate) fn set_waiting(&mut self, reason: &str, message: Option<String>) {
        for record in self.containers.values_mut() {
            if let ContainerPhase::Waiting { .. } = record.phase {
                record.phase = ContainerPhase::Waiting { reason: reason.to_owned(), message: message.clone() };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_termination_message_is_the_files_end_else_the_failed_logs_end() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("message");
        let log = dir.path().join("0.log");
        let source = MessageSource { file: Some(file.clone()), log: Some(log.clone()) };
        std::fs::write(&file, "").expect("file");
        let lines: String = (0..100).map(|i| crate::provider::cri_log_line("stdout", &format!("line {i}"))).collect();
        std::fs::write(&log, format!("{lines}2026-01-01T00:00:00Z stdout P DONE\n")).expect("log");
        assert_eq!(source.read(0), None, "a success does not fall back to the log");
        let message = source.read(1).expect("the log's end");
        assert!(message.starts_with("line 21\n") && message.ends_with("line 99\nDONE"), "{message:?}");
        // A file's last 4 KiB win over the log.
        std::fs::write(&file, format!("{}END", "x".repeat(5000))).expect("file");
        let message = source.read(1).expect("the file");
        assert_eq!(message.len(), MAX_TERMINATION_MESSAGE as usize);
        assert!(message.ends_with("xEND"));
    }
}
