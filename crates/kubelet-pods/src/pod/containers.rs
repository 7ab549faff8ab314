//! Starting, adopting, watching and stopping one container: the steps the
//! container states share.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::jiff::Timestamp;
use krator::Context;
use tokio::time::Instant;

use super::PodLifecycle;
use super::data::{ContainerEvent, ContainerPhase, ExitReport, PodData, ProbeReport, ProbeState, Terminated};
use super::node_files;
use super::probe::{ProbeKind, ProbeSpec, Target, Worker};
use super::run_options;
use crate::device_manager::ContainerKind;
use crate::device_manager::RunOptions;
use crate::events::EventType;
use crate::provider::{ContainerId, ContainerLaunch, ContainerRunOptions, Provider, ProviderErrorKind};

/// Why a container did not start.
#[derive(Debug)]
pub(crate) struct StartFailure {
    /// `CreateContainerConfigError`, `RunContainerError`, …
    pub reason: &'static str,
    /// Details.
    pub message: String,
    /// Whether trying again may help (with backoff).
    pub retry: bool,
}

/// The start of a container the pod does not have.
fn no_container(name: &str) -> StartFailure {
    StartFailure { reason: "RunContainerError", message: format!("no container {name}"), retry: false }
}

/// The pod's log dir: `<root>/pods/<namespace>_<name>_<uid>`.
pub(crate) fn log_dir(lifecycle: &PodLifecycle, data: &PodData) -> std::path::PathBuf {
    super::pod_log_dir(&lifecycle.config.root_dir, &data.id.namespace, &data.id.name, &data.id.uid)
}

/// Where the container's log goes.
pub(crate) fn log_path(lifecycle: &PodLifecycle, data: &PodData, container: &str, restart: u32) -> std::path::PathBuf {
    log_dir(lifecycle, data).join(container).join(format!("{restart}.log"))
}

/// Starts (or adopts, after a node restart) the container `name`: adopt
/// it if it survived a restart, else prepare its image, its devices, the
/// pod's sandbox, its run options and its claims' devices, count the
/// restart, launch it, and follow it (status, probes, postStart).
pub(crate) async fn start(
    ctx: &mut Context<PodLifecycle>,
    provider: &Arc<dyn Provider>,
    name: &str,
) -> Result<(), StartFailure> {
    if adopt(ctx, provider, name).await || ephemeral_lost_in_restart(&mut ctx.data, name) {
        return Ok(());
    }
    let lifecycle = Arc::clone(&ctx.machine);
    // A container added to the running pod (an ephemeral one) has its
    // image prepared now.
    pull_if_needed(ctx, provider, name).await?;
    let devices = device_options(&lifecycle, &ctx.data.id.uid, name).await?;
    let data = &mut ctx.data;
    if !data.containers.contains_key(name) {
        return Err(no_container(name));
    }
    ensure_sandbox(&lifecycle, data, provider).await?;
    let (mut run_options, message_file) = run_options_of(&lifecycle, data, provider, name, &devices).await?;
    add_claim_devices(&lifecycle, data, provider, name, &mut run_options)?;
    count_restart(data, name);
    let (launch, message_source) = launch_of(&lifecycle, data, name, run_options, message_file)?;
    launch_and_follow(&lifecycle, data, provider, name, launch, message_source).await
}

/// Follows container `name` if it ran before a node restart and runs
/// still (it is not started again); whether it did.
async fn adopt(ctx: &mut Context<PodLifecycle>, provider: &Arc<dyn Provider>, name: &str) -> bool {
    let lifecycle = Arc::clone(&ctx.machine);
    let uid = ctx.data.id.uid.clone();
    let Some(running) = lifecycle.take_adopted(&uid, name) else { return false };
    tracing::info!(pod.uid = %uid, container = name, id = %running.id, "container adopted, not restarted");
    if let Some(record) = ctx.data.containers.get_mut(name) {
        record.restart_count = running.restart_count;
        record.previous_run = None;
    }
    // Probe delays count from the container's own start.
    let ran_for = Timestamp::now().duration_since(running.started_at);
    let ran_for = Duration::try_from(ran_for).unwrap_or_default();
    let started = Instant::now().checked_sub(ran_for).unwrap_or_else(Instant::now);
    let also = own_addresses(&lifecycle, &ctx.data);
    follow(&mut ctx.data, provider, name, running.id, running.started_at, started, also).await;
    true
}

/// An ephemeral container that ran before the node restarted and did not
/// survive it is not run again (its end is unknown): it is recorded as
/// ended; whether it was such a container.
fn ephemeral_lost_in_restart(data: &mut PodData, name: &str) -> bool {
    let Some(record) = data.containers.get_mut(name) else { return false };
    if record.kind != ContainerKind::Ephemeral {
        return false;
    }
    let Some(previous) = record.previous_run.take() else { return false };
    record.wants_start = false;
    record.phase = ContainerPhase::Terminated(Terminated {
        exit_code: 137,
        reason: "ContainerStatusUnknown".into(),
        message: Some("the node restarted while the ephemeral container ran; its end was not seen".into()),
        started_at: previous.started_at,
        finished_at: Timestamp::now(),
        container_id: previous.container_id,
    });
    true
}

/// What the device plugins give container `name` (PreStartContainer runs
/// before every start).
async fn device_options(lifecycle: &PodLifecycle, uid: &str, name: &str) -> Result<RunOptions, StartFailure> {
    let Some(devices) = &lifecycle.devices else { return Ok(RunOptions::default()) };
    devices.container_run_options(uid, name).await.map_err(|e| StartFailure {
        reason: "RunContainerError",
        message: e.to_string(),
        retry: true,
    })
}

/// The pod's network, made before its first container: its IPs are in the
/// env (`status.podIP`) and in /etc/hosts.
async fn ensure_sandbox(
    lifecycle: &PodLifecycle,
    data: &mut PodData,
    provider: &Arc<dyn Provider>,
) -> Result<(), StartFailure> {
    let host_network = data.pod.spec.as_ref().and_then(|s| s.host_network).unwrap_or(false);
    if !data.pod_ips.is_empty() || host_network {
        return Ok(());
    }
    wait_for_the_network(data, provider).await?;
    let directory = log_dir(lifecycle, data);
    let prepared = provider.prepare_pod(&data.pod, &directory).await;
    lifecycle.metrics.sandbox(prepared.is_ok());
    data.pod_ips = prepared.map_err(|e| StartFailure {
        reason: "ContainerCreating",
        message: format!("Failed to create pod sandbox: {}", e.message),
        retry: true,
    })?;
    Ok(())
}

/// Holds a pod that needs the pod network while the runtime says it is not
/// ready, as the kubelet does: a `NetworkNotReady` Warning with upstream's
/// `network is not ready: <the runtime's reason>`, the containers waiting
/// in `ContainerCreating`, no backoff and no restart counted; it goes on as
/// soon as the network is ready. A deadline or an eviction meanwhile ends
/// the wait (the verdict is recorded for the caller).
async fn wait_for_the_network(data: &mut PodData, provider: &Arc<dyn Provider>) -> Result<(), StartFailure> {
    let Some(mut network) = provider.network_readiness(&data.pod) else { return Ok(()) };
    let Some(why) = network.borrow_and_update().clone() else { return Ok(()) };
    let message = format!("network is not ready: {why}");
    tracing::info!(pod.uid = %data.id.uid, %why, "the pod waits for the pod network");
    data.recorder.pod(&data.pod, None, EventType::Warning, "NetworkNotReady", message.clone());
    data.set_waiting("ContainerCreating", None);
    tokio::select! {
        ready = network.wait_for(Option::is_none) => {
            // The provider gone: the sandbox call says what is wrong.
            let _ = ready;
            tracing::info!(pod.uid = %data.id.uid, "the pod network is ready: the pod goes on");
            Ok(())
        }
        () = until_deadline(data) => Err(StartFailure { reason: "ContainerCreating", message, retry: false }),
    }
}

/// Records the pod's events until one is a deadline or an eviction.
async fn until_deadline(data: &mut PodData) {
    loop {
        let Some(event) = data.events.recv().await else { return std::future::pending().await };
        if record_event(data, event) == Recorded::Deadline {
            return;
        }
    }
}

/// Container `name`'s run options (env with its API objects, services and
/// downward values, mounts, devices, the node's files) and the file its
/// termination message is read from.
async fn run_options_of(
    lifecycle: &PodLifecycle,
    data: &PodData,
    provider: &Arc<dyn Provider>,
    name: &str,
    devices: &RunOptions,
) -> Result<(ContainerRunOptions, Option<std::path::PathBuf>), StartFailure> {
    let config_error = |message: String| StartFailure { reason: "CreateContainerConfigError", message, retry: true };
    let Some(record) = data.containers.get(name) else {
        return Err(no_container(name));
    };
    // The ConfigMaps and Secrets its env references, and the services whose
    // link variables it gets, read now (as upstream does at every start).
    let (env_objects, services) = match lifecycle.volumes.objects() {
        Some(objects) => (
            Some(
                crate::volume::api_data::env_objects(objects.as_ref(), &data.pod, &record.spec)
                    .await
                    .map_err(|e| config_error(e.to_string()))?,
            ),
            crate::volume::api_data::link_services(objects.as_ref(), &data.pod).await,
        ),
        None => (None, Vec::new()),
    };
    let downward = lifecycle.downward_context(data);
    let sources = run_options::EnvSources { objects: env_objects.as_ref(), services: &services, downward: &downward };
    let mut run_options = run_options::build(&data.pod, &record.spec, &data.volumes, devices, sources)
        .map_err(|e| config_error(e.to_string()))?;
    let mut message_file = None;
    if provider.mounts_files(&data.pod) {
        let files = node_files::prepare(lifecycle, data, &record.spec, &downward).map_err(config_error)?;
        run_options.mounts.extend(files.mounts);
        message_file = files.termination_message;
    }
    Ok((run_options, message_file))
}

/// The CDI devices of the resource claims container `name` uses, which
/// must be prepared. The names go to the runtime (the CRI field); one
/// that does not read CDI specs gets their edits from the node.
fn add_claim_devices(
    lifecycle: &PodLifecycle,
    data: &PodData,
    provider: &Arc<dyn Provider>,
    name: &str,
    run_options: &mut ContainerRunOptions,
) -> Result<(), StartFailure> {
    if let Some((claims, _)) = &lifecycle.claims {
        let missing = claims.unprepared_claims(&data.pod, name);
        if !missing.is_empty() {
            return Err(StartFailure {
                reason: "CreateContainerConfigError",
                message: format!("resource claims not prepared: {}", missing.join(", ")),
                retry: true,
            });
        }
        for id in claims.cdi_devices(&data.pod, name) {
            if !run_options.cdi_devices.contains(&id) {
                run_options.cdi_devices.push(id);
            }
        }
    }
    if !run_options.cdi_devices.is_empty() && !provider.reads_cdi(&data.pod) {
        let registry = super::cdi::Registry::read(&lifecycle.config.cdi_spec_dirs);
        let names = run_options.cdi_devices.clone();
        if let Some(unresolved) = registry.apply(&names, run_options) {
            tracing::warn!(pod = %data.id.name, namespace = %data.id.namespace, container = name, dirs = ?lifecycle.config.cdi_spec_dirs, "{unresolved}: the container starts without their edits");
        }
        tracing::debug!(pod = %data.id.name, namespace = %data.id.namespace, container = name, devices = ?names, "CDI devices resolved by the node");
    }
    Ok(())
}

/// A restart counts when the new instance is made (upstream's count of
/// the instances that came before), not when its backoff begins.
fn count_restart(data: &mut PodData, name: &str) {
    if let Some(record) = data.containers.get_mut(name) {
        continue_previous_run(record);
        if std::mem::take(&mut record.restart_pending) {
            record.restart_count += 1;
        }
    }
}

/// What the provider is asked to start for container `name`, and where
/// its termination message will come from.
fn launch_of(
    lifecycle: &PodLifecycle,
    data: &PodData,
    name: &str,
    run_options: ContainerRunOptions,
    message_file: Option<std::path::PathBuf>,
) -> Result<(ContainerLaunch, super::data::MessageSource), StartFailure> {
    let Some(record) = data.containers.get(name) else {
        return Err(no_container(name));
    };
    let restart_count = record.restart_count;
    let log_path = log_path(lifecycle, data, name, restart_count);
    let message_source = super::data::MessageSource {
        file: message_file,
        log: (record.spec.termination_message_policy.as_deref() == Some("FallbackToLogsOnError"))
            .then(|| log_path.clone()),
    };
    let target = record
        .target
        .as_ref()
        .and_then(|t| data.containers.get(t))
        .filter(|t| t.is_running())
        .and_then(|t| t.id.clone());
    let launch = ContainerLaunch {
        target,
        pod: Arc::clone(&data.pod),
        container: record.spec.clone(),
        kind: record.kind,
        restart_count,
        run_options,
        log_path,
    };
    Ok((launch, message_source))
}

/// Starts `launch` and follows the container: its events, its status, its
/// probes, its postStart hook.
async fn launch_and_follow(
    lifecycle: &PodLifecycle,
    data: &mut PodData,
    provider: &Arc<dyn Provider>,
    name: &str,
    launch: ContainerLaunch,
    message_source: super::data::MessageSource,
) -> Result<(), StartFailure> {
    if let Some(parent) = launch.log_path.parent() {
        let _ = std::fs::create_dir_all(parent);
    }
    let started = provider.start_container(&launch).await.map_err(|e| StartFailure {
        reason: match e.kind {
            ProviderErrorKind::Config => "CreateContainerConfigError",
            _ => "RunContainerError",
        },
        message: e.message,
        retry: true,
    });
    lifecycle.metrics.container_start(launch.kind, started.as_ref().err().map(|f| f.reason));
    let id = started?;
    tracing::info!(pod.uid = %data.id.uid, container = name, %id, restart = launch.restart_count, "container started");
    if let Some(record) = data.containers.get_mut(name) {
        record.message_source = message_source;
    }
    data.recorder.pod(&data.pod, Some(name), EventType::Normal, "Created", format!("Created container {name}"));
    data.recorder.pod(&data.pod, Some(name), EventType::Normal, "Started", format!("Started container {name}"));
    let also = own_addresses(lifecycle, data);
    // The runtime's start time where it says it (the kubelet reports the
    // runtime's, and a node that adopts the container reads the same).
    let started_at = provider.started_at(&id).await.unwrap_or_else(|_| Timestamp::now());
    follow(data, provider, name, id.clone(), started_at, Instant::now(), also).await;
    let address = lifecycle.hook_address(data);
    run_post_start(data, provider, name, &id, address).await;
    Ok(())
}

/// Prepares the image of container `name` if nothing has yet (an
/// ephemeral container's: the pod's images were prepared before it
/// existed).
async fn pull_if_needed(
    ctx: &mut Context<PodLifecycle>,
    provider: &Arc<dyn Provider>,
    name: &str,
) -> Result<(), StartFailure> {
    let Some(record) = ctx.data.containers.get(name).filter(|r| r.image_id.is_none()) else { return Ok(()) };
    let spec = record.spec.clone();
    let secrets = match ctx.machine.volumes.objects() {
        Some(objects) => crate::volume::api_data::pull_secrets(objects.as_ref(), &ctx.data.pod).await,
        None => crate::provider::PullSecrets::default(),
    };
    let image = provider
        .prepare_image_with_secrets(&ctx.data.pod, &spec, &secrets)
        .await
        .map_err(|e| StartFailure { reason: "ErrImagePull", message: e.message, retry: true })?;
    if let Some(record) = ctx.data.containers.get_mut(name) {
        record.image_id = Some(image.image_id);
    }
    Ok(())
}

/// The most a postStart hook may take (upstream sets none; the pod's
/// removal interrupts it anyway).
const POST_START_TIMEOUT: Duration = Duration::from_secs(600);

/// Runs container `name`'s postStart hook, if it has one; a failure stops
/// the container (its exit then follows the restart policy).
async fn run_post_start(
    data: &mut PodData,
    provider: &Arc<dyn Provider>,
    name: &str,
    id: &ContainerId,
    address: std::net::IpAddr,
) {
    let Some(spec) = data.containers.get(name).map(|r| r.spec.clone()) else { return };
    if super::hooks::Hook::PostStart.handler(&spec).is_none() {
        return;
    }
    let hook = super::hooks::Hook::PostStart;
    match super::hooks::run(hook, provider, &data.pod, &spec, id, address, POST_START_TIMEOUT).await {
        Ok(()) => tracing::debug!(pod.uid = %data.id.uid, container = name, "postStart hook done"),
        Err(message) => {
            tracing::warn!(pod.uid = %data.id.uid, container = name, %message, "postStart hook failed: stopping the container");
            data.recorder.pod(&data.pod, Some(name), EventType::Warning, hook.failure_reason(), message);
            let grace = super::spec::grace_period(&data.pod);
            if let Err(error) = provider.stop_container(id, grace).await {
                tracing::warn!(pod.uid = %data.id.uid, container = name, %error, "stopping after a failed postStart hook");
            }
        }
    }
}

/// Addresses other than its own IP that a probe may name as the pod's: a
/// host-network pod's are the node's IPs (and loopback).
fn own_addresses(lifecycle: &PodLifecycle, data: &PodData) -> Vec<std::net::IpAddr> {
    let host_network = data.pod.spec.as_ref().and_then(|s| s.host_network).unwrap_or(false);
    if !host_network {
        return Vec::new();
    }
    let mut also = lifecycle.config.host_ips.clone();
    also.push(std::net::Ipv4Addr::LOCALHOST.into());
    also
}

/// Records that container `name` runs as `id` (started at `started_at`,
/// `started` on the monotonic clock), learns the pod's IPs, and starts
/// watching it: its exit and its probes.
async fn follow(
    data: &mut PodData,
    provider: &Arc<dyn Provider>,
    name: &str,
    id: ContainerId,
    started_at: Timestamp,
    started: Instant,
    also: Vec<std::net::IpAddr>,
) {
    if data.pod_ips.is_empty() {
        data.pod_ips = provider.pod_ips(&data.id.uid).await;
    }
    let runtime = provider.runtime_type(&data.pod);
    if let Some(record) = data.containers.get_mut(name) {
        record.runtime = runtime;
        record.id = Some(id.clone());
        record.phase = ContainerPhase::Running { started_at };
        record.started = Some(started);
        record.wants_start = false;
        // Started with (or, adopted, last given) its allocation.
        record.actuated = Some(record.spec.resources.clone().unwrap_or_default());
        record.resize_restart = false;
    }
    // Finished waiter and probe tasks are reaped as new ones come.
    while data.waiters.try_join_next().is_some() {}
    watch_exit(data, provider, name, id.clone());
    start_probes(data, provider, name, id, started, also);
}

/// A container the API showed before a node restart, and that did not
/// survive it (its provider runs it inside the node process, say), starts
/// again as a restart: its count goes on from the API's, and the run the
/// restart ended is its last state, its end unknown.
fn continue_previous_run(record: &mut super::data::ContainerRecord) {
    let Some(previous) = record.previous_run.take() else { return };
    record.restart_count = previous.restart_count;
    if !previous.started {
        return;
    }
    record.restart_count = previous.restart_count.saturating_add(1);
    record.last_terminated = Some(Terminated {
        exit_code: 137,
        reason: "ContainerStatusUnknown".into(),
        message: Some("the node restarted while the container ran; its end was not seen".into()),
        started_at: previous.started_at,
        finished_at: Timestamp::now(),
        container_id: previous.container_id,
    });
}

/// Spawns the task that waits for the container's exit and reports it.
fn watch_exit(data: &mut PodData, provider: &Arc<dyn Provider>, name: &str, id: ContainerId) {
    let provider = Arc::clone(provider);
    let sender = data.event_sender.clone();
    let container = name.to_owned();
    // Not supervised: the pod's own task (its JoinSet), aborted when its lifecycle ends.
    data.waiters.spawn(async move {
        let exit = provider.wait_container(&id).await;
        let _ = sender.send(ContainerEvent::Exit(ExitReport { container, id, exit }));
    });
}

/// Starts the probe workers of the container instance `id` that just
/// started (or was adopted): readiness starts unready and startup
/// unstarted; liveness and readiness wait for startup.
fn start_probes(
    data: &mut PodData,
    provider: &Arc<dyn Provider>,
    name: &str,
    id: ContainerId,
    started: Instant,
    also: Vec<std::net::IpAddr>,
) {
    let Some(record) = data.containers.get(name) else { return };
    let specs: Vec<ProbeSpec> = [ProbeKind::Startup, ProbeKind::Liveness, ProbeKind::Readiness]
        .into_iter()
        .filter_map(|kind| ProbeSpec::of(kind, &record.spec))
        .collect();
    let mut state = ProbeState::default();
    let has = |kind| specs.iter().any(|s: &ProbeSpec| s.kind == kind);
    state.ready = has(ProbeKind::Readiness).then_some(false);
    state.started = has(ProbeKind::Startup).then_some(false);
    let (start_sender, started_flag) = tokio::sync::watch::channel(!has(ProbeKind::Startup));
    let mut start_sender = Some(start_sender);
    let target = Target {
        provider: Arc::clone(provider),
        id,
        address: data.pod_ips.first().copied().unwrap_or(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST)),
        also,
    };
    for spec in specs {
        let worker = Worker {
            start_sender: if spec.kind == ProbeKind::Startup { start_sender.take() } else { None },
            spec,
            target: target.clone(),
            container: name.to_owned(),
            started_at: started,
            started: started_flag.clone(),
            pod_grace: super::spec::grace_period(&data.pod),
            events: data.event_sender.clone(),
            pod: Arc::clone(&data.pod),
            recorder: data.recorder.clone(),
            metrics: data.probe_metrics.clone(),
        };
        // Not supervised: the pod's own task (its JoinSet), aborted when its lifecycle ends.
        state.tasks.push(data.waiters.spawn(worker.run()));
    }
    if let Some(record) = data.containers.get_mut(name) {
        record.probes.stop();
        record.probes = state;
    }
}

/// What an event changed.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Recorded {
    /// The container (its name) ended.
    Exit(String),
    /// A probe changed the container's status.
    Status,
    /// Containers were added that should start now (ephemeral ones).
    StartDue,
    /// The pod ran past its deadline: its verdict is set, its containers
    /// must stop.
    Deadline,
    /// A resize is to be judged ([`PodData::resize_due`] is set).
    Resize,
    /// Nothing: the event was about an instance that is gone.
    Nothing,
}

/// Records an event from a waiter or probe task.
pub(crate) fn record_event(data: &mut PodData, event: ContainerEvent) -> Recorded {
    match event {
        ContainerEvent::Exit(report) => record_exit(data, report).map_or(Recorded::Nothing, Recorded::Exit),
        ContainerEvent::Probe(report) => {
            if record_probe(data, report) {
                Recorded::Status
            } else {
                Recorded::Nothing
            }
        }
        ContainerEvent::Ephemeral(added) => {
            let mut any = false;
            for (spec, target) in added {
                if data.containers.contains_key(&spec.name) {
                    continue;
                }
                tracing::info!(pod.uid = %data.id.uid, container = %spec.name, target = ?target, "ephemeral container added");
                let mut record = super::data::ContainerRecord::new(ContainerKind::Ephemeral, &spec);
                record.target = target;
                // One the API showed before a node restart: adopted if it
                // still runs, never run again if it ended (ephemeral
                // containers run once).
                let before = data
                    .pod
                    .status
                    .as_ref()
                    .and_then(|s| s.ephemeral_container_statuses.as_ref())
                    .and_then(|s| s.iter().find(|c| c.name == spec.name));
                if let Some(before) = before {
                    record.previous_run = Some(super::data::PreviousRun::of(before));
                    if let Some(ended) = before.state.as_ref().and_then(|s| s.terminated.as_ref()) {
                        record.phase = ContainerPhase::Terminated(Terminated {
                            exit_code: ended.exit_code,
                            reason: ended.reason.clone().unwrap_or_else(|| "Completed".into()),
                            message: ended.message.clone(),
                            started_at: ended.started_at.as_ref().map(|t| t.0),
                            finished_at: ended.finished_at.as_ref().map_or_else(Timestamp::now, |t| t.0),
                            container_id: ended.container_id.clone().map(ContainerId),
                        });
                        record.wants_start = false;
                    }
                }
                any |= record.wants_start;
                data.order.push(spec.name.clone());
                data.containers.insert(spec.name.clone(), record);
            }
            if any { Recorded::StartDue } else { Recorded::Status }
        }
        ContainerEvent::Resize => {
            data.resize.waiting_release = false;
            data.resize_due = true;
            Recorded::Resize
        }
        ContainerEvent::DeadlineExceeded => {
            if data.verdict.is_some() {
                return Recorded::Nothing;
            }
            tracing::info!(pod.uid = %data.id.uid, "the pod ran past its activeDeadlineSeconds: stopping it");
            data.recorder.pod(
                &data.pod,
                None,
                EventType::Normal,
                super::data::DEADLINE_EXCEEDED,
                super::data::DEADLINE_MESSAGE.to_owned(),
            );
            data.verdict = Some(super::data::PodVerdict {
                phase: "Failed",
                reason: Some(super::data::DEADLINE_EXCEEDED.into()),
                message: Some(super::data::DEADLINE_MESSAGE.into()),
                rejected: false,
                disruption: false,
            });
            Recorded::Deadline
        }
        ContainerEvent::Evict(eviction) => {
            if data.verdict.is_some() {
                return Recorded::Nothing;
            }
            tracing::warn!(pod.uid = %data.id.uid, message = %eviction.message, "evicting the pod");
            data.recorder.pod(&data.pod, None, EventType::Warning, super::data::EVICTED, eviction.message.clone());
            data.verdict = Some(super::data::PodVerdict {
                phase: "Failed",
                reason: Some(super::data::EVICTED.into()),
                message: Some(eviction.message),
                rejected: false,
                disruption: eviction.disruption,
            });
            data.stop_grace = Some(eviction.grace);
            Recorded::Deadline
        }
    }
}

/// Watches the pod's manifest while it lives: tells the lifecycle when
/// ephemeral containers are added and when `activeDeadlineSeconds`
/// (counted from the pod's start, and changeable while it runs) runs out.
pub(crate) fn watch_manifest(
    data: &mut PodData,
    mut manifest: tokio::sync::watch::Receiver<Arc<k8s_openapi::api::core::v1::Pod>>,
) {
    let sender = data.event_sender.clone();
    let start_time = data.start_time;
    // Those the pod has now are new to this run of the node too (after a
    // node restart they are adopted or reported as they ended).
    let mut seen: std::collections::HashSet<String> = std::collections::HashSet::new();
    let uid = data.id.uid.clone();
    // The sizes the pod runs with: a manifest with others asks for a resize.
    let mut sizes = super::resize::sizes(&data.pod);
    // Not supervised: the pod's own task (its JoinSet), aborted when its lifecycle ends.
    data.waiters.spawn(async move {
        let mut open = true;
        let mut deadline_sent = false;
        loop {
            let deadline = {
                let pod = manifest.borrow_and_update();
                let now = super::resize::sizes(&pod);
                let resized = now.len() != sizes.len()
                    || now.iter().zip(&sizes).any(|((a, x), (b, y))| a != b || !super::resize::same(x, y));
                if resized {
                    sizes = now;
                    if sender.send(ContainerEvent::Resize).is_err() {
                        return;
                    }
                }
                let added: Vec<_> = ephemeral_of(&pod).into_iter().filter(|(c, _)| !seen.contains(&c.name)).collect();
                if !added.is_empty() {
                    seen.extend(added.iter().map(|(c, _)| c.name.clone()));
                    if sender.send(ContainerEvent::Ephemeral(added)).is_err() {
                        return;
                    }
                }
                pod.spec.as_ref().and_then(|s| s.active_deadline_seconds).filter(|_| !deadline_sent)
            };
            let sleep = deadline.map(|seconds| {
                let at =
                    start_time.checked_add(k8s_openapi::jiff::SignedDuration::from_secs(seconds)).unwrap_or(start_time);
                let left = Timestamp::now().duration_until(at);
                Instant::now() + Duration::try_from(left).unwrap_or_default()
            });
            tokio::select! {
                changed = manifest.changed(), if open => {
                    if changed.is_err() {
                        open = false;
                    }
                }
                () = sleep_until_or_forever(sleep) => {
                    tracing::debug!(pod.uid = %uid, "activeDeadlineSeconds reached");
                    deadline_sent = true;
                    if sender.send(ContainerEvent::DeadlineExceeded).is_err() {
                        return;
                    }
                }
            }
            if !open && deadline_sent {
                return;
            }
        }
    });
}

async fn sleep_until_or_forever(until: Option<Instant>) {
    match until {
        Some(until) => tokio::time::sleep_until(until).await,
        None => std::future::pending().await,
    }
}

/// The pod's ephemeral containers as containers, with their targets.
fn ephemeral_of(pod: &k8s_openapi::api::core::v1::Pod) -> Vec<(k8s_openapi::api::core::v1::Container, Option<String>)> {
    let Some(spec) = pod.spec.as_ref() else { return Vec::new() };
    spec.ephemeral_containers
        .iter()
        .flatten()
        .filter_map(|e| {
            // The same fields under the same names, but the target.
            let mut value = serde_json::to_value(e).ok()?;
            if let Some(object) = value.as_object_mut() {
                object.remove("targetContainerName");
            }
            let container = serde_json::from_value(value).ok()?;
            Some((container, e.target_container_name.clone().filter(|t| !t.is_empty())))
        })
        .collect()
}

/// Records a probe's changed result; returns whether it counted.
fn record_probe(data: &mut PodData, report: ProbeReport) -> bool {
    let Some(record) = data.containers.get_mut(&report.container) else { return false };
    if record.id.as_ref() != Some(&report.id) || !record.is_running() {
        return false;
    }
    // (Each failed attempt was recorded as `Unhealthy` by the worker.)
    let probe = report.kind.title();
    match (report.kind, report.healthy) {
        (ProbeKind::Readiness, ready) => record.probes.ready = Some(ready),
        (ProbeKind::Startup, true) => record.probes.started = Some(true),
        (kind, false) => {
            let what = if kind == ProbeKind::Startup { "startup" } else { "liveness" };
            let message = format!("Container {} failed {what} probe, will be restarted", report.container);
            data.recorder.pod(&data.pod, Some(&report.container), EventType::Normal, "Killing", message);
            record.probes.killed_by = Some(format!("Unhealthy: {probe} probe failed: {}", report.message));
        }
        (ProbeKind::Liveness, true) => return false,
    }
    true
}

/// Records a start failure and backs off before the next try. As upstream,
/// a provider that could not start the container counts as an attempt that
/// ended (`lastState.terminated`: exit code 128, reason `StartError`, the
/// provider's message; the restart count goes up and the container waits
/// in `CrashLoopBackOff`); a failure before the provider was asked (run
/// options, devices) leaves it waiting with that reason.
pub(crate) fn record_start_failure(ctx: &mut Context<PodLifecycle>, name: &str, failure: &StartFailure) {
    let config = ctx.machine.config.restart_backoff;
    let uid = ctx.data.id.uid.clone();
    tracing::warn!(pod.uid = %uid, container = name, reason = failure.reason, error = %failure.message, "container did not start");
    ctx.data.recorder.pod(
        &ctx.data.pod,
        Some(name),
        EventType::Warning,
        "Failed",
        format!("Error: {}", failure.message),
    );
    let Some(record) = ctx.data.containers.get_mut(name) else { return };
    let now = Instant::now();
    record.backoff.fail(&config, Duration::ZERO, now);
    record.wants_start = failure.retry;
    if failure.reason == "RunContainerError" && failure.retry {
        record.last_terminated = Some(Terminated {
            exit_code: 128,
            reason: "StartError".into(),
            message: Some(failure.message.clone()),
            started_at: None,
            finished_at: Timestamp::now(),
            container_id: None,
        });
        record.restart_pending = true;
        record.phase = ContainerPhase::Waiting {
            reason: "CrashLoopBackOff".into(),
            message: Some(format!("back-off restarting failed container {name}: {}", failure.message)),
        };
    } else {
        record.phase =
            ContainerPhase::Waiting { reason: failure.reason.to_owned(), message: Some(failure.message.clone()) };
    }
}

/// Records an exit reported by a waiter; returns the container's name if the
/// report is about its current instance.
fn record_exit(data: &mut PodData, report: ExitReport) -> Option<String> {
    let record = data.containers.get_mut(&report.container)?;
    if record.id.as_ref() != Some(&report.id) || !record.is_running() {
        return None;
    }
    record.probes.stop();
    let killed_by = record.probes.killed_by.take();
    let started_at = match &record.phase {
        ContainerPhase::Running { started_at } => Some(*started_at),
        _ => None,
    };
    let terminated = match report.exit {
        Ok(exit) => Terminated {
            exit_code: exit.exit_code,
            reason: exit.reason.unwrap_or_else(|| if exit.exit_code == 0 { "Completed" } else { "Error" }.to_owned()),
            message: join_messages(killed_by.or(exit.message), record.message_source.read(exit.exit_code)),
            started_at,
            finished_at: exit.finished_at,
            container_id: Some(report.id.clone()),
        },
        Err(error) => Terminated {
            exit_code: 137,
            reason: "Error".to_owned(),
            message: Some(format!("the provider lost the container: {error}")),
            started_at,
            finished_at: Timestamp::now(),
            container_id: Some(report.id.clone()),
        },
    };
    tracing::info!(
        pod.uid = %data.id.uid,
        container = %report.container,
        exit_code = terminated.exit_code,
        reason = %terminated.reason,
        "container exited"
    );
    record.phase = ContainerPhase::Terminated(terminated);
    Some(report.container)
}

/// The runtime's word on an exit and the container's termination message,
/// joined as upstream joins them (`<runtime's>: <container's>`).
fn join_messages(runtime: Option<String>, container: Option<String>) -> Option<String> {
    match (runtime, container) {
        (Some(runtime), Some(container)) => Some(format!("{runtime}: {container}")),
        (runtime, container) => runtime.or(container),
    }
}

/// Marks a terminated container for a restart after its backoff; returns the
/// delay.
pub(crate) fn schedule_restart(ctx: &mut Context<PodLifecycle>, name: &str) -> Option<Duration> {
    let config = ctx.machine.config.restart_backoff;
    let record = ctx.data.containers.get_mut(name)?;
    let now = Instant::now();
    let delay = record.backoff.fail(&config, record.ran_for(now), now);
    if let ContainerPhase::Terminated(t) = &record.phase {
        record.last_terminated = Some(t.clone());
    }
    record.restart_pending = true;
    record.wants_start = true;
    Some(delay)
}

/// Stops every running container within `grace`, all at once. A later
/// manifest with a shorter deletion grace period (`kubectl delete
/// --grace-period=1`, or `--force --grace-period=0`) cuts the stop short:
/// the containers are stopped again within what is left of the new one.
/// Returns what failed.
pub(crate) async fn stop_all(ctx: &mut Context<PodLifecycle>, grace: Duration) -> Vec<String> {
    let Some(provider) = ctx.machine.provider.clone() else { return Vec::new() };
    // Probes end first (upstream turns them off for a pod being removed):
    // a liveness probe failing during the grace period must not cut it short.
    for record in ctx.data.containers.values_mut() {
        record.probes.stop();
    }
    let running: Vec<(String, ContainerId)> = ctx
        .data
        .containers
        .values()
        .filter(|c| c.is_running())
        .filter_map(|c| c.id.clone().map(|id| (c.spec.name.clone(), id)))
        .collect();
    let specs: std::collections::HashMap<String, k8s_openapi::api::core::v1::Container> =
        ctx.data.containers.values().map(|c| (c.spec.name.clone(), c.spec.clone())).collect();
    let pod = Arc::clone(&ctx.data.pod);
    let recorder = ctx.data.recorder.clone();
    let address = ctx.machine.hook_address(&ctx.data);
    for (name, _) in &running {
        ctx.data.recorder.pod(
            &ctx.data.pod,
            Some(name),
            EventType::Normal,
            "Killing",
            format!("Stopping container {name}"),
        );
    }
    let uid = ctx.data.id.uid.clone();
    let mut stops = tokio::task::JoinSet::new();
    let spawn_stops = |stops: &mut tokio::task::JoinSet<_>, grace: Duration, hurried: bool| {
        for (name, id) in running.clone() {
            let provider = Arc::clone(&provider);
            // The first stop runs the preStop hook within the grace period
            // and gives the stop what is left (at least 2 s); a hurried
            // one only stops.
            let hook = (!hurried)
                .then(|| specs.get(&name).cloned())
                .flatten()
                .filter(|spec| super::hooks::Hook::PreStop.handler(spec).is_some() && !grace.is_zero());
            let (pod, recorder) = (Arc::clone(&pod), recorder.clone());
            // Not supervised: one container's stop, joined by the pod's termination.
            stops.spawn(async move {
                let mut grace = grace;
                if let Some(spec) = hook {
                    let began = Instant::now();
                    let pre_stop = super::hooks::Hook::PreStop;
                    if let Err(message) = super::hooks::run(pre_stop, &provider, &pod, &spec, &id, address, grace).await
                    {
                        tracing::warn!(container = %name, %message, "preStop hook failed");
                        recorder.pod(&pod, Some(&name), EventType::Warning, pre_stop.failure_reason(), message);
                    }
                    grace = grace.saturating_sub(began.elapsed()).max(super::hooks::MIN_STOP_GRACE);
                }
                (name, hurried, provider.stop_container(&id, grace).await)
            });
        }
    };
    spawn_stops(&mut stops, grace, false);
    let started = Instant::now();
    let mut deadline = grace;
    let mut manifest = ctx.manifest.clone();
    let mut manifest_open = true;
    let mut failures = Vec::new();
    loop {
        tokio::select! {
            joined = stops.join_next() => match joined {
                None => break,
                Some(Ok((name, _, Ok(())))) => tracing::debug!(pod.uid = %uid, container = %name, "container stopped"),
                // A second, hurried stop may find the container gone: only
                // the first stop's failures count.
                Some(Ok((_, true, Err(_)))) => {}
                Some(Ok((name, false, Err(error)))) => failures.push(format!("stop container {name}: {error}")),
                Some(Err(error)) => failures.push(format!("stop task: {error}")),
            },
            changed = manifest.changed(), if manifest_open => {
                if changed.is_err() {
                    manifest_open = false;
                    continue;
                }
                let shorter = super::spec::deletion_grace_period(&manifest.borrow_and_update());
                let elapsed = started.elapsed();
                if let Some(shorter) = shorter
                    && elapsed + shorter < deadline
                {
                    tracing::info!(pod.uid = %uid, grace = ?shorter, "a shorter grace period cuts the stop short");
                    deadline = elapsed + shorter;
                    spawn_stops(&mut stops, shorter, true);
                }
            }
        }
    }
    failures
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provider::ContainerExit;

    fn probed_pod() -> PodData {
        let pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "namespace": "default", "uid": "u"},
            "spec": {"containers": [{"name": "c", "image": "i", "readinessProbe": {"exec": {"command": ["true"]}}}]}
        }))
        .expect("pod");
        let mut data = PodData::new(Arc::new(pod));
        let record = data.containers.get_mut("c").expect("record");
        record.id = Some(ContainerId("new".into()));
        record.phase = ContainerPhase::Running { started_at: Timestamp::now() };
        record.probes.ready = Some(false);
        data
    }

    fn report(id: &str, kind: ProbeKind, healthy: bool) -> ContainerEvent {
        let message = if healthy { String::new() } else { "boom".to_owned() };
        ContainerEvent::Probe(ProbeReport { container: "c".into(), id: ContainerId(id.into()), kind, healthy, message })
    }

    #[test]
    fn probe_results_count_for_the_running_instance_only() {
        let mut data = probed_pod();
        assert_eq!(record_event(&mut data, report("old", ProbeKind::Readiness, true)), Recorded::Nothing);
        assert!(!data.containers["c"].is_ready(), "a result about an earlier instance is ignored");
        assert_eq!(record_event(&mut data, report("new", ProbeKind::Readiness, true)), Recorded::Status);
        assert!(data.containers["c"].is_ready());
        assert_eq!(record_event(&mut data, report("new", ProbeKind::Liveness, true)), Recorded::Nothing);
        // A failed liveness probe: the exit that follows says why.
        assert_eq!(record_event(&mut data, report("new", ProbeKind::Liveness, false)), Recorded::Status);
        let exit = ContainerExit { exit_code: 137, reason: None, message: None, finished_at: Timestamp::now() };
        let ended =
            ContainerEvent::Exit(ExitReport { container: "c".into(), id: ContainerId("new".into()), exit: Ok(exit) });
        assert_eq!(record_event(&mut data, ended), Recorded::Exit("c".into()));
        let ContainerPhase::Terminated(terminated) = &data.containers["c"].phase else { panic!("terminated") };
        assert_eq!(terminated.message.as_deref(), Some("Unhealthy: Liveness probe failed: boom"));
        assert!(!data.containers["c"].is_ready());
    }
}
