//! krator: a small async state-machine runtime.
//!
//! Each object (a pod, a job, anything with a key and a manifest) is driven by
//! its own task through typed states:
//!
//! - a state is a type implementing [`State`]; its `next` does the work and
//!   returns a [`Transition`];
//! - edges are declared with [`TransitionTo`], so a transition the graph does
//!   not allow does not compile;
//! - the object's manifest is a `watch` channel that states can read and wait on
//!   ([`Context::manifest`]);
//! - deleting an object interrupts its current state and runs its terminal
//!   states ([`Machine::deleted`]);
//! - every state entry reports a status ([`Machine::status`]).
//!
//! Nothing here knows about Kubernetes.
//!
//! # Example
//!
//! A job that waits for its manifest to say `go`, works, and is cleaned up when
//! deleted:
//!
//! ```
//! use std::sync::{Arc, Mutex};
//! use krator::{Context, Machine, Runtime, State, Transition, TransitionTo};
//! use tokio_util::sync::CancellationToken;
//!
//! struct Jobs {
//!     log: Mutex<Vec<String>>,
//! }
//!
//! impl Machine for Jobs {
//!     type Key = String;
//!     type Manifest = &'static str;
//!     type Data = u32; // work done so far
//!     type Status = &'static str;
//!     type Error = String;
//!
//!     fn start(&self, _: &String, _: &&'static str) -> (u32, Box<dyn State<Self>>) {
//!         (0, Box::new(Waiting))
//!     }
//!     fn deleted(&self, _: &String, _: &u32) -> Box<dyn State<Self>> {
//!         Box::new(CleaningUp)
//!     }
//!     fn status(&self, key: &String, status: &'static str) {
//!         self.log.lock().unwrap().push(format!("{key}: {status}"));
//!     }
//! }
//!
//! struct Waiting;
//! struct Working;
//! struct CleaningUp;
//! impl TransitionTo<Working> for Waiting {}
//!
//! #[async_trait::async_trait]
//! impl State<Jobs> for Waiting {
//!     async fn next(self: Box<Self>, ctx: &mut Context<Jobs>) -> Transition<Jobs> {
//!         // Wait until the manifest says "go".
//!         let _ = ctx.manifest.wait_for(|manifest| *manifest == "go").await;
//!         Transition::next(&*self, Working)
//!     }
//!     fn status(&self, _: &Context<Jobs>) -> &'static str { "waiting" }
//! }
//!
//! #[async_trait::async_trait]
//! impl State<Jobs> for Working {
//!     async fn next(self: Box<Self>, ctx: &mut Context<Jobs>) -> Transition<Jobs> {
//!         ctx.data += 1;
//!         std::future::pending().await // works until deleted
//!     }
//!     fn status(&self, _: &Context<Jobs>) -> &'static str { "working" }
//! }
//!
//! #[async_trait::async_trait]
//! impl State<Jobs> for CleaningUp {
//!     async fn next(self: Box<Self>, ctx: &mut Context<Jobs>) -> Transition<Jobs> {
//!         ctx.data = 0;
//!         Transition::complete(Ok(()))
//!     }
//!     fn status(&self, _: &Context<Jobs>) -> &'static str { "cleaning up" }
//! }
//!
//! // `Transition::next(&*self, Waiting)` inside `Working` would not compile:
//! // no `impl TransitionTo<Waiting> for Working`.
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let shutdown = CancellationToken::new();
//! let jobs = Arc::new(Jobs { log: Mutex::new(Vec::new()) });
//! let runtime = Runtime::new(Arc::clone(&jobs), shutdown.clone());
//! runtime.apply("build".to_string(), "wait");
//! runtime.apply("build".to_string(), "go");
//! # while !jobs.log.lock().unwrap().iter().any(|l| l.ends_with("working")) { tokio::task::yield_now().await; }
//! runtime.delete(&"build".to_string());
//! # while runtime.contains(&"build".to_string()) { tokio::task::yield_now().await; }
//! # assert_eq!(*jobs.log.lock().unwrap(), ["build: waiting", "build: working", "build: cleaning up"]);
//! shutdown.cancel();
//! runtime.stopped().await;
//! # }
//! ```

mod runtime;
mod state;

pub use runtime::{Applied, Deleted, Runtime};
pub use state::{Context, Machine, Outcome, State, Transition, TransitionTo};
