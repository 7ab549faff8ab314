//! Cluster mode: the node in a Kubernetes cluster, through kube-rs.
//!
//! Built so far: the Node object, its status and its Lease
//! (`node_sync`); pods bound to the node run through the lifecycle, their
//! statuses patched and their deletion finished (`pod_sync`). Not yet:
//! mirror pods, volumes from API objects, CSI node info on the Node and
//! CSINode. The `rustlet`
//! binary still refuses cluster mode until pods run through it.

pub mod node_sync;
pub mod pod_sync;

pub use node_sync::{LEASE_NAMESPACE, NodeSync, NodeSyncConfig, NodeSyncStats};
pub use pod_sync::{PodSync, PodSyncConfig, PodSyncStats};
