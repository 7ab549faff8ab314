//! Cluster mode: the node in a Kubernetes cluster, through kube-rs.
//!
//! Built so far: the Node object, its status and its Lease
//! (`node_sync`). Not yet: pods from the API, mirror pods, volumes from
//! API objects, CSI node info on the Node and CSINode. The `rustlet`
//! binary still refuses cluster mode until pods run through it.

pub mod node_sync;

pub use node_sync::{LEASE_NAMESPACE, NodeSync, NodeSyncConfig, NodeSyncStats};
