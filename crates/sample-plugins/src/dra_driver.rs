//! A sample DRA driver: a `DRAPlugin` kubelet plugin (v1 and v1beta1) with
//! its registration socket, as a real driver built on upstream's helper
//! lays them out.
//!
//! - Registration socket `<plugins_registry>/<driver>-<instance>-reg.sock`,
//!   service endpoint `<plugins>/<driver>/dra-<instance>.sock`: each
//!   instance has its own pair, so two instances of one driver run side by
//!   side during an upgrade (seamless upgrade).
//! - Devices: a fixed list. A CDI spec file for them is written at start
//!   (`<cdi_dir>/<driver>.json`, kind `<driver>/device`); each device's edit
//!   sets `DRA_DEVICE_<NAME>=<name>` in the container.
//! - With an API client ([`DraDriver::with_client`], the node's identity):
//!   its devices are published as a ResourceSlice of the node
//!   (`<pool>-<driver>`), recreated whenever it is deleted (the node wipes
//!   its slices at start), and `NodePrepareResources` prepares the devices
//!   the scheduler allocated to the claim (its `status.allocation`).
//! - Without one, `NodePrepareResources` gives each new claim the first
//!   device no other prepared claim holds. Either way it answers the CDI
//!   IDs, and a claim prepared again gets the same devices. The prepared claims are kept in
//!   `<plugins>/<driver>/prepared.json`, which every instance shares, so an
//!   upgraded instance knows what the older one prepared.
//!   `NodeUnprepareResources` releases them.
//! - Every answer is reported ([`Report::DraPrepare`],
//!   [`Report::DraUnprepare`]).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use kubelet_api::constants::{DRA_PLUGIN_TYPE, DRA_PLUGIN_VERSIONS};
use kubelet_api::dra::{v1, v1beta1};
use prost::Message;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::registration::{Behaviour, Identity, RegistrationPlugin};
use crate::report::{Report, Reporter};

use futures_util::StreamExt as _;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::{Api, PostParams};
use kube::api::{ApiResource, DynamicObject};
use kube::runtime::watcher;
use kubelet_api::resource::{self as resource_api, ResourceVersion};

/// A driver instance's settings.
#[derive(Clone, Debug)]
pub struct DraDriverConfig {
    /// The driver's name (a DNS subdomain, e.g. `gpu.example.com`).
    pub driver: String,
    /// This instance's name, unique among the driver's instances.
    pub instance: String,
    /// The node's `plugins_registry` directory.
    pub registry_dir: PathBuf,
    /// The node's `plugins` directory (the endpoint goes under
    /// `<plugins>/<driver>/`).
    pub plugins_dir: PathBuf,
    /// Where the CDI spec file goes.
    pub cdi_dir: PathBuf,
    /// The pool the devices are in (the node's name, as in its
    /// ResourceSlices).
    pub pool: String,
    /// The device names.
    pub devices: Vec<String>,
    /// The versions announced, in order of preference.
    pub versions: Vec<String>,
}

impl DraDriverConfig {
    /// A driver `driver` instance `instance` on the node whose root dir is
    /// `root_dir`, with `devices`, announcing both versions (v1 first).
    pub fn new(driver: &str, instance: &str, root_dir: &Path, pool: &str, devices: Vec<String>) -> Self {
        DraDriverConfig {
            driver: driver.to_owned(),
            instance: instance.to_owned(),
            registry_dir: root_dir.join(kubelet_api::constants::PLUGINS_REGISTRY_DIR),
            plugins_dir: root_dir.join(kubelet_api::constants::PLUGINS_DIR),
            cdi_dir: root_dir.join("cdi"),
            pool: pool.to_owned(),
            devices,
            versions: DRA_PLUGIN_VERSIONS.iter().map(|v| (*v).to_owned()).collect(),
        }
    }

    /// The registration socket.
    pub(crate) fn registration_socket(&self) -> PathBuf {
        self.registry_dir.join(format!("{}-{}-reg.sock", self.driver, self.instance))
    }

    /// The `DRAPlugin` endpoint.
    pub(crate) fn endpoint(&self) -> PathBuf {
        self.plugins_dir.join(&self.driver).join(format!("dra-{}.sock", self.instance))
    }

    /// The CDI kind of the devices (`<driver>/device`).
    pub(crate) fn cdi_kind(&self) -> String {
        format!("{}/device", self.driver)
    }

    /// The CDI ID of `device`.
    pub(crate) fn cdi_id(&self, device: &str) -> String {
        format!("{}={device}", self.cdi_kind())
    }

    fn state_file(&self) -> PathBuf {
        self.plugins_dir.join(&self.driver).join("prepared.json")
    }
}

/// A running driver instance.
#[derive(Clone)]
pub struct DraDriver {
    config: Arc<DraDriverConfig>,
    /// Serializes the state file's read-modify-write within this process.
    lock: Arc<tokio::sync::Mutex<()>>,
    reporter: Reporter,
    client: Option<kube::Client>,
    /// The `resource.k8s.io` version the server serves, asked once.
    served: Arc<tokio::sync::OnceCell<ResourceVersion>>,
}

/// Claim UID → its devices.
type Prepared = BTreeMap<String, Vec<String>>;

impl DraDriver {
    /// A driver instance with `config`, reporting to `reporter`.
    pub fn new(config: DraDriverConfig, reporter: Reporter) -> Self {
        DraDriver { config: Arc::new(config), lock: Arc::default(), reporter, client: None, served: Arc::default() }
    }

    /// Publishes the devices as a ResourceSlice and prepares what the
    /// claims' allocations say, with `client` (the node's identity).
    pub fn with_client(mut self, client: kube::Client) -> Self {
        self.client = Some(client);
        self
    }

    /// The name of the ResourceSlice this driver publishes.
    pub(crate) fn slice_name(&self) -> String {
        format!("{}-{}", self.config.pool, self.config.driver).to_lowercase()
    }

    /// Keeps the ResourceSlice of the devices in the API until `shutdown`:
    /// created when absent at the start of each watch, and again whenever
    /// it is deleted.
    async fn keep_slice(self, client: kube::Client, shutdown: CancellationToken) {
        let version = tokio::select! {
            () = shutdown.cancelled() => return,
            version = self.served_version(&client) => version,
        };
        let api: Api<DynamicObject> = Api::all_with(client, &resource(version, "ResourceSlice", "resourceslices"));
        let name = self.slice_name();
        let devices: Vec<serde_json::Value> =
            self.config.devices.iter().map(|d| serde_json::json!({"name": d})).collect();
        let mut slice = serde_json::json!({
            "apiVersion": ResourceVersion::V1.api_version(), "kind": "ResourceSlice",
            "metadata": {"name": name},
            "spec": {
                "driver": self.config.driver,
                "pool": {"name": self.config.pool, "generation": 1, "resourceSliceCount": 1},
                "nodeName": self.config.pool,
                "devices": devices,
            },
        });
        resource_api::from_hub(&mut slice, version);
        let slice: DynamicObject = match serde_json::from_value(slice) {
            Ok(slice) => slice,
            Err(error) => {
                tracing::error!(%error, "cannot build the ResourceSlice");
                return;
            }
        };
        let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
        let mut events = watcher(api.clone(), config).boxed();
        let mut present = false;
        loop {
            let event = tokio::select! {
                () = shutdown.cancelled() => return,
                event = events.next() => event,
            };
            let publish = match event {
                None => return,
                Some(Ok(watcher::Event::Init)) => {
                    present = false;
                    false
                }
                Some(Ok(watcher::Event::InitApply(_) | watcher::Event::Apply(_))) => {
                    present = true;
                    false
                }
                Some(Ok(watcher::Event::InitDone)) => !present,
                Some(Ok(watcher::Event::Delete(_))) => {
                    present = false;
                    true
                }
                Some(Err(error)) => {
                    tracing::warn!(%error, "ResourceSlice watch failed; resuming");
                    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
                    false
                }
            };
            if publish {
                match api.create(&PostParams::default(), &slice).await {
                    Ok(_) => self
                        .reporter
                        .report(Report::SlicePublished { instance: self.config.instance.clone(), name: name.clone() }),
                    Err(kube::Error::Api(status)) if status.code == 409 => {}
                    Err(error) => tracing::warn!(%error, slice = %name, "cannot publish the ResourceSlice"),
                }
            }
        }
    }

    /// The devices of this driver and pool allocated to the claim.
    async fn allocated(&self, client: &kube::Client, claim: &v1::Claim) -> Result<Vec<String>, String> {
        let version = self.served_version(client).await;
        let api: Api<DynamicObject> = Api::namespaced_with(
            client.clone(),
            &claim.namespace,
            &resource(version, "ResourceClaim", "resourceclaims"),
        );
        let object = api
            .get(&claim.name)
            .await
            .map_err(|e| format!("reading ResourceClaim {}/{} ({version}): {e}", claim.namespace, claim.name))?;
        let mut object = serde_json::to_value(object).map_err(|e| e.to_string())?;
        object["apiVersion"] = version.api_version().into();
        object["kind"] = "ResourceClaim".into();
        resource_api::to_hub(&mut object);
        let object: ResourceClaim = serde_json::from_value(object)
            .map_err(|e| format!("ResourceClaim {}/{} is malformed: {e}", claim.namespace, claim.name))?;
        if object.metadata.uid.as_deref() != Some(claim.uid.as_str()) {
            return Err(format!(
                "ResourceClaim {}/{} is not the claim with UID {}",
                claim.namespace, claim.name, claim.uid
            ));
        }
        let devices: Vec<String> = object
            .status
            .and_then(|s| s.allocation)
            .and_then(|a| a.devices)
            .and_then(|d| d.results)
            .unwrap_or_default()
            .into_iter()
            .filter(|r| r.driver == self.config.driver && r.pool == self.config.pool)
            .map(|r| r.device)
            .collect();
        if devices.is_empty() {
            return Err(format!(
                "ResourceClaim {}/{} has no device of driver {} allocated in pool {}",
                claim.namespace, claim.name, self.config.driver, self.config.pool
            ));
        }
        Ok(devices)
    }

    /// Writes the CDI spec, binds the endpoint, then the registration
    /// socket (so the node finds the service ready), and serves both until
    /// `shutdown`.
    pub fn spawn(self, shutdown: CancellationToken) -> std::io::Result<tokio::task::JoinHandle<()>> {
        self.write_cdi_spec()?;
        let endpoint = self.config.endpoint();
        let listener = kubelet_api::uds::bind(&endpoint).map_err(std::io::Error::other)?;
        let identity = Identity {
            plugin_type: DRA_PLUGIN_TYPE.to_owned(),
            name: self.config.driver.clone(),
            endpoint: endpoint.display().to_string(),
            versions: self.config.versions.clone(),
        };
        let registration = RegistrationPlugin::new(
            self.config.registration_socket(),
            identity,
            Behaviour::Normal,
            self.reporter.clone(),
        )
        .spawn(shutdown.clone())?;
        if let Some(client) = self.client.clone() {
            // Not supervised: a sample driver's ResourceSlice loop, until its shutdown.
            tokio::spawn(self.clone().keep_slice(client, shutdown.clone()));
        }
        let driver = self.clone();
        // Not supervised: a sample plugin's server, returned to its caller (a plugin process or a test).
        Ok(tokio::spawn(async move {
            let router = tonic::transport::Server::builder()
                .add_service(v1::dra_plugin_server::DraPluginServer::new(driver.clone()))
                .add_service(v1beta1::dra_plugin_server::DraPluginServer::new(driver));
            if let Err(error) = kubelet_api::uds::serve(router, listener, shutdown.cancelled_owned()).await {
                tracing::warn!(endpoint = %endpoint.display(), %error, "DRA driver stopped");
            }
            let _ = registration.await;
        }))
    }

    fn write_cdi_spec(&self) -> std::io::Result<()> {
        std::fs::create_dir_all(&self.config.cdi_dir)?;
        let devices: Vec<serde_json::Value> = self
            .config
            .devices
            .iter()
            .map(|d| {
                let variable: String =
                    d.chars().map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_uppercase() } else { '_' }).collect();
                serde_json::json!({"name": d, "containerEdits": {"env": [format!("DRA_DEVICE_{variable}={d}")]}})
            })
            .collect();
        let spec = serde_json::json!({"cdiVersion": "0.6.0", "kind": self.config.cdi_kind(), "devices": devices});
        let path = self.config.cdi_dir.join(format!("{}.json", self.config.driver));
        let temporary = path.with_extension("json.tmp");
        std::fs::write(&temporary, serde_json::to_vec_pretty(&spec).unwrap_or_default())?;
        std::fs::rename(temporary, path)
    }

    fn load(&self) -> Prepared {
        std::fs::read(self.config.state_file()).ok().and_then(|b| serde_json::from_slice(&b).ok()).unwrap_or_default()
    }

    fn store(&self, prepared: &Prepared) -> Result<(), Status> {
        let path = self.config.state_file();
        let temporary = path.with_extension("json.tmp");
        std::fs::write(&temporary, serde_json::to_vec(prepared).unwrap_or_default())
            .and_then(|()| std::fs::rename(&temporary, &path))
            .map_err(|e| Status::internal(format!("cannot record prepared claims in {}: {e}", path.display())))
    }

    async fn prepare(
        &self,
        request: v1::NodePrepareResourcesRequest,
    ) -> Result<v1::NodePrepareResourcesResponse, Status> {
        let _guard = self.lock.lock().await;
        let mut prepared = self.load();
        let mut answer = v1::NodePrepareResourcesResponse::default();
        let mut report = Vec::new();
        for claim in request.claims {
            let devices = match (prepared.get(&claim.uid), &self.client) {
                (Some(devices), _) => Ok(devices.clone()),
                (None, Some(client)) => {
                    let allocated = self.allocated(client, &claim).await;
                    if let Ok(devices) = &allocated {
                        prepared.insert(claim.uid.clone(), devices.clone());
                    }
                    allocated
                }
                (None, None) => {
                    let held: Vec<&String> = prepared.values().flatten().collect();
                    match self.config.devices.iter().find(|d| !held.contains(d)) {
                        Some(free) => {
                            let devices = vec![free.clone()];
                            prepared.insert(claim.uid.clone(), devices.clone());
                            Ok(devices)
                        }
                        None => Err(format!(
                            "no free device of driver {} for ResourceClaim {}/{}",
                            self.config.driver, claim.namespace, claim.name
                        )),
                    }
                }
            };
            let entry = match &devices {
                Ok(devices) => v1::NodePrepareResourceResponse {
                    devices: devices
                        .iter()
                        .map(|d| v1::Device {
                            request_names: Vec::new(),
                            pool_name: self.config.pool.clone(),
                            device_name: d.clone(),
                            cdi_device_ids: vec![self.config.cdi_id(d)],
                        })
                        .collect(),
                    error: String::new(),
                },
                Err(error) => v1::NodePrepareResourceResponse { devices: Vec::new(), error: error.clone() },
            };
            answer.claims.insert(claim.uid.clone(), entry);
            report.push((claim.uid, devices));
        }
        self.store(&prepared)?;
        self.reporter.report(Report::DraPrepare { instance: self.config.instance.clone(), claims: report });
        Ok(answer)
    }

    async fn unprepare(
        &self,
        request: v1::NodeUnprepareResourcesRequest,
    ) -> Result<v1::NodeUnprepareResourcesResponse, Status> {
        let _guard = self.lock.lock().await;
        let mut prepared = self.load();
        let mut answer = v1::NodeUnprepareResourcesResponse::default();
        let mut released = Vec::new();
        for claim in request.claims {
            prepared.remove(&claim.uid);
            answer.claims.insert(claim.uid.clone(), v1::NodeUnprepareResourceResponse { error: String::new() });
            released.push(claim.uid);
        }
        self.store(&prepared)?;
        self.reporter.report(Report::DraUnprepare { instance: self.config.instance.clone(), claims: released });
        Ok(answer)
    }
}

/// One version's message as the other's (the same on the wire).
fn convert<A: Message, B: Message + Default>(from: &A) -> B {
    B::decode(from.encode_to_vec().as_slice()).unwrap_or_default()
}

#[tonic::async_trait]
impl v1::dra_plugin_server::DraPlugin for DraDriver {
    async fn node_prepare_resources(
        &self,
        request: Request<v1::NodePrepareResourcesRequest>,
    ) -> Result<Response<v1::NodePrepareResourcesResponse>, Status> {
        self.prepare(request.into_inner()).await.map(Response::new)
    }

    async fn node_unprepare_resources(
        &self,
        request: Request<v1::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<v1::NodeUnprepareResourcesResponse>, Status> {
        self.unprepare(request.into_inner()).await.map(Response::new)
    }
}

#[tonic::async_trait]
impl v1beta1::dra_plugin_server::DraPlugin for DraDriver {
    async fn node_prepare_resources(
        &self,
        request: Request<v1beta1::NodePrepareResourcesRequest>,
    ) -> Result<Response<v1beta1::NodePrepareResourcesResponse>, Status> {
        self.prepare(convert(&request.into_inner())).await.map(|a| Response::new(convert(&a)))
    }

    async fn node_unprepare_resources(
        &self,
        request: Request<v1beta1::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<v1beta1::NodeUnprepareResourcesResponse>, Status> {
        self.unprepare(convert(&request.into_inner())).await.map(|a| Response::new(convert(&a)))
    }
}

impl DraDriver {
    /// The newest version of `resource.k8s.io` the server serves slices
    /// at, asked once (`v1` when discovery says nothing better: the
    /// request then tells).
    async fn served_version(&self, client: &kube::Client) -> ResourceVersion {
        *self
            .served
            .get_or_init(|| async {
                for version in ResourceVersion::PREFERENCE {
                    if let Ok(list) = client.list_api_group_resources(version.api_version()).await
                        && list.resources.iter().any(|r| r.name == "resourceslices")
                    {
                        return version;
                    }
                }
                ResourceVersion::V1
            })
            .await
    }
}

/// `kind`/`plural` of `resource.k8s.io` at `version`.
fn resource(version: ResourceVersion, kind: &str, plural: &str) -> ApiResource {
    ApiResource {
        group: resource_api::GROUP.into(),
        version: version.as_str().into(),
        api_version: version.api_version().into(),
        kind: kind.into(),
        plural: plural.into(),
    }
}
