//! What a kind of object brings to the runtime, and what each of its states
//! sees while it runs.

use std::fmt::{Debug, Display};
use std::hash::Hash;
use std::sync::Arc;

use tokio::sync::watch;

use crate::state::State;

/// A kind of object driven by state machines: the types it works with, where a
/// new object starts, where a deleted one goes, and where statuses are sent.
///
/// One value of the implementing type is shared (as an `Arc`) by every
/// object's task; it is the place for what all objects use (a provider, a
/// device manager, a status sink).
pub trait Machine: Send + Sync + Sized + 'static {
    /// Identifies an object (a pod UID, a name).
    type Key: Clone + Eq + Hash + Debug + Display + Send + Sync + 'static;
    /// The object's desired state as its owner gives it; it may change while
    /// the machine runs ([`Context::manifest`]).
    type Manifest: Clone + Send + Sync + 'static;
    /// What one object's states share and hand on to each other.
    type Data: Send + 'static;
    /// What a state reports on entry ([`State::status`]).
    type Status: Send + 'static;
    /// How a machine that ends badly says why.
    type Error: Display + Send + 'static;

    /// Prepares a new object: its data and its first state.
    fn start(&self, key: &Self::Key, manifest: &Self::Manifest) -> (Self::Data, Box<dyn State<Self>>);

    /// The state a deleted object moves to, interrupting whatever state it was
    /// in; from there the object's terminal states run to completion.
    fn deleted(&self, key: &Self::Key, data: &Self::Data) -> Box<dyn State<Self>>;

    /// The state an object moves to when one of its states panicked
    /// (`message`: the panic's payload): by default the deleted state, so
    /// that the terminal states release what the object holds. The object
    /// is not deleted: a later delete interrupts these states as any other.
    fn panicked(&self, key: &Self::Key, data: &Self::Data, message: &str) -> Box<dyn State<Self>> {
        let _ = message;
        self.deleted(key, data)
    }

    /// Receives the status of every state the object enters, and any status a
    /// state reports on its own ([`Context::report`]). Called on the object's
    /// task: keep it quick (send it to a channel).
    fn status(&self, key: &Self::Key, status: Self::Status);

    /// Called once when an object's task ends.
    fn finished(&self, key: &Self::Key, outcome: &Outcome<Self::Error>) {
        let _ = (key, outcome);
    }
}

/// How an object's task ended.
#[derive(Debug)]
pub enum Outcome<E> {
    /// A state returned [`crate::Transition::complete`] with this result.
    Completed(Result<(), E>),
    /// A state panicked; the message is the panic's payload when it is a string.
    Panicked(String),
    /// The runtime shut down while the object was running; its terminal states
    /// did not run.
    ShutDown,
}

/// What the states of one object work with.
pub struct Context<M: Machine> {
    key: M::Key,
    /// The object's manifest: `borrow()` for the latest, `changed()` to wait
    /// for the next change.
    pub manifest: watch::Receiver<M::Manifest>,
    /// The object's own data, handed from state to state.
    pub data: M::Data,
    /// The machine shared by all objects.
    pub machine: Arc<M>,
    deleting: bool,
}

impl<M: Machine> Context<M> {
    pub(crate) fn new(key: M::Key, manifest: watch::Receiver<M::Manifest>, data: M::Data, machine: Arc<M>) -> Self {
        Context { key, manifest, data, machine, deleting: false }
    }

    /// The object's key.
    pub fn key(&self) -> &M::Key {
        &self.key
    }

    /// A copy of the latest manifest.
    pub fn latest_manifest(&self) -> M::Manifest {
        self.manifest.borrow().clone()
    }

    /// Whether the object has been deleted (its terminal states are running).
    pub fn is_deleting(&self) -> bool {
        self.deleting
    }

    pub(crate) fn mark_deleting(&mut self) {
        self.deleting = true;
    }

    /// Reports a status without changing state (a container restarted while
    /// the pod stays Running, for example).
    pub fn report(&self, status: M::Status) {
        self.machine.status(&self.key, status);
    }
}
