//! Cluster mode, the node's own objects: the Node (created, adopted,
//! recreated after an administrator deletes it), its status, and its Lease,
//! through kube-rs with a node identity; each test against the real
//! kube-apiserver and the in-process one, but the one that injects faults
//! (the in-process server's alone).

use std::sync::atomic::Ordering;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Node;
use kube::Client;
use kube::api::{Api, DeleteParams, PostParams};
use kubelet::cluster::{NodeSyncConfig, node_sync};
use rustlet_testkit::apiserver::{ApiServer, Fault};
use rustlet_testkit::test_api::{TestApi, json_of};
use serde_json::{Value, json};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// A liveness bound: these take milliseconds.
const SOON: Duration = Duration::from_secs(20);

async fn client(server: &ApiServer, token: &str) -> Client {
    server.client(token).await.expect("client")
}

fn desired(name: &str, gpus: u32) -> Node {
    serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, "kubernetes.io/arch": "wasm32-wasi"}},
        "spec": {"taints": [{"key": "kubernetes.io/arch", "value": "wasm32-wasi", "effect": "NoSchedule"}]},
        "status": {
            "capacity": {"cpu": "2", "pods": "110", "example.com/gpu": gpus.to_string()},
            "allocatable": {"cpu": "2", "pods": "110", "example.com/gpu": gpus.to_string()},
            "conditions": [
                {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "rustlet is posting ready status"},
                {"type": "MemoryPressure", "status": "False", "reason": "KubeletHasSufficientMemory", "message": "kubelet has sufficient memory available"},
                {"type": "DiskPressure", "status": "False", "reason": "KubeletHasNoDiskPressure", "message": "kubelet has no disk pressure"},
                {"type": "PIDPressure", "status": "False", "reason": "KubeletHasSufficientPID", "message": "kubelet has sufficient PID available"},
            ]
        }
    }))
    .expect("node")
}

/// Fast timings so the tests see several renewals; the behaviour is the
/// same at upstream's.
fn config(name: &str) -> NodeSyncConfig {
    NodeSyncConfig {
        renew_interval: Duration::from_millis(100),
        retry_initial: Duration::from_millis(10),
        retry_max: Duration::from_millis(100),
        ..NodeSyncConfig::new(name)
    }
}

const NODE: (&str, &str, &str, &str) = ("", "nodes", "", "n1");
const LEASE: (&str, &str, &str, &str) = ("coordination.k8s.io", "leases", "kube-node-lease", "n1");

fn nodes(api: &TestApi) -> Api<Node> {
    Api::all(api.admin.clone())
}

fn leases(api: &TestApi) -> Api<Lease> {
    Api::namespaced(api.admin.clone(), "kube-node-lease")
}

/// Waits until the Node satisfies `pred` (as JSON); returns it as JSON.
async fn wait_node(api: &TestApi, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
    let node = api.wait_for(&nodes(api), &api.node, what, SOON, |n| n.is_some_and(|n| pred(&json_of(n)))).await;
    json_of(&node.expect("node"))
}

/// Waits until the node's Lease satisfies `pred` (as JSON); returns it.
async fn wait_lease(api: &TestApi, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
    let lease = api.wait_for(&leases(api), &api.node, what, SOON, |l| l.is_some_and(|l| pred(&json_of(l)))).await;
    json_of(&lease.expect("lease"))
}

fn condition<'a>(node: &'a Value, type_: &str) -> &'a Value {
    node["status"]["conditions"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["type"] == type_))
        .unwrap_or_else(|| panic!("no {type_} condition in {node}"))
}

async fn the_node_registers_with_its_status_and_keeps_its_lease(api: TestApi) {
    let name = api.node.clone();
    let (_tx, rx) = watch::channel(desired(&name, 4));
    let shutdown = CancellationToken::new();
    let sync = node_sync::start(api.node_client.clone(), config(&name), rx, shutdown.clone());

    let node = wait_node(&api, "registered with its status", |n| n["status"]["conditions"].is_array()).await;
    assert_eq!(node["metadata"]["labels"]["kubernetes.io/arch"], "wasm32-wasi");
    assert_eq!(node["spec"]["taints"][0]["effect"], "NoSchedule");
    assert_eq!(node["status"]["allocatable"]["example.com/gpu"], "4");
    let ready = condition(&node, "Ready");
    assert_eq!((ready["status"].as_str(), ready["reason"].as_str()), (Some("True"), Some("KubeletReady")));
    assert!(ready["lastHeartbeatTime"].is_string() && ready["lastTransitionTime"].is_string());
    for (type_, reason) in [
        ("MemoryPressure", "KubeletHasSufficientMemory"),
        ("DiskPressure", "KubeletHasNoDiskPressure"),
        ("PIDPressure", "KubeletHasSufficientPID"),
    ] {
        let c = condition(&node, type_);
        assert_eq!((c["status"].as_str(), c["reason"].as_str()), (Some("False"), Some(reason)));
    }

    let lease = wait_lease(&api, "held", |_| true).await;
    assert_eq!(lease["spec"]["holderIdentity"], name.as_str());
    assert_eq!(lease["spec"]["leaseDurationSeconds"], 40);
    assert_eq!(lease["metadata"]["ownerReferences"][0]["kind"], "Node");
    assert_eq!(lease["metadata"]["ownerReferences"][0]["uid"], node["metadata"]["uid"]);
    // Renewed: its renew time moves on (three more renewals).
    let first = lease["spec"]["renewTime"].clone();
    let renewals = sync.stats().lease_renewals.load(Ordering::Relaxed);
    wait_lease(&api, "renewed three more times", |l| {
        l["spec"]["renewTime"] != first && sync.stats().lease_renewals.load(Ordering::Relaxed) >= renewals + 3
    })
    .await;
    assert_eq!(sync.stats().registrations.load(Ordering::Relaxed), 1);
    shutdown.cancel();
}
rustlet_testkit::on_both_api_servers!(
    the_node_registers_with_its_status_and_keeps_its_lease_on,
    the_node_registers_with_its_status_and_keeps_its_lease
);

/// A whole node joining: it reports, as `kubeletVersion`, the newest
/// Kubernetes release Rustlet conforms to that its control plane's
/// `/version` is not older than (the in-process server says 1.32 here, so
/// v1.28.7; the real one its own).
async fn the_node_reports_the_newest_conformed_version_its_control_plane_takes(api: TestApi) {
    use kubelet::cluster::{ApiSource, ClusterSettings};
    use kubelet::node::{NodeBuilder, NodeConfig};
    let minor = match (api.control_plane(), api.fake_server()) {
        (Some(plane), _) => plane.minor_version(),
        (None, Some(server)) => {
            server.set_minor_version(32);
            32
        }
        (None, None) => unreachable!("a TestApi has a server"),
    };
    let root = rustlet_testkit::node_root::tempdir("rustlet-node-");
    let mut config = NodeConfig::new(root.path(), api.node.clone());
    config.http_address = None;
    let shutdown = CancellationToken::new();
    let _stop = shutdown.clone().drop_guard();
    let node = NodeBuilder::new(config)
        .provider(std::sync::Arc::new(rustlet_testkit::host_provider::HostProcessProvider::new()))
        .cluster(ClusterSettings::new(ApiSource::Client(api.node_client.clone())))
        .start(shutdown.clone())
        .await
        .expect("node");
    let want = kubelet::cluster::kubelet_version_for("1", &minor.to_string());
    let expected = if minor >= 33 { "v1.33.3+rustlet." } else { "v1.28.7+rustlet." };
    assert!(want.starts_with(expected), "{want} for 1.{minor}");
    let registered = wait_node(&api, "registered", |n| n["status"]["nodeInfo"]["kubeletVersion"].is_string()).await;
    assert_eq!(registered["status"]["nodeInfo"]["kubeletVersion"], want.as_str());
    shutdown.cancel();
    node.stopped().await;
}
rustlet_testkit::on_both_api_servers!(
    the_node_reports_the_newest_conformed_version_its_control_plane_takes_on,
    the_node_reports_the_newest_conformed_version_its_control_plane_takes
);

async fn changes_reach_the_node_coalesced_and_transition_times_hold(api: TestApi) {
    let name = api.node.clone();
    let (tx, rx) = watch::channel(desired(&name, 4));
    let shutdown = CancellationToken::new();
    let sync = node_sync::start(
        api.node_client.clone(),
        NodeSyncConfig { coalesce: Duration::from_millis(50), ..config(&name) },
        rx,
        shutdown.clone(),
    );
    let node = wait_node(&api, "registered with its status", |n| n["status"]["conditions"].is_array()).await;
    let transition = condition(&node, "Ready")["lastTransitionTime"].clone();
    let patches = sync.stats().status_patches.load(Ordering::Relaxed);
    // Ten changes in a burst (a device plugin's devices coming and going).
    for gpus in 0..10 {
        tx.send_replace(desired(&name, gpus));
    }
    let node =
        wait_node(&api, "showing the last change", |n| n["status"]["allocatable"]["example.com/gpu"] == "9").await;
    let made = sync.stats().status_patches.load(Ordering::Relaxed) - patches;
    assert!(made <= 2, "ten changes in a burst made {made} patches");
    assert_eq!(condition(&node, "Ready")["lastTransitionTime"], transition, "Ready stayed True");

    // Not ready: the condition changes, with a new transition time.
    let mut not_ready = desired(&name, 9);
    let conditions = not_ready.status.as_mut().and_then(|s| s.conditions.as_mut()).expect("conditions");
    conditions[0].status = "False".into();
    conditions[0].reason = Some("KubeletNotReady".into());
    conditions[0].message = Some("plugin-manager failed: boom".into());
    tx.send_replace(not_ready);
    let node = wait_node(&api, "not ready", |n| condition(n, "Ready")["status"] == "False").await;
    assert_eq!(condition(&node, "Ready")["message"], "plugin-manager failed: boom");

    // The device plugin's resource is gone for good: 0, not its last value.
    let mut gone = desired(&name, 9);
    let status = gone.status.as_mut().expect("status");
    for map in [&mut status.capacity, &mut status.allocatable] {
        map.as_mut().expect("resources").remove("example.com/gpu");
    }
    tx.send_replace(gone);
    wait_node(&api, "showing the resource as 0", |n| {
        n["status"]["capacity"]["example.com/gpu"] == "0" && n["status"]["allocatable"]["example.com/gpu"] == "0"
    })
    .await;
    shutdown.cancel();
}
rustlet_testkit::on_both_api_servers!(
    changes_reach_the_node_coalesced_and_transition_times_hold_on,
    changes_reach_the_node_coalesced_and_transition_times_hold
);

async fn an_existing_node_is_adopted_and_a_deleted_one_recreated(api: TestApi) {
    let name = api.node.clone();
    let existing: Node =
        serde_json::from_value(json!({"metadata": {"name": name, "labels": {"team": "a"}}})).expect("node");
    let created = nodes(&api).create(&PostParams::default(), &existing).await.expect("create");
    let (_tx, rx) = watch::channel(desired(&name, 1));
    let shutdown = CancellationToken::new();
    let sync = node_sync::start(api.node_client.clone(), config(&name), rx, shutdown.clone());
    let mut registered = sync.registered();
    let uid = registered.wait_for(Option::is_some).await.expect("registered").clone();
    assert_eq!(uid, created.metadata.uid, "the existing object is adopted, not replaced");
    let node =
        wait_node(&api, "with our labels", |n| n["metadata"]["labels"]["kubernetes.io/arch"] == "wasm32-wasi").await;
    assert_eq!(node["metadata"]["labels"]["team"], "a", "its labels stay");
    assert_eq!(sync.stats().registrations.load(Ordering::Relaxed), 0);

    // An administrator deletes it: it is created again, with a new UID, and
    // the lease is owned by the new object.
    nodes(&api).delete(&name, &DeleteParams::default()).await.expect("delete");
    let node = wait_node(&api, "recreated", |n| n["metadata"]["uid"].as_str() != uid.as_deref()).await;
    let new_uid = node["metadata"]["uid"].clone();
    wait_lease(&api, "owned by the new Node", |l| l["metadata"]["ownerReferences"][0]["uid"] == new_uid).await;
    assert_eq!(sync.stats().registrations.load(Ordering::Relaxed), 1);
    shutdown.cancel();
}
rustlet_testkit::on_both_api_servers!(
    an_existing_node_is_adopted_and_a_deleted_one_recreated_on,
    an_existing_node_is_adopted_and_a_deleted_one_recreated
);

#[tokio::test]
async fn api_errors_are_retried_with_backoff_and_counted() {
    let server = ApiServer::start().await.expect("start");
    server.inject(Fault::status(Some(http::Method::POST), "/api/v1/nodes", 500, 3));
    server.inject(Fault::status(Some(http::Method::PATCH), "/api/v1/nodes/n1/status", 500, 2));
    // Throttled: the lease calls are answered 429 at first.
    server.inject(Fault::status(None, "/leases/n1", 429, 2));
    let client = client(&server, &server.node_token("n1")).await;
    let (_tx, rx) = watch::channel(desired("n1", 2));
    let shutdown = CancellationToken::new();
    let sync = node_sync::start(client, config("n1"), rx, shutdown.clone());
    // Registered and its status patched in the end (lease renewals keep
    // the store changing, so the counters are looked at again).
    server
        .wait_object(NODE, SOON, |n| n.is_some() && sync.stats().status_patches.load(Ordering::Relaxed) >= 1)
        .await
        .expect("registered in the end");
    assert!(sync.stats().failures.load(Ordering::Relaxed) >= 5, "{:?}", sync.stats());
    let lease = server.wait_object(LEASE, SOON, |l| l.is_some_and(|l| l["spec"]["holderIdentity"] == "n1")).await;
    assert!(lease.is_ok(), "the lease is held despite the 429s: {lease:?}");
    assert!(server.requests().iter().any(|r| r.status == 429), "the 429s were answered");
    // A node identity may not touch another node's objects: its own work
    // needs nothing more than the Node authorizer gives.
    let forbidden = server.requests().iter().filter(|r| r.status == 403).count();
    assert_eq!(forbidden, 0, "{:?}", server.requests());
    shutdown.cancel();
}
