//! Cluster mode, volumes and CSI node info: the Node annotation
//! `csi.volume.kubernetes.io/nodeid`, topology labels and the CSINode stay
//! exact under many concurrent registrations and removals, other writers'
//! conflicts and API errors; real CSI drivers registering through a node's
//! `plugins_registry` reach the API; a recreated Node gets its CSI facts
//! back; claims resolve through the API; configMap, secret and projected
//! volumes and env references are read with the node's identity. Each test
//! runs against the real kube-apiserver and the in-process one, except the
//! one that injects faults (the in-process server's alone).

use std::collections::BTreeMap;
use std::time::Duration;

use axum::http::Method;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::storage::v1::CSINode;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kubelet::cluster::{ApiNodeInfo, ApiSource, ClusterSettings};
use kubelet::csi::{CsiNodeDriver, NodeInfoPublisher};
use kubelet::node::{NodeBuilder, NodeConfig};
use rustlet_testkit::apiserver::{ApiServer, Fault};
use rustlet_testkit::csi_driver::{CsiDriverConfig, RegisteredCsiDriver};
use rustlet_testkit::report::Reporter;
use rustlet_testkit::test_api::{TestApi, json_of};
use serde_json::{Value, json};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// A liveness bound: these take milliseconds.
const SOON: Duration = Duration::from_secs(30);
const ANNOTATION: &str = "csi.volume.kubernetes.io/nodeid";

fn driver(i: usize) -> CsiNodeDriver {
    CsiNodeDriver {
        name: format!("d{i:03}.csi.example.com"),
        node_id: format!("n1-{i}"),
        topology_keys: Vec::new(),
        allocatable_count: Some(10),
        topology: BTreeMap::from([(format!("topology.d{i:03}/zone"), "z1".to_owned())]),
    }
}

/// The driver → node ID map of the Node's annotation.
fn annotation(node: &Value) -> BTreeMap<String, String> {
    node.pointer(&format!("/metadata/annotations/{}", ANNOTATION.replace('/', "~1")))
        .and_then(Value::as_str)
        .map(|text| serde_json::from_str(text).expect("the annotation is a JSON map"))
        .unwrap_or_default()
}

fn csi_node_drivers(csi_node: &Value) -> BTreeMap<String, String> {
    csi_node["spec"]["drivers"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|d| {
            (d["name"].as_str().unwrap_or_default().to_owned(), d["nodeID"].as_str().unwrap_or_default().to_owned())
        })
        .collect()
}

#[tokio::test]
async fn node_info_stays_exact_under_concurrent_registrations_removals_and_conflicts() {
    let server = ApiServer::start().await.expect("start");
    let client = server.client(&server.node_token("n1")).await.expect("client");
    let nodes: Api<Node> = Api::all(client.clone());
    let node: Node = serde_json::from_value(json!({"metadata": {"name": "n1"}})).expect("node");
    let uid = nodes.create(&PostParams::default(), &node).await.expect("create").metadata.uid.expect("uid");
    let shutdown = CancellationToken::new();
    let _stop = shutdown.clone().drop_guard();
    let info = ApiNodeInfo::new();
    let (_registered_tx, registered) = watch::channel(Some(uid));
    info.start(client, "n1", registered, shutdown.clone());
    info.add_driver(driver(0)).await.expect("add");
    tokio::time::timeout(SOON, info.synced()).await.expect("the CSINode is created in time");
    // Failures on the way: the writer retries until stored.
    server.inject(Fault::status(Some(Method::PUT), "/csinodes/n1", 500, 3));
    server.inject(Fault::status(Some(Method::PATCH), "/nodes/n1", 500, 2));
    // Conflicts the other writer may not happen to cause.
    server.inject(Fault::status(Some(Method::PUT), "/csinodes/n1", 409, 2));

    // Another writer changes the CSINode meanwhile: real 409s for us.
    let admin: Api<CSINode> = Api::all(server.client(server.admin_token()).await.expect("admin"));
    let meddler = tokio::spawn(async move {
        let mut changed = 0;
        for i in 0..50 {
            let patch = json!({"metadata": {"labels": {"meddled": i.to_string()}}});
            if admin.patch("n1", &PatchParams::default(), &Patch::Merge(&patch)).await.is_ok() {
                changed += 1;
            }
            tokio::task::yield_now().await;
        }
        changed
    });

    let adds: Vec<_> = (1..100)
        .map(|i| {
            let info = info.clone();
            tokio::spawn(async move { info.add_driver(driver(i)).await })
        })
        .collect();
    for add in adds {
        add.await.expect("task").expect("add");
    }
    let removes: Vec<_> = (7..100)
        .map(|i| {
            let info = info.clone();
            tokio::spawn(async move { info.remove_driver(&driver(i).name).await })
        })
        .collect();
    for remove in removes {
        remove.await.expect("task");
    }
    let meddled = meddler.await.expect("meddler");
    tokio::time::timeout(SOON, info.synced()).await.expect("stored in time");

    let want: BTreeMap<String, String> = (0..7).map(|i| (driver(i).name, driver(i).node_id)).collect();
    let node = server.object("", "nodes", "", "n1").expect("node");
    assert_eq!(annotation(&node), want, "the annotation holds exactly the registered drivers");
    for i in [0, 50, 99] {
        let label = format!("topology.d{i:03}/zone");
        assert_eq!(node["metadata"]["labels"][&label], "z1", "topology labels stay, as upstream ({label})");
    }
    let csi_node = server.object("storage.k8s.io", "csinodes", "", "n1").expect("csinode");
    assert_eq!(csi_node_drivers(&csi_node), want, "CSINode holds exactly the registered drivers");
    assert_eq!(csi_node["spec"]["drivers"][0]["allocatable"]["count"], 10);
    assert_eq!(csi_node["spec"]["drivers"][0]["topologyKeys"], json!(["topology.d000/zone"]));
    let owner = &csi_node["metadata"]["ownerReferences"][0];
    assert_eq!((owner["kind"].as_str(), owner["name"].as_str()), (Some("Node"), Some("n1")));
    let stats = info.stats();
    eprintln!(
        "stored {} times, {} conflicts, {} failures; the other writer changed the CSINode {meddled} times",
        stats.stored.load(std::sync::atomic::Ordering::Relaxed),
        stats.conflicts.load(std::sync::atomic::Ordering::Relaxed),
        stats.failures.load(std::sync::atomic::Ordering::Relaxed),
    );
    assert!(stats.failures.load(std::sync::atomic::Ordering::Relaxed) >= 5, "the injected errors were met and retried");
    assert!(stats.conflicts.load(std::sync::atomic::Ordering::Relaxed) >= 2, "the conflicts were met and retried");

    // The last driver goes: the annotation key goes with it.
    for i in 0..7 {
        info.remove_driver(&driver(i).name).await;
    }
    tokio::time::timeout(SOON, info.synced()).await.expect("stored in time");
    let node = server.object("", "nodes", "", "n1").expect("node");
    assert!(node.pointer("/metadata/annotations").and_then(|a| a.get(ANNOTATION)).is_none(), "{node:#}");
    let csi_node = server.object("storage.k8s.io", "csinodes", "", "n1").expect("csinode");
    assert!(csi_node_drivers(&csi_node).is_empty(), "{csi_node:#}");
}

async fn drivers_registering_through_the_node_reach_the_api_and_survive_node_recreation(api: TestApi) {
    let root = rustlet_testkit::node_root::tempdir("rustlet-node-");
    let mut config = NodeConfig::new(root.path(), api.node.clone());
    config.http_address = None;
    let mut settings = ClusterSettings::new(ApiSource::Client(api.node_client.clone()));
    settings.node_sync.retry_initial = Duration::from_millis(10);
    settings.node_sync.retry_max = Duration::from_millis(100);
    let shutdown = CancellationToken::new();
    let _stop = shutdown.clone().drop_guard();
    let node = NodeBuilder::new(config).cluster(settings).start(shutdown.clone()).await.expect("node");

    let drivers = CancellationToken::new();
    let mut stops = Vec::new();
    let mut registrations: Vec<std::path::PathBuf> = Vec::new();
    for (name, zone) in [("a.csi.example.com", "za"), ("b.csi.example.com", "zb")] {
        let stop = drivers.child_token();
        let config = CsiDriverConfig {
            name: name.into(),
            node_id: format!("{name}-{}", api.node),
            topology: [("topology.example.com/zone".to_owned(), zone.to_owned())].into(),
            ..CsiDriverConfig::default()
        };
        let registration = root.path().join("plugins_registry").join(format!("{name}.sock"));
        let endpoint = root.path().join("plugins").join(name).join("csi.sock");
        RegisteredCsiDriver::new(&registration, &endpoint, config)
            .spawn(Reporter::Discard, stop.clone())
            .expect("driver");
        stops.push(stop);
        registrations.push(registration);
    }
    let csi_nodes: Api<CSINode> = Api::all(api.admin.clone());
    let nodes: Api<Node> = Api::all(api.admin.clone());
    let csi_node = api
        .wait_for(&csi_nodes, &api.node, "listing both drivers", SOON, |c| {
            c.is_some_and(|c| csi_node_drivers(&json_of(c)).len() == 2)
        })
        .await
        .expect("csinode");
    assert_eq!(csi_node_drivers(&json_of(&csi_node))["a.csi.example.com"], format!("a.csi.example.com-{}", api.node));
    let node_object = api
        .wait_for(&nodes, &api.node, "annotated with both drivers", SOON, |n| {
            n.is_some_and(|n| annotation(&json_of(n)).len() == 2)
        })
        .await
        .expect("node");
    let labels = node_object.metadata.labels.clone().unwrap_or_default();
    assert!(labels.contains_key("topology.example.com/zone"), "{labels:?}");

    // One driver goes away (its registration socket removed): its CSINode
    // entry and annotation key go.
    stops[1].cancel();
    std::fs::remove_file(&registrations[1]).expect("rm");
    api.wait_for(&csi_nodes, &api.node, "without b's entry", SOON, |c| {
        c.is_some_and(|c| csi_node_drivers(&json_of(c)).keys().eq(["a.csi.example.com"]))
    })
    .await;

    // An administrator deletes the Node: recreated, with the annotation back.
    let old_uid = node_object.metadata.uid.clone().expect("uid");
    nodes.delete(&api.node, &DeleteParams::default()).await.expect("delete");
    let back = api
        .wait_for(&nodes, &api.node, "recreated with its CSI annotation", SOON, |n| {
            n.is_some_and(|n| n.metadata.uid.as_deref() != Some(old_uid.as_str()) && annotation(&json_of(n)).len() == 1)
        })
        .await
        .expect("node");
    assert_eq!(annotation(&json_of(&back))["a.csi.example.com"], format!("a.csi.example.com-{}", api.node));
    let new_uid = back.metadata.uid.clone().expect("uid");
    api.wait_for(&csi_nodes, &api.node, "owned by the new Node", SOON, |c| {
        c.and_then(|c| c.metadata.owner_references.as_ref()?.first()).is_some_and(|o| o.uid == new_uid)
    })
    .await;
    assert!(node.cluster().is_some());
    drivers.cancel();
}
rustlet_testkit::on_both_api_servers!(
    drivers_registering_through_the_node_reach_the_api_and_survive_node_recreation_on,
    drivers_registering_through_the_node_reach_the_api_and_survive_node_recreation
);

/// A cluster node on `api` running host processes, with its root dir and
/// shutdown token.
async fn host_node(api: &TestApi) -> (tempfile::TempDir, CancellationToken, kubelet::node::Node) {
    host_node_with(api, |_| {}).await
}

/// [`host_node`], its settings changed by `tweak`.
async fn host_node_with(
    api: &TestApi,
    tweak: impl FnOnce(&mut NodeConfig),
) -> (tempfile::TempDir, CancellationToken, kubelet::node::Node) {
    let root = rustlet_testkit::node_root::tempdir("rustlet-node-");
    let provider = std::sync::Arc::new(rustlet_testkit::host_provider::HostProcessProvider::new());
    cluster_node(api, root, provider, tweak).await
}

/// A cluster node on `api` in `root` running pods with `provider`, its
/// settings changed by `tweak`.
async fn cluster_node(
    api: &TestApi,
    root: tempfile::TempDir,
    provider: std::sync::Arc<dyn kubelet::provider::Provider>,
    tweak: impl FnOnce(&mut NodeConfig),
) -> (tempfile::TempDir, CancellationToken, kubelet::node::Node) {
    let mut config = NodeConfig::new(root.path(), api.node.clone());
    config.http_address = None;
    tweak(&mut config);
    let shutdown = CancellationToken::new();
    let node = NodeBuilder::new(config)
        .provider(provider)
        .cluster(ClusterSettings::new(ApiSource::Client(api.node_client.clone())))
        .start(shutdown.clone())
        .await
        .expect("node");
    (root, shutdown, node)
}

/// The pod's `status.message`, if any.
fn pod_message(pod: Option<&k8s_openapi::api::core::v1::Pod>) -> Option<&str> {
    pod?.status.as_ref()?.message.as_deref()
}

fn pod_phase(pod: Option<&k8s_openapi::api::core::v1::Pod>) -> Option<&str> {
    pod?.status.as_ref()?.phase.as_deref()
}

/// A persistentVolumeClaim volume through the API: the pod waits (saying
/// why) while its claim is unbound, then the PV's CSI source is staged and
/// published with its attributes; the CSIDriver object from the API asks
/// for the pod's info on mount; an inline CSI volume of another driver is
/// published too, with the service-account token its CSIDriver asks for.
async fn claims_resolve_through_the_api_and_csi_driver_objects_apply(api: TestApi) {
    use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Pod, Secret};
    use rustlet_testkit::report::Report;

    let (root, shutdown, _node) = host_node(&api).await;
    let _stop = shutdown.clone().drop_guard();
    let (reports, mut calls) = tokio::sync::mpsc::unbounded_channel();
    // One driver stages (for the claim), one serves inline volumes (which
    // are never staged).
    for (name, stage_unstage) in [("vol.csi.example.com", true), ("eph.csi.example.com", false)] {
        let driver_config = CsiDriverConfig {
            name: name.into(),
            node_id: format!("{}-{name}", api.node),
            stage_unstage,
            ..CsiDriverConfig::default()
        };
        RegisteredCsiDriver::new(
            root.path().join("plugins_registry").join(format!("{name}.sock")),
            root.path().join("plugins").join(name).join("csi.sock"),
            driver_config,
        )
        .spawn(Reporter::Channel(reports.clone()), shutdown.child_token())
        .expect("driver");
    }

    let admin = api.admin.clone();
    // The inline driver asks for a token of the pod's service account
    // (`tokenRequests`), the other for none.
    let tokens = json!([{"audience": "vault.example.com", "expirationSeconds": 600}]);
    for (name, modes, tokens) in [
        ("vol.csi.example.com", json!(["Persistent"]), json!(null)),
        ("eph.csi.example.com", json!(["Ephemeral"]), tokens),
    ] {
        api.csi_driver_object(
            name,
            json!({"attachRequired": false, "podInfoOnMount": true, "volumeLifecycleModes": modes, "tokenRequests": tokens}),
        )
        .await;
    }
    let pv_name = format!("pv-{}", api.node);
    let secret: Secret = serde_json::from_value(json!({
        "metadata": {"name": "publish", "namespace": "default"},
        "data": {"password": "aHVudGVyMg=="},
    }))
    .expect("secret");
    Api::<Secret>::namespaced(admin.clone(), "default").create(&PostParams::default(), &secret).await.expect("secret");
    let volume: PersistentVolume = serde_json::from_value(json!({
        "metadata": {"name": pv_name},
        "spec": {
            "capacity": {"storage": "1Gi"},
            "accessModes": ["ReadWriteOnce"],
            "claimRef": {"namespace": "default", "name": "data"},
            "csi": {
                "driver": "vol.csi.example.com",
                "volumeHandle": "handle-1",
                "fsType": "ext4",
                "volumeAttributes": {"tier": "gold"},
                "nodePublishSecretRef": {"name": "publish", "namespace": "default"},
            },
        },
    }))
    .expect("pv");
    Api::<PersistentVolume>::all(admin.clone()).create(&PostParams::default(), &volume).await.expect("pv");
    let claim: PersistentVolumeClaim = serde_json::from_value(json!({
        "metadata": {"name": "data", "namespace": "default"},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}},
    }))
    .expect("pvc");
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(admin.clone(), "default");
    claims.create(&PostParams::default(), &claim).await.expect("pvc");
    // The account whose token the inline driver gets.
    let account = serde_json::from_value(json!({"metadata": {"name": "csi-user"}})).expect("account");
    Api::<k8s_openapi::api::core::v1::ServiceAccount>::namespaced(admin.clone(), "default")
        .create(&PostParams::default(), &account)
        .await
        .expect("service account");
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": "user", "namespace": "default"},
        "spec": {
            "nodeName": api.node,
            "serviceAccountName": "csi-user",
            "automountServiceAccountToken": false,
            "terminationGracePeriodSeconds": 2,
            "containers": [{"name": "main", "image": "busybox", "command": ["sleep", "600"], "volumeMounts": [
                {"name": "data", "mountPath": "/data"}, {"name": "scratch", "mountPath": "/scratch"},
            ]}],
            "volumes": [
                {"name": "data", "persistentVolumeClaim": {"claimName": "data"}},
                {"name": "scratch", "csi": {"driver": "eph.csi.example.com", "volumeAttributes": {"size": "1"}}},
            ],
        },
    }))
    .expect("pod");
    let pods = Api::<Pod>::namespaced(admin.clone(), "default");
    pods.create(&PostParams::default(), &pod).await.expect("pod");

    let waiting = api
        .wait_for(&pods, "user", "saying its claim is unbound", SOON, |p| {
            pod_message(p).is_some_and(|m| m.contains("is not bound"))
        })
        .await;
    assert_eq!(pod_phase(waiting.as_ref()), Some("Pending"));
    eprintln!("while unbound: {:?}", pod_message(waiting.as_ref()));

    // The binder's work, done by hand.
    let mut bound = claims.get("data").await.expect("pvc");
    bound.spec.as_mut().expect("spec").volume_name = Some(pv_name.clone());
    let bound = claims.replace("data", &PostParams::default(), &bound).await.expect("bind");
    let mut status = bound;
    status.status = Some(serde_json::from_value(json!({"phase": "Bound"})).expect("status"));
    claims.replace_status("data", &PostParams::default(), &status).await.expect("status");

    api.wait_for(&pods, "user", "Running once its claim is bound", SOON, |p| pod_phase(p) == Some("Running")).await;
    let mut published = BTreeMap::new();
    while published.len() < 2 {
        let report = tokio::time::timeout(SOON, calls.recv()).await.expect("calls in time").expect("driver alive");
        if let Report::VolumeCall { rpc, volume_id, volume_context, .. } = report
            && rpc == "NodePublishVolume"
        {
            published.insert(volume_id, volume_context.into_iter().collect::<BTreeMap<_, _>>());
        }
    }
    let persistent = &published["handle-1"];
    assert_eq!(persistent["tier"], "gold", "the PV's volumeAttributes");
    assert_eq!(persistent["csi.storage.k8s.io/pod.name"], "user", "podInfoOnMount from the API's CSIDriver");
    let inline = published.iter().find(|(id, _)| *id != "handle-1").map(|(_, c)| c).expect("the inline volume");
    assert_eq!(inline["csi.storage.k8s.io/ephemeral"], "true");
    assert_eq!(inline["size"], "1");
    // The token its CSIDriver asked for, as the kubelet hands it: a JSON
    // object by audience, each with the token and its expiry.
    let handed: serde_json::Value =
        serde_json::from_str(&inline["csi.storage.k8s.io/serviceAccount.tokens"]).expect("tokens are JSON");
    let token = &handed["vault.example.com"];
    assert!(token["token"].as_str().is_some_and(|t| !t.is_empty()), "a token for the audience: {handed}");
    assert!(
        token["expirationTimestamp"].as_str().is_some_and(|t| t.parse::<jiff::Timestamp>().is_ok()),
        "an RFC 3339 expiry: {handed}"
    );
    assert!(
        !persistent.contains_key("csi.storage.k8s.io/serviceAccount.tokens"),
        "no token for a driver that asks for none"
    );

    // A pod that runs to completion gives its volumes back while it stays
    // in the API (a finished Job's pod), as upstream's SyncTerminatedPod:
    // its inline CSI volume is unpublished and its emptyDir removed.
    let job: Pod = serde_json::from_value(json!({
        "metadata": {"name": "job", "namespace": "default"},
        "spec": {
            "nodeName": api.node,
            "automountServiceAccountToken": false,
            "restartPolicy": "Never",
            "containers": [{"name": "main", "image": "busybox", "command": ["true"], "volumeMounts": [
                {"name": "scratch", "mountPath": "/scratch"}, {"name": "tmp", "mountPath": "/tmp"},
            ]}],
            "volumes": [
                {"name": "scratch", "csi": {"driver": "eph.csi.example.com", "volumeAttributes": {"size": "2"}}},
                {"name": "tmp", "emptyDir": {}},
            ],
        },
    }))
    .expect("pod");
    let job = pods.create(&PostParams::default(), &job).await.expect("job");
    let mut job_volume = None;
    let unpublished = loop {
        let report = tokio::time::timeout(SOON, calls.recv()).await.expect("calls in time").expect("driver alive");
        let Report::VolumeCall { rpc, volume_id, volume_context, .. } = report else { continue };
        match rpc.as_str() {
            "NodePublishVolume" if volume_context.iter().any(|(k, v)| k == "size" && v == "2") => {
                job_volume = Some(volume_id);
            }
            "NodeUnpublishVolume" if job_volume.as_ref() == Some(&volume_id) => break volume_id,
            _ => {}
        }
    };
    eprintln!("{unpublished} was unpublished once the pod finished");
    let finished = api.wait_for(&pods, "job", "Succeeded", SOON, |p| pod_phase(p) == Some("Succeeded")).await;
    assert!(finished.is_some(), "the finished pod stays in the API");
    let uid = job.metadata.uid.expect("uid");
    let empty_dir = root.path().join("pods").join(&uid).join("volumes/kubernetes.io~empty-dir/tmp");
    assert!(!empty_dir.exists(), "the finished pod's emptyDir is gone: {}", empty_dir.display());
}
rustlet_testkit::on_both_api_servers!(
    claims_resolve_through_the_api_and_csi_driver_objects_apply_on,
    claims_resolve_through_the_api_and_csi_driver_objects_apply
);

/// An online expansion's node step: the external-resizer's controller step
/// done by hand (the PV grown, the claim marked `NodeResizePending` with
/// `FileSystemResizePending`), the node calls `NodeExpandVolume` for the
/// volume its pod uses, with the new size, and writes the claim's status:
/// the new capacity, the resize conditions and status gone.
async fn a_claims_volume_grown_by_its_controller_is_expanded_on_the_node(api: TestApi) {
    use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Pod};
    use rustlet_testkit::report::Report;

    let (root, shutdown, _node) =
        host_node_with(&api, |config| config.pods.volume_refresh = Duration::from_millis(300)).await;
    let _stop = shutdown.clone().drop_guard();
    let (reports, mut calls) = tokio::sync::mpsc::unbounded_channel();
    let driver = "grow.csi.example.com";
    let driver_config =
        CsiDriverConfig { name: driver.into(), node_id: api.node.clone(), expand: true, ..CsiDriverConfig::default() };
    spawn_registered_driver(&api, &root, &shutdown, driver_config, reports).await;

    let admin = api.admin.clone();
    let (pv_name, claim_name) = (format!("pv-grow-{}", api.node), format!("grow-{}", api.node));
    let csi = json!({"driver": driver, "volumeHandle": "grow-1", "fsType": "ext4"});
    bound_claim(&api, &pv_name, &claim_name, "ReadWriteOnce", csi).await;
    let volumes = Api::<PersistentVolume>::all(admin.clone());
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(admin.clone(), "default");
    let pod = claim_user(&api, &format!("grower-{}", api.node), &claim_name);
    let pods = Api::<Pod>::namespaced(admin.clone(), "default");
    let pod_name = pod.metadata.name.clone().expect("name");
    pods.create(&PostParams::default(), &pod).await.expect("pod");
    api.wait_for(&pods, &pod_name, "Running", SOON, |p| pod_phase(p) == Some("Running")).await;
    let target = loop {
        let report = tokio::time::timeout(SOON, calls.recv()).await.expect("calls in time").expect("driver alive");
        if let Report::VolumeCall { rpc, target_path, .. } = report
            && rpc == "NodePublishVolume"
        {
            break target_path;
        }
    };

    // The resizer's controller step.
    let mut grown = volumes.get(&pv_name).await.expect("pv");
    grown.spec.as_mut().expect("spec").capacity =
        Some([("storage".to_owned(), k8s_openapi::apimachinery::pkg::api::resource::Quantity("2Gi".into()))].into());
    volumes.replace(&pv_name, &PostParams::default(), &grown).await.expect("grow the pv");
    let mut pending = claims.get(&claim_name).await.expect("pvc");
    let status = pending.status.as_mut().expect("status");
    status.allocated_resource_statuses = Some([("storage".to_owned(), "NodeResizePending".to_owned())].into());
    status.conditions = Some(vec![
        serde_json::from_value(json!({"type": "FileSystemResizePending", "status": "True",
            "message": "Waiting for user to (re-)start a pod to finish file system resize of volume on node."}))
        .expect("condition"),
    ]);
    claims.replace_status(&claim_name, &PostParams::default(), &pending).await.expect("node resize pending");

    let (volume_path, required_bytes) = loop {
        let report = tokio::time::timeout(SOON, calls.recv()).await.expect("calls in time").expect("driver alive");
        if let Report::VolumeCall { rpc, target_path, required_bytes, .. } = report
            && rpc == "NodeExpandVolume"
        {
            break (target_path, required_bytes);
        }
    };
    assert_eq!((volume_path, required_bytes), (target, 2 << 30), "expanded where it is published, to the PV's size");
    let done = api
        .wait_for(&claims, &claim_name, "the claim's new capacity", SOON, |c| {
            c.and_then(|c| c.status.as_ref()?.capacity.as_ref()?.get("storage").cloned()).is_some_and(|q| q.0 == "2Gi")
        })
        .await
        .expect("pvc");
    // In one go: the finished step is not refused for the resourceVersion
    // the in-progress step moved (which would call the driver again).
    let mut again = 0;
    while let Ok(report) = calls.try_recv() {
        again += usize::from(matches!(report, Report::VolumeCall { ref rpc, .. } if rpc == "NodeExpandVolume"));
    }
    assert_eq!(again, 0, "NodeExpandVolume once");
    let status = done.status.expect("status");
    let conditions: Vec<String> = status.conditions.iter().flatten().map(|c| c.type_.clone()).collect();
    assert!(conditions.is_empty(), "no resize condition left: {conditions:?}");
    assert!(
        !status.allocated_resource_statuses.unwrap_or_default().contains_key("storage"),
        "the node's step is no longer pending"
    );
    // NodeRestriction: the node writes nothing else of the claim's status.
    let as_node: Api<PersistentVolumeClaim> = Api::namespaced(api.node_client.clone(), "default");
    let refused = as_node
        .patch_status(&claim_name, &PatchParams::default(), &Patch::Strategic(json!({"status": {"phase": "Lost"}})))
        .await
        .expect_err("a node may not set a claim's phase");
    // ("status.quantity" since 1.32, "status.capacity" before.)
    assert!(refused.to_string().contains("is not allowed to update fields other than status."), "{refused}");
}
rustlet_testkit::on_both_api_servers!(
    a_claims_volume_grown_by_its_controller_is_expanded_on_the_node_on,
    a_claims_volume_grown_by_its_controller_is_expanded_on_the_node
);

/// A node expansion the driver refuses for good (`PermissionDenied`, a
/// final error) leaves the claim a `NodeResizeError` condition and the
/// step in progress; once the user asks for another size, the next failure
/// marks the step `NodeResizeInfeasible` (the claim handed back to the
/// resizer), and the size the resizer then gives is expanded on the node:
/// the kubelet's recovery from a failed node expansion. Before 1.32 (the
/// claim does not track the step) only the condition is written.
async fn a_node_expansion_that_fails_for_good_is_handed_back_for_recovery(api: TestApi) {
    use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Pod};
    use k8s_openapi::api::storage::v1::StorageClass;
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    use rustlet_testkit::csi_driver::VolumeCallBehaviour;
    use rustlet_testkit::report::Report;

    let (root, shutdown, _node) =
        host_node_with(&api, |config| config.pods.volume_refresh = Duration::from_millis(300)).await;
    let _stop = shutdown.clone().drop_guard();
    let (reports, mut calls) = tokio::sync::mpsc::unbounded_channel();
    let driver = "recover.csi.example.com";
    let mut driver_config =
        CsiDriverConfig { name: driver.into(), node_id: api.node.clone(), expand: true, ..CsiDriverConfig::default() };
    driver_config
        .volume_calls
        .insert("NodeExpandVolume".into(), VolumeCallBehaviour::FailAbove(tonic::Code::PermissionDenied, 8 << 30));
    spawn_registered_driver(&api, &root, &shutdown, driver_config, reports).await;

    // A claim of an expandable class (the API server resizes no other).
    let admin = api.admin.clone();
    let class = format!("expandable-{}", api.node);
    let storage_class: StorageClass = serde_json::from_value(json!({
        "metadata": {"name": class}, "provisioner": driver, "allowVolumeExpansion": true,
    }))
    .expect("class");
    Api::<StorageClass>::all(admin.clone()).create(&PostParams::default(), &storage_class).await.expect("class");
    let (pv_name, claim_name) = (format!("pv-recover-{}", api.node), format!("recover-{}", api.node));
    let volume: PersistentVolume = serde_json::from_value(json!({
        "metadata": {"name": pv_name},
        "spec": {
            "capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"], "storageClassName": class,
            "claimRef": {"namespace": "default", "name": claim_name},
            "csi": {"driver": driver, "volumeHandle": "recover-1", "fsType": "ext4"},
        },
    }))
    .expect("pv");
    let volumes = Api::<PersistentVolume>::all(admin.clone());
    volumes.create(&PostParams::default(), &volume).await.expect("pv");
    let claim: PersistentVolumeClaim = serde_json::from_value(json!({
        "metadata": {"name": claim_name, "namespace": "default"},
        "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": class,
                 "resources": {"requests": {"storage": "1Gi"}}, "volumeName": pv_name},
    }))
    .expect("pvc");
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(admin.clone(), "default");
    let mut claim = claims.create(&PostParams::default(), &claim).await.expect("pvc");
    claim.status = Some(serde_json::from_value(json!({"phase": "Bound", "capacity": {"storage": "1Gi"}})).expect("s"));
    claims.replace_status(&claim_name, &PostParams::default(), &claim).await.expect("bound");

    let pods = Api::<Pod>::namespaced(admin.clone(), "default");
    let pod = claim_user(&api, &format!("recoverer-{}", api.node), &claim_name);
    let pod_name = pod.metadata.name.clone().expect("name");
    pods.create(&PostParams::default(), &pod).await.expect("pod");
    api.wait_for(&pods, &pod_name, "Running", SOON, |p| pod_phase(p) == Some("Running")).await;

    let size = |s: &str| Some([("storage".to_owned(), Quantity(s.into()))].into());
    // The user asks for 9Gi; the resizer grows the volume in its controller
    // and leaves the node its step (by hand here).
    let resize = |to: &'static str, step: &'static str| {
        let (volumes, claims, pv_name, claim_name) =
            (volumes.clone(), claims.clone(), pv_name.clone(), claim_name.clone());
        async move {
            let mut grown = volumes.get(&pv_name).await.expect("pv");
            grown.spec.as_mut().expect("spec").capacity = size(to);
            volumes.replace(&pv_name, &PostParams::default(), &grown).await.expect("resize the pv");
            let mut pending = claims.get(&claim_name).await.expect("pvc");
            let status = pending.status.as_mut().expect("status");
            status.allocated_resources = size(to);
            status.allocated_resource_statuses = Some([("storage".to_owned(), step.to_owned())].into());
            status.conditions = Some(vec![
                serde_json::from_value(json!({"type": "FileSystemResizePending", "status": "True"}))
                    .expect("condition"),
            ]);
            claims.replace_status(&claim_name, &PostParams::default(), &pending).await.expect("node resize pending")
        }
    };
    let mut asked = claims.get(&claim_name).await.expect("pvc");
    asked.spec.as_mut().expect("spec").resources.as_mut().expect("resources").requests = size("9Gi");
    claims.replace(&claim_name, &PostParams::default(), &asked).await.expect("ask for 9Gi");
    let written = resize("9Gi", "NodeResizePending").await;
    // Before 1.32 the API server drops the step (the gate is off there).
    let tracked = written.status.as_ref().and_then(|s| s.allocated_resource_statuses.as_ref()).is_some();

    loop {
        let report = tokio::time::timeout(SOON, calls.recv()).await.expect("calls in time").expect("driver alive");
        if let Report::VolumeCall { rpc, required_bytes, .. } = report
            && rpc == "NodeExpandVolume"
        {
            assert_eq!(required_bytes, 9 << 30, "the PV's size");
            break;
        }
    }
    let node_resize_error = |c: &PersistentVolumeClaim| {
        c.status.iter().flat_map(|s| s.conditions.iter().flatten()).find(|c| c.type_ == "NodeResizeError").cloned()
    };
    let failed = api
        .wait_for(&claims, &claim_name, "NodeResizeError", SOON, |c| c.and_then(node_resize_error).is_some())
        .await
        .expect("pvc");
    let message = node_resize_error(&failed).and_then(|c| c.message).unwrap_or_default();
    assert!(message.starts_with("failed to expand pvc with "), "{message}");
    assert!(message.contains("PermissionDenied"), "the driver's error: {message}");
    let status = failed.status.clone().expect("status");
    assert_eq!(status.capacity, size("1Gi"), "not expanded");
    if !tracked {
        return;
    }
    let step =
        |c: &PersistentVolumeClaim| c.status.as_ref()?.allocated_resource_statuses.as_ref()?.get("storage").cloned();
    assert_eq!(step(&failed).as_deref(), Some("NodeResizeInProgress"), "a final error is not infeasible by itself");

    // The user gives up on 9Gi and asks for 5Gi: the node's next failure
    // hands the claim back.
    let mut smaller = claims.get(&claim_name).await.expect("pvc");
    smaller.spec.as_mut().expect("spec").resources.as_mut().expect("resources").requests = size("5Gi");
    claims.replace(&claim_name, &PostParams::default(), &smaller).await.expect("ask for 5Gi");
    api.wait_for(&claims, &claim_name, "NodeResizeInfeasible", SOON, |c| {
        c.and_then(step).as_deref() == Some("NodeResizeInfeasible")
    })
    .await;

    // The resizer takes the size asked for now; the node expands to it.
    resize("5Gi", "NodeResizePending").await;
    let done = api
        .wait_for(&claims, &claim_name, "the claim's capacity 5Gi", SOON, |c| {
            c.and_then(|c| c.status.as_ref()?.capacity.clone()) == size("5Gi")
        })
        .await
        .expect("pvc");
    assert_eq!(step(&done), None, "the node's step is over");
    let left: Vec<String> =
        done.status.iter().flat_map(|s| s.conditions.iter().flatten()).map(|c| c.type_.clone()).collect();
    assert!(left.is_empty(), "no resize condition left: {left:?}");
}
rustlet_testkit::on_both_api_servers!(
    a_node_expansion_that_fails_for_good_is_handed_back_for_recovery_on,
    a_node_expansion_that_fails_for_good_is_handed_back_for_recovery
);

/// As the kubelet: a volume no container mounts or maps is not set up at
/// all: an unused CSI volume is never published, an unused hostPath of the
/// wrong type is not checked, and the pod runs with the volume it uses.
async fn a_volume_no_container_uses_is_neither_published_nor_checked(api: TestApi) {
    use k8s_openapi::api::core::v1::Pod;
    use rustlet_testkit::report::Report;

    let (root, shutdown, _node) = host_node(&api).await;
    let _stop = shutdown.clone().drop_guard();
    let (reports, mut calls) = tokio::sync::mpsc::unbounded_channel();
    let driver = "unused.csi.example.com";
    let driver_config =
        CsiDriverConfig { name: driver.into(), node_id: api.node.clone(), ..CsiDriverConfig::default() };
    RegisteredCsiDriver::new(
        root.path().join("plugins_registry").join(format!("{driver}.sock")),
        root.path().join("plugins").join(driver).join("csi.sock"),
        driver_config,
    )
    .spawn(Reporter::Channel(reports), shutdown.child_token())
    .expect("driver");
    api.csi_driver_object(driver, json!({"attachRequired": false, "volumeLifecycleModes": ["Ephemeral"]})).await;
    let not_a_dir = root.path().join("not-a-dir");
    std::fs::write(&not_a_dir, "x").expect("file");
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": format!("frugal-{}", api.node), "namespace": "default"},
        "spec": {
            "nodeName": api.node,
            "automountServiceAccountToken": false,
            "terminationGracePeriodSeconds": 1,
            "containers": [{"name": "main", "image": "busybox", "command": ["sleep", "600"],
                            "volumeMounts": [{"name": "used", "mountPath": "/used"}]}],
            "volumes": [
                {"name": "used", "csi": {"driver": driver, "volumeAttributes": {"which": "used"}}},
                {"name": "unused", "csi": {"driver": driver, "volumeAttributes": {"which": "unused"}}},
                {"name": "wrong", "hostPath": {"path": not_a_dir.display().to_string(), "type": "Directory"}},
            ],
        },
    }))
    .expect("pod");
    let pods = Api::<Pod>::namespaced(api.admin.clone(), "default");
    let name = pod.metadata.name.clone().expect("name");
    pods.create(&PostParams::default(), &pod).await.expect("pod");
    api.wait_for(&pods, &name, "Running", SOON, |p| pod_phase(p) == Some("Running")).await;
    // Volumes are published before the containers start: every publish
    // the pod will ever see has been reported by now.
    let mut published = Vec::new();
    while let Ok(report) = calls.try_recv() {
        if let Report::VolumeCall { rpc, volume_context, .. } = report
            && rpc == "NodePublishVolume"
        {
            published.extend(volume_context.into_iter().filter(|(k, _)| k == "which").map(|(_, v)| v));
        }
    }
    assert_eq!(published, ["used"], "only the mounted volume is published");
}
rustlet_testkit::on_both_api_servers!(
    a_volume_no_container_uses_is_neither_published_nor_checked_on,
    a_volume_no_container_uses_is_neither_published_nor_checked
);

/// A CSIDriver with `requiresRepublish` gets `NodePublishVolume` again
/// while the pod runs (same volume, same target), each time with a token
/// of the pod's service account; a driver without it is published once.
async fn a_driver_that_requires_republish_is_published_again_while_the_pod_runs(api: TestApi) {
    use k8s_openapi::api::core::v1::Pod;
    use rustlet_testkit::report::Report;

    let (root, shutdown, _node) =
        host_node_with(&api, |config| config.pods.volume_refresh = Duration::from_millis(300)).await;
    let _stop = shutdown.clone().drop_guard();
    let (reports, mut calls) = tokio::sync::mpsc::unbounded_channel();
    let tokens = json!([{"audience": "secrets.example.com"}]);
    for (driver, republish) in [("again.csi.example.com", true), ("once.csi.example.com", false)] {
        let config = CsiDriverConfig { name: driver.into(), node_id: api.node.clone(), ..CsiDriverConfig::default() };
        RegisteredCsiDriver::new(
            root.path().join("plugins_registry").join(format!("{driver}.sock")),
            root.path().join("plugins").join(driver).join("csi.sock"),
            config,
        )
        .spawn(Reporter::Channel(reports.clone()), shutdown.child_token())
        .expect("driver");
        let spec = json!({"attachRequired": false, "volumeLifecycleModes": ["Ephemeral"],
                          "requiresRepublish": republish, "tokenRequests": tokens});
        api.csi_driver_object(driver, spec).await;
    }
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": format!("rotating-{}", api.node), "namespace": "default"},
        "spec": {
            "nodeName": api.node,
            "automountServiceAccountToken": false,
            "terminationGracePeriodSeconds": 1,
            "containers": [{"name": "main", "image": "busybox", "command": ["sleep", "600"], "volumeMounts": [
                {"name": "again", "mountPath": "/again"}, {"name": "once", "mountPath": "/once"},
            ]}],
            "volumes": [
                {"name": "again", "csi": {"driver": "again.csi.example.com"}},
                {"name": "once", "csi": {"driver": "once.csi.example.com"}},
            ],
        },
    }))
    .expect("pod");
    let pods = Api::<Pod>::namespaced(api.admin.clone(), "default");
    pods.create(&PostParams::default(), &pod).await.expect("pod");

    // Three publishes of the volume that asks for it (the first and two
    // more); the other volume's by then.
    let (mut again, mut once) = (Vec::new(), Vec::new());
    while again.len() < 3 {
        let report = tokio::time::timeout(SOON, calls.recv()).await.expect("calls in time").expect("driver alive");
        let Report::VolumeCall { rpc, target_path, volume_context, .. } = report else { continue };
        if rpc != "NodePublishVolume" {
            continue;
        }
        let token = volume_context.iter().any(|(k, _)| k == "csi.storage.k8s.io/serviceAccount.tokens");
        if target_path.split('/').any(|c| c == "again") {
            again.push((target_path, token));
        } else {
            once.push((target_path, token));
        }
    }
    assert!(
        again.iter().all(|(target, token)| *target == again[0].0 && *token),
        "same target, a token each: {again:?}"
    );
    assert_eq!(once.len(), 1, "published once: {once:?}");
}
rustlet_testkit::on_both_api_servers!(
    a_driver_that_requires_republish_is_published_again_while_the_pod_runs_on,
    a_driver_that_requires_republish_is_published_again_while_the_pod_runs
);

/// configMap, secret and projected (configMap, downwardAPI, token) volumes
/// and env from refs reach a container; a missing non-optional ConfigMap
/// holds the pod with upstream's message until it is created.
async fn config_maps_secrets_and_tokens_reach_the_container(api: TestApi) {
    use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret};

    let (root, shutdown, _node) = host_node(&api).await;
    let _stop = shutdown.clone().drop_guard();
    let admin = api.admin.clone();
    let config_maps: Api<ConfigMap> = Api::namespaced(admin.clone(), "default");
    let settings: ConfigMap = serde_json::from_value(json!({
        "metadata": {"name": "settings", "namespace": "default"},
        "data": {"hello": "hi there", "colour": "blue"},
    }))
    .expect("configmap");
    config_maps.create(&PostParams::default(), &settings).await.expect("configmap");
    let secret: Secret = serde_json::from_value(json!({
        "metadata": {"name": "creds", "namespace": "default"},
        "data": {"password": "aHVudGVyMg=="},
    }))
    .expect("secret");
    Api::<Secret>::namespaced(admin.clone(), "default").create(&PostParams::default(), &secret).await.expect("secret");

    let script = "cat \"$MOUNT_CONF/greeting\"; echo; cat \"$MOUNT_CREDS/password\"; echo; \
                  cat \"$MOUNT_ALL/colour\"; echo; cat \"$MOUNT_ALL/name\"; echo; \
                  test -s \"$MOUNT_ALL/token\" && echo token-present; \
                  stat -L -c %a \"$MOUNT_CONF/greeting\"; \
                  echo \"env GREETING=$GREETING PASSWORD=$PASSWORD X_colour=$X_colour OPT=${OPT-unset} EXTRA=${EXTRA-unset}\"";
    let pod = |name: &str, needs: &str| -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "default"},
            "spec": {
                "nodeName": api.node,
                "automountServiceAccountToken": false,
                "restartPolicy": "Never",
                "containers": [{
                    "name": "main", "image": "busybox", "command": ["sh", "-c", script],
                    "env": [
                        {"name": "GREETING", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "hello"}}},
                        {"name": "PASSWORD", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "password"}}},
                        {"name": "OPT", "valueFrom": {"configMapKeyRef": {"name": "absent", "key": "k", "optional": true}}},
                        {"name": "EXTRA", "valueFrom": {"configMapKeyRef": {"name": needs, "key": "extra", "optional": true}}},
                    ],
                    "envFrom": [{"prefix": "X_", "configMapRef": {"name": "settings"}}],
                    "volumeMounts": [
                        {"name": "conf", "mountPath": "/conf"},
                        {"name": "creds", "mountPath": "/creds"},
                        {"name": "all", "mountPath": "/all"},
                        {"name": "needed", "mountPath": "/needed"},
                    ],
                }],
                "volumes": [
                    {"name": "conf", "configMap": {"name": "settings", "items": [{"key": "hello", "path": "greeting", "mode": 0o400}]}},
                    {"name": "creds", "secret": {"secretName": "creds"}},
                    {"name": "all", "projected": {"sources": [
                        {"configMap": {"name": "settings", "items": [{"key": "colour", "path": "colour"}]}},
                        {"downwardAPI": {"items": [{"path": "name", "fieldRef": {"fieldPath": "metadata.name"}}]}},
                        {"serviceAccountToken": {"path": "token", "audience": "vault", "expirationSeconds": 600}},
                    ]}},
                    {"name": "needed", "configMap": {"name": needs}},
                ],
            },
        }))
        .expect("pod")
    };
    let pods: Api<Pod> = Api::namespaced(admin.clone(), "default");
    // "late" does not exist yet: the pod waits, saying why.
    pods.create(&PostParams::default(), &pod("reader", "late")).await.expect("pod");
    let waiting = api
        .wait_for(&pods, "reader", "saying its ConfigMap is missing", SOON, |p| {
            pod_message(p).is_some_and(|m| m.contains("configmap \"late\" not found"))
        })
        .await;
    assert_eq!(pod_phase(waiting.as_ref()), Some("Pending"));
    let late: ConfigMap = serde_json::from_value(json!({
        "metadata": {"name": "late", "namespace": "default"},
        "data": {"extra": "arrived"},
    }))
    .expect("configmap");
    config_maps.create(&PostParams::default(), &late).await.expect("configmap");

    let done = api
        .wait_for(&pods, "reader", "finished", SOON, |p| matches!(pod_phase(p), Some("Succeeded" | "Failed")))
        .await
        .expect("pod");
    let uid = done.metadata.uid.as_deref().expect("uid");
    let log_path = kubelet::pod::pod_log_dir(root.path(), "default", "reader", uid).join("main").join("0.log");
    let log = std::fs::read_to_string(&log_path).expect("log");
    let lines: Vec<&str> = log.lines().map(|l| l.splitn(4, ' ').nth(3).unwrap_or_default()).collect();
    assert_eq!(pod_phase(Some(&done)), Some("Succeeded"), "{lines:?}");
    assert_eq!(
        lines,
        [
            "hi there",
            "hunter2",
            "blue",
            "reader",
            "token-present",
            "400",
            "env GREETING=hi there PASSWORD=hunter2 X_colour=blue OPT=unset EXTRA=arrived",
        ],
    );
}
rustlet_testkit::on_both_api_servers!(
    config_maps_secrets_and_tokens_reach_the_container_on,
    config_maps_secrets_and_tokens_reach_the_container
);

/// Volume contents follow the API while the pod runs, as upstream's
/// atomic writer keeps them: a changed ConfigMap, an optional ConfigMap and
/// Secret created after the pod started, and new labels reach the running
/// container's files; secret files belong to the pod's `fsGroup` and are
/// group-readable; a projected downwardAPI source carries resources; the
/// env has the link variables of the namespace's services.
async fn volume_contents_follow_the_api_while_the_pod_runs(api: TestApi) {
    use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret, Service};
    use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};

    let root = rustlet_testkit::node_root::tempdir("rustlet-node-");
    let provider = std::sync::Arc::new(rustlet_testkit::host_provider::HostProcessProvider::new());
    let mut config = NodeConfig::new(root.path(), api.node.clone());
    config.http_address = None;
    config.pods.volume_refresh = Duration::from_millis(300);
    let shutdown = CancellationToken::new();
    let _stop = shutdown.clone().drop_guard();
    let _node = NodeBuilder::new(config)
        .provider(provider)
        .cluster(ClusterSettings::new(ApiSource::Client(api.node_client.clone())))
        .start(shutdown.clone())
        .await
        .expect("node");
    let admin = api.admin.clone();
    let config_maps: Api<ConfigMap> = Api::namespaced(admin.clone(), "default");
    let secrets: Api<Secret> = Api::namespaced(admin.clone(), "default");
    let object = |name: &str, value: &str| -> ConfigMap {
        serde_json::from_value(json!({"metadata": {"name": name, "namespace": "default"}, "data": {"data-1": value}}))
            .expect("configmap")
    };
    config_maps.create(&PostParams::default(), &object("live", "value-1")).await.expect("configmap");
    let service: Service = serde_json::from_value(json!({
        "metadata": {"name": "fooservice", "namespace": "default"},
        "spec": {"ports": [{"port": 8765, "protocol": "TCP", "targetPort": 8080}]},
    }))
    .expect("service");
    let service = Api::<Service>::namespaced(admin.clone(), "default")
        .create(&PostParams::default(), &service)
        .await
        .expect("service");
    let cluster_ip = service.spec.and_then(|s| s.cluster_ip).expect("a cluster IP");

    let script = "echo \"FOOSERVICE_SERVICE_HOST=$FOOSERVICE_SERVICE_HOST\"; \
                  while true; do \
                    echo \"live=$(cat $MOUNT_LIVE/data-1) opt=$(cat $MOUNT_OPT/data-1 2>/dev/null) \
                    secret=$(cat $MOUNT_SECRET/data-1 2>/dev/null) labels=$(cat $MOUNT_INFO/labels | tr '\\n' ' ')\"; \
                    sleep 0.2; done";
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": "follower", "namespace": "default", "labels": {"key1": "value1"}},
        "spec": {
            "nodeName": api.node,
            "automountServiceAccountToken": false,
            "securityContext": {"fsGroup": 4321},
            "containers": [{
                "name": "main", "image": "busybox", "command": ["sh", "-c", script],
                "resources": {"limits": {"memory": "64Mi"}, "requests": {"cpu": "250m"}},
                "volumeMounts": [
                    {"name": "live", "mountPath": "/live"}, {"name": "opt", "mountPath": "/opt"},
                    {"name": "secret", "mountPath": "/secret"}, {"name": "info", "mountPath": "/info"},
                ],
            }],
            "volumes": [
                {"name": "live", "configMap": {"name": "live"}},
                {"name": "opt", "configMap": {"name": "later", "optional": true}},
                {"name": "secret", "secret": {"secretName": "later-secret", "optional": true, "defaultMode": 0o400}},
                {"name": "info", "projected": {"sources": [{"downwardAPI": {"items": [
                    {"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}},
                    {"path": "memory_limit", "resourceFieldRef": {"containerName": "main", "resource": "limits.memory", "divisor": "1Mi"}},
                    {"path": "cpu_request", "resourceFieldRef": {"containerName": "main", "resource": "requests.cpu", "divisor": "1m"}},
                ]}}]}},
            ],
        },
    }))
    .expect("pod");
    let pods: Api<Pod> = Api::namespaced(admin.clone(), "default");
    let created = pods.create(&PostParams::default(), &pod).await.expect("pod");
    let uid = created.metadata.uid.clone().expect("uid");
    let log = kubelet::pod::pod_log_dir(root.path(), "default", "follower", &uid).join("main").join("0.log");
    let first = rustlet_testkit::wait_file(&log, |text| text.contains("live=value-1"), SOON).await;
    assert!(first.contains(&format!("FOOSERVICE_SERVICE_HOST={cluster_ip}")), "{first}");
    assert!(first.contains("labels=key1=\"value1\""), "{first}");
    let info = root.path().join(format!("pods/{uid}/volumes/kubernetes.io~projected/info"));
    assert_eq!(std::fs::read_to_string(info.join("memory_limit")).expect("memory_limit"), "64");
    assert_eq!(std::fs::read_to_string(info.join("cpu_request")).expect("cpu_request"), "250");

    // Changes while it runs.
    config_maps
        .replace("live", &PostParams::default(), &{
            let mut live = config_maps.get("live").await.expect("get");
            live.data = Some([("data-1".to_owned(), "value-2".to_owned())].into());
            live
        })
        .await
        .expect("update");
    config_maps.create(&PostParams::default(), &object("later", "created-later")).await.expect("configmap");
    let secret: Secret = serde_json::from_value(json!({
        "metadata": {"name": "later-secret", "namespace": "default"}, "stringData": {"data-1": "secret-later"},
    }))
    .expect("secret");
    secrets.create(&PostParams::default(), &secret).await.expect("secret");
    pods.patch(
        "follower",
        &PatchParams::default(),
        &Patch::Merge(&json!({"metadata": {"labels": {"key3": "value3"}}})),
    )
    .await
    .expect("labels");
    let text = rustlet_testkit::wait_file(
        &log,
        |text| {
            text.lines().any(|l| {
                l.contains("live=value-2")
                    && l.contains("opt=created-later")
                    && l.contains("secret=secret-later")
                    && l.contains("key3=\"value3\"")
            })
        },
        SOON,
    )
    .await;
    assert!(!text.is_empty());
    // Three more changes, each seen by the running container.
    for round in 3..6 {
        let mut live = config_maps.get("live").await.expect("get");
        live.data = Some([("data-1".to_owned(), format!("value-{round}"))].into());
        config_maps.replace("live", &PostParams::default(), &live).await.expect("update");
        let seen = format!("live=value-{round} ");
        rustlet_testkit::wait_file(&log, |text| text.contains(&seen), SOON).await;
    }
    // The rewrites (every 300 ms here) read the objects from their watches,
    // not the API: one watch per object, a GET only while a new watch has
    // not listed (the first start's reads wait 2 s for it); a container's
    // link variables come from a watch of the services.
    if let rustlet_testkit::test_api::Server::Fake(server) = &api.server {
        let node_user = format!("system:node:{}", api.node);
        let by_node = || -> Vec<_> {
            server.requests().into_iter().filter(|r| r.user.as_deref() == Some(node_user.as_str())).collect()
        };
        let gets_of_live = |requests: &[rustlet_testkit::apiserver::Logged]| {
            requests.iter().filter(|r| r.method == Method::GET && r.uri.ends_with("/configmaps/live")).count()
        };
        let service_lists = |requests: &[rustlet_testkit::apiserver::Logged]| {
            requests.iter().filter(|r| r.uri.contains("/namespaces/default/services")).count()
        };
        let before = by_node();
        let gets = gets_of_live(&before);
        assert!(gets <= 2, "GETs of the ConfigMap: {gets}: {before:#?}");
        let watches = before
            .iter()
            .filter(|r| {
                r.uri.contains("/configmaps?") && r.uri.contains("metadata.name%3Dlive") && r.uri.contains("watch=true")
            })
            .count();
        assert!(watches >= 1, "no watch of the ConfigMap: {before:#?}");
        let service_watch =
            before.iter().any(|r| r.uri.starts_with("/api/v1/services?") && r.uri.contains("watch=true"));
        assert!(service_watch, "no watch of the services: {before:#?}");
        // A second pod showing the same ConfigMap in a volume and its env
        // starts from the watches alone: no GET, no listing.
        let second: Pod = serde_json::from_value(json!({
            "metadata": {"name": "second", "namespace": "default"},
            "spec": {
                "nodeName": api.node,
                "automountServiceAccountToken": false,
                "containers": [{
                    "name": "main", "image": "busybox",
                    "command": ["sh", "-c", "echo \"second env=$LIVE file=$(cat $MOUNT_LIVE/data-1) host=$FOOSERVICE_SERVICE_HOST\"; sleep 3600"],
                    "env": [{"name": "LIVE", "valueFrom": {"configMapKeyRef": {"name": "live", "key": "data-1"}}}],
                    "volumeMounts": [{"name": "live", "mountPath": "/live"}],
                }],
                "volumes": [{"name": "live", "configMap": {"name": "live"}}],
            },
        }))
        .expect("pod");
        let uid = pods.create(&PostParams::default(), &second).await.expect("pod").metadata.uid.expect("uid");
        let log = kubelet::pod::pod_log_dir(root.path(), "default", "second", &uid).join("main").join("0.log");
        let line = format!("second env=value-5 file=value-5 host={cluster_ip}");
        rustlet_testkit::wait_file(&log, |text| text.contains(&line), SOON).await;
        let after = by_node();
        assert_eq!(gets_of_live(&after), gets, "the second pod's start read the ConfigMap from the API");
        assert_eq!(service_lists(&after), service_lists(&before), "the second pod's start listed the services");
    }
    // The secret's file: the pod's fsGroup, group-readable (0400 → 0440).
    let file = root.path().join(format!("pods/{uid}/volumes/kubernetes.io~secret/secret/data-1"));
    let meta = std::fs::metadata(&file).expect("secret file");
    if rustlet_testkit::skip::is_root() {
        assert_eq!((meta.gid(), meta.permissions().mode() & 0o777), (4321, 0o440));
    } else {
        rustlet_testkit::skip::skip_check(
            "volume_contents_follow_the_api_while_the_pod_runs",
            "the file's fsGroup",
            rustlet_testkit::skip::Need::Root,
            "only root may give files to another group",
        );
        // The mode still follows.
        assert_eq!(meta.permissions().mode() & 0o777, 0o440);
    }
    pods.delete("follower", &DeleteParams::default()).await.expect("delete");
}
rustlet_testkit::on_both_api_servers!(
    volume_contents_follow_the_api_while_the_pod_runs_on,
    volume_contents_follow_the_api_while_the_pod_runs
);

/// A pod's `imagePullSecrets` (a `kubernetes.io/dockerconfigjson` Secret)
/// reach the WebAssembly provider: an image from a registry that wants a
/// password is pulled with it, and without it the pod says access was
/// refused.
async fn image_pull_secrets_reach_the_provider(api: TestApi) {
    use k8s_openapi::api::core::v1::{Pod, Secret};
    let Some(registry) =
        rustlet_testkit::registry::registry_or_skip("image pull secrets", Some(("puller", "s3cret"))).await
    else {
        return;
    };
    let module = rustlet_wasi::examples::binary("sleep").expect("module");
    registry.push_wasm("wasm/private", "v1", &module).await.expect("push");
    let root = rustlet_testkit::node_root::tempdir("rustlet-node-");
    let provider = rustlet_wasi::WasiProvider::new(rustlet_wasi::WasiConfig::new(root.path())).expect("provider");
    let (_root, shutdown, _node) = cluster_node(&api, root, std::sync::Arc::new(provider), |_| {}).await;
    let _stop = shutdown.clone().drop_guard();
    let admin = api.admin.clone();
    let docker_config = json!({"auths": {registry.host(): {"username": "puller", "password": "s3cret"}}}).to_string();
    let secret: Secret = serde_json::from_value(json!({
        "metadata": {"name": "registry-login", "namespace": "default"},
        "type": "kubernetes.io/dockerconfigjson",
        "stringData": {".dockerconfigjson": docker_config},
    }))
    .expect("secret");
    Api::<Secret>::namespaced(admin.clone(), "default").create(&PostParams::default(), &secret).await.expect("secret");
    let pods: Api<Pod> = Api::namespaced(admin, "default");
    let image = registry.reference("wasm/private", "v1");
    for (name, secrets) in [("without", json!([])), ("with", json!([{"name": "registry-login"}]))] {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "default"},
            "spec": {
                "nodeName": api.node,
                "automountServiceAccountToken": false,
                "terminationGracePeriodSeconds": 2,
                "imagePullSecrets": secrets,
                "containers": [{"name": "main", "image": image, "imagePullPolicy": "Always"}],
            },
        }))
        .expect("pod");
        pods.create(&PostParams::default(), &pod).await.expect("pod");
    }
    api.wait_for(&pods, "with", "Running (pulled with the secret)", SOON, |p| pod_phase(p) == Some("Running")).await;
    // The same image, pulled without credentials: refused, even though the
    // other pod's pull put it in the store (policy Always asks the registry).
    let refused = api
        .wait_for(&pods, "without", "refused its image", SOON, |p| {
            let reason = p
                .and_then(|p| p.status.as_ref()?.container_statuses.as_ref()?.first()?.state.as_ref()?.waiting.as_ref())
                .and_then(|w| w.reason.as_deref());
            matches!(reason, Some("ErrImagePull" | "ImagePullBackOff"))
        })
        .await;
    assert_eq!(pod_phase(refused.as_ref()), Some("Pending"));
}
rustlet_testkit::on_both_api_servers!(image_pull_secrets_reach_the_provider_on, image_pull_secrets_reach_the_provider);

/// A token request for a new pod that the API server refuses because its
/// own view of the pod lags (403 or 404 while its authorizer's informers
/// catch up) is asked again within a second, not after the volume backoff.
#[tokio::test]
async fn a_new_pods_token_refused_while_the_api_server_catches_up_is_asked_again_at_once() {
    use k8s_openapi::api::core::v1::Pod;

    let api = TestApi::fake().await;
    let server = api.fake_server().expect("the in-process server");
    // A volume backoff far past the test's bound: only the token request's
    // own quick retries can start the pod in time.
    let (root, shutdown, _node) = host_node_with(&api, |config| {
        config.pods.volume_backoff =
            kubelet::pod::BackoffConfig { initial: SOON * 10, max: SOON * 10, reset_after: Duration::MAX };
    })
    .await;
    let _stop = shutdown.clone().drop_guard();
    server.inject(Fault::status(Some(Method::POST), "/serviceaccounts/default/token", 403, 1));
    server.inject(Fault::status(Some(Method::POST), "/serviceaccounts/default/token", 404, 1));
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": "fresh", "namespace": "default"},
        "spec": {
            "nodeName": api.node,
            "automountServiceAccountToken": false,
            "restartPolicy": "Never",
            "containers": [{
                "name": "main", "image": "busybox",
                "command": ["sh", "-c", "test -s \"$MOUNT_TOKEN/token\" && echo token-present"],
                "volumeMounts": [{"name": "token", "mountPath": "/token"}],
            }],
            "volumes": [{"name": "token", "projected": {"sources": [
                {"serviceAccountToken": {"path": "token", "expirationSeconds": 600}},
            ]}}],
        },
    }))
    .expect("pod");
    let pods: Api<Pod> = Api::namespaced(api.admin.clone(), "default");
    pods.create(&PostParams::default(), &pod).await.expect("pod");
    let done = api
        .wait_for(&pods, "fresh", "finished", SOON, |p| matches!(pod_phase(p), Some("Succeeded" | "Failed")))
        .await
        .expect("pod");
    assert_eq!(pod_phase(Some(&done)), Some("Succeeded"));
    let uid = done.metadata.uid.as_deref().expect("uid");
    let log = kubelet::pod::pod_log_dir(root.path(), "default", "fresh", uid).join("main").join("0.log");
    assert!(std::fs::read_to_string(&log).expect("log").contains("token-present"));
    let node_user = format!("system:node:{}", api.node);
    let tokens: Vec<_> = server
        .requests()
        .into_iter()
        .filter(|r| r.user.as_deref() == Some(node_user.as_str()) && r.uri.contains("/token"))
        .collect();
    let statuses: Vec<u16> = tokens.iter().map(|r| r.status).collect();
    assert_eq!(statuses, [403, 404, 201], "{tokens:#?}");
}

/// A volume whose only access mode is `ReadWriteOncePod` serves one pod of
/// the node at a time: a second pod placed on the node by name (the
/// scheduler would keep it away) waits, saying why in upstream's words,
/// until the first is deleted, then starts.
async fn a_read_write_once_pod_volume_serves_one_pod_at_a_time(api: TestApi) {
    use k8s_openapi::api::core::v1::Pod;

    let driver = "rwop.csi.example.com";
    let (_root, _stop, _node) = node_with_driver(&api, driver).await;

    let admin = api.admin.clone();
    let (pv_name, claim_name) = (format!("pv-rwop-{}", api.node), format!("rwop-{}", api.node));
    bound_claim(&api, &pv_name, &claim_name, "ReadWriteOncePod", json!({"driver": driver, "volumeHandle": "rwop-1"}))
        .await;
    let pod = |name: &str| claim_user(&api, name, &claim_name);
    let pods = Api::<Pod>::namespaced(admin.clone(), "default");
    let (first, second) = (format!("rwop-first-{}", api.node), format!("rwop-second-{}", api.node));
    pods.create(&PostParams::default(), &pod(&first)).await.expect("pod");
    api.wait_for(&pods, &first, "Running", SOON, |p| pod_phase(p) == Some("Running")).await;

    pods.create(&PostParams::default(), &pod(&second)).await.expect("pod");
    let refused = "volume uses the ReadWriteOncePod access mode and is already in use by another pod";
    let waiting = api
        .wait_for(&pods, &second, "held back by the first pod's use", SOON, |p| {
            pod_message(p).is_some_and(|m| m.contains(refused))
        })
        .await;
    assert_eq!(pod_phase(waiting.as_ref()), Some("Pending"), "{:?}", pod_message(waiting.as_ref()));

    // Once the first pod is gone the second gets the volume (a liveness
    // bound over the volume backoff, which has doubled meanwhile).
    pods.delete(&first, &DeleteParams::default()).await.expect("delete");
    api.wait_for(&pods, &second, "Running once the first pod is gone", SOON * 6, |p| pod_phase(p) == Some("Running"))
        .await;
}
rustlet_testkit::on_both_api_servers!(
    a_read_write_once_pod_volume_serves_one_pod_at_a_time_on,
    a_read_write_once_pod_volume_serves_one_pod_at_a_time
);

/// The test CSI driver `config` registered through the node's
/// `plugins_registry` (reporting to `reports`), with a CSIDriver object
/// saying it needs no attaching.
async fn spawn_registered_driver(
    api: &TestApi,
    root: &tempfile::TempDir,
    shutdown: &CancellationToken,
    config: CsiDriverConfig,
    reports: tokio::sync::mpsc::UnboundedSender<rustlet_testkit::report::Report>,
) {
    let driver = config.name.clone();
    RegisteredCsiDriver::new(
        root.path().join("plugins_registry").join(format!("{driver}.sock")),
        root.path().join("plugins").join(&driver).join("csi.sock"),
        config,
    )
    .spawn(Reporter::Channel(reports), shutdown.child_token())
    .expect("driver");
    api.csi_driver_object(&driver, json!({"attachRequired": false})).await;
}

/// A 1Gi PersistentVolume `pv_name` of CSI source `csi` with the one
/// access mode `mode`, and claim `claim_name` in `default` bound to it.
async fn bound_claim(api: &TestApi, pv_name: &str, claim_name: &str, mode: &str, csi: Value) {
    use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
    let volume: PersistentVolume = serde_json::from_value(json!({
        "metadata": {"name": pv_name},
        "spec": {
            "capacity": {"storage": "1Gi"},
            "accessModes": [mode],
            "claimRef": {"namespace": "default", "name": claim_name},
            "csi": csi,
        },
    }))
    .expect("pv");
    Api::<PersistentVolume>::all(api.admin.clone()).create(&PostParams::default(), &volume).await.expect("pv");
    let claim: PersistentVolumeClaim = serde_json::from_value(json!({
        "metadata": {"name": claim_name, "namespace": "default"},
        "spec": {"accessModes": [mode], "resources": {"requests": {"storage": "1Gi"}}, "volumeName": pv_name},
    }))
    .expect("pvc");
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(api.admin.clone(), "default");
    let mut claim = claims.create(&PostParams::default(), &claim).await.expect("pvc");
    claim.status = Some(serde_json::from_value(json!({"phase": "Bound", "capacity": {"storage": "1Gi"}})).expect("s"));
    claims.replace_status(claim_name, &PostParams::default(), &claim).await.expect("bound");
}

/// Pod `name` in `default` on the test's node, a sleeping container with
/// claim `claim` mounted.
fn claim_user(api: &TestApi, name: &str, claim: &str) -> k8s_openapi::api::core::v1::Pod {
    volume_user(api, name, json!({"name": "data", "persistentVolumeClaim": {"claimName": claim}}))
}

/// Pod `name` in `default` on the test's node, a sleeping container with
/// the one volume `volume` mounted at `/data`.
fn volume_user(api: &TestApi, name: &str, volume: Value) -> k8s_openapi::api::core::v1::Pod {
    let mount = json!({"name": volume["name"], "mountPath": "/data"});
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "nodeName": api.node,
            "automountServiceAccountToken": false,
            "terminationGracePeriodSeconds": 1,
            "containers": [{"name": "main", "image": "busybox", "command": ["sleep", "600"], "volumeMounts": [mount]}],
            "volumes": [volume],
        },
    }))
    .expect("pod")
}

/// A generic ephemeral volume (`ephemeral.volumeClaimTemplate`) is the
/// claim `<pod>-<volume>` its controller makes (made here by hand, owned by
/// the pod), published as any claim; a claim of that name the pod does not
/// own is refused in upstream's words.
async fn a_generic_ephemeral_volume_is_the_claim_made_for_its_pod(api: TestApi) {
    use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod};

    let driver = "gev.csi.example.com";
    let (_root, _stop, _node) = node_with_driver(&api, driver).await;

    let pods = Api::<Pod>::namespaced(api.admin.clone(), "default");
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(api.admin.clone(), "default");
    let template = json!({"spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}});
    for (pod_name, owned) in [(format!("gev-{}", api.node), true), (format!("gev-thief-{}", api.node), false)] {
        let pod =
            volume_user(&api, &pod_name, json!({"name": "scratch", "ephemeral": {"volumeClaimTemplate": template}}));
        let pod = pods.create(&PostParams::default(), &pod).await.expect("pod");
        // The ephemeral controller's work, done by hand.
        let claim_name = format!("{pod_name}-scratch");
        bound_claim(
            &api,
            &format!("pv-{claim_name}"),
            &claim_name,
            "ReadWriteOnce",
            json!({"driver": driver, "volumeHandle": claim_name}),
        )
        .await;
        if owned {
            let owner = json!({"metadata": {"ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": pod_name,
                "uid": pod.metadata.uid, "controller": true, "blockOwnerDeletion": true}]}});
            claims.patch(&claim_name, &PatchParams::default(), &Patch::Merge(&owner)).await.expect("owner");
            api.wait_for(&pods, &pod_name, "Running on its claim", SOON, |p| pod_phase(p) == Some("Running")).await;
        } else {
            let refused = api
                .wait_for(&pods, &pod_name, "refused a claim it does not own", SOON, |p| {
                    pod_message(p).is_some_and(|m| m.contains("(pod is not owner)"))
                })
                .await;
            assert_eq!(pod_phase(refused.as_ref()), Some("Pending"), "{:?}", pod_message(refused.as_ref()));
        }
    }
}
rustlet_testkit::on_both_api_servers!(
    a_generic_ephemeral_volume_is_the_claim_made_for_its_pod_on,
    a_generic_ephemeral_volume_is_the_claim_made_for_its_pod
);

/// A host node on `api` with the test CSI driver `driver` registered (its
/// calls unread); the node stops when the guard drops.
async fn node_with_driver(
    api: &TestApi,
    driver: &str,
) -> (tempfile::TempDir, tokio_util::sync::DropGuard, kubelet::node::Node) {
    let (root, shutdown, node) = host_node(api).await;
    let (reports, calls) = tokio::sync::mpsc::unbounded_channel();
    // Nobody reads the calls: the receiver goes, and the driver's reports with it.
    drop(calls);
    let config = CsiDriverConfig { name: driver.into(), node_id: api.node.clone(), ..CsiDriverConfig::default() };
    spawn_registered_driver(api, &root, &shutdown, config, reports).await;
    (root, shutdown.drop_guard(), node)
}
