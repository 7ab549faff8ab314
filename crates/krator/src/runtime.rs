//! The runtime: one task per object, driving its states.
//!
//! # Flow
//! [`Runtime::apply`] starts a task for a new key (the machine's
//! [`Machine::start`] gives its data and first state) or hands a changed
//! manifest to the running one. The task enters a state (reporting its
//! status), runs its `next`, and follows the transition until a state
//! completes. [`Runtime::delete`] interrupts the current state (its `next`
//! future is dropped) and moves the object to [`Machine::deleted`], whose
//! states then run to completion, undisturbed by further deletes.
//!
//! # Guarantees
//! - At most one task per key. A key applied again while its terminal states
//!   run is queued and starts afresh once they finish.
//! - A panicking state ends only that state: the object moves to
//!   [`Machine::panicked`] (by default its deleted state, so its terminal
//!   states release what it holds). A panic in the terminal states, or a
//!   second panic, ends the object, reported as [`Outcome::Panicked`].
//! - Shutdown (the token given to [`Runtime::new`]) stops every task without
//!   running terminal states: stopping the runtime is not deleting the objects.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use crate::state::Step;
use crate::state::{Context, Machine, Outcome};

/// What [`Runtime::apply`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// A new object: its task started.
    Started,
    /// The running object's manifest was replaced.
    Updated,
    /// The object is being deleted; it starts again with this manifest once
    /// its terminal states finish.
    Queued,
}

/// What [`Runtime::delete`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Deleted {
    /// The object was running; it moves to its deleted state now.
    Deleting,
    /// The object was already being deleted (a queued re-apply is dropped).
    AlreadyDeleting,
    /// No object has this key.
    NotFound,
}

/// Runs one state machine per object.
pub struct Runtime<M: Machine> {
    inner: Arc<Inner<M>>,
}

impl<M: Machine> Clone for Runtime<M> {
    fn clone(&self) -> Self {
        Runtime { inner: Arc::clone(&self.inner) }
    }
}

struct Inner<M: Machine> {
    machine: Arc<M>,
    objects: Mutex<HashMap<M::Key, Entry<M>>>,
    tracker: TaskTracker,
    shutdown: CancellationToken,
    next_generation: std::sync::atomic::AtomicU64,
}

struct Entry<M: Machine> {
    generation: u64,
    manifest: watch::Sender<M::Manifest>,
    delete: CancellationToken,
    pending: Option<M::Manifest>,
}

impl<M: Machine> Runtime<M> {
    /// A runtime for `machine`'s objects; every task stops when `shutdown`
    /// fires.
    pub fn new(machine: Arc<M>, shutdown: CancellationToken) -> Self {
        Runtime {
            inner: Arc::new(Inner {
                machine,
                objects: Mutex::new(HashMap::new()),
                tracker: TaskTracker::new(),
                shutdown,
                next_generation: std::sync::atomic::AtomicU64::new(1),
            }),
        }
    }

    /// The machine shared by all objects.
    pub fn machine(&self) -> &Arc<M> {
        &self.inner.machine
    }

    /// Starts `key` with `manifest`, or gives the running object its new
    /// manifest.
    pub fn apply(&self, key: M::Key, manifest: M::Manifest) -> Applied {
        let mut objects = self.inner.lock();
        match objects.get_mut(&key) {
            Some(entry) if entry.delete.is_cancelled() => {
                entry.pending = Some(manifest);
                Applied::Queued
            }
            Some(entry) => {
                entry.manifest.send_replace(manifest);
                Applied::Updated
            }
            None => {
                let entry = Inner::spawn(&self.inner, key.clone(), manifest);
                objects.insert(key, entry);
                Applied::Started
            }
        }
    }

    /// Gives `key`'s task a new manifest whether or not it is being deleted
    /// (a terminal state may read it: a shorter deadline, say); unlike
    /// [`Runtime::apply`], nothing is started or queued. Returns whether
    /// `key` has a task.
    pub fn update(&self, key: &M::Key, manifest: M::Manifest) -> bool {
        match self.inner.lock().get(key) {
            Some(entry) => {
                entry.manifest.send_replace(manifest);
                true
            }
            None => false,
        }
    }

    /// Deletes `key`: its current state is interrupted and its terminal states
    /// run.
    pub fn delete(&self, key: &M::Key) -> Deleted {
        let mut objects = self.inner.lock();
        match objects.get_mut(key) {
            None => Deleted::NotFound,
            Some(entry) if entry.delete.is_cancelled() => {
                entry.pending = None;
                Deleted::AlreadyDeleting
            }
            Some(entry) => {
                entry.delete.cancel();
                Deleted::Deleting
            }
        }
    }

    /// Whether `key` has a task (running, or running its terminal states).
    pub fn contains(&self, key: &M::Key) -> bool {
        self.inner.lock().contains_key(key)
    }

    /// The keys that have a task.
    pub fn keys(&self) -> Vec<M::Key> {
        self.inner.lock().keys().cloned().collect()
    }

    /// Waits until every task has stopped after the shutdown token fired.
    pub async fn stopped(&self) {
        self.inner.tracker.close();
        self.inner.tracker.wait().await;
    }
}

impl<M: Machine> Inner<M> {
    fn lock(&self) -> MutexGuard<'_, HashMap<M::Key, Entry<M>>> {
        // The map is only touched by short, non-panicking critical sections.
        self.objects.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn spawn(this: &Arc<Self>, key: M::Key, manifest: M::Manifest) -> Entry<M> {
        let generation = this.next_generation.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (sender, receiver) = watch::channel(manifest);
        let delete = CancellationToken::new();
        let span = tracing::debug_span!("object", key = %key);
        let inner = Arc::clone(this);
        let task_key = key.clone();
        let task_delete = delete.clone();
        this.tracker.spawn(
            async move {
                // Not supervised: one object's driver, awaited by the tracked task around it.
                let driven = tokio::spawn(
                    drive(Arc::clone(&inner.machine), task_key.clone(), receiver, task_delete, inner.shutdown.clone())
                        .in_current_span(),
                );
                let outcome = match driven.await {
                    Ok(outcome) => outcome,
                    Err(error) if error.is_panic() => Outcome::Panicked(panic_message(error.into_panic())),
                    Err(_) => Outcome::ShutDown,
                };
                match &outcome {
                    Outcome::Completed(Ok(())) => tracing::debug!("object finished"),
                    Outcome::Completed(Err(error)) => tracing::warn!(%error, "object finished with an error"),
                    Outcome::Panicked(message) => tracing::error!(panic = %message, "a state panicked"),
                    Outcome::ShutDown => tracing::debug!("object stopped by shutdown"),
                }
                inner.machine.finished(&task_key, &outcome);
                if matches!(outcome, Outcome::ShutDown) {
                    return;
                }
                let mut objects = inner.lock();
                let same = objects.get(&task_key).is_some_and(|entry| entry.generation == generation);
                if same
                    && let Some(mut entry) = objects.remove(&task_key)
                    && let Some(manifest) = entry.pending.take()
                {
                    let restarted = Inner::spawn(&inner, task_key.clone(), manifest);
                    objects.insert(task_key, restarted);
                }
            }
            .instrument(span),
        );
        Entry { generation, manifest: sender, delete, pending: None }
    }
}

async fn drive<M: Machine>(
    machine: Arc<M>,
    key: M::Key,
    manifest: watch::Receiver<M::Manifest>,
    delete: CancellationToken,
    shutdown: CancellationToken,
) -> Outcome<M::Error> {
    let (data, mut state) = {
        let current = manifest.borrow();
        machine.start(&key, &current)
    };
    let mut ctx = Context::new(key, manifest, data, machine);
    let mut panicked = false;
    loop {
        tracing::debug!(state = state.name(), "entering state");
        ctx.report(state.status(&ctx));
        let name = state.name();
        let transition = if ctx.is_deleting() {
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => return Outcome::ShutDown,
                transition = CatchUnwind(state.next(&mut ctx)) => transition,
            }
        } else {
            let transition = tokio::select! {
                biased;
                _ = shutdown.cancelled() => return Outcome::ShutDown,
                _ = delete.cancelled() => None,
                transition = CatchUnwind(state.next(&mut ctx)) => Some(transition),
            };
            match transition {
                Some(transition) => transition,
                None => {
                    tracing::debug!(interrupted = name, "object deleted");
                    ctx.mark_deleting();
                    state = ctx.machine.deleted(ctx.key(), &ctx.data);
                    continue;
                }
            }
        };
        let transition = match transition {
            Ok(transition) => transition,
            // A panic in the terminal states, or in the states a first
            // panic led to, ends the object.
            Err(payload) if ctx.is_deleting() || panicked => std::panic::resume_unwind(payload),
            Err(payload) => {
                let message = panic_message(payload);
                tracing::error!(state = name, panic = %message, "a state panicked; releasing what the object holds");
                panicked = true;
                state = ctx.machine.panicked(ctx.key(), &ctx.data, &message);
                continue;
            }
        };
        match transition.0 {
            Step::Next(next) => state = next,
            Step::Complete(result) => return Outcome::Completed(result),
        }
    }
}

/// A state's `next`, with a panic inside it caught as an error (its
/// payload) instead of unwinding through the object's task.
struct CatchUnwind<F>(F);

impl<F> std::future::Future for CatchUnwind<F>
where
    F: std::future::Future + Unpin,
{
    type Output = Result<F::Output, Box<dyn std::any::Any + Send>>;

    fn poll(self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Self::Output> {
        let inner = &mut self.get_mut().0;
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| std::pin::Pin::new(&mut *inner).poll(cx))) {
            Ok(std::task::Poll::Pending) => std::task::Poll::Pending,
            Ok(std::task::Poll::Ready(output)) => std::task::Poll::Ready(Ok(output)),
            Err(payload) => std::task::Poll::Ready(Err(payload)),
        }
    }
}

fn panic_message(payload: Box<dyn std::any::Any + Send>) -> String {
    if let Some(message) = payload.downcast_ref::<&str>() {
        (*message).to_string()
    } else if let Some(message) = payload.downcast_ref::<String>() {
        message.clone()
    } else {
        "a non-string panic payload".to_string()
    }
}
