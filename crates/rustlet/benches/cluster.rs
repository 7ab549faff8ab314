//! Cluster-mode benchmark against the in-process fake API server: prints
//! figures, asserts nothing about time.
//!
//! In one process: the fake API server, and the node as the binary runs it
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

fn pod(name: &str) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "nodeName": "bench",
            "terminationGracePeriodSeconds": 5,
            "containers": [{"name": "main", "image": IMAGE, "imagePullPolicy": "Never",
                            "resources": {"limits": {"memory": "16Mi"}}}],
        },
    }))
    .expect("pod")
}

/// Creates `count` pods named `<prefix><i>`, 64 requests in flight.
async fn create_pods(pods: &Api<Pod>, prefix: &str, count: usize) -> Result<(), BoxError> {
    use futures_util::StreamExt as _;
    let results: Vec<Result<Pod, kube::Error>> = futures_util::stream::iter(0..count)
        .map(|i| {
            let pods = pods.clone();
            let name = format!("{prefix}{i}");
            async move { pods.create(&PostParams::default(), &pod(&name)).await }
        })
        .buffer_unordered(64)
        .collect()
        .await;
    for result in results {
        result?;
    }
    Ok(())
}

/// Notes a changed pod named `<prefix>...` as Running or not.
fn note_running(running: &mut std::collections::HashSet<String>, object: &Value, prefix: &str) {
    let Some(name) = object.pointer("/metadata/name").and_then(Value::as_str).filter(|n| n.starts_with(prefix)) else {
        return;
    };
    if object.pointer("/status/phase").and_then(Value::as_str) == Some("Running") {
        running.insert(name.to_owned());
    } else {
        running.remove(name);
    }
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

async fn run() -> Result<(), BoxError> {
    let _ = rlimit::increase_nofile_limit(u64::MAX);
    let (count, flap_for, idle_for) = if quick() {
        (200, Duration::from_secs(10), Duration::from_secs(12))
    } else {
        (1000, Duration::from_secs(60), Duration::from_secs(30))
    };
    let server = ApiServer::start().await?;
    let admin = server.client(server.admin_token()).await?;
    let node_client = server.client(&server.node_token("bench")).await?;
    let shutdown = CancellationToken::new();
    let root = tempfile::Builder::new().prefix("rustlet-bench-cluster-").tempdir()?;
    let provider = common::sleep_provider(root.path(), IMAGE)?;
    let mut config = NodeConfig::new(root.path(), "bench");
    config.http_address = None;
    config.pods.allocatable = Some(Allocatable { cpu_milli: 64_000, memory: 64 << 30, pods: count + 100 });
    let node = NodeBuilder::new(config)
        .provider(provider)
        .cluster(ClusterSettings::new(ApiSource::Client(node_client)))
        .start(shutdown.clone())
        .await?;
    let ready = server
        .wait_object(("", "nodes", "", "bench"), DEADLINE, |n| {
            n.and_then(|n| n.pointer("/status/conditions"))
                .and_then(Value::as_array)
                .is_some_and(|c| c.iter().any(|c| c["type"] == "Ready" && c["status"] == "True"))
        })
        .await;
    ready.map_err(|_| "the node did not become Ready")?;
    println!(
        "cluster benchmark: fake API server + NodeBuilder in cluster mode + the WebAssembly provider, in one process"
    );

    // Floor: what the API server costs for the same objects and writes.
    let pods: Api<Pod> = Api::namespaced(admin.clone(), "default");
    let began = Instant::now();
    let floor_pods: Api<Pod> = pods.clone();
    {
        use futures_util::StreamExt as _;
        let results: Vec<Result<Pod, kube::Error>> = futures_util::stream::iter(0..count)
            .map(|i| {
                let pods = floor_pods.clone();
                async move {
                    let mut object = pod(&format!("floor{i}"));
                    if let Some(spec) = object.spec.as_mut() {
                        spec.node_name = Some("elsewhere".into());
                    }
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
    }
    let floor = began.elapsed();

    let mut changes = server.changes();
    let before = requests(&server);
    let began = Instant::now();
    create_pods(&pods, "bound", count).await?;
    let created = began.elapsed();
    let mut running = std::collections::HashSet::new();
    while running.len() < count {
        match tokio::time::timeout(DEADLINE.saturating_sub(began.elapsed()), changes.recv()).await {
            Err(_) => return Err(format!("not all {count} pods Running in the API within {DEADLINE:?}").into()),
            Ok(Err(tokio::sync::broadcast::error::RecvError::Closed)) => return Err("the API server stopped".into()),
            Ok(Err(tokio::sync::broadcast::error::RecvError::Lagged(_))) => {
                return Err("the benchmark fell behind the API server's changes".into());
            }
            Ok(Ok(change)) => note_running(&mut running, &change.object, "bound"),
        }
    }
    let all_running = began.elapsed();
    let spent = since(&before, &requests(&server));
    let status_patches: usize = spent
        .iter()
        .filter(|(k, _)| k.starts_with("PATCH") && k.ends_with("/status") && k.contains("/pods/"))
        .map(|(_, v)| v)
        .sum();
    println!("\n{count} pods bound to the node at once:");
    println!(
        "  all Running in the API after {:.2} s   (target ≤ 10 s; the creations alone took {:.2} s)",
        all_running.as_secs_f64(),
        created.as_secs_f64()
    );
    println!("  pod status patches: {status_patches} ({:.2} per pod)", status_patches as f64 / count as f64);
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
    Ok(())
}

fn main() -> Result<(), BoxError> {
    tokio::runtime::Builder::new_multi_thread().enable_all().build()?.block_on(run())
}
