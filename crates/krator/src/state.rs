//! A kind of object driven by state machines ([`Machine`]), what each of
//! its states sees while it runs ([`Context`]), the states and the
//! transitions between them: one module, since a machine names its states
//! and each state names its machine.
//!
//! A state is a type implementing [`State`]; its `next` method does the state's
//! work and returns a [`Transition`]. The only way to build a transition to
//! another state is [`Transition::next`], which requires the edge to be
//! declared with [`TransitionTo`]: a transition that the state graph does not
//! allow does not compile.

use std::fmt::{Debug, Display};
use std::hash::Hash;
use std::sync::Arc;

use async_trait::async_trait;
use tokio::sync::watch;

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

/// One state of an object's machine.
///
/// `next` runs the state's work and decides where to go. It may be dropped
/// before it finishes when the object is deleted (see [`crate::Runtime::delete`]),
/// so anything it must undo is recorded in the object's
/// [`Context::data`] before it is done, for the terminal states to clean up.
#[async_trait]
pub trait State<M: Machine>: Send + 'static {
    /// Does this state's work and returns the transition to the next state.
    async fn next(self: Box<Self>, ctx: &mut Context<M>) -> Transition<M>;

    /// The status the object reports when it enters this state.
    fn status(&self, ctx: &Context<M>) -> M::Status;

    /// A short name for logs; the type's name by default.
    fn name(&self) -> &'static str {
        let full = std::any::type_name::<Self>();
        let without_generics = full.split('<').next().unwrap_or(full);
        without_generics.rsplit("::").next().unwrap_or(without_generics)
    }
}

/// Declares the edge `Self → To` of a state graph.
///
/// `impl TransitionTo<Running> for Starting {}` allows
/// `Transition::next(&starting, Running)`; without the impl that call does not
/// compile:
///
/// ```compile_fail
/// use krator::{Context, Machine, State, Transition, TransitionTo};
/// struct M;
/// impl Machine for M {
///     type Key = String;
///     type Manifest = ();
///     type Data = ();
///     type Status = ();
///     type Error = String;
///     fn start(&self, _: &String, _: &()) -> ((), Box<dyn State<M>>) { ((), Box::new(Starting)) }
///     fn deleted(&self, _: &String, _: &()) -> Box<dyn State<M>> { Box::new(Starting) }
///     fn status(&self, _: &String, _: ()) {}
/// }
/// struct Starting;
/// struct Running;
/// // No `impl TransitionTo<Running> for Starting {}`.
/// #[async_trait::async_trait]
/// impl State<M> for Starting {
///     async fn next(self: Box<Self>, _: &mut Context<M>) -> Transition<M> {
///         Transition::next(&*self, Running) // error: the edge is not declared
///     }
///     fn status(&self, _: &Context<M>) {}
/// }
/// #[async_trait::async_trait]
/// impl State<M> for Running {
///     async fn next(self: Box<Self>, _: &mut Context<M>) -> Transition<M> {
///         Transition::complete(Ok(()))
///     }
///     fn status(&self, _: &Context<M>) {}
/// }
/// ```
pub trait TransitionTo<To> {}

/// What a state's `next` returns: go to another state, or finish.
pub struct Transition<M: Machine>(pub(crate) Step<M>);

pub(crate) enum Step<M: Machine> {
    Next(Box<dyn State<M>>),
    Complete(Result<(), M::Error>),
}

impl<M: Machine> Transition<M> {
    /// Moves from the state `from` to `to`; the edge must be declared with
    /// [`TransitionTo`].
    pub fn next<From, To>(from: &From, to: To) -> Self
    where
        From: TransitionTo<To>,
        To: State<M>,
    {
        let _ = from;
        Transition(Step::Next(Box::new(to)))
    }

    /// Ends the machine: the object's task stops with this outcome.
    pub fn complete(result: Result<(), M::Error>) -> Self {
        Transition(Step::Complete(result))
    }
}

impl<M: Machine> std::fmt::Debug for Transition<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0 {
            Step::Next(state) => write!(f, "Transition::Next({})", state.name()),
            Step::Complete(Ok(())) => write!(f, "Transition::Complete(Ok)"),
            Step::Complete(Err(error)) => write!(f, "Transition::Complete(Err({error}))"),
        }
    }
}
