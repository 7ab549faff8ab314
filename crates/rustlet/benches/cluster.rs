//! Cluster-mode benchmark: prints figures, asserts nothing about time.
//!
//! Runs against the in-process fake API server, and again against the real
//! kube-apiserver (etcd + kube-apiserver v1.28.7 started by
//! `rustlet_testkit::control_plane`) when `RUSTLET_KUBE_BIN_DIR` names the
//! Kubernetes binaries. Pod status writes are limited as the binary's
//! `--kube-api-qps`/`--kube-api-burst` limit them: `RUSTLET_BENCH_QPS`
//! (default 500) and twice that as the burst; upstream's defaults (50/100)
//! make 1,000 pods take at least 20 s of writes.
//!
//! In one process: the API server (fake), and the node as the binary runs it
//! in cluster mode (`NodeBuilder` with the WebAssembly provider and the
//! `sleep` module imported; a node identity). Measures:
//! - N pods bound to the node at once (created by an administrator with
//!   `spec.nodeName`) → all Running in the API (their statuses patched);
//!   beside the floor: the same creations plus one status patch each, sent
//!   by the benchmark itself (what the API server costs);
//! - an idle node (the pods running): API requests per minute by kind,
//!   over a 30 s window (upstream: a lease renewal every 10 s, and a status
//!   patch every 5 min without changes);
//! - a device plugin flapping one device's health 100 times a second for a
//!   minute → the Node status patches sent (target: at most 60 in the
//!   minute) and allocatable exact once it settles.
//!
//! Run: `cargo bench -p rustlet --bench cluster` (`RUSTLET_BENCH_QUICK=1`:
//! 200 pods, shorter windows).

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kubelet::cluster::{ApiSource, ClusterSettings};
use kubelet::node::{NodeBuilder, NodeConfig};
use kubelet::pod::Allocatable;
use kubelet_api::constants::{DEVICE_PLUGIN_VERSION, DEVICE_PLUGINS_DIR, KUBELET_SOCKET};
use kubelet_api::deviceplugin::v1beta1::DevicePluginOptions;
use rustlet_sample_plugins::device_plugin::{
    DevicePluginBehaviour, DeviceSpec, FakeDevicePlugin, register_with_kubelet,
};
use rustlet_sample_plugins::report::Reporter;
use rustlet_testkit::apiserver::ApiServer;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
const IMAGE: &str = "example.com/bench/sleep:v1";
const RESOURCE: &str = "example.com/flappy";
const DEADLINE: Duration = Duration::from_secs(300);

fn quick() -> bool {
    std::env::var("RUSTLET_BENCH_QUICK").is_ok_and(|v| v == "1")
}

fn pod(name: &str, node: &str) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": "default", "labels": {"bench": "bound"}},
        "spec": {
            "nodeName": node,
            "automountServiceAccountToken": false,
            "tolerations": [{"operator": "Exists"}],
            "terminationGracePeriodSeconds": 5,
            "containers": [{"name": "main", "image": IMAGE, "imagePullPolicy": "Never",
                            "resources": {"limits": {"memory": "16Mi"}}}],
        },
    }))
    .expect("pod")
}

/// Creates `count` pods named `<prefix><i>` bound to `node`, 64 requests
/// in flight.
async fn create_pods(pods: &Api<Pod>, node: &str, prefix: &str, count: usize) -> Result<(), BoxError> {
    use futures_util::StreamExt as _;
    let results: Vec<Result<Pod, kube::Error>> = futures_util::stream::iter(0..count)
        .map(|i| {
            let pods = pods.clone();
            let name = format!("{prefix}{i}");
            async move { pods.create(&PostParams::default(), &pod(&name, node)).await }
        })
        .buffer_unordered(64)
        .collect()
        .await;
    for result in results {
        result?;
    }
    Ok(())
}

/// Requests so far by "METHOD path-without-query".
fn requests(server: &ApiServer) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for logged in server.requests() {
        let path = logged.uri.split('?').next().unwrap_or_default().to_owned();
        let watch = logged.uri.contains("watch=true");
        let key = format!("{} {path}{}", logged.method, if watch { " (watch)" } else { "" });
        *counts.entry(key).or_default() += 1;
    }
    counts
}

fn since(before: &BTreeMap<String, usize>, after: &BTreeMap<String, usize>) -> BTreeMap<String, usize> {
    after
        .iter()
        .filter_map(|(k, v)| {
            let n = v - before.get(k).copied().unwrap_or(0);
            (n > 0).then(|| (k.clone(), n))
        })
        .collect()
}

fn qps() -> f64 {
    std::env::var("RUSTLET_BENCH_QPS").ok().and_then(|v| v.parse().ok()).unwrap_or(500.0)
}

/// A node in cluster mode on `node_client`, named `node_name`, in `root`.
async fn start_node(
    root: &std::path::Path,
    node_name: &str,
    node_client: kube::Client,
    count: usize,
    shutdown: &CancellationToken,
) -> Result<kubelet::node::Node, BoxError> {
    let provider = common::sleep_provider(root, IMAGE)?;
    let mut config = NodeConfig::new(root, node_name);
    config.http_address = None;
    config.pods.allocatable = Some(Allocatable { cpu_milli: 64_000, memory: 64 << 30, pods: count + 100 });
    let mut settings = ClusterSettings::new(ApiSource::Client(node_client));
    settings.pod_sync.api_qps = qps();
    settings.pod_sync.api_burst = (qps() * 2.0) as u32;
    Ok(NodeBuilder::new(config).provider(provider).cluster(settings).start(shutdown.clone()).await?)
}

/// Waits until the Node is Ready.
async fn ready(admin: &kube::Client, node_name: &str) -> Result<(), BoxError> {
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(admin.clone());
    let cond = |n: Option<&k8s_openapi::api::core::v1::Node>| {
        n.and_then(|n| n.status.as_ref()?.conditions.as_ref())
            .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
    };
    tokio::time::timeout(DEADLINE, kube::runtime::wait::await_condition(nodes, node_name, cond))
        .await
        .map_err(|_| "the node did not become Ready")??;
    Ok(())
}

/// The API server's own cost: `count` pods created and each status
/// patched once by this client (bound elsewhere, so no node touches them).
async fn floor(pods: &Api<Pod>, count: usize) -> Result<Duration, BoxError> {
    use futures_util::StreamExt as _;
    let began = Instant::now();
    let results: Vec<Result<Pod, kube::Error>> = futures_util::stream::iter(0..count)
        .map(|i| {
            let pods = pods.clone();
            async move {
                let mut object = pod(&format!("floor{i}"), "elsewhere");
                object.metadata.labels = None;
                pods.create(&PostParams::default(), &object).await?;
                let patch = json!({"status": {"phase": "Running"}});
                pods.patch_status(&format!("floor{i}"), &PatchParams::default(), &Patch::Merge(&patch)).await
            }
        })
        .buffer_unordered(64)
        .collect()
        .await;
    for result in results {
        result?;
    }
    Ok(began.elapsed())
}

/// Creates `count` pods bound to `node_name` and waits (through a watch)
/// until all are Running in the API; returns (creations, all Running).
async fn bound_pods_running(pods: &Api<Pod>, node_name: &str, count: usize) -> Result<(Duration, Duration), BoxError> {
    use futures_util::StreamExt as _;
    let config = kube::runtime::watcher::Config::default().labels("bench=bound");
    let mut events = kube::runtime::watcher(pods.clone(), config).boxed();
    // The watch is established (its first list done) before the pods exist.
    while let Some(event) = events.next().await {
        if matches!(event?, kube::runtime::watcher::Event::InitDone) {
            break;
        }
    }
    let began = Instant::now();
    create_pods(pods, node_name, "bound", count).await?;
    let created = began.elapsed();
    let mut running = std::collections::HashSet::new();
    while running.len() < count {
        let left = DEADLINE.saturating_sub(began.elapsed());
        let Ok(Some(event)) = tokio::time::timeout(left, events.next()).await else {
            return Err(format!("not all {count} pods Running in the API within {DEADLINE:?}").into());
        };
        if let kube::runtime::watcher::Event::Apply(pod) | kube::runtime::watcher::Event::InitApply(pod) = event? {
            let name = pod.metadata.name.clone().unwrap_or_default();
            if pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running") {
                running.insert(name);
            } else {
                running.remove(&name);
            }
        }
    }
    Ok((created, began.elapsed()))
}

/// The real kube-apiserver: the same 1,000 bound pods, with its own floor.
async fn run_real(count: usize) -> Result<(), BoxError> {
    let Some(plane) = rustlet_testkit::control_plane::ControlPlane::shared("cluster benchmark") else {
        println!("\nreal kube-apiserver: skipped (RUSTLET_KUBE_BIN_DIR is not set)");
        return Ok(());
    };
    let identity = plane.node();
    let admin = plane.admin_client().await?;
    let node_client = plane.client(&identity.token).await?;
    let shutdown = CancellationToken::new();
    let root = rustlet_testkit::node_root::tempdir("rustlet-bench-cluster-");
    let rss_before = common::rss_mib();
    let node = start_node(root.path(), &identity.name, node_client, count, &shutdown).await?;
    ready(&admin, &identity.name).await?;
    let pods: Api<Pod> = Api::namespaced(admin.clone(), "default");
    let floor = floor(&pods, count).await?;
    let (created, all_running) = bound_pods_running(&pods, &identity.name, count).await?;
    println!("\nreal kube-apiserver v1.28.7 (etcd on loopback, Node,RBAC + NodeRestriction, a node identity):");
    println!(
        "  {count} pods bound at once: all Running in the API after {:.2} s   (target ≤ 10 s; the creations alone took {:.2} s)",
        all_running.as_secs_f64(),
        created.as_secs_f64()
    );
    println!(
        "  floor: the API server creating {count} pods and patching each status once: {:.2} s",
        floor.as_secs_f64()
    );
    println!(
        "  this process's RSS (node + benchmark client): {:.0} MiB (before the node: {rss_before:.0} MiB)",
        common::rss_mib()
    );
    shutdown.cancel();
    node.stopped().await;
    Ok(())
}

async fn run() -> Result<(), BoxError> {
    let _ = rlimit::increase_nofile_limit(u64::MAX);
    let _ = rustls::crypto::ring::default_provider().install_default();
    let (count, flap_for, idle_for) = if quick() {
        (200, Duration::from_secs(10), Duration::from_secs(12))
    } else {
        (1000, Duration::from_secs(60), Duration::from_secs(30))
    };
    let server = ApiServer::start().await?;
    let admin = server.client(server.admin_token()).await?;
    let node_client = server.client(&server.node_token("bench")).await?;
    let shutdown = CancellationToken::new();
    let root = rustlet_testkit::node_root::tempdir("rustlet-bench-cluster-");
    let node = start_node(root.path(), "bench", node_client, count, &shutdown).await?;
    ready(&admin, "bench").await?;
    println!(
        "cluster benchmark: NodeBuilder in cluster mode + the WebAssembly provider, pod status writes at most {:.0}/s (burst {:.0})",
        qps(),
        qps() * 2.0
    );
    println!("\nin-process fake API server:");

    let pods: Api<Pod> = Api::namespaced(admin.clone(), "default");
    let floor = floor(&pods, count).await?;
    let before = requests(&server);
    let (created, all_running) = bound_pods_running(&pods, "bench", count).await?;
    let spent = since(&before, &requests(&server));
    let status_patches: usize = spent
        .iter()
        .filter(|(k, _)| k.starts_with("PATCH") && k.ends_with("/status") && k.contains("/pods/"))
        .map(|(_, v)| v)
        .sum();
    println!("  {count} pods bound to the node at once:");
    println!(
        "  all Running in the API after {:.2} s   (target ≤ 10 s; the creations alone took {:.2} s)",
        all_running.as_secs_f64(),
        created.as_secs_f64()
    );
    println!(
        "  pod status patches: {status_patches} ({:.2} per pod, {:.0} a second on average)",
        status_patches as f64 / count as f64,
        status_patches as f64 / all_running.as_secs_f64()
    );
    println!(
        "  floor: the API server creating {count} pods and patching each status once: {:.2} s",
        floor.as_secs_f64()
    );

    // Idle.
    let before = requests(&server);
    tokio::time::sleep(idle_for).await;
    let spent = since(&before, &requests(&server));
    let total: usize = spent.values().sum();
    println!("\nidle node with {count} running pods, {:.0} s window:", idle_for.as_secs_f64());
    println!("  API requests: {:.1} a minute", total as f64 * 60.0 / idle_for.as_secs_f64());
    for (kind, n) in &spent {
        println!("    {kind}: {:.1} a minute", *n as f64 * 60.0 / idle_for.as_secs_f64());
    }
    println!("  upstream: a lease renewal every 10 s (6 a minute) and a node status patch every 5 min without changes");

    // A device plugin flapping health.
    let devices: Vec<DeviceSpec> =
        ["d0:Healthy:0", "d1:Healthy:0"].iter().map(|d| d.parse().expect("device")).collect();
    let options = DevicePluginOptions::default();
    let (plugin, control) =
        FakeDevicePlugin::new(RESOURCE, devices, options, DevicePluginBehaviour::Normal, Reporter::Discard);
    plugin.spawn(&root.path().join(DEVICE_PLUGINS_DIR).join("flappy.sock"), shutdown.child_token())?;
    register_with_kubelet(
        &root.path().join(DEVICE_PLUGINS_DIR).join(KUBELET_SOCKET),
        DEVICE_PLUGIN_VERSION,
        "flappy.sock",
        RESOURCE,
        options,
    )
    .await?;
    let allocatable = |want: &'static str| {
        let server = &server;
        async move {
            server
                .wait_object(("", "nodes", "", "bench"), DEADLINE, |n| {
                    n.and_then(|n| n.pointer(&format!("/status/allocatable/{}", RESOURCE.replace('/', "~1"))))
                        .and_then(Value::as_str)
                        == Some(want)
                })
                .await
                .map(|_| ())
                .map_err(|_| format!("allocatable {RESOURCE} never became {want}"))
        }
    };
    allocatable("2").await?;
    let before = requests(&server);
    let began = Instant::now();
    let mut flips = 0u32;
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    while began.elapsed() < flap_for {
        tick.tick().await;
        control.set_health("d1", if flips.is_multiple_of(2) { "Unhealthy" } else { "Healthy" });
        flips += 1;
    }
    control.set_health("d1", "Unhealthy");
    let flapped = began.elapsed();
    allocatable("1").await?;
    let spent = since(&before, &requests(&server));
    let node_patches = spent.get("PATCH /api/v1/nodes/bench/status").copied().unwrap_or(0);
    println!("\na device plugin flapping a device's health {flips} times in {:.1} s:", flapped.as_secs_f64());
    println!(
        "  Node status patches: {node_patches} in {:.0} s (target ≤ 60 a minute; upstream sends one every 10 s at most)",
        flapped.as_secs_f64()
    );
    println!("  allocatable once settled: 1 of 2 (exact)");

    drop(control);
    shutdown.cancel();
    node.stopped().await;
    run_real(count).await
}

fn main() -> Result<(), BoxError> {
    tokio::runtime::Builder::new_multi_thread().enable_all().build()?.block_on(run())
}
