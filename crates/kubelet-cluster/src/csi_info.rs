//! CSI node info in the cluster: what registered CSI drivers say about the
//! node, written to the API as the kubelet writes it.
//!
//! - The Node annotation `csi.volume.kubernetes.io/nodeid`: a JSON map of
//!   driver name → the driver's node ID (the key is removed with the last
//!   driver).
//! - A Node label per topology segment (labels stay after deregistration,
//!   as upstream).
//! - The `CSINode` object of the node's name, owned by the Node:
//!   `spec.drivers` with name, nodeID, topologyKeys and allocatable count.
//!
//! Exactness under concurrency: registrations and removals change an
//! in-memory table ([`InMemoryNodeInfo`]) at once; one writer task stores
//! the table's latest state (never a delta), so any number of concurrent
//! changes end as one exact object. The CSINode is replaced with its
//! resourceVersion as a precondition; a 409 conflict (someone else wrote
//! it) is answered by reading it again and retrying, other errors by a
//! doubling backoff. When the Node object is created again (an
//! administrator deleted it), the annotation and labels are written again.
//!
//! Unlike upstream, a registration does not wait for the API: the driver
//! is usable on the node at once and its node info reaches the API as soon
//! as the API answers.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::storage::v1::{CSINode, CSINodeDriver, CSINodeSpec, VolumeNodeResources};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::api::{Api, Patch};

use crate::retry::RetryBackoff;
use kubelet_api::constants::CSI_NODE_ID_ANNOTATION;
use serde_json::json;
use tokio::sync::watch;

use super::describe;
use crate::csi::{CsiNodeDriver, InMemoryNodeInfo, NodeCsiInfo, NodeInfoPublisher, PublishError};

/// Counters of the CSI node info writer.
#[derive(Debug, Default)]
pub struct CsiInfoStats {
    /// States of the table stored in full (Node and CSINode written).
    pub stored: AtomicU64,
    /// CSINode writes refused with 409 and retried.
    pub conflicts: AtomicU64,
    /// Other failed calls (retried with backoff).
    pub failures: AtomicU64,
}

/// A [`NodeInfoPublisher`] that keeps the node's CSI facts in memory and
/// stores them in the API in the background. Cheap to clone.
#[derive(Clone)]
pub struct ApiNodeInfo {
    memory: InMemoryNodeInfo,
    /// Bumped by every change of the table.
    generation: Arc<watch::Sender<u64>>,
    /// The last generation stored in full.
    stored: Arc<watch::Sender<u64>>,
    stats: Arc<CsiInfoStats>,
}

impl Default for ApiNodeInfo {
    fn default() -> Self {
        ApiNodeInfo {
            memory: InMemoryNodeInfo::new(),
            generation: Arc::new(watch::channel(0).0),
            stored: Arc::new(watch::channel(0).0),
            stats: Arc::default(),
        }
    }
}

impl ApiNodeInfo {
    /// An empty table; nothing is written until [`ApiNodeInfo::start`].
    pub fn new() -> Self {
        Self::default()
    }

    /// The in-memory table (what `/status` shows).
    pub fn memory(&self) -> &InMemoryNodeInfo {
        &self.memory
    }

    /// What the writer did.
    pub fn stats(&self) -> &CsiInfoStats {
        &self.stats
    }

    /// Waits until every change made so far is stored in the API.
    pub async fn synced(&self) {
        let target = *self.generation.borrow();
        let mut stored = self.stored.subscribe();
        let _ = stored.wait_for(|g| *g >= target).await;
    }

    /// Starts storing the table for node `node_name` once the Node object
    /// exists (`registered` holds its UID), until `shutdown`.
    pub fn start(
        &self,
        client: kube::Client,
        node_name: &str,
        registered: watch::Receiver<Option<String>>,
        supervision: impl Into<super::Supervision>,
    ) {
        let writer = Writer {
            nodes: Api::all(client.clone()),
            csi_nodes: Api::all(client),
            node_name: node_name.to_owned(),
            info: self.clone(),
            registered,
        };
        supervision.into().spawn("cluster-csi-node-info", move || writer.clone().run());
    }

    fn bump(&self) {
        self.generation.send_modify(|g| *g += 1);
    }
}

#[async_trait]
impl NodeInfoPublisher for ApiNodeInfo {
    async fn add_driver(&self, driver: CsiNodeDriver) -> Result<(), PublishError> {
        self.memory.add_driver(driver).await?;
        self.bump();
        Ok(())
    }

    async fn remove_driver(&self, name: &str) {
        self.memory.remove_driver(name).await;
        self.bump();
    }
}

#[derive(Clone)]
struct Writer {
    nodes: Api<Node>,
    csi_nodes: Api<CSINode>,
    node_name: String,
    info: ApiNodeInfo,
    registered: watch::Receiver<Option<String>>,
}

/// Why one store attempt stopped.
enum Failure {
    /// Someone else changed the CSINode: read it again at once.
    Conflict,
    /// Anything else: back off.
    Error(String),
}

impl Writer {
    async fn run(mut self) {
        let mut generations = self.info.generation.subscribe();
        let mut backoff = RetryBackoff::new(Duration::from_millis(200), Duration::from_secs(10));
        // The annotation and labels last written to this Node object.
        let mut written_node: Option<(String, NodeCsiInfo)> = None;
        loop {
            let Ok(uid) = self.registered.wait_for(Option::is_some).await.map(|uid| uid.clone().unwrap_or_default())
            else {
                return;
            };
            let generation = *generations.borrow_and_update();
            let info = self.info.memory.snapshot();
            match self.store(&uid, &info, &mut written_node).await {
                Ok(()) => {
                    backoff.reset();
                    self.info.stats.stored.fetch_add(1, Ordering::Relaxed);
                    self.info.stored.send_replace(generation);
                    tokio::select! {
                        changed = generations.changed() => if changed.is_err() { return },
                        changed = self.registered.changed() => if changed.is_err() { return },
                    }
                }
                Err(Failure::Conflict) => {
                    self.info.stats.conflicts.fetch_add(1, Ordering::Relaxed);
                }
                Err(Failure::Error(error)) => {
                    self.info.stats.failures.fetch_add(1, Ordering::Relaxed);
                    let delay = backoff.next_delay();
                    tracing::warn!(node = %self.node_name, %error, retry_in = ?delay, "cannot store CSI node info; retrying");
                    tokio::time::sleep(delay).await;
                }
            }
        }
    }

    async fn store(
        &self,
        node_uid: &str,
        info: &NodeCsiInfo,
        written_node: &mut Option<(String, NodeCsiInfo)>,
    ) -> Result<(), Failure> {
        let node_part = NodeCsiInfo { drivers: Vec::new(), ..info.clone() };
        let fresh = written_node.as_ref().is_none_or(|(uid, written)| uid != node_uid || *written != node_part);
        if fresh {
            let annotation = info.annotations.get(CSI_NODE_ID_ANNOTATION).map_or(serde_json::Value::Null, |v| json!(v));
            let patch = json!({"metadata": {
                "annotations": {CSI_NODE_ID_ANNOTATION: annotation},
                "labels": info.labels,
            }});
            self.nodes
                .patch(&self.node_name, &super::patch_params(), &Patch::Merge(&patch))
                .await
                .map_err(|e| Failure::Error(format!("node {}: {}", self.node_name, describe(&e))))?;
            *written_node = Some((node_uid.to_owned(), node_part));
        }
        self.store_csi_node(node_uid, &info.drivers).await
    }

    async fn store_csi_node(&self, node_uid: &str, drivers: &[CsiNodeDriver]) -> Result<(), Failure> {
        let error = |e: kube::Error| match &e {
            kube::Error::Api(status) if status.code == 409 => Failure::Conflict,
            _ => Failure::Error(format!("CSINode {}: {}", self.node_name, describe(&e))),
        };
        let owner = OwnerReference {
            api_version: "v1".into(),
            kind: "Node".into(),
            name: self.node_name.clone(),
            uid: node_uid.to_owned(),
            ..OwnerReference::default()
        };
        let spec = CSINodeSpec { drivers: drivers.iter().map(csi_node_driver).collect() };
        match self.csi_nodes.get_opt(&self.node_name).await.map_err(error)? {
            None => {
                let object = CSINode {
                    metadata: ObjectMeta {
                        name: Some(self.node_name.clone()),
                        owner_references: Some(vec![owner]),
                        ..ObjectMeta::default()
                    },
                    spec,
                };
                self.csi_nodes.create(&super::post_params(), &object).await.map_err(error)?;
            }
            Some(mut object) => {
                let owners = object.metadata.owner_references.get_or_insert_with(Vec::new);
                let owned = owners.iter().any(|o| o.kind == "Node" && o.uid == node_uid);
                if object.spec == spec && owned {
                    return Ok(());
                }
                if !owned {
                    owners.retain(|o| o.kind != "Node");
                    owners.push(owner);
                }
                object.spec = spec;
                // The resourceVersion read above is the precondition.
                self.csi_nodes.replace(&self.node_name, &super::post_params(), &object).await.map_err(error)?;
            }
        }
        Ok(())
    }
}

fn csi_node_driver(driver: &CsiNodeDriver) -> CSINodeDriver {
    CSINodeDriver {
        name: driver.name.clone(),
        node_id: driver.node_id.clone(),
        topology_keys: (!driver.topology_keys.is_empty()).then(|| driver.topology_keys.clone()),
        allocatable: driver.allocatable_count.map(|count| VolumeNodeResources { count: Some(count as i32) }),
    }
}
