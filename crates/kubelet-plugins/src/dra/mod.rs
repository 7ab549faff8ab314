//! Dynamic Resource Allocation (DRA) kubelet plugins.
//!
//! A DRA driver registers through the plugin registration service with
//! type `DRAPlugin`, its driver name, the endpoint of its `DRAPlugin` gRPC
//! service and the versions it speaks (`v1.DRAPlugin`, `v1beta1.DRAPlugin`,
//! in its order of preference). The node takes the first entry of that list
//! it serves; entries it does not know (such as `v1alpha1.DRAResourceHealth`)
//! are skipped, and a list with none it serves is refused with both lists
//! named.
//!
//! **Seamless upgrade.** A driver may run two instances side by side while
//! it is upgraded, each with its own registration socket and endpoint. The
//! node keeps every instance ([`DraDrivers`]) and sends each call to the
//! most recently registered instance that is connected (to the most recent
//! one when none is). Each instance's connection is held open and watched:
//! the moment the instance goes away the node knows, without polling, and
//! dials it again with backoff until it is back or deregistered.
//!
//! Calls ([`DraDrivers::prepare`], [`DraDrivers::unprepare`]) are batched
//! per driver and bounded by upstream's deadline (45 s).
//!
//! **Claims.** [`DraClaims`] prepares each claim once, for the first pod
//! that needs it, releases it when the last pod using it is gone, and keeps
//! both facts in a checkpoint (`<root-dir>/dra_manager_state`) across
//! restarts. The CDI device IDs a driver returns go to the containers that
//! reference the claim in `resources.claims`.

mod claims;
mod metrics;
mod plugins;

pub use claims::{ClaimError, ClaimSource, ContainerClaim, DRA_CHECKPOINT_FILE, DraClaims, ResolvedClaim, claim_name};
pub use plugins::{
    ClaimRef, DraConfig, DraDrivers, DraError, DraInstance, DraPluginHandler, DraVersion, PreparedDevice,
};
