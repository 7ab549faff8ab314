//! Publishing what CSI drivers say about this node.
//!
//! Upstream writes three things per driver: a key in the Node annotation
//! `csi.volume.kubernetes.io/nodeid` (a JSON map driver → node ID), a Node
//! label per topology segment, and an entry in `CSINode.spec.drivers`.
//! Deregistration drops the annotation key and the CSINode entry; labels
//! stay. [`NodeInfoPublisher`] is that seam; [`InMemoryNodeInfo`] is the
//! standalone implementation (the cluster one writes Node and CSINode).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use kubelet_api::constants::CSI_NODE_ID_ANNOTATION;

use super::error::PublishError;

/// One driver's entry in `CSINode.spec.drivers`, plus its topology values.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CsiNodeDriver {
    /// Driver name.
    pub name: String,
    /// The driver's ID for this node.
    #[serde(rename = "nodeID")]
    pub node_id: String,
    /// Topology keys the driver uses, sorted.
    pub topology_keys: Vec<String>,
    /// `allocatable.count`: most volumes on this node, if limited.
    pub allocatable_count: Option<i64>,
    /// Topology segments (key → value), which become Node labels.
    pub topology: BTreeMap<String, String>,
}

/// Where the node's CSI facts go.
#[async_trait]
pub trait NodeInfoPublisher: Send + Sync + 'static {
    /// Adds or replaces `driver`'s entry. On error the registration is undone.
    async fn add_driver(&self, driver: CsiNodeDriver) -> Result<(), PublishError>;
    /// Removes `name`'s entry and annotation key (labels stay). Must not fail
    /// and must not wait on remote calls: a publisher that writes to an API
    /// records the removal and stores it in the background, retrying until
    /// it is stored.
    async fn remove_driver(&self, name: &str);
}

/// The node's CSI facts as the API objects would show them.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct NodeCsiInfo {
    /// Node annotations written for CSI.
    pub annotations: BTreeMap<String, String>,
    /// Node labels written for CSI topology.
    pub labels: BTreeMap<String, String>,
    /// `CSINode.spec.drivers`, sorted by name.
    pub drivers: Vec<CsiNodeDriver>,
}

/// Standalone publisher: keeps the node's CSI facts in memory.
#[derive(Clone, Default)]
pub struct InMemoryNodeInfo {
    state: Arc<Mutex<State>>,
}

#[derive(Default)]
struct State {
    drivers: BTreeMap<String, CsiNodeDriver>,
    labels: BTreeMap<String, String>,
}

impl InMemoryNodeInfo {
    /// An empty node.
    pub fn new() -> Self {
        Self::default()
    }

    /// The annotation, labels and CSINode drivers as they stand now.
    pub fn snapshot(&self) -> NodeCsiInfo {
        let state = self.lock();
        let mut annotations = BTreeMap::new();
        if !state.drivers.is_empty() {
            let ids: BTreeMap<&str, &str> =
                state.drivers.values().map(|d| (d.name.as_str(), d.node_id.as_str())).collect();
            let json = serde_json::to_string(&ids).unwrap_or_default();
            annotations.insert(CSI_NODE_ID_ANNOTATION.to_owned(), json);
        }
        NodeCsiInfo { annotations, labels: state.labels.clone(), drivers: state.drivers.values().cloned().collect() }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[async_trait]
impl NodeInfoPublisher for InMemoryNodeInfo {
    async fn add_driver(&self, mut driver: CsiNodeDriver) -> Result<(), PublishError> {
        driver.topology_keys = driver.topology.keys().cloned().collect();
        let mut state = self.lock();
        state.labels.extend(driver.topology.iter().map(|(k, v)| (k.clone(), v.clone())));
        state.drivers.insert(driver.name.clone(), driver);
        Ok(())
    }

    async fn remove_driver(&self, name: &str) {
        self.lock().drivers.remove(name);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn driver(name: &str, id: &str, topology: &[(&str, &str)]) -> CsiNodeDriver {
        CsiNodeDriver {
            name: name.into(),
            node_id: id.into(),
            topology_keys: vec![],
            allocatable_count: Some(3),
            topology: topology.iter().map(|(k, v)| ((*k).into(), (*v).into())).collect(),
        }
    }

    #[tokio::test]
    async fn annotation_labels_and_drivers_follow_registrations() {
        let node = InMemoryNodeInfo::new();
        node.add_driver(driver("b.csi", "node-b", &[("zone", "z1"), ("rack", "r9")])).await.expect("add");
        node.add_driver(driver("a.csi", "node-a", &[])).await.expect("add");
        let snap = node.snapshot();
        assert_eq!(snap.annotations[CSI_NODE_ID_ANNOTATION], r#"{"a.csi":"node-a","b.csi":"node-b"}"#);
        assert_eq!(snap.labels.get("zone").map(String::as_str), Some("z1"));
        assert_eq!(snap.drivers[1].topology_keys, vec!["rack".to_owned(), "zone".to_owned()]);

        node.remove_driver("b.csi").await;
        let snap = node.snapshot();
        assert_eq!(snap.annotations[CSI_NODE_ID_ANNOTATION], r#"{"a.csi":"node-a"}"#);
        assert_eq!(snap.drivers.len(), 1);
        assert_eq!(snap.labels.get("zone").map(String::as_str), Some("z1"), "labels stay, as upstream");

        node.remove_driver("a.csi").await;
        assert!(node.snapshot().annotations.is_empty());
    }
}
