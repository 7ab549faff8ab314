//! DRA and PodResources benchmark: prints figures, asserts nothing about time.
//!
//! In-process: a node in cluster mode on the in-process API server (the
//! v1.28 binaries predate `resource.k8s.io/v1`), the WebAssembly provider
//! running a module that sleeps, and the sample DRA driver on real Unix
//! sockets (it reads each claim's allocation from the API, as real drivers
//! do). Measures:
//! - **claim allocated → container running**: the scheduler's order (pod
//!   created, claim allocated and reserved for it, pod bound); from the bind
//!   to the pod Running in the API, beside the driver's own share (the same
//!   `NodePrepareResources` for a fresh claim, called directly);
//! - **100 claims prepared at once**: 100 pods with a claim each, bound at
//!   once, until all are Running; beside one `NodePrepareResources` batch of
//!   100 claims called directly;
//! - **PodResources `List` with 500 pods**: latency of one `List` on the
//!   node's socket, paced under the API's rate limit (100 per second).
//!
//! Run: `cargo bench -p rustlet --bench dra` (`RUSTLET_BENCH_QUICK=1`: fewer
//! samples, 100 pods for `List`).

mod common;

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kubelet::cluster::{ApiSource, ClusterSettings};
use kubelet::dra::ClaimRef;
use kubelet::node::{Node, NodeBuilder, NodeConfig};
use kubelet::pod::Allocatable;
use kubelet_api::podresources::v1 as podresources;
use rustlet_sample_plugins::dra_driver::{DraDriver, DraDriverConfig};
use rustlet_sample_plugins::report::Reporter;
use rustlet_testkit::apiserver::ApiServer;
use serde_json::json;
use tokio_util::sync::CancellationToken;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
const IMAGE: &str = "example.com/bench/sleep:v1";
const DRIVER: &str = "gpu.dra.example.com";
/// The same driver program under another name, reading claims as an
/// administrator: the direct calls (claims no pod on the node uses, which
/// the node's identity may not read).
const DIRECT: &str = "direct.dra.example.com";
const NODE: &str = "n1";
const DEADLINE: Duration = Duration::from_secs(300);

fn quick() -> bool {
    std::env::var("RUSTLET_BENCH_QUICK").is_ok_and(|v| v == "1")
}

fn claim(name: &str) -> ResourceClaim {
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.example.com"}}]}},
    }))
    .expect("claim")
}

fn pod(name: &str, claim: Option<&str>) -> Pod {
    let mut spec = json!({
        "automountServiceAccountToken": false,
        "terminationGracePeriodSeconds": 1,
        "containers": [{"name": "main", "image": IMAGE, "imagePullPolicy": "Never"}],
    });
    if let Some(claim) = claim {
        spec["resourceClaims"] = json!([{"name": "gpu", "resourceClaimName": claim}]);
        spec["containers"][0]["resources"] = json!({"claims": [{"name": "gpu"}]});
    }
    serde_json::from_value(json!({"metadata": {"name": name, "namespace": "default"}, "spec": spec})).expect("pod")
}

struct Bench {
    server: ApiServer,
    admin: kube::Client,
    claims: Api<ResourceClaim>,
    pods: Api<Pod>,
    node: Node,
}

impl Bench {
    /// Creates claim `name` and pod `name` (not bound), allocates the claim
    /// to `device` and reserves it for the pod, as the scheduler does
    /// before it binds.
    async fn scheduled(&self, name: &str, device: &str) -> Result<(), BoxError> {
        self.scheduled_for(DRIVER, name, device).await
    }

    async fn scheduled_for(&self, driver: &str, name: &str, device: &str) -> Result<(), BoxError> {
        self.claims.create(&PostParams::default(), &claim(name)).await?;
        let created = self.pods.create(&PostParams::default(), &pod(name, Some(name))).await?;
        let status = json!({"status": {
            "allocation": {"devices": {"results": [{"request": "gpu", "driver": driver, "pool": NODE, "device": device}]}},
            "reservedFor": [{"resource": "pods", "name": name, "uid": created.metadata.uid}],
        }});
        self.claims.patch_status(name, &PatchParams::default(), &Patch::Merge(&status)).await?;
        Ok(())
    }

    /// Binds pod `name` to the node (`pods/binding`).
    async fn bind(&self, name: &str) -> Result<(), BoxError> {
        let request = http::Request::post(format!("/api/v1/namespaces/default/pods/{name}/binding"))
            .header("content-type", "application/json")
            .body(
                serde_json::to_vec(&json!({
                    "apiVersion": "v1", "kind": "Binding",
                    "metadata": {"name": name}, "target": {"kind": "Node", "name": NODE},
                }))
                .expect("binding"),
            )?;
        self.admin.request_text(request).await?;
        Ok(())
    }

    /// Waits until every pod in `names` is Running in the API.
    async fn running(&self, names: &[String]) -> Result<(), BoxError> {
        for name in names {
            let seen = self
                .server
                .wait_object(("", "pods", "default", name), DEADLINE, |p| {
                    p.is_some_and(|p| p["status"]["phase"] == "Running")
                })
                .await;
            seen.map_err(|last| format!("{name} not Running: {last:?}"))?;
        }
        Ok(())
    }
}

async fn start(
    root: &std::path::Path,
    devices: usize,
    pods: usize,
    shutdown: &CancellationToken,
) -> Result<Bench, BoxError> {
    let server = ApiServer::start().await?;
    let admin = server.client(server.admin_token()).await?;
    let node_client = server.client(&server.node_token(NODE)).await?;
    let provider = common::sleep_provider(root, IMAGE)?;
    let mut config = NodeConfig::new(root, NODE);
    config.http_address = None;
    config.pods.allocatable = Some(Allocatable { cpu_milli: 64_000, memory: 64 << 30, pods: pods + 300 });
    let mut settings = ClusterSettings::new(ApiSource::Client(node_client.clone()));
    settings.pod_sync.api_qps = 1000.0;
    settings.pod_sync.api_burst = 2000;
    let node = NodeBuilder::new(config).provider(provider).cluster(settings).start(shutdown.clone()).await?;
    let names = (0..devices).map(|i| format!("dev-{i}")).collect();
    DraDriver::new(DraDriverConfig::new(DRIVER, "a", root, NODE, names), Reporter::Discard)
        .with_client(node_client)
        .spawn(shutdown.child_token())?;
    let names = (0..devices).map(|i| format!("dev-{i}")).collect();
    DraDriver::new(DraDriverConfig::new(DIRECT, "a", root, NODE, names), Reporter::Discard)
        .with_client(admin.clone())
        .spawn(shutdown.child_token())?;
    if !node.dra_drivers().wait_until(DEADLINE, |i| i.iter().filter(|i| i.connected).count() == 2).await {
        return Err("the DRA driver did not connect".into());
    }
    let claims = Api::namespaced(admin.clone(), "default");
    let pods = Api::namespaced(admin.clone(), "default");
    Ok(Bench { server, admin, claims, pods, node })
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let samples = if quick() { 10 } else { 40 };
    let list_pods = if quick() { 100 } else { 500 };
    let batch = 100;
    let root = rustlet_testkit::node_root::tempdir("rustlet-bench-dra-");
    let shutdown = CancellationToken::new();
    let devices = 2 * samples + 3 * batch;
    let bench = start(root.path(), devices, list_pods + samples + batch, &shutdown).await?;
    let mut next_device = 0;
    let mut device = || {
        next_device += 1;
        format!("dev-{}", next_device - 1)
    };

    // Claim allocated → container running, one pod at a time, interleaved
    // with the driver's own prepare of a fresh claim.
    let mut to_running = Vec::new();
    let mut driver_share = Vec::new();
    for i in 0..samples {
        let name = format!("one-{i}");
        bench.scheduled(&name, &device()).await?;
        let started = Instant::now();
        bench.bind(&name).await?;
        bench.running(std::slice::from_ref(&name)).await?;
        to_running.push(started.elapsed());
        // The driver alone: a claim allocated but used by no pod.
        let direct = format!("direct-{i}");
        bench.scheduled_for(DIRECT, &direct, &device()).await?;
        let uid = bench.claims.get(&direct).await?.metadata.uid.unwrap_or_default();
        let claim = ClaimRef { namespace: "default".into(), uid, name: direct };
        let started = Instant::now();
        let answer = bench.node.dra_drivers().prepare(DIRECT, std::slice::from_ref(&claim)).await?;
        driver_share.push(started.elapsed());
        if answer.values().any(Result::is_err) {
            return Err(format!("direct prepare failed: {answer:?}").into());
        }
    }
    println!("DRA pod, claim allocated → Running in the API ({samples} pods, one at a time):");
    println!("  bind → Running:               {}", common::figures(to_running).in_ms());
    println!("  driver's NodePrepareResources: {}", common::figures(driver_share).in_ms());

    // 100 claims prepared at once: 100 pods bound together.
    let names: Vec<String> = (0..batch).map(|i| format!("batch-{i}")).collect();
    for name in &names {
        bench.scheduled(name, &device()).await?;
    }
    let started = Instant::now();
    futures_util::future::try_join_all(names.iter().map(|n| bench.bind(n))).await?;
    bench.running(&names).await?;
    let all = started.elapsed();
    let mut direct = Vec::new();
    for i in 0..batch {
        let name = format!("direct-batch-{i}");
        bench.scheduled_for(DIRECT, &name, &device()).await?;
        let uid = bench.claims.get(&name).await?.metadata.uid.unwrap_or_default();
        direct.push(ClaimRef { namespace: "default".into(), uid, name });
    }
    let started = Instant::now();
    let answer = bench.node.dra_drivers().prepare(DIRECT, &direct).await?;
    if answer.values().any(Result::is_err) {
        return Err("a direct batch prepare failed".into());
    }
    let one_batch = started.elapsed();
    println!("{batch} claims prepared at once:");
    println!("  {batch} pods bound together → all Running: {}", common::ms(all));
    println!("  one NodePrepareResources of {batch} claims, direct: {}", common::ms(one_batch));

    // PodResources List with many pods.
    let plain: Vec<String> = (0..list_pods.saturating_sub(samples + batch)).map(|i| format!("plain-{i}")).collect();
    for name in &plain {
        let mut object = pod(name, None);
        object.spec.as_mut().expect("spec").node_name = Some(NODE.into());
        bench.pods.create(&PostParams::default(), &object).await?;
    }
    bench.running(&plain).await?;
    let channel = kubelet_api::uds::dial(root.path().join("pod-resources/kubelet.sock"), DEADLINE).await?;
    let mut lister = podresources::pod_resources_lister_client::PodResourcesListerClient::new(channel);
    let mut latencies = Vec::new();
    let mut listed = 0;
    let mut pace = tokio::time::interval(Duration::from_millis(20));
    for _ in 0..50 {
        pace.tick().await;
        let started = Instant::now();
        let answer = lister.list(podresources::ListPodResourcesRequest {}).await?.into_inner();
        latencies.push(started.elapsed());
        listed = answer.pod_resources.len();
    }
    // The floor: the same socket and rate limit, a call that walks no pods.
    let mut floor = Vec::new();
    for _ in 0..50 {
        pace.tick().await;
        let started = Instant::now();
        lister.get_allocatable_resources(podresources::AllocatableResourcesRequest {}).await?;
        floor.push(started.elapsed());
    }
    println!("PodResources List ({listed} pods, 50 calls paced at 50 per second):");
    println!("  List:                                 {}", common::figures(latencies).in_ms());
    println!("  floor, GetAllocatableResources (no pods): {}", common::figures(floor).in_ms());

    shutdown.cancel();
    bench.node.stopped().await;
    Ok(())
}
