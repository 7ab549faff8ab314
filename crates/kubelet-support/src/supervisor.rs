//! The one supervisor of the node's long-running tasks (the plugin
//! manager, the volume reconciler, the endpoints, and every task of
//! cluster mode). Each supervised task:
//! - reports a named `/healthz` check, failing with the reason while it is
//!   down;
//! - has its end before shutdown (it returned, failed or panicked; a panic
//!   is caught, its message kept) logged and counted in
//!   `rustlet_supervised_task_ends_total{task, outcome}` (outcome
//!   `panicked`, `stopped` or `failed`);
//! - is built again and restarted with the one retry backoff
//!   ([`RetryBackoff`], 500 ms doubling to 60 s, jittered; reset after a
//!   run of two minutes) when it was spawned from a factory
//!   ([`Supervision::spawn`]); a task that cannot be built again
//!   ([`Supervision::watch`]: a listener bound once, a component whose
//!   state lives in its task) stays down with its check failing;
//! - ends by itself without harm when it is one job, not a loop
//!   ([`Supervision::once`]: a panic is logged, counted and fails its
//!   check);
//! - is awaited at shutdown through the node's task tracker.

use std::future::Future;
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use crate::health::{HealthReporter, Healthz};
use crate::retry::RetryBackoff;

/// The first restart delay (doubling up to [`RESTART_MAX`]).
const RESTART_INITIAL: Duration = Duration::from_millis(500);
/// The longest restart delay.
const RESTART_MAX: Duration = Duration::from_secs(60);
/// A task that ran this long before it ended restarts after the first
/// delay again.
const RESET_AFTER: Duration = Duration::from_secs(120);

/// Ends of supervised tasks before shutdown, by `task` and `outcome`.
pub type TaskEnds = Family<Vec<(&'static str, String)>, Counter>;

/// Where supervised tasks report and are tracked. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Supervision {
    shutdown: CancellationToken,
    healthz: Option<Healthz>,
    tasks: Option<TaskTracker>,
    ends: TaskEnds,
}

impl Supervision {
    /// Tasks that stop with `shutdown`, with a `/healthz` check each in
    /// `healthz`, tracked by `tasks` (awaited at the node's shutdown).
    pub fn new(shutdown: CancellationToken, healthz: Healthz, tasks: TaskTracker) -> Supervision {
        Supervision { shutdown, healthz: Some(healthz), tasks: Some(tasks), ends: TaskEnds::default() }
    }

    /// The same supervision, counting task ends in `ends` (registered by
    /// the caller as `rustlet_supervised_task_ends`).
    pub fn counting(mut self, ends: TaskEnds) -> Supervision {
        self.ends = ends;
        self
    }

    /// The shutdown token.
    pub fn shutdown(&self) -> &CancellationToken {
        &self.shutdown
    }

    /// Runs the task `make` builds, building and starting it again after
    /// it ends or panics (before shutdown).
    pub fn spawn<F, Fut>(&self, name: &'static str, mut make: F)
    where
        F: FnMut() -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let reporter = self.reporter(name);
        let shutdown = self.shutdown.clone();
        let ends = self.ends.clone();
        let supervisor = async move {
            let mut backoff = RetryBackoff::new(RESTART_INITIAL, RESTART_MAX);
            loop {
                let started = Instant::now();
                let run = tokio::spawn(make().in_current_span());
                let abort = run.abort_handle();
                let result = tokio::select! {
                    () = shutdown.cancelled() => {
                        abort.abort();
                        return;
                    }
                    result = run => result,
                };
                if shutdown.is_cancelled() {
                    return;
                }
                let reason = ended(name, result, &ends);
                if started.elapsed() > RESET_AFTER {
                    backoff.reset();
                }
                let wait = backoff.next_delay();
                tracing::error!(task = name, %reason, restart_in = ?wait, "task ended; restarting it");
                reporter.failing(format!("{reason}; restarting"));
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    () = tokio::time::sleep(wait) => {}
                }
                reporter.healthy();
            }
        }
        .instrument(tracing::info_span!("supervised", task = name));
        self.track(supervisor);
    }

    /// Watches `task`, which cannot be built again: if it ends before
    /// shutdown (returns, fails or panics), its check turns failing with
    /// the reason and the end is logged and counted; it is not restarted.
    pub fn watch(&self, name: &'static str, task: JoinHandle<()>) {
        self.observe(name, task, true);
    }

    /// Runs `work`, a task that ends by itself once its job is done (cluster
    /// mode's join, say): its end is fine, but a panic before shutdown is
    /// logged, counted, and turns its check failing with the reason; it is
    /// not restarted (what it did half is not known).
    pub fn once(&self, name: &'static str, work: impl Future<Output = ()> + Send + 'static) {
        let span = tracing::info_span!("supervised", task = name);
        self.observe(name, tokio::spawn(work.instrument(span)), false);
    }

    /// A check for `task` that fails when it panics or fails before
    /// shutdown, or (`ending_fails`) ends at all.
    fn observe(&self, name: &'static str, task: JoinHandle<()>, ending_fails: bool) {
        let reporter = self.reporter(name);
        let shutdown = self.shutdown.clone();
        let ends = self.ends.clone();
        let watcher = async move {
            let result = task.await;
            if shutdown.is_cancelled() {
                if let Err(error) = result {
                    tracing::error!(%error, "component failed while stopping");
                }
                return;
            }
            if result.is_ok() && !ending_fails {
                return;
            }
            let reason = ended(name, result, &ends);
            tracing::error!(task = name, %reason, "node component is down");
            reporter.failing(reason);
        }
        .instrument(tracing::info_span!("supervised", task = name));
        self.track(watcher);
    }

    /// A reporter for task `name`, its check added to the node's.
    fn reporter(&self, name: &'static str) -> HealthReporter {
        let reporter = HealthReporter::new();
        if let Some(healthz) = &self.healthz {
            healthz.add(name, reporter.check());
        }
        reporter
    }

    fn track(&self, work: impl Future<Output = ()> + Send + 'static) {
        match &self.tasks {
            Some(tasks) => {
                tasks.spawn(work);
            }
            None => {
                tokio::spawn(work);
            }
        }
    }
}

/// Why task `name` ended (its check's reason), counted in `ends`.
fn ended(name: &'static str, result: Result<(), tokio::task::JoinError>, ends: &TaskEnds) -> String {
    let (outcome, reason) = match result {
        Ok(()) => ("stopped", "stopped unexpectedly".to_owned()),
        Err(error) if error.is_panic() => {
            ("panicked", format!("panicked: {}", crate::health::panic_message(&*error.into_panic())))
        }
        Err(error) => ("failed", format!("failed: {error}")),
    };
    ends.get_or_create(&vec![("task", name.to_owned()), ("outcome", outcome.to_owned())]).inc();
    reason
}

impl From<CancellationToken> for Supervision {
    /// Tasks that stop with `shutdown`, with no health checks and nobody
    /// awaiting them (for embedders that run one part on its own).
    fn from(shutdown: CancellationToken) -> Supervision {
        Supervision { shutdown, healthz: None, tasks: None, ends: TaskEnds::default() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::health::ComponentHealth;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A task that panics is restarted (built again), its check failing
    /// meanwhile and healthy once it runs again; at shutdown it stops and is
    /// awaited.
    #[tokio::test(start_paused = true)]
    async fn a_panicking_task_is_restarted_and_its_check_recovers() {
        let shutdown = CancellationToken::new();
        let healthz = Healthz::new();
        let tasks = TaskTracker::new();
        let supervision = Supervision::new(shutdown.clone(), healthz.clone(), tasks.clone());
        let runs = Arc::new(AtomicUsize::new(0));
        let counted = runs.clone();
        supervision.spawn("flaky", move || {
            let run = counted.fetch_add(1, Ordering::SeqCst);
            async move {
                if run == 0 {
                    panic!("first run breaks");
                }
                std::future::pending::<()>().await;
            }
        });
        let mut check = healthz.watch("flaky").expect("check");
        check.wait_for(|h| !h.is_healthy()).await.expect("reporter");
        assert_eq!(
            healthz.get("flaky"),
            Some(ComponentHealth::Failing { reason: "panicked: first run breaks; restarting".into() })
        );
        check.wait_for(ComponentHealth::is_healthy).await.expect("reporter");
        assert_eq!(runs.load(Ordering::SeqCst), 2, "built and started again");
        shutdown.cancel();
        tasks.close();
        tasks.wait().await;
    }

    /// A supervision that counts task ends, and what it reports to.
    struct Counted {
        tasks: TaskTracker,
        healthz: Healthz,
        shutdown: CancellationToken,
        ends: TaskEnds,
        supervision: Supervision,
    }

    impl Counted {
        fn new() -> Counted {
            let (tasks, healthz, shutdown, ends) =
                (TaskTracker::new(), Healthz::new(), CancellationToken::new(), TaskEnds::default());
            let supervision = Supervision::new(shutdown.clone(), healthz.clone(), tasks.clone()).counting(ends.clone());
            Counted { tasks, healthz, shutdown, ends, supervision }
        }
    }

    fn ends_of(ends: &TaskEnds, task: &str, outcome: &str) -> u64 {
        ends.get_or_create(&vec![("task", task.to_owned()), ("outcome", outcome.to_owned())]).get()
    }

    /// A component task that panics before shutdown turns its check to
    /// failing with the panic's message and is counted; one that ends at
    /// shutdown is neither.
    #[tokio::test]
    async fn a_watched_component_that_dies_fails_its_check() {
        let Counted { tasks, healthz, shutdown, ends, supervision } = Counted::new();
        let gate = Arc::new(tokio::sync::Notify::new());
        let wait = gate.clone();
        let doomed = tokio::spawn(async move {
            wait.notified().await;
            panic!("boom");
        });
        supervision.watch("doomed", doomed);
        assert_eq!(healthz.get("doomed"), Some(ComponentHealth::Healthy));
        let fine = tokio::spawn(shutdown.clone().cancelled_owned());
        supervision.watch("fine", fine);
        let mut changes = healthz.watch("doomed").expect("check exists");
        gate.notify_one();
        tokio::time::timeout(Duration::from_secs(20), changes.wait_for(|h| !h.is_healthy()))
            .await
            .expect("in time")
            .expect("reporter alive");
        assert_eq!(healthz.get("doomed"), Some(ComponentHealth::Failing { reason: "panicked: boom".into() }));
        let count = |task: &str, outcome: &str| ends_of(&ends, task, outcome);
        assert_eq!(count("doomed", "panicked"), 1);
        shutdown.cancel();
        tasks.close();
        tokio::time::timeout(Duration::from_secs(20), tasks.wait()).await.expect("supervisors end");
        assert_eq!(healthz.get("fine"), Some(ComponentHealth::Healthy), "ending at shutdown is not a failure");
        assert_eq!(count("fine", "stopped"), 0);
    }

    /// A one-shot task that finishes is fine; one that panics fails its
    /// check and is counted, and is not run again.
    #[tokio::test]
    async fn a_one_shot_task_may_end_but_not_panic() {
        let Counted { tasks, healthz, shutdown, ends, supervision } = Counted::new();
        let runs = Arc::new(AtomicUsize::new(0));
        let (done_runs, broken_runs) = (runs.clone(), runs.clone());
        let (done_tx, done_rx) = tokio::sync::oneshot::channel();
        supervision.once("done", async move {
            done_runs.fetch_add(1, Ordering::SeqCst);
            let _ = done_tx.send(());
        });
        assert!(healthz.watch("broken").is_none(), "no check before it is added");
        supervision.once("broken", async move {
            broken_runs.fetch_add(1, Ordering::SeqCst);
            panic!("half done");
        });
        let mut broken = healthz.watch("broken").expect("check exists");
        tokio::time::timeout(Duration::from_secs(20), broken.wait_for(|h| !h.is_healthy()))
            .await
            .expect("in time")
            .expect("reporter alive");
        assert_eq!(healthz.get("broken"), Some(ComponentHealth::Failing { reason: "panicked: half done".into() }));
        tokio::time::timeout(Duration::from_secs(20), done_rx).await.expect("in time").expect("ran");
        let count = |task: &str, outcome: &str| ends_of(&ends, task, outcome);
        assert_eq!(count("broken", "panicked"), 1);
        shutdown.cancel();
        tasks.close();
        tokio::time::timeout(Duration::from_secs(20), tasks.wait()).await.expect("supervisors end");
        assert_eq!(runs.load(Ordering::SeqCst), 2, "each ran once");
        assert_eq!(healthz.get("done"), Some(ComponentHealth::Healthy), "a job that finished is healthy");
        assert_eq!(count("done", "stopped"), 0);
    }
}
