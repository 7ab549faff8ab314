//! The checkpoint writer: one thread that writes the newest state whenever
//! a write was asked for since the last one (group commit).
//!
//! Callers ask for a write and get a generation; a write started after the
//! ask covers it. Asks that arrive while a write is in progress are all
//! covered by the next write. On shutdown the writer finishes what was asked
//! before it stopped, then exits; later asks are refused.
//!
//! The writer reports its health: failing with the error after a failed
//! write, healthy again after a good one.

use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use tokio::sync::watch;

use crate::health::{HealthCheck, HealthReporter};

/// Why the device checkpoint could not be written. Cheap to clone: every
/// caller waiting for one write gets the same error.
#[derive(Clone, Debug, thiserror::Error)]
pub enum CheckpointWriteError {
    /// Writing, syncing or renaming the file failed.
    #[error("cannot write device checkpoint {path}: {source}")]
    Io {
        /// The checkpoint file.
        path: PathBuf,
        /// The system error.
        #[source]
        source: Arc<std::io::Error>,
    },
    /// A part of the checkpoint could not be encoded (a bug).
    #[error("cannot encode {what} for the device checkpoint: {source}")]
    Encode {
        /// What was being encoded.
        what: String,
        /// The encoder's error.
        #[source]
        source: Arc<serde_json::Error>,
    },
    /// The device manager is shutting down and takes no more writes.
    #[error("the device manager is shutting down")]
    ShuttingDown,
    /// The write panicked (a bug); the writer goes on with the next one.
    #[error("the device checkpoint writer panicked")]
    WriterPanicked,
}

#[derive(Default)]
struct State {
    wanted: u64,
    stopping: bool,
}

/// What the writer has done so far.
#[derive(Clone, Debug, Default)]
struct Done {
    /// The last generation a write was attempted for.
    attempted: u64,
    /// The last generation written successfully.
    written: u64,
    /// Why the last attempt failed, if it did.
    error: Option<CheckpointWriteError>,
}

/// Shared between the manager (asks, waits) and the writer thread.
pub(crate) struct Writer {
    state: Mutex<State>,
    wake: Condvar,
    done: watch::Sender<Done>,
    health: HealthReporter,
}

impl Writer {
    pub(crate) fn new() -> Writer {
        Writer {
            state: Mutex::default(),
            wake: Condvar::new(),
            done: watch::Sender::new(Done::default()),
            health: HealthReporter::new(),
        }
    }

    /// The writer's health: failing after a failed write (with the error),
    /// healthy after a good one.
    pub(crate) fn health(&self) -> HealthCheck {
        self.health.check()
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // Two integer fields: a poisoned lock still holds consistent data.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Asks for a write of the current state; `None` once the writer stops.
    pub(crate) fn request(&self) -> Option<u64> {
        let mut state = self.state();
        if state.stopping {
            return None;
        }
        state.wanted += 1;
        self.wake.notify_one();
        Some(state.wanted)
    }

    /// Waits until a write covering generation `generation` was attempted:
    /// `Ok` once one succeeded (a later write holds the newest state, so it
    /// covers earlier generations too), else the failed attempt's error.
    pub(crate) async fn written(&self, generation: u64) -> Result<(), CheckpointWriteError> {
        let mut done = self.done.subscribe();
        match done.wait_for(|d| d.attempted >= generation).await {
            Ok(d) if d.written >= generation => Ok(()),
            // A failed attempt always records its error.
            Ok(d) => Err(d.error.clone().unwrap_or(CheckpointWriteError::WriterPanicked)),
            // The sender lives as long as `self`, so this cannot happen
            // while we borrow it.
            Err(_) => Err(CheckpointWriteError::ShuttingDown),
        }
    }

    /// Tells the writer to finish what was asked and exit.
    pub(crate) fn stop(&self) {
        self.state().stopping = true;
        self.wake.notify_one();
    }

    /// The writer thread's body: `write` writes the current state.
    pub(crate) fn run(&self, mut write: impl FnMut() -> Result<(), CheckpointWriteError>) {
        let mut written = 0;
        loop {
            let generation = {
                let mut state = self.state();
                while state.wanted == written && !state.stopping {
                    state = self.wake.wait(state).unwrap_or_else(|p| p.into_inner());
                }
                if state.wanted == written {
                    return;
                }
                state.wanted
            };
            // A panic is a bug, but it must not leave waiters waiting forever.
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(&mut write))
                .unwrap_or(Err(CheckpointWriteError::WriterPanicked));
            match &result {
                Ok(()) => self.health.healthy(),
                Err(error) => {
                    tracing::error!(%error, "cannot write the device checkpoint");
                    self.health.failing(error.to_string());
                }
            }
            written = generation;
            self.done.send_modify(|done| {
                done.attempted = generation;
                match result {
                    Ok(()) => {
                        done.written = generation;
                        done.error = None;
                    }
                    Err(error) => done.error = Some(error),
                }
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};

    use super::*;
    use crate::health::ComponentHealth;

    fn disk_full() -> CheckpointWriteError {
        CheckpointWriteError::Io {
            path: "/dp/kubelet_internal_checkpoint".into(),
            source: Arc::new(std::io::Error::from(std::io::ErrorKind::StorageFull)),
        }
    }

    fn is_disk_full(result: Result<(), CheckpointWriteError>) -> bool {
        matches!(result, Err(CheckpointWriteError::Io { source, .. }) if source.kind() == std::io::ErrorKind::StorageFull)
    }

    /// A writer whose thread runs `write` for every write.
    fn started(
        write: impl FnMut() -> Result<(), CheckpointWriteError> + Send + 'static,
    ) -> (Arc<Writer>, std::thread::JoinHandle<()>) {
        let writer = Arc::new(Writer::new());
        let thread = {
            let writer = writer.clone();
            std::thread::spawn(move || writer.run(write))
        };
        (writer, thread)
    }

    #[tokio::test]
    async fn asks_made_during_a_write_share_the_next_one_and_shutdown_drains() {
        let writes = Arc::new(AtomicU64::new(0));
        let (entered_tx, entered_rx) = std::sync::mpsc::channel::<()>();
        let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
        let (writer, thread) = started({
            let writes = writes.clone();
            move || {
                writes.fetch_add(1, Ordering::SeqCst);
                entered_tx.send(()).ok();
                release_rx.recv().ok();
                Ok(())
            }
        });
        let first = writer.request().expect("running");
        entered_rx.recv().expect("first write started");
        // Three asks while the first write is blocked: one write covers them.
        let asks: Vec<u64> = (0..3).map(|_| writer.request().expect("running")).collect();
        release_tx.send(()).expect("release first");
        writer.written(first).await.expect("first written");
        entered_rx.recv().expect("second write started");
        writer.stop();
        assert_eq!(writer.request(), None, "asks after stop are refused");
        release_tx.send(()).expect("release second");
        for ask in asks {
            writer.written(ask).await.expect("covered by the second write");
        }
        thread.join().expect("writer exits after draining");
        assert_eq!(writes.load(Ordering::SeqCst), 2);
    }

    /// A waiter that wakes after a later write failed still hears that its
    /// own generation was written.
    #[tokio::test]
    async fn a_later_failure_is_not_reported_for_an_earlier_generation() {
        let mut results = vec![Err(disk_full()), Ok(())];
        let (written_tx, written_rx) = std::sync::mpsc::channel::<()>();
        let (writer, thread) = started(move || {
            let result = results.pop().unwrap_or(Ok(()));
            written_tx.send(()).ok();
            result
        });
        let first = writer.request().expect("running");
        written_rx.recv().expect("first written");
        let second = writer.request().expect("running");
        written_rx.recv().expect("second attempted");
        assert!(is_disk_full(writer.written(second).await));
        assert!(writer.written(first).await.is_ok(), "the first write succeeded");
        writer.stop();
        thread.join().expect("exits");
    }

    #[tokio::test]
    async fn a_panicking_write_fails_its_waiters_instead_of_hanging_them() {
        let (writer, thread) = started(|| panic!("bug in the writer"));
        let ask = writer.request().expect("running");
        assert!(matches!(writer.written(ask).await, Err(CheckpointWriteError::WriterPanicked)));
        let again = writer.request().expect("still running");
        assert!(matches!(writer.written(again).await, Err(CheckpointWriteError::WriterPanicked)));
        assert_eq!(
            writer.health().get(),
            ComponentHealth::Failing { reason: "the device checkpoint writer panicked".into() }
        );
        writer.stop();
        thread.join().expect("exits");
    }

    /// A failed write is reported to its waiters and fails the writer's
    /// health check until a write succeeds again.
    #[tokio::test]
    async fn a_failed_write_is_reported_to_its_waiters_and_health() {
        let mut results = vec![Ok(()), Err(disk_full())];
        let (writer, thread) = started(move || results.pop().unwrap_or(Ok(())));
        let health = writer.health();
        assert!(health.get().is_healthy());
        let ask = writer.request().expect("running");
        assert!(is_disk_full(writer.written(ask).await));
        assert_eq!(
            health.get(),
            ComponentHealth::Failing {
                reason: format!("cannot write device checkpoint /dp/kubelet_internal_checkpoint: {}", disk_full_text())
            }
        );
        let again = writer.request().expect("running");
        assert!(writer.written(again).await.is_ok());
        assert!(health.get().is_healthy(), "healthy again after a good write");
        writer.stop();
        thread.join().expect("exits");
    }

    fn disk_full_text() -> String {
        std::io::Error::from(std::io::ErrorKind::StorageFull).to_string()
    }
}
