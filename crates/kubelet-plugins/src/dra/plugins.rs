//! The DRA drivers registered on this node, their instances and their
//! connections; the `DRAPlugin` registration handler; the calls.

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use kubelet_api::constants::DRA_PLUGIN_VERSIONS;
use kubelet_api::dra::{v1, v1beta1};
use kubelet_api::uds::{self, UdsChannel};
use prost::Message;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::plugin_manager::{HandlerError, PluginHandler, PluginInfo};
use crate::retry::RetryBackoff;

/// A `DRAPlugin` API version the node serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum DraVersion {
    /// `v1.DRAPlugin` (`k8s.io.kubelet.pkg.apis.dra.v1`).
    #[serde(rename = "v1.DRAPlugin")]
    V1,
    /// `v1beta1.DRAPlugin` (`k8s.io.kubelet.pkg.apis.dra.v1beta1`).
    #[serde(rename = "v1beta1.DRAPlugin")]
    V1beta1,
}

impl DraVersion {
    /// The version string of plugin registration.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            DraVersion::V1 => DRA_PLUGIN_VERSIONS[0],
            DraVersion::V1beta1 => DRA_PLUGIN_VERSIONS[1],
        }
    }

    /// The first entry of `offered` (the plugin's order of preference) the
    /// node serves; `None` when there is none.
    pub(crate) fn choose(offered: &[String]) -> Option<DraVersion> {
        offered.iter().find_map(|v| match v.as_str() {
            "v1.DRAPlugin" => Some(DraVersion::V1),
            "v1beta1.DRAPlugin" => Some(DraVersion::V1beta1),
            _ => None,
        })
    }
}

impl fmt::Display for DraVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Settings of the DRA plugin handler.
#[derive(Clone, Copy, Debug)]
pub struct DraConfig {
    /// Deadline of each `NodePrepareResources`/`NodeUnprepareResources`
    /// call (upstream: 45 s).
    pub call_timeout: Duration,
    /// Deadline of one dial of an instance's endpoint.
    pub dial_timeout: Duration,
    /// First and longest wait between dials of an instance that is gone.
    pub reconnect: (Duration, Duration),
}

impl Default for DraConfig {
    fn default() -> Self {
        DraConfig {
            call_timeout: Duration::from_secs(45),
            dial_timeout: Duration::from_secs(5),
            reconnect: (Duration::from_millis(100), Duration::from_secs(5)),
        }
    }
}

/// Why a DRA registration or call failed.
#[derive(Debug, thiserror::Error)]
pub enum DraError {
    /// The plugin listed no versions.
    #[error(
        "invalid supported gRPC versions of DRA driver plugin {driver} at endpoint {endpoint}: empty list of supported gRPC services (aka supported versions)"
    )]
    NoVersions {
        /// The driver.
        driver: String,
        /// Its endpoint.
        endpoint: String,
    },
    /// None of the plugin's versions is one the node serves.
    #[error(
        "invalid supported gRPC versions of DRA driver plugin {driver} at endpoint {endpoint}: none of services supported by the plugin ({offered:?}) are supported by the node ({served:?}){hint}"
    )]
    Unsupported {
        /// Advice when the list is an older API's.
        hint: &'static str,
        /// The driver.
        driver: String,
        /// Its endpoint.
        endpoint: String,
        /// What the plugin offered.
        offered: Vec<String>,
        /// What the node serves.
        served: Vec<String>,
    },
    /// The endpoint is registered for the driver already.
    #[error("endpoint {endpoint} already registered for DRA driver plugin {driver}")]
    AlreadyRegistered {
        /// The driver.
        driver: String,
        /// The endpoint.
        endpoint: String,
    },
    /// No instance of the driver is registered.
    #[error("DRA driver {0} is not registered")]
    NotRegistered(String),
    /// A call failed (transport or gRPC status).
    #[error("DRA driver {driver}: {call} at {endpoint}: {reason}")]
    Call {
        /// The driver.
        driver: String,
        /// The RPC.
        call: &'static str,
        /// The instance's endpoint.
        endpoint: String,
        /// What failed.
        reason: String,
    },
    /// A call did not answer within the deadline.
    #[error("DRA driver {driver}: {call} at {endpoint} did not answer within {timeout:?}")]
    Timeout {
        /// The driver.
        driver: String,
        /// The RPC.
        call: &'static str,
        /// The instance's endpoint.
        endpoint: String,
        /// The deadline.
        timeout: Duration,
    },
}

/// One registered instance of a driver, as the node sees it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DraInstance {
    /// The driver's name.
    pub driver: String,
    /// The endpoint of its `DRAPlugin` service.
    pub endpoint: String,
    /// The registration socket it came through.
    pub socket_path: PathBuf,
    /// The version chosen at registration.
    pub version: DraVersion,
    /// Registration order across all instances (higher: more recent).
    pub registered: u64,
    /// Whether its connection is up.
    pub connected: bool,
}

/// A claim as the driver is told about it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub struct ClaimRef {
    /// The ResourceClaim's namespace.
    pub namespace: String,
    /// Its UID.
    pub uid: String,
    /// Its name.
    pub name: String,
}

/// A device the driver prepared for a claim.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PreparedDevice {
    /// The claim's requests it serves (empty: all of them).
    pub request_names: Vec<String>,
    /// Its pool.
    pub pool: String,
    /// Its name in the pool.
    pub device: String,
    /// CDI device IDs for the containers using it.
    pub cdi_device_ids: Vec<String>,
}

struct Entry {
    instance: DraInstance,
    channel: Option<UdsChannel>,
    stop: CancellationToken,
}

struct Inner {
    config: DraConfig,
    /// Per driver, its instances in registration order.
    drivers: Mutex<BTreeMap<String, Vec<Entry>>>,
    sequence: AtomicU64,
    changes: watch::Sender<u64>,
    shutdown: CancellationToken,
    metrics: super::metrics::DraMetrics,
}

/// The DRA drivers of this node. Cheap to clone; clones share one registry.
#[derive(Clone)]
pub struct DraDrivers {
    inner: Arc<Inner>,
}

impl DraDrivers {
    /// An empty registry; the connection watchers stop with `shutdown`.
    pub fn new(config: DraConfig, shutdown: CancellationToken) -> Self {
        DraDrivers {
            inner: Arc::new(Inner {
                config,
                drivers: Mutex::default(),
                sequence: AtomicU64::new(0),
                changes: watch::channel(0).0,
                shutdown,
                metrics: super::metrics::DraMetrics::default(),
            }),
        }
    }

    /// Adds DRA's metrics to `registry` (upstream's
    /// `dra_operations_duration_seconds` and
    /// `dra_grpc_operations_duration_seconds`).
    pub fn register_metrics(&self, registry: &mut prometheus_client::registry::Registry) {
        self.inner.metrics.register(registry);
    }

    pub(crate) fn metrics(&self) -> &super::metrics::DraMetrics {
        &self.inner.metrics
    }

    /// The `DRAPlugin` registration handler writing this registry.
    pub fn plugin_handler(&self) -> DraPluginHandler {
        DraPluginHandler { drivers: self.clone() }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Vec<Entry>>> {
        // Critical sections are map operations without await or panic.
        self.inner.drivers.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn changed(&self) {
        self.inner.changes.send_modify(|n| *n += 1);
    }

    /// Every registered instance, by driver, in registration order.
    pub fn list(&self) -> Vec<DraInstance> {
        self.lock().values().flatten().map(|e| e.instance.clone()).collect()
    }

    /// Whether an instance of `driver` is connected.
    pub fn usable(&self, driver: &str) -> bool {
        self.lock().get(driver).is_some_and(|entries| entries.iter().any(|e| e.instance.connected))
    }

    /// A counter bumped on every registration, removal and connection
    /// change.
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.inner.changes.subscribe()
    }

    /// Waits until `ready` holds for the instances (checked on every
    /// change), at most `timeout`; whether it held.
    pub async fn wait_until(&self, timeout: Duration, ready: impl Fn(&[DraInstance]) -> bool) -> bool {
        let mut changes = self.changes();
        let wait = async {
            loop {
                if ready(&self.list()) {
                    return true;
                }
                if changes.changed().await.is_err() {
                    return false;
                }
            }
        };
        tokio::time::timeout(timeout, wait).await.unwrap_or(false)
    }

    fn check_new(&self, plugin: &PluginInfo) -> Result<DraVersion, DraError> {
        if plugin.supported_versions.is_empty() {
            return Err(DraError::NoVersions { driver: plugin.name.clone(), endpoint: plugin.endpoint.clone() });
        }
        let older = plugin
            .supported_versions
            .iter()
            .any(|v| v == "1.0.0" || v.starts_with("v1alpha") && v.ends_with("NodeService"));
        let version = DraVersion::choose(&plugin.supported_versions).ok_or_else(|| DraError::Unsupported {
            hint: if older {
                "; this is a driver of an older DRA API (Kubernetes 1.26-1.31: \"1.0.0\" or v1alpha3/v1alpha4 NodeService), which the node does not serve: upgrade the driver to the v1 or v1beta1 DRAPlugin service"
            } else {
                ""
            },
            driver: plugin.name.clone(),
            endpoint: plugin.endpoint.clone(),
            offered: plugin.supported_versions.clone(),
            served: DRA_PLUGIN_VERSIONS.iter().map(|v| (*v).to_owned()).collect(),
        })?;
        let taken = self
            .lock()
            .get(&plugin.name)
            .is_some_and(|entries| entries.iter().any(|e| e.instance.endpoint == plugin.endpoint));
        if taken {
            return Err(DraError::AlreadyRegistered { driver: plugin.name.clone(), endpoint: plugin.endpoint.clone() });
        }
        Ok(version)
    }

    fn insert(&self, plugin: &PluginInfo) -> Result<(), DraError> {
        let version = self.check_new(plugin)?;
        let stop = self.inner.shutdown.child_token();
        let (instance, instances) = {
            let mut drivers = self.lock();
            // Numbered under the lock: registration order and the order of
            // the driver's list agree.
            let instance = DraInstance {
                driver: plugin.name.clone(),
                endpoint: plugin.endpoint.clone(),
                socket_path: plugin.socket_path.clone(),
                version,
                registered: self.inner.sequence.fetch_add(1, Ordering::Relaxed) + 1,
                connected: false,
            };
            let entries = drivers.entry(plugin.name.clone()).or_default();
            // A racing registration of the same endpoint lost to this one.
            if entries.iter().any(|e| e.instance.endpoint == plugin.endpoint) {
                return Err(DraError::AlreadyRegistered {
                    driver: plugin.name.clone(),
                    endpoint: plugin.endpoint.clone(),
                });
            }
            entries.push(Entry { instance: instance.clone(), channel: None, stop: stop.clone() });
            (instance, entries.len())
        };
        tracing::info!(driver = %plugin.name, endpoint = %plugin.endpoint, %version, instances, "DRA driver instance registered");
        self.changed();
        let drivers = self.clone();
        // Not supervised: lives as long as one driver instance's connection.
        tokio::spawn(async move { drivers.watch_connection(instance, stop).await });
        Ok(())
    }

    fn remove(&self, driver: &str, endpoint: &str) {
        let left = {
            let mut drivers = self.lock();
            let Some(entries) = drivers.get_mut(driver) else { return };
            let Some(at) = entries.iter().position(|e| e.instance.endpoint == endpoint) else { return };
            let entry = entries.remove(at);
            entry.stop.cancel();
            let left = entries.len();
            if left == 0 {
                drivers.remove(driver);
            }
            left
        };
        tracing::info!(%driver, %endpoint, instances_left = left, "DRA driver instance deregistered");
        self.changed();
    }

    /// Records the connection state of an instance; false when it is no
    /// longer registered.
    fn set_channel(&self, instance: &DraInstance, channel: Option<UdsChannel>) -> bool {
        let mut drivers = self.lock();
        let Some(entry) = drivers
            .get_mut(&instance.driver)
            .and_then(|entries| entries.iter_mut().find(|e| e.instance.registered == instance.registered))
        else {
            return false;
        };
        entry.instance.connected = channel.is_some();
        entry.channel = channel;
        drop(drivers);
        self.changed();
        true
    }

    /// Holds a connection to the instance open and notices when it ends;
    /// dials again with backoff until the instance is deregistered (or the
    /// node stops: its connection is closed then).
    async fn watch_connection(self, instance: DraInstance, stop: CancellationToken) {
        let (first, longest) = self.inner.config.reconnect;
        let mut backoff = RetryBackoff::new(first, longest);
        let path = uds::socket_path_of(&instance.endpoint).to_path_buf();
        loop {
            let dialed = tokio::select! {
                () = stop.cancelled() => return,
                dialed = uds::dial_watched(&path, self.inner.config.dial_timeout) => dialed,
            };
            match dialed {
                Ok((channel, ended)) => {
                    if !self.set_channel(&instance, Some(channel)) {
                        return;
                    }
                    tracing::info!(driver = %instance.driver, endpoint = %instance.endpoint, "DRA driver instance connected");
                    let connected_at = tokio::time::Instant::now();
                    tokio::select! {
                        () = stop.cancelled() => {
                            self.set_channel(&instance, None);
                            return;
                        }
                        _ = ended => {}
                    }
                    // A connection that lasted starts the backoff afresh; one
                    // that ends at once (an endpoint that accepts and hangs
                    // up) keeps backing off.
                    if connected_at.elapsed() >= longest {
                        backoff = RetryBackoff::new(first, longest);
                    }
                    if !self.set_channel(&instance, None) {
                        return;
                    }
                    tracing::warn!(driver = %instance.driver, endpoint = %instance.endpoint, "DRA driver instance disconnected; dialing it again");
                }
                Err(error) => {
                    tracing::debug!(driver = %instance.driver, %error, "DRA driver instance not reachable");
                }
            }
            let delay = backoff.next_delay();
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(delay) => {}
            }
        }
    }

    /// The instance calls go to: the most recently registered connected
    /// one, else the most recently registered one.
    fn pick(&self, driver: &str) -> Result<(DraInstance, Option<UdsChannel>), DraError> {
        let drivers = self.lock();
        let entries =
            drivers.get(driver).filter(|e| !e.is_empty()).ok_or_else(|| DraError::NotRegistered(driver.to_owned()))?;
        let entry = entries
            .iter()
            .rev()
            .find(|e| e.instance.connected)
            .or_else(|| entries.last())
            .ok_or_else(|| DraError::NotRegistered(driver.to_owned()))?;
        Ok((entry.instance.clone(), entry.channel.clone()))
    }

    async fn channel_for(&self, driver: &str, call: &'static str) -> Result<(DraInstance, UdsChannel), DraError> {
        let (instance, channel) = self.pick(driver)?;
        match channel {
            Some(channel) => Ok((instance, channel)),
            None => {
                let path = uds::socket_path_of(&instance.endpoint).to_path_buf();
                let channel = uds::dial(&path, self.inner.config.dial_timeout).await.map_err(|e| DraError::Call {
                    driver: driver.to_owned(),
                    call,
                    endpoint: instance.endpoint.clone(),
                    reason: e.to_string(),
                })?;
                Ok((instance, channel))
            }
        }
    }

    /// `NodePrepareResources` for `claims`, all of `driver`: per claim UID,
    /// its devices or the driver's reason. Claims the driver left out of
    /// its answer are errors too.
    pub async fn prepare(
        &self,
        driver: &str,
        claims: &[ClaimRef],
    ) -> Result<BTreeMap<String, Result<Vec<PreparedDevice>, String>>, DraError> {
        const CALL: &str = "NodePrepareResources";
        let (instance, channel) = self.channel_for(driver, CALL).await?;
        let request = v1::NodePrepareResourcesRequest { claims: claims.iter().map(wire_claim).collect() };
        let answer: v1::NodePrepareResourcesResponse = self
            .bounded(&instance, CALL, async {
                match instance.version {
                    DraVersion::V1 => v1::dra_plugin_client::DraPluginClient::new(channel)
                        .node_prepare_resources(request)
                        .await
                        .map(tonic::Response::into_inner),
                    DraVersion::V1beta1 => v1beta1::dra_plugin_client::DraPluginClient::new(channel)
                        .node_prepare_resources(convert::<_, v1beta1::NodePrepareResourcesRequest>(&request)?)
                        .await
                        .and_then(|a| convert(&a.into_inner())),
                }
            })
            .await?;
        let mut results = BTreeMap::new();
        let mut answers = answer.claims;
        for claim in claims {
            let result = match answers.remove(&claim.uid) {
                None => Err(format!("NodePrepareResources skipped ResourceClaim {}/{}", claim.namespace, claim.name)),
                Some(one) if !one.error.is_empty() => Err(one.error),
                Some(one) => Ok(one
                    .devices
                    .into_iter()
                    .map(|d| PreparedDevice {
                        request_names: d.request_names,
                        pool: d.pool_name,
                        device: d.device_name,
                        cdi_device_ids: d.cdi_device_ids,
                    })
                    .collect()),
            };
            results.insert(claim.uid.clone(), result);
        }
        for unknown in answers.keys() {
            tracing::warn!(%driver, claim.uid = %unknown, "NodePrepareResources answered for a claim not asked about");
        }
        Ok(results)
    }

    /// `NodeUnprepareResources` for `claims`, all of `driver`: per claim
    /// UID, done or the driver's reason.
    pub async fn unprepare(
        &self,
        driver: &str,
        claims: &[ClaimRef],
    ) -> Result<BTreeMap<String, Result<(), String>>, DraError> {
        const CALL: &str = "NodeUnprepareResources";
        let (instance, channel) = self.channel_for(driver, CALL).await?;
        let request = v1::NodeUnprepareResourcesRequest { claims: claims.iter().map(wire_claim).collect() };
        let answer: v1::NodeUnprepareResourcesResponse = self
            .bounded(&instance, CALL, async {
                match instance.version {
                    DraVersion::V1 => v1::dra_plugin_client::DraPluginClient::new(channel)
                        .node_unprepare_resources(request)
                        .await
                        .map(tonic::Response::into_inner),
                    DraVersion::V1beta1 => v1beta1::dra_plugin_client::DraPluginClient::new(channel)
                        .node_unprepare_resources(convert::<_, v1beta1::NodeUnprepareResourcesRequest>(&request)?)
                        .await
                        .and_then(|a| convert(&a.into_inner())),
                }
            })
            .await?;
        let mut answers = answer.claims;
        Ok(claims
            .iter()
            .map(|claim| {
                let result = match answers.remove(&claim.uid) {
                    None => {
                        Err(format!("NodeUnprepareResources skipped ResourceClaim {}/{}", claim.namespace, claim.name))
                    }
                    Some(one) if !one.error.is_empty() => Err(one.error),
                    Some(_) => Ok(()),
                };
                (claim.uid.clone(), result)
            })
            .collect())
    }

    async fn bounded<T>(
        &self,
        instance: &DraInstance,
        call: &'static str,
        future: impl std::future::Future<Output = Result<T, tonic::Status>>,
    ) -> Result<T, DraError> {
        let timeout = self.inner.config.call_timeout;
        let started = std::time::Instant::now();
        let answer = tokio::time::timeout(timeout, future).await;
        let package = match instance.version {
            DraVersion::V1 => "k8s.io.kubelet.pkg.apis.dra.v1",
            DraVersion::V1beta1 => "k8s.io.kubelet.pkg.apis.dra.v1beta1",
        };
        let code = match &answer {
            Ok(Ok(_)) => Some(tonic::Code::Ok),
            Ok(Err(status)) => Some(status.code()),
            Err(_) => None,
        };
        self.inner.metrics.call(&instance.driver, format!("/{package}.DRAPlugin/{call}"), code, started.elapsed());
        match answer {
            Ok(Ok(answer)) => Ok(answer),
            Ok(Err(status)) => Err(DraError::Call {
                driver: instance.driver.clone(),
                call,
                endpoint: instance.endpoint.clone(),
                reason: format!("{:?}: {}", status.code(), status.message()),
            }),
            Err(_) => Err(DraError::Timeout {
                driver: instance.driver.clone(),
                call,
                endpoint: instance.endpoint.clone(),
                timeout,
            }),
        }
    }
}

fn wire_claim(claim: &ClaimRef) -> v1::Claim {
    v1::Claim { namespace: claim.namespace.clone(), uid: claim.uid.clone(), name: claim.name.clone() }
}

/// One version's message as the other's: the two are the same on the wire.
/// (Bytes one version encoded decode as the other; a failure is reported
/// as the call's, never hidden.)
fn convert<A: Message, B: Message + Default>(from: &A) -> Result<B, tonic::Status> {
    B::decode(from.encode_to_vec().as_slice())
        .map_err(|e| tonic::Status::internal(format!("converting between DRA v1 and v1beta1: {e}")))
}

/// Handles plugins of type `DRAPlugin`: validate chooses the version and
/// refuses an endpoint registered twice; register records the instance and
/// starts watching its connection; deregister forgets that instance only.
pub struct DraPluginHandler {
    drivers: DraDrivers,
}

#[async_trait]
impl PluginHandler for DraPluginHandler {
    async fn validate(&self, plugin: &PluginInfo) -> Result<(), HandlerError> {
        self.drivers.check_new(plugin)?;
        Ok(())
    }

    async fn register(&self, plugin: &PluginInfo) -> Result<(), HandlerError> {
        self.drivers.insert(plugin)?;
        Ok(())
    }

    async fn deregister(&self, plugin: &PluginInfo) {
        self.drivers.remove(&plugin.name, &plugin.endpoint);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn versions(list: &[&str]) -> Vec<String> {
        list.iter().map(|v| (*v).to_owned()).collect()
    }

    fn plugin(endpoint: &str, offered: &[&str]) -> PluginInfo {
        PluginInfo {
            plugin_type: crate::plugin_manager::PluginType::Dra,
            name: "gpu.example.com".into(),
            endpoint: endpoint.into(),
            supported_versions: versions(offered),
            socket_path: PathBuf::from("/r/plugins_registry/gpu-reg.sock"),
        }
    }

    #[tokio::test]
    async fn an_empty_version_list_and_a_second_registration_of_an_endpoint_are_refused() {
        let drivers = DraDrivers::new(DraConfig::default(), CancellationToken::new());
        let empty = drivers.check_new(&plugin("/r/dra-a.sock", &[])).expect_err("no versions");
        assert_eq!(
            empty.to_string(),
            "invalid supported gRPC versions of DRA driver plugin gpu.example.com at endpoint /r/dra-a.sock: empty list of supported gRPC services (aka supported versions)"
        );
        drivers.insert(&plugin("/r/dra-a.sock", &["v1.DRAPlugin"])).expect("first");
        let twice = drivers.insert(&plugin("/r/dra-a.sock", &["v1.DRAPlugin"])).expect_err("same endpoint");
        assert_eq!(
            twice.to_string(),
            "endpoint /r/dra-a.sock already registered for DRA driver plugin gpu.example.com"
        );
        drivers.insert(&plugin("/r/dra-b.sock", &["v1beta1.DRAPlugin"])).expect("another instance");
        let listed = drivers.list();
        assert_eq!(listed.len(), 2);
        assert!(listed[0].registered < listed[1].registered, "{listed:?}");
        drivers.remove("gpu.example.com", "/r/dra-a.sock");
        assert_eq!(drivers.list().len(), 1, "the other instance stays");
    }

    #[test]
    fn the_plugins_first_served_version_is_chosen() {
        assert_eq!(DraVersion::choose(&versions(&["v1beta1.DRAPlugin", "v1.DRAPlugin"])), Some(DraVersion::V1beta1));
        assert_eq!(
            DraVersion::choose(&versions(&["v1alpha1.DRAResourceHealth", "v1.DRAPlugin"])),
            Some(DraVersion::V1)
        );
        assert_eq!(DraVersion::choose(&versions(&["v1alpha3.NodeService", "1.0.0"])), None);
    }

    #[test]
    fn the_versions_are_the_same_on_the_wire() {
        let request = v1::NodePrepareResourcesRequest {
            claims: vec![v1::Claim { namespace: "ns".into(), uid: "u".into(), name: "n".into() }],
        };
        let other: v1beta1::NodePrepareResourcesRequest = convert(&request).expect("same wire format");
        assert_eq!(other.claims[0].uid, "u");
        assert_eq!(other.claims[0].name, "n");
    }
}
