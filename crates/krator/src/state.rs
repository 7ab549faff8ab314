//! States and the transitions between them.
//!
//! A state is a type implementing [`State`]; its `next` method does the state's
//! work and returns a [`Transition`]. The only way to build a transition to
//! another state is [`Transition::next`], which requires the edge to be
//! declared with [`TransitionTo`]: a transition that the state graph does not
//! allow does not compile.

use async_trait::async_trait;

use crate::machine::{Context, Machine};

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
