//! The pod's states and the edges between them (see the module diagram in
//! `pod`).

mod admission;
mod claims;
mod containers;
mod finished;
mod prepare;
mod terminating;

pub(crate) use admission::{Registered, Resources};
pub(crate) use claims::Claims;
pub(crate) use containers::{CrashLoopBackOff, Initializing, Running, Starting};
pub(crate) use finished::{AlreadyFinished, Completed, Failed};
pub use prepare::NO_PROVIDER_MESSAGE;
pub(crate) use prepare::{ImagePull, ImagePullBackOff, NoProvider, Volumes};
pub use terminating::LIFECYCLE_ERROR;
pub(crate) use terminating::Terminating;

use krator::TransitionTo;

impl TransitionTo<Resources> for Registered {}
impl TransitionTo<AlreadyFinished> for Registered {}
impl TransitionTo<Failed> for Registered {}
impl TransitionTo<Claims> for Resources {}
impl TransitionTo<ImagePull> for Claims {}
impl TransitionTo<Failed> for Claims {}
impl TransitionTo<Failed> for Resources {}
impl TransitionTo<Volumes> for ImagePull {}
impl TransitionTo<ImagePullBackOff> for ImagePull {}
impl TransitionTo<ImagePull> for ImagePullBackOff {}
impl TransitionTo<Failed> for ImagePullBackOff {}
impl TransitionTo<Failed> for Volumes {}
impl TransitionTo<Initializing> for Volumes {}
impl TransitionTo<NoProvider> for Volumes {}
impl TransitionTo<Starting> for Initializing {}
impl TransitionTo<Failed> for Initializing {}
impl TransitionTo<Running> for Starting {}
impl TransitionTo<CrashLoopBackOff> for Starting {}
impl TransitionTo<Failed> for Starting {}
impl TransitionTo<CrashLoopBackOff> for Running {}
impl TransitionTo<Starting> for Running {}
impl TransitionTo<Completed> for Running {}
impl TransitionTo<Failed> for Running {}
impl TransitionTo<Starting> for CrashLoopBackOff {}
impl TransitionTo<Completed> for CrashLoopBackOff {}
impl TransitionTo<Failed> for CrashLoopBackOff {}
impl TransitionTo<Failed> for Terminating {}
