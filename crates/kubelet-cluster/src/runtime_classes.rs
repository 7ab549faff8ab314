//! The cluster's RuntimeClass objects (`node.k8s.io/v1`), watched as the
//! kubelet's informer watches them: each class's `handler` goes into the
//! node's [`ClassHandlers`] table, a deleted class leaves it, and classes
//! deleted while the watch was down are dropped when it lists again.

use crate::runtime_class::ClassHandlers;

/// Keeps `classes` equal to the cluster's RuntimeClasses until the stream
/// ends (run it under the node's shutdown): the one mirror loop
/// (`mirror.rs`).
pub(crate) async fn follow(client: kube::Client, classes: ClassHandlers) {
    crate::mirror::follow(client, classes).await;
}
