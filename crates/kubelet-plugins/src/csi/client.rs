//! Calls the node agent makes to a CSI driver, converted to our own types.
//! Generated CSI types do not leave this file.

use std::collections::BTreeMap;
use std::time::Duration;

use kubelet_api::csi::v1::NodeGetInfoRequest;
use kubelet_api::csi::v1::node_client::NodeClient;
use kubelet_api::uds;

use super::error::CsiClientError;

/// What a driver says about this node (`NodeGetInfoResponse`).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CsiNodeInfo {
    /// The driver's ID for this node.
    pub node_id: String,
    /// Most volumes the driver can publish on this node; `None` for no limit.
    pub max_volumes_per_node: Option<i64>,
    /// Topology segments this node is in, by key.
    pub accessible_topology: BTreeMap<String, String>,
}

/// Dials `endpoint` and calls `NodeGetInfo`, each step within `timeout`.
pub async fn node_get_info(endpoint: &str, timeout: Duration) -> Result<CsiNodeInfo, CsiClientError> {
    const RPC: &str = "NodeGetInfo";
    let path = uds::socket_path_of(endpoint).to_path_buf();
    let channel = uds::dial(&path, timeout).await?;
    let mut client = NodeClient::new(channel);
    let call = client.node_get_info(NodeGetInfoRequest {});
    let response = match tokio::time::timeout(timeout, call).await {
        Ok(Ok(response)) => response.into_inner(),
        Ok(Err(status)) => return Err(CsiClientError::Rpc { rpc: RPC, endpoint: path, status }),
        Err(_) => return Err(CsiClientError::Timeout { rpc: RPC, endpoint: path, timeout }),
    };
    if response.node_id.is_empty() {
        return Err(CsiClientError::Invalid { rpc: RPC, endpoint: path, reason: "node_id is empty".into() });
    }
    if response.max_volumes_per_node < 0 {
        return Err(CsiClientError::Invalid {
            rpc: RPC,
            endpoint: path,
            reason: format!("max_volumes_per_node is negative ({})", response.max_volumes_per_node),
        });
    }
    Ok(CsiNodeInfo {
        node_id: response.node_id,
        max_volumes_per_node: (response.max_volumes_per_node > 0).then_some(response.max_volumes_per_node),
        accessible_topology: response.accessible_topology.map(|t| t.segments.into_iter().collect()).unwrap_or_default(),
    })
}
