//! Initializing, Starting, Running and CrashLoopBackOff: the containers run.

use k8s_openapi::api::core::v1::PodStatus;
use krator::{Context, State, Transition};
use tokio::time::Instant;

use super::{Completed, Failed};
use crate::device_manager::ContainerKind;
use crate::pod::PodLifecycle;
use crate::pod::containers::{Recorded, record_event, record_start_failure, schedule_restart, start, stop_all};
use crate::pod::data::{ContainerPhase, PodVerdict};
use crate::pod::spec::{RestartPolicy, grace_period};
use crate::pod::status::{Stage, pod_status};

/// Init containers run one at a time, each to success; sidecars start and
/// keep running.
pub(crate) struct Initializing;

#[async_trait::async_trait]
impl State<PodLifecycle> for Initializing {
    async fn next(self: Box<Self>, ctx: &mut Context<PodLifecycle>) -> Transition<PodLifecycle> {
        let Some(provider) = ctx.machine.provider.clone() else { return Transition::next(&*self, Starting) };
        let uid = ctx.data.id.uid.clone();
        // After a node restart, app containers still running mean the init
        // containers completed.
        if ctx.machine.has_adopted(&uid)
            && ctx.data.names_of(&[ContainerKind::App]).iter().any(|n| ctx.machine.adopted_contains(&uid, n))
        {
            ctx.data.initialized = true;
            return Transition::next(&*self, Starting);
        }
        ctx.data.set_waiting("PodInitializing", None);
        let policy = RestartPolicy::of(&ctx.data.pod);
        for name in ctx.data.names_of(&[ContainerKind::Init, ContainerKind::RestartableInit]) {
            let kind = ctx.data.containers.get(&name).map(|c| c.kind);
            loop {
                if let Some(until) = ctx.data.containers.get(&name).and_then(|c| c.backoff.until()) {
                    tokio::select! {
                        () = tokio::time::sleep_until(until) => {}
                        () = deadline_event(&mut ctx.data) => return past_deadline(&*self, ctx).await,
                    }
                    if let Some(c) = ctx.data.containers.get_mut(&name) {
                        c.backoff.waited();
                    }
                }
                if let Err(failure) = start(ctx, &provider, &name).await {
                    record_start_failure(ctx, &name, &failure);
                    if ctx.data.verdict.is_some() {
                        return past_deadline(&*self, ctx).await;
                    }
                    ctx.report(pod_status(&ctx.data, Stage::Pending));
                    continue;
                }
                ctx.report(pod_status(&ctx.data, Stage::Pending));
                if kind == Some(ContainerKind::RestartableInit) {
                    // As upstream, the next init container waits for the
                    // sidecar's startup probe (at once without one).
                    let started = loop {
                        if ctx.data.containers.get(&name).is_some_and(|c| c.has_started()) {
                            break true;
                        }
                        let Some(event) = ctx.data.events.recv().await else { return std::future::pending().await };
                        let ended = exited(ctx, event, Stage::Pending);
                        if ctx.data.verdict.is_some() {
                            return past_deadline(&*self, ctx).await;
                        }
                        let Some(ended) = ended else { continue };
                        ctx.report(pod_status(&ctx.data, Stage::Pending));
                        let delay = schedule_restart(ctx, &ended);
                        if ended == name {
                            set_crash_loop(ctx, &name, delay);
                            break false;
                        }
                    };
                    if started {
                        break;
                    }
                    ctx.report(pod_status(&ctx.data, Stage::Pending));
                    continue;
                }
                // Wait for this init container to end (sidecar exits are
                // recorded; the sidecar restarts when the app containers start).
                let exit_code = loop {
                    let Some(event) = ctx.data.events.recv().await else { return std::future::pending().await };
                    let ended = exited(ctx, event, Stage::Pending);
                    if ctx.data.verdict.is_some() {
                        return past_deadline(&*self, ctx).await;
                    }
                    if let Some(ended) = ended {
                        ctx.report(pod_status(&ctx.data, Stage::Pending));
                        if ended == name {
                            break match &ctx.data.containers[&name].phase {
                                ContainerPhase::Terminated(t) => t.exit_code,
                                _ => 1,
                            };
                        }
                        schedule_restart(ctx, &ended);
                    }
                };
                if exit_code == 0 {
                    break;
                }
                if policy == RestartPolicy::Never {
                    ctx.data.verdict = Some(PodVerdict {
                        phase: "Failed",
                        reason: None,
                        message: None,
                        rejected: false,
                        disruption: false,
                    });
                    let grace = grace_period(&ctx.data.pod);
                    for failure in stop_all(ctx, grace).await {
                        tracing::warn!(pod.uid = %uid, %failure, "stopping sidecars");
                    }
                    drain_exits(ctx);
                    return Transition::next(&*self, Failed);
                }
                let delay = schedule_restart(ctx, &name);
                set_crash_loop(ctx, &name, delay);
                ctx.report(pod_status(&ctx.data, Stage::Pending));
            }
        }
        ctx.data.initialized = true;
        Transition::next(&*self, Starting)
    }

    fn status(&self, ctx: &Context<PodLifecycle>) -> PodStatus {
        pod_status(&ctx.data, Stage::Pending)
    }
}

/// Sidecars and app containers that should run are started.
pub(crate) struct Starting;

#[async_trait::async_trait]
impl State<PodLifecycle> for Starting {
    async fn next(self: Box<Self>, ctx: &mut Context<PodLifecycle>) -> Transition<PodLifecycle> {
        let Some(provider) = ctx.machine.provider.clone() else { return std::future::pending().await };
        let now = Instant::now();
        let due: Vec<String> = ctx
            .data
            .ordered()
            .filter(|c| c.kind != ContainerKind::Init && c.wants_start && !c.is_running() && c.backoff.ready(now))
            .map(|c| c.spec.name.clone())
            .collect();
        for name in due {
            if let Some(c) = ctx.data.containers.get_mut(&name) {
                c.backoff.waited();
            }
            if let Err(failure) = start(ctx, &provider, &name).await {
                record_start_failure(ctx, &name, &failure);
                if ctx.data.verdict.is_some() {
                    return past_deadline(&*self, ctx).await;
                }
            }
            ctx.report(pod_status(&ctx.data, Stage::Running));
        }
        if ctx.data.containers.values().any(|c| c.kind != ContainerKind::Init && c.wants_start && !c.is_running()) {
            return Transition::next(&*self, CrashLoopBackOff);
        }
        if !std::mem::replace(&mut ctx.data.seen.1, true) {
            ctx.machine.metrics.pod_started(ctx.data.seen.0.elapsed());
        }
        Transition::next(&*self, Running)
    }

    fn status(&self, ctx: &Context<PodLifecycle>) -> PodStatus {
        pod_status(&ctx.data, Stage::Running)
    }
}

/// What to do after an exit: keep running, restart after a backoff, start
/// again at once (a resize's restart), or end.
enum AfterExit {
    Keep,
    Restart,
    StartNow,
    Done,
}

/// Judges a resize (and reports where it stands).
async fn resize(ctx: &mut Context<PodLifecycle>) {
    ctx.data.resize_due = false;
    crate::pod::resize::apply(ctx).await;
    ctx.report(pod_status(&ctx.data, Stage::Running));
}

/// Records one exit and applies the restart policy.
async fn handle_exit(ctx: &mut Context<PodLifecycle>, name: &str) -> AfterExit {
    let policy = RestartPolicy::of(&ctx.data.pod);
    let Some(record) = ctx.data.containers.get(name) else { return AfterExit::Keep };
    let exit_code = match &record.phase {
        ContainerPhase::Terminated(t) => t.exit_code,
        _ => return AfterExit::Keep,
    };
    if record.resize_restart {
        // Stopped for its new size: started again at once, whatever the
        // restart policy, and counted as a restart.
        if let Some(record) = ctx.data.containers.get_mut(name) {
            record.resize_restart = false;
            if let ContainerPhase::Terminated(t) = &record.phase {
                record.last_terminated = Some(t.clone());
            }
            record.restart_pending = true;
            record.wants_start = true;
            record.backoff.waited();
        }
        return AfterExit::StartNow;
    }
    let restarts = match record.kind {
        ContainerKind::RestartableInit => !apps_finished(ctx, policy),
        // Ephemeral containers run once.
        ContainerKind::Ephemeral => false,
        _ => policy.restarts(exit_code),
    };
    if restarts {
        let delay = schedule_restart(ctx, name);
        set_crash_loop(ctx, name, delay);
        return AfterExit::Restart;
    }
    if apps_finished(ctx, policy) {
        // The app containers are done for good: sidecars stop too.
        let grace = grace_period(&ctx.data.pod);
        for failure in stop_all(ctx, grace).await {
            tracing::warn!(pod.uid = %ctx.data.id.uid, %failure, "stopping sidecars");
        }
        drain_exits(ctx);
        return AfterExit::Done;
    }
    AfterExit::Keep
}

/// Whether every app container has ended and will not restart.
fn apps_finished(ctx: &Context<PodLifecycle>, policy: RestartPolicy) -> bool {
    ctx.data.containers.values().filter(|c| c.kind == ContainerKind::App).all(|c| match &c.phase {
        ContainerPhase::Terminated(t) => !policy.restarts(t.exit_code),
        _ => false,
    })
}

/// Records the exits the sidecars' stop produced.
fn drain_exits(ctx: &mut Context<PodLifecycle>) {
    drain_exits_because(ctx, "stopped after the app containers ended");
}

/// Records the exits a stop produced; a container whose exit has not been
/// seen is recorded as stopped, `why`.
fn drain_exits_because(ctx: &mut Context<PodLifecycle>, why: &str) {
    while let Ok(event) = ctx.data.events.try_recv() {
        record_event(&mut ctx.data, event);
    }
    for record in ctx.data.containers.values_mut() {
        record.probes.stop();
        if record.is_running() {
            record.phase = ContainerPhase::Terminated(crate::pod::data::Terminated {
                exit_code: 0,
                reason: "Completed".into(),
                message: Some(why.to_owned()),
                started_at: None,
                finished_at: k8s_openapi::jiff::Timestamp::now(),
                container_id: record.id.clone(),
            });
        }
    }
}

/// How long the exits of containers stopped for the pod's deadline are
/// waited for (the runtime reports them within its relist).
const STOPPED_EXIT_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// Waits (at most `within`) until no container runs, recording events.
pub(super) async fn await_exits(ctx: &mut Context<PodLifecycle>, within: std::time::Duration) {
    let deadline = Instant::now() + within;
    while ctx.data.containers.values().any(|c| c.is_running()) {
        match tokio::time::timeout_at(deadline, ctx.data.events.recv()).await {
            Ok(Some(event)) => {
                record_event(&mut ctx.data, event);
            }
            _ => return,
        }
    }
}

/// Records events until one says the pod ran past its deadline (never
/// returns otherwise): for states that wait on something else.
pub(super) async fn deadline_event(data: &mut crate::pod::data::PodData) {
    loop {
        let Some(event) = data.events.recv().await else { return std::future::pending().await };
        if record_event(data, event) == Recorded::Deadline {
            return;
        }
    }
}

/// Upstream's CrashLoopBackOff message.
fn back_off_message(
    delay: Option<std::time::Duration>,
    container: &str,
    pod: &str,
    namespace: &str,
    uid: &str,
) -> String {
    let delay = delay.unwrap_or_default();
    format!("back-off {} restarting failed container={container} pod={pod}_{namespace}({uid})", humantime_secs(delay))
}

/// A delay as Go prints durations (`10s`, `2m40s`, `5m0s`, `50ms`).
fn humantime_secs(delay: std::time::Duration) -> String {
    let secs = delay.as_secs();
    if secs >= 60 {
        format!("{}m{}s", secs / 60, secs % 60)
    } else if delay.subsec_millis() == 0 {
        format!("{secs}s")
    } else {
        format!("{}ms", delay.as_millis())
    }
}

/// The pod's containers run; exits are recorded and the restart policy
/// applied.
pub(crate) struct Running;

#[async_trait::async_trait]
impl State<PodLifecycle> for Running {
    async fn next(self: Box<Self>, ctx: &mut Context<PodLifecycle>) -> Transition<PodLifecycle> {
        if apps_finished(ctx, RestartPolicy::of(&ctx.data.pod)) {
            return finish(&*self, ctx);
        }
        if ctx.data.resize_due || crate::pod::resize::in_progress(&ctx.data) {
            resize(ctx).await;
        }
        // A resize that failed is tried again a while after the failure
        // (its error stays in the condition meanwhile); other events do
        // not put the retry off.
        let mut retry_at: Option<tokio::time::Instant> = None;
        loop {
            retry_at = match (&ctx.data.resize.error, retry_at) {
                (None, _) => None,
                (Some(_), Some(at)) => Some(at),
                (Some(_), None) => Some(tokio::time::Instant::now() + crate::pod::resize::RETRY_AFTER_ERROR),
            };
            let event = tokio::select! {
                event = ctx.data.events.recv() => event,
                () = tokio::time::sleep_until(retry_at.unwrap_or_else(tokio::time::Instant::now)), if retry_at.is_some() => {
                    retry_at = None;
                    resize(ctx).await;
                    continue;
                }
            };
            let Some(event) = event else { return std::future::pending().await };
            let name = match happened(ctx, event, Stage::Running) {
                None => continue,
                Some(Happened::StartDue) => return Transition::next(&*self, Starting),
                Some(Happened::Deadline) => return past_deadline(&*self, ctx).await,
                Some(Happened::Resize) => {
                    resize(ctx).await;
                    continue;
                }
                Some(Happened::Exit(name)) => name,
            };
            match handle_exit(ctx, &name).await {
                AfterExit::Keep => ctx.report(pod_status(&ctx.data, Stage::Running)),
                AfterExit::Restart => return Transition::next(&*self, CrashLoopBackOff),
                AfterExit::StartNow => return Transition::next(&*self, Starting),
                AfterExit::Done => return finish(&*self, ctx),
            }
        }
    }

    fn status(&self, ctx: &Context<PodLifecycle>) -> PodStatus {
        pod_status(&ctx.data, Stage::Running)
    }
}

/// What an event asks of the state that received it.
enum Happened {
    /// A container (its name) ended.
    Exit(String),
    /// Containers were added that should start (ephemeral ones).
    StartDue,
    /// The pod ran past its deadline.
    Deadline,
    /// Its containers may have a new size.
    Resize,
}

/// Records an event: a probe's change is reported at once (as `stage`).
fn happened(
    ctx: &mut Context<PodLifecycle>,
    event: crate::pod::data::ContainerEvent,
    stage: Stage,
) -> Option<Happened> {
    match record_event(&mut ctx.data, event) {
        Recorded::Exit(name) => Some(Happened::Exit(name)),
        Recorded::Status => {
            ctx.report(pod_status(&ctx.data, stage));
            None
        }
        Recorded::StartDue => {
            ctx.report(pod_status(&ctx.data, stage));
            Some(Happened::StartDue)
        }
        Recorded::Deadline => Some(Happened::Deadline),
        Recorded::Resize => Some(Happened::Resize),
        Recorded::Nothing => None,
    }
}

/// [`happened`] for states that only wait for exits (init containers run):
/// the container that ended, if one did. Ephemeral containers added then
/// start once the app containers do; a deadline shows in the verdict.
fn exited(ctx: &mut Context<PodLifecycle>, event: crate::pod::data::ContainerEvent, stage: Stage) -> Option<String> {
    match happened(ctx, event, stage) {
        Some(Happened::Exit(name)) => Some(name),
        _ => None,
    }
}

/// The pod ran past its `activeDeadlineSeconds`, or the node evicts it (its
/// verdict says which): its containers are stopped within the grace period
/// (the pod's, or the eviction's) and it ends Failed.
async fn past_deadline<S>(from: &S, ctx: &mut Context<PodLifecycle>) -> Transition<PodLifecycle>
where
    S: krator::TransitionTo<Failed>,
{
    let grace = ctx.data.stop_grace.unwrap_or_else(|| grace_period(&ctx.data.pod));
    let evicted = ctx.data.verdict.as_ref().and_then(|v| v.reason.as_deref()) == Some(crate::pod::data::EVICTED);
    let why =
        if evicted { "stopped: the pod was evicted" } else { "stopped: the pod ran past its activeDeadlineSeconds" };
    for failure in stop_all(ctx, grace).await {
        tracing::warn!(pod.uid = %ctx.data.id.uid, %failure, why, "stopping the containers of a pod");
    }
    await_exits(ctx, STOPPED_EXIT_WAIT).await;
    drain_exits_because(ctx, why);
    Transition::next(from, Failed)
}

/// Container `name` waits out its restart backoff (`CrashLoopBackOff`).
fn set_crash_loop(ctx: &mut Context<PodLifecycle>, name: &str, delay: Option<std::time::Duration>) {
    let id = ctx.data.id.clone();
    let message =
        format!("Back-off restarting failed container {name} in pod {}_{}({})", id.name, id.namespace, id.uid);
    ctx.data.recorder.pod(&ctx.data.pod, Some(name), crate::events::EventType::Warning, "BackOff", message);
    if let Some(record) = ctx.data.containers.get_mut(name) {
        record.phase = ContainerPhase::Waiting {
            reason: "CrashLoopBackOff".into(),
            message: Some(back_off_message(delay, name, &id.name, &id.namespace, &id.uid)),
        };
    }
}

fn finish<S>(from: &S, ctx: &Context<PodLifecycle>) -> Transition<PodLifecycle>
where
    S: krator::TransitionTo<Completed> + krator::TransitionTo<Failed>,
{
    let all_succeeded = ctx.data.containers.values().filter(|c| c.kind == ContainerKind::App).all(|c| c.succeeded());
    tracing::info!(pod.uid = %ctx.data.id.uid, succeeded = all_succeeded, "pod finished");
    if all_succeeded { Transition::next(from, Completed) } else { Transition::next(from, Failed) }
}

/// A container waits out its restart backoff; other exits are still
/// recorded meanwhile.
pub(crate) struct CrashLoopBackOff;

#[async_trait::async_trait]
impl State<PodLifecycle> for CrashLoopBackOff {
    async fn next(self: Box<Self>, ctx: &mut Context<PodLifecycle>) -> Transition<PodLifecycle> {
        loop {
            let until = ctx
                .data
                .containers
                .values()
                .filter(|c| c.wants_start && !c.is_running())
                .filter_map(|c| c.backoff.until())
                .min();
            let Some(until) = until else { return Transition::next(&*self, Starting) };
            tokio::select! {
                _ = tokio::time::sleep_until(until) => return Transition::next(&*self, Starting),
                event = ctx.data.events.recv() => {
                    let Some(event) = event else { return std::future::pending().await };
                    let name = match happened(ctx, event, Stage::Running) {
                        None => continue,
                        Some(Happened::StartDue) => return Transition::next(&*self, Starting),
                        Some(Happened::Deadline) => return past_deadline(&*self, ctx).await,
                        Some(Happened::Resize) => {
                            resize(ctx).await;
                            continue;
                        }
                        Some(Happened::Exit(name)) => name,
                    };
                    match handle_exit(ctx, &name).await {
                        AfterExit::Keep | AfterExit::Restart => ctx.report(pod_status(&ctx.data, Stage::Running)),
                        AfterExit::StartNow => return Transition::next(&*self, Starting),
                        AfterExit::Done => return finish(&*self, ctx),
                    }
                }
            }
        }
    }

    fn status(&self, ctx: &Context<PodLifecycle>) -> PodStatus {
        pod_status(&ctx.data, Stage::Running)
    }
}
