//! Supervision of cluster mode's tasks (the pod watch, the status writer,
//! the Node and Lease writers, the CSI node info writer, the CSIDriver
//! watch): each runs on a task of its own, is built again and restarted
//! with the node's retry backoff ([`RetryBackoff`]) if it ends or panics before shutdown,
//! reports a named `/healthz` check (failing with the reason while it is
//! down), and is awaited at shutdown through the node's task tracker.

use std::future::Future;
use std::time::Duration;

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

/// Where supervised tasks report and are tracked. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Supervision {
    shutdown: CancellationToken,
    healthz: Option<Healthz>,
    tasks: Option<TaskTracker>,
}

impl Supervision {
    /// Tasks that stop with `shutdown`, with a `/healthz` check each in
    /// `healthz`, tracked by `tasks` (awaited at the node's shutdown).
    pub fn new(shutdown: CancellationToken, healthz: Healthz, tasks: TaskTracker) -> Supervision {
        Supervision { shutdown, healthz: Some(healthz), tasks: Some(tasks) }
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
        let reporter = HealthReporter::new();
        if let Some(healthz) = &self.healthz {
            healthz.add(name, reporter.check());
        }
        let shutdown = self.shutdown.clone();
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
                let reason = match result {
                    Ok(()) => "stopped unexpectedly".to_owned(),
                    Err(error) if error.is_panic() => {
                        format!("panicked: {}", crate::health::panic_message(&*error.into_panic()))
                    }
                    Err(error) => format!("failed: {error}"),
                };
                if started.elapsed() > RESET_AFTER {
                    backoff.reset();
                }
                let wait = backoff.next_delay();
                tracing::error!(task = name, %reason, restart_in = ?wait, "cluster task ended; restarting it");
                reporter.failing(format!("{reason}; restarting"));
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    () = tokio::time::sleep(wait) => {}
                }
                reporter.healthy();
            }
        }
        .instrument(tracing::info_span!("cluster_task", task = name));
        match &self.tasks {
            Some(tasks) => {
                tasks.spawn(supervisor);
            }
            None => {
                tokio::spawn(supervisor);
            }
        }
    }
}

impl From<CancellationToken> for Supervision {
    /// Tasks that stop with `shutdown`, with no health checks and nobody
    /// awaiting them (for embedders that run one part on its own).
    fn from(shutdown: CancellationToken) -> Supervision {
        Supervision { shutdown, healthz: None, tasks: None }
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
}
