//! Rustlet's pod lifecycle: what happens to a pod from admission to its
//! removal, whoever the pod came from (the API, a static manifest) and
//! whichever provider runs its containers.
//!
//! - [`pod`]: admission, the typed state machine (volumes, resources,
//!   containers, terminating), probes and hooks, statuses, the pod store.
//! - [`volume`]: pod volumes (emptyDir, hostPath, configMap, secret,
//!   projected, downwardAPI, CSI) and their reconciler.
//! - [`static_pods`]: pods from manifests in a directory.
//! - [`runtime_class`]: several providers behind one node, chosen by a pod's
//!   RuntimeClass.
//! - [`events`]: the events pods make (the cluster writes them to the API).
//! - [`pod_resources`]: the PodResources API, answered from the pod store
//!   and the device and DRA managers.
//!
//! Devices, CSI drivers and DRA claims come from `kubelet-plugins`;
//! containers run through a `kubelet-provider` provider.

mod api_error;
pub mod events;
pub mod eviction;
pub mod gc;
pub mod log_rotation;
pub mod metrics;
pub mod pod;
pub mod pod_resources;
pub mod pressure;
pub mod runtime_class;
pub mod static_pods;
pub mod volume;

pub use api_error::ApiError;

use kubelet_plugins::{csi, device_manager, dra};
use kubelet_provider as provider;
#[cfg(test)]
use kubelet_support::fuzz;
use kubelet_support::retry;
