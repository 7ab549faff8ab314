//! The checkpoint writer: one thread that writes the newest state whenever
//! a write was asked for since the last one (group commit).
//!
//! Callers ask for a write and get a generation; a write started after the
//! ask covers it. Asks that arrive while a write is in progress are all
//! covered by the next write. On shutdown the writer finishes what was asked
//! before it stopped, then exits; later asks are refused.

use std::sync::{Condvar, Mutex, MutexGuard};

use tokio::sync::watch;

#[derive(Default)]
struct State {
    wanted: u64,
    stopping: bool,
}

/// Shared between the manager (asks, waits) and the writer thread.
pub(crate) struct Writer {
    state: Mutex<State>,
    wake: Condvar,
    /// The last generation written, with the error if writing it failed.
    done: watch::Sender<(u64, Option<String>)>,
}

impl Writer {
    pub(crate) fn new() -> Writer {
        Writer { state: Mutex::default(), wake: Condvar::new(), done: watch::Sender::new((0, None)) }
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

    /// Waits until generation `generation` (or a later one) is written.
    pub(crate) async fn written(&self, generation: u64) -> Result<(), String> {
        let mut done = self.done.subscribe();
        match done.wait_for(|(written, _)| *written >= generation).await {
            Ok(state) => state.1.clone().map_or(Ok(()), Err),
            Err(_) => Err("the checkpoint writer stopped".into()),
        }
    }

    /// Tells the writer to finish what was asked and exit.
    pub(crate) fn stop(&self) {
        self.state().stopping = true;
        self.wake.notify_one();
    }

    /// The writer thread's body: `write` writes the current state.
    pub(crate) fn run(&self, mut write: impl FnMut() -> Result<(), String>) {
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
            let result = write();
            if let Err(error) = &result {
                tracing::error!(%error, "cannot write the device checkpoint");
            }
            written = generation;
            self.done.send_replace((generation, result.err()));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};

    use super::*;

    #[tokio::test]
    async fn asks_made_during_a_write_share_the_next_one_and_shutdown_drains() {
        let writer = Arc::new(Writer::new());
        let writes = Arc::new(AtomicU64::new(0));
        let (entered_tx, entered_rx) = std::sync::mpsc::channel::<()>();
        let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
        let thread = {
            let (writer, writes) = (writer.clone(), writes.clone());
            std::thread::spawn(move || {
                writer.run(|| {
                    writes.fetch_add(1, Ordering::SeqCst);
                    entered_tx.send(()).ok();
                    release_rx.recv().ok();
                    Ok(())
                })
            })
        };
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

    #[tokio::test]
    async fn a_failed_write_is_reported_to_its_waiters() {
        let writer = Arc::new(Writer::new());
        let thread = {
            let writer = writer.clone();
            std::thread::spawn(move || writer.run(|| Err("disk full".into())))
        };
        let ask = writer.request().expect("running");
        assert_eq!(writer.written(ask).await, Err("disk full".into()));
        writer.stop();
        thread.join().expect("exits");
    }
}
