//! `rustlet --kubeconfig` as a user runs it: the binary joins a cluster (the
//! in-process API server, with a node identity under the Node authorizer),
//! registers its Node with labels, taints, addresses and a device plugin's
//! resource, runs a pod bound to it, and keeps going when the kubeconfig is
//! missing or the API unreachable at start.

use std::path::Path;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, PostParams};
use kubelet_api::constants::{DEVICE_PLUGIN_VERSION, DEVICE_PLUGINS_DIR, KUBELET_SOCKET};
use kubelet_api::deviceplugin::v1beta1::DevicePluginOptions;
use rustlet_sample_plugins::device_plugin::{
    DeviceControl, DevicePluginBehaviour, DeviceSpec, FakeDevicePlugin, register_with_kubelet,
};
use rustlet_sample_plugins::report::Reporter;
use rustlet_testkit::apiserver::{ApiServer, write_kubeconfig};
use rustlet_testkit::node_process::{NodeProcess, http_get, local_socket};
use rustlet_testkit::test_api::TestApi;
use serde_json::{Value, json};
use tokio::process::Command;
use tokio_util::sync::CancellationToken;

/// A liveness bound for API objects to reach a state.
const SOON: Duration = Duration::from_secs(60);
const RESOURCE: &str = "example.com/gpu";

fn rustlet(root: &Path, kubeconfig: &Path, extra: &[&str]) -> NodeProcess {
    rustlet_as("n1", root, kubeconfig, extra)
}

/// `rustlet --kubeconfig` as node `node`.
fn rustlet_as(node: &str, root: &Path, kubeconfig: &Path, extra: &[&str]) -> NodeProcess {
    let mut command = Command::new(env!("CARGO_BIN_EXE_rustlet"));
    command
        .env("RUSTLET_LOG", "info")
        .env_remove("RUSTLET_ROOT_DIR")
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .arg("--root-dir")
        .arg(root)
        .args(["--node-name", node, "--healthz-port", "0", "--port", "0"])
        .args(extra);
    NodeProcess::start(command)
}

async fn import_example(root: &Path, name: &str) {
    rustlet_testkit::node_process::import_example(
        Path::new(env!("CARGO_BIN_EXE_rustlet")),
        root,
        "example.com/test",
        name,
    )
    .await;
}

/// A device plugin with `healthy` healthy devices, registered on the node;
/// its device stream lasts as long as the returned control.
async fn device_plugin(root: &Path, healthy: usize, stop: &CancellationToken) -> DeviceControl {
    let devices: Vec<DeviceSpec> =
        (0..healthy).map(|i| format!("gpu-{i}:Healthy:0").parse().expect("device")).collect();
    let options = DevicePluginOptions::default();
    let (plugin, control) =
        FakeDevicePlugin::new(RESOURCE, devices, options, DevicePluginBehaviour::Normal, Reporter::Discard);
    let socket = root.join(DEVICE_PLUGINS_DIR).join("gpu.sock");
    plugin.spawn(&socket, stop.child_token()).expect("plugin");
    register_with_kubelet(
        &root.join(DEVICE_PLUGINS_DIR).join(KUBELET_SOCKET),
        DEVICE_PLUGIN_VERSION,
        "gpu.sock",
        RESOURCE,
        options,
    )
    .await
    .expect("register");
    control
}

fn text<'a>(value: &'a Value, pointer: &str) -> Option<&'a str> {
    value.pointer(pointer).and_then(Value::as_str)
}

fn condition(node: &Value, type_: &str) -> Option<String> {
    node.pointer("/status/conditions")?
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)
        .and_then(|c| c["status"].as_str().map(str::to_owned))
}

async fn ready_node(server: &ApiServer) -> Value {
    let ready = server
        .wait_object(("", "nodes", "", "n1"), SOON, |node| {
            node.is_some_and(|n| condition(n, "Ready").as_deref() == Some("True"))
        })
        .await;
    ready.unwrap_or_else(|seen| panic!("node n1 not Ready in time; last seen: {seen:#?}")).expect("node")
}

#[tokio::test]
async fn the_binary_joins_a_cluster_as_a_node_and_runs_a_bound_pod() {
    let root = tempfile::tempdir().expect("tempdir");
    import_example(root.path(), "sleep").await;
    let server = ApiServer::start().await.expect("api server");
    let kubeconfig = root.path().join("kubeconfig");
    server.write_kubeconfig(&kubeconfig, &server.node_token("n1")).expect("kubeconfig");
    let mut node = rustlet(
        root.path(),
        &kubeconfig,
        &[
            "--node-labels",
            "zone=z1,tier=edge",
            "--register-with-taints",
            "dedicated=wasm:NoSchedule",
            "--node-ip",
            "10.9.8.7",
        ],
    );
    node.http_address().await;
    node.line_with("node started").await;
    let plugins = CancellationToken::new();
    let _devices = device_plugin(root.path(), 2, &plugins).await;

    // The Node: labels (own, provider's, flags'), taints, address, the
    // device resource, Ready.
    let with_devices = server
        .wait_object(("", "nodes", "", "n1"), SOON, |node| {
            node.and_then(|n| text(n, &format!("/status/allocatable/{}", RESOURCE.replace('/', "~1")))) == Some("2")
        })
        .await;
    let node_object = with_devices.unwrap_or_else(|seen| panic!("no {RESOURCE} on the node: {seen:#?}")).expect("node");
    let labels = &node_object["metadata"]["labels"];
    assert_eq!(labels["zone"], "z1");
    assert_eq!(labels["tier"], "edge");
    assert_eq!(labels["kubernetes.io/hostname"], "n1");
    assert_eq!(labels["kubernetes.io/arch"], "wasm32-wasi", "the WebAssembly provider's label");
    let taints = node_object["spec"]["taints"].as_array().cloned().unwrap_or_default();
    assert!(
        taints.iter().any(|t| t["key"] == "dedicated" && t["value"] == "wasm" && t["effect"] == "NoSchedule"),
        "{taints:?}"
    );
    let addresses = node_object["status"]["addresses"].as_array().cloned().unwrap_or_default();
    assert_eq!(addresses[0], json!({"type": "InternalIP", "address": "10.9.8.7"}), "{addresses:?}");
    let node_object = ready_node(&server).await;
    for pressure in ["MemoryPressure", "DiskPressure", "PIDPressure"] {
        assert_eq!(condition(&node_object, pressure).as_deref(), Some("False"), "{pressure}");
    }
    let lease = server
        .wait_object(("coordination.k8s.io", "leases", "kube-node-lease", "n1"), SOON, |lease| {
            lease.is_some_and(|l| text(l, "/spec/holderIdentity") == Some("n1"))
        })
        .await;
    assert!(lease.is_ok(), "no lease held by n1: {lease:?}");

    // A pod bound to the node that asks for a device runs, and its status
    // reaches the API.
    let admin = server.client(server.admin_token()).await.expect("admin");
    let pods: Api<Pod> = Api::namespaced(admin, "default");
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": "sleeper", "namespace": "default"},
        "spec": {
            "nodeName": "n1",
            "terminationGracePeriodSeconds": 5,
            "containers": [{
                "name": "main",
                "image": "example.com/test/sleep:v1",
                "imagePullPolicy": "Never",
                "resources": {"limits": {RESOURCE: "1"}},
            }],
        },
    }))
    .expect("pod");
    let created = pods.create(&PostParams::default(), &pod).await.expect("create");
    let running = server
        .wait_object(("", "pods", "default", "sleeper"), SOON, |pod| {
            pod.is_some_and(|p| {
                text(p, "/status/phase") == Some("Running")
                    && p.pointer("/status/containerStatuses/0/state/running").is_some()
            })
        })
        .await;
    let running = running.unwrap_or_else(|seen| panic!("pod not Running in time: {seen:#?}")).expect("pod");
    assert_eq!(text(&running, "/status/hostIP"), Some("10.9.8.7"));
    assert_eq!(text(&running, "/status/podIP"), Some("10.9.8.7"));
    assert!(text(&running, "/status/startTime").is_some());

    // Deleting it: the node stops it, frees its device and deletes it for good.
    pods.delete("sleeper", &DeleteParams::default()).await.expect("delete");
    let gone = server.wait_object(("", "pods", "default", "sleeper"), SOON, |pod| pod.is_none()).await;
    assert!(gone.is_ok(), "pod still in the API: {gone:?}");
    let uid = created.metadata.uid.expect("uid");
    let (_, body) = http_get(&local_socket(root.path()), "/pods").await;
    assert!(!body.contains(&uid), "the node still has the pod: {body}");
    plugins.cancel();
}

/// `--kube-api-qps 5 --kube-api-burst 5`: every request the node sends
/// (watches, reads, pod status writes) keeps to the token bucket while 20
/// pods are bound to it at once and reach Running. The heartbeat (the
/// Node's registration and status, the Lease) goes through a client of
/// its own without a bucket, as upstream's heartbeat client does, so that
/// it never waits behind the rest; its own periods bound it.
#[tokio::test]
async fn every_request_of_the_node_keeps_to_kube_api_qps() {
    const QPS: usize = 5;
    const BURST: usize = 5;
    const PODS: usize = 20;
    let root = tempfile::tempdir().expect("tempdir");
    import_example(root.path(), "sleep").await;
    let server = ApiServer::start().await.expect("api server");
    let kubeconfig = root.path().join("kubeconfig");
    server.write_kubeconfig(&kubeconfig, &server.node_token("n1")).expect("kubeconfig");
    let (qps, burst) = (QPS.to_string(), BURST.to_string());
    let mut node = rustlet(root.path(), &kubeconfig, &["--kube-api-qps", &qps, "--kube-api-burst", &burst]);
    node.line_with("node started").await;
    ready_node(&server).await;
    let admin = server.client(server.admin_token()).await.expect("admin");
    let pods: Api<Pod> = Api::namespaced(admin, "default");
    for i in 0..PODS {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": format!("p{i}"), "namespace": "default"},
            "spec": {
                "nodeName": "n1",
                "terminationGracePeriodSeconds": 1,
                "containers": [{"name": "main", "image": "example.com/test/sleep:v1", "imagePullPolicy": "Never"}],
            },
        }))
        .expect("pod");
        pods.create(&PostParams::default(), &pod).await.expect("create");
    }
    for i in 0..PODS {
        let running = server
            .wait_object(("", "pods", "default", &format!("p{i}")), SOON, |pod| {
                pod.is_some_and(|p| p.pointer("/status/containerStatuses/0/state/running").is_some())
            })
            .await;
        assert!(running.is_ok(), "p{i} not Running in time: {running:?}");
    }
    let heartbeat = |r: &rustlet_testkit::apiserver::Logged| {
        r.uri.contains("/leases")
            || (r.method != http::Method::GET
                && r.uri.split('?').next().is_some_and(|p| p.starts_with("/api/v1/nodes")))
    };
    let sent: Vec<std::time::Instant> = server
        .requests()
        .into_iter()
        .filter(|r| r.user.as_deref() == Some("system:node:n1") && !heartbeat(r))
        .map(|r| r.received)
        .collect();
    // The bucket lets at most BURST + QPS × 2 requests through in any two
    // seconds; 2 more are allowed for requests that took a token apart and
    // arrived together (connection setup). Unlimited, the node sends some
    // 50 in its first two seconds with 20 new pods.
    let window = Duration::from_secs(2);
    let most = sent.iter().map(|start| sent.iter().filter(|t| **t >= *start && **t < *start + window).count()).max();
    let allowed = BURST + QPS * 2 + 2;
    assert!(
        most.unwrap_or(0) <= allowed,
        "{most:?} requests in two seconds, {allowed} allowed ({} in all)",
        sent.len()
    );
    assert!(sent.len() > allowed, "enough requests to have tried the limit: {}", sent.len());
}

#[tokio::test]
async fn a_missing_kubeconfig_is_retried_while_the_node_serves() {
    let root = tempfile::tempdir().expect("tempdir");
    let kubeconfig = root.path().join("later").join("kubeconfig");
    let mut node = rustlet(root.path(), &kubeconfig, &[]);
    let address = node.http_address().await;
    let error = node.line_with("cannot connect to the cluster").await;
    assert!(error.contains(&kubeconfig.display().to_string()), "the error names the file: {error}");
    assert!(error.contains("retry_in"), "the error says it retries: {error}");
    assert_eq!(http_get(&address, "/healthz").await, (200, "ok".to_owned()), "standalone parts serve meanwhile");

    let server = ApiServer::start().await.expect("api server");
    std::fs::create_dir_all(kubeconfig.parent().expect("dir")).expect("mkdir");
    server.write_kubeconfig(&kubeconfig, &server.node_token("n1")).expect("kubeconfig");
    ready_node(&server).await;
}

#[tokio::test]
async fn an_unreachable_api_is_retried_until_it_answers() {
    let root = tempfile::tempdir().expect("tempdir");
    // An address with nothing listening (yet).
    let address = std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("address");
    let kubeconfig = root.path().join("kubeconfig");
    write_kubeconfig(&kubeconfig, &format!("http://{address}"), "node-token-n1").expect("kubeconfig");
    let mut node = rustlet(root.path(), &kubeconfig, &[]);
    let error = node.line_with("cannot register the node; retrying").await;
    assert!(error.contains("n1"), "{error}");

    let server = ApiServer::start_on(address).await.expect("api server on the address");
    assert_eq!(server.node_token("n1"), "node-token-n1");
    ready_node(&server).await;
}

/// `rustlet --kubeconfig` as node `api.node`.
fn rustlet_on(api: &TestApi, root: &Path, extra: &[&str]) -> NodeProcess {
    rustlet_as(&api.node, root, &api.node_kubeconfig, extra)
}

fn pod_phase(pod: Option<&Pod>) -> Option<&str> {
    pod?.status.as_ref()?.phase.as_deref()
}

fn annotation<'a>(pod: &'a Pod, key: &str) -> Option<&'a str> {
    pod.metadata.annotations.as_ref()?.get(key).map(String::as_str)
}

/// Static pods get mirror pods owned by the Node (NodeRestriction refuses
/// any other), recreated when deleted, and gone with their static pod; a
/// user's pod holding the mirror pod's name is left alone.
async fn static_pods_get_mirror_pods(api: TestApi) {
    let root = tempfile::tempdir().expect("tempdir");
    import_example(root.path(), "sleep").await;
    let manifests = root.path().join("manifests");
    std::fs::create_dir_all(&manifests).expect("mkdir");
    // The WebAssembly node's arch taints are NoSchedule and NoExecute: a
    // mirror pod that does not tolerate them is deleted by the
    // controller manager's taint eviction (where one runs) as often as the
    // node makes it.
    let manifest = |name: &str| {
        format!(
            "apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}, labels: {{app: {name}}}}}\nspec:\n  \
             terminationGracePeriodSeconds: 2\n  \
             tolerations: [{{key: kubernetes.io/arch, operator: Equal, value: wasm32-wasi}}]\n  \
             containers:\n  - name: main\n    \
             image: example.com/test/sleep:v1\n    imagePullPolicy: Never\n"
        )
    };
    std::fs::write(manifests.join("sleeper.yaml"), manifest("sleeper")).expect("manifest");
    // A user's pod already has the name the second static pod's mirror pod
    // would take.
    let pods: Api<Pod> = Api::namespaced(api.admin.clone(), "default");
    let taken = format!("taken-{}", api.node);
    let user_pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": taken, "namespace": "default"},
        "spec": {"automountServiceAccountToken": false, "containers": [{"name": "c", "image": "busybox"}]},
    }))
    .expect("pod");
    let user_pod = pods.create(&PostParams::default(), &user_pod).await.expect("user pod");
    std::fs::write(manifests.join("taken.yaml"), manifest("taken")).expect("manifest");
    let mut node = rustlet_on(&api, root.path(), &["--pod-manifest-path", manifests.to_str().expect("utf8")]);

    // The mirror pod: the static pod's name (with the node's suffix),
    // labels, the mirror annotation, the Node as its controller, and the
    // static pod's status.
    let mirror_name = format!("sleeper-{}", api.node);
    let mirror = api
        .wait_for(&pods, &mirror_name, "a Running mirror pod", SOON, |p| pod_phase(p) == Some("Running"))
        .await
        .expect("pod");
    assert_eq!(annotation(&mirror, "kubernetes.io/config.mirror"), annotation(&mirror, "kubernetes.io/config.hash"));
    assert_eq!(annotation(&mirror, "kubernetes.io/config.source"), Some("file"));
    assert_eq!(mirror.metadata.labels.as_ref().and_then(|l| l.get("app")).map(String::as_str), Some("sleeper"));
    assert_eq!(mirror.spec.as_ref().and_then(|s| s.node_name.as_deref()), Some(api.node.as_str()));
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(api.admin.clone());
    let node_object = nodes.get(&api.node).await.expect("node");
    let owners = mirror.metadata.owner_references.clone().unwrap_or_default();
    assert_eq!(owners.len(), 1, "{owners:?}");
    assert_eq!(
        (owners[0].api_version.as_str(), owners[0].kind.as_str(), owners[0].name.as_str(), owners[0].controller),
        ("v1", "Node", api.node.as_str(), Some(true))
    );
    assert_eq!(Some(&owners[0].uid), node_object.metadata.uid.as_ref());

    // The user's pod of the other static pod's mirror name is reported
    // and left alone.
    node.line_with("a pod that is not a mirror pod has the static pod's name").await;
    let still = pods.get(&taken).await.expect("the user's pod is still there");
    assert_eq!(still.metadata.uid, user_pod.metadata.uid);
    assert_eq!(annotation(&still, "kubernetes.io/config.mirror"), None);

    // An administrator deletes the mirror pod: it comes back (a new
    // object), and the static pod never stopped.
    let first_uid = mirror.metadata.uid.clone().expect("uid");
    pods.delete(&mirror_name, &DeleteParams::default()).await.expect("delete");
    let back = api
        .wait_for(&pods, &mirror_name, "recreated and Running", SOON, |p| {
            p.is_some_and(|p| {
                p.metadata.uid.as_deref() != Some(first_uid.as_str())
                    && p.metadata.deletion_timestamp.is_none()
                    && pod_phase(Some(p)) == Some("Running")
            })
        })
        .await
        .expect("pod");
    let restarts = back.status.as_ref().and_then(|s| s.container_statuses.as_ref()).map(|c| c[0].restart_count);
    assert_eq!(restarts, Some(0), "the static pod kept running");

    // The user's pod goes: the static pod gets its mirror pod then.
    pods.delete(&taken, &DeleteParams { grace_period_seconds: Some(0), ..DeleteParams::default() })
        .await
        .expect("delete");
    api.wait_for(&pods, &taken, "the static pod's mirror pod", SOON, |p| {
        p.is_some_and(|p| annotation(p, "kubernetes.io/config.mirror").is_some())
    })
    .await;

    // The manifest goes: the mirror pod goes with the static pod.
    std::fs::remove_file(manifests.join("sleeper.yaml")).expect("rm");
    api.wait_for(&pods, &mirror_name, "gone", SOON, |p| p.is_none()).await;
}
rustlet_testkit::on_both_api_servers!(static_pods_get_mirror_pods_on, static_pods_get_mirror_pods);

#[tokio::test]
async fn reserved_node_labels_are_refused_at_start() {
    let root = tempfile::tempdir().expect("tempdir");
    let output = Command::new(env!("CARGO_BIN_EXE_rustlet"))
        .env_remove("RUSTLET_ROOT_DIR")
        .arg("--kubeconfig")
        .arg(root.path().join("kubeconfig"))
        .arg("--root-dir")
        .arg(root.path())
        .args([
            "--node-name",
            "n1",
            "--healthz-port",
            "0",
            "--port",
            "0",
            "--node-labels",
            "zone=a,node-role.kubernetes.io/worker=",
        ])
        .output()
        .await
        .expect("run rustlet");
    assert!(!output.status.success(), "the node must not start");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains(
            "invalid --node-labels: unknown 'kubernetes.io' or 'k8s.io' labels specified with --node-labels: [node-role.kubernetes.io/worker]"
        ),
        "{stderr}"
    );
    assert!(stderr.contains("allowed prefix (kubelet.kubernetes.io, node.kubernetes.io)"), "{stderr}");
}

/// A pod with a resource claim (and a device-plugin device) on the binary:
/// the claim is prepared once through a real DRA driver; `kill -9` of the
/// node and a restart prepare nothing again (the checkpoint says it is
/// prepared); PodResources shows both the device
/// and the claim; the pod's deletion releases the claim exactly once.
#[tokio::test]
async fn a_claim_is_prepared_once_across_a_kill_9_and_released_once() {
    use k8s_openapi::api::resource::v1::ResourceClaim;
    use kube::api::{Patch, PatchParams};
    use kubelet_api::podresources::v1 as podresources;
    use rustlet_sample_plugins::dra_driver::{DraDriver, DraDriverConfig};
    use rustlet_sample_plugins::report::Report;

    const DRIVER: &str = "gpu.dra.example.com";
    // The driver's next prepare or release (registration and slice reports
    // skipped), and those already reported.
    async fn next_call(calls: &mut tokio::sync::mpsc::UnboundedReceiver<Report>) -> Report {
        loop {
            let report = tokio::time::timeout(SOON, calls.recv()).await.expect("a call in time").expect("driver");
            if matches!(report, Report::DraPrepare { .. } | Report::DraUnprepare { .. }) {
                return report;
            }
        }
    }
    fn reported_calls(calls: &mut tokio::sync::mpsc::UnboundedReceiver<Report>) -> Vec<Report> {
        std::iter::from_fn(|| calls.try_recv().ok())
            .filter(|r| matches!(r, Report::DraPrepare { .. } | Report::DraUnprepare { .. }))
            .collect()
    }
    let root = tempfile::tempdir().expect("tempdir");
    import_example(root.path(), "sleep").await;
    let api = TestApi::fake().await;
    let mut node = rustlet_on(&api, root.path(), &[]);
    node.line_with("node started").await;
    let plugins = CancellationToken::new();
    let _devices = device_plugin(root.path(), 2, &plugins).await;
    let (reports, mut calls) = tokio::sync::mpsc::unbounded_channel();
    let config = DraDriverConfig::new(DRIVER, "a", root.path(), &api.node, vec!["dev-0".into(), "dev-1".into()]);
    DraDriver::new(config, Reporter::Channel(reports))
        .with_client(api.node_client.clone())
        .spawn(plugins.child_token())
        .expect("DRA driver");
    node.line_with("DRA driver instance connected").await;

    let claims: Api<ResourceClaim> = Api::namespaced(api.admin.clone(), "default");
    let pods: Api<Pod> = Api::namespaced(api.admin.clone(), "default");
    let claim: ResourceClaim = serde_json::from_value(json!({
        "metadata": {"name": "gpu-claim", "namespace": "default"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.example.com"}}]}},
    }))
    .expect("claim");
    let claim_uid = claims.create(&PostParams::default(), &claim).await.expect("claim").metadata.uid.expect("uid");
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": "dra-sleeper", "namespace": "default"},
        "spec": {
            "nodeName": api.node,
            "terminationGracePeriodSeconds": 5,
            "resourceClaims": [{"name": "gpu", "resourceClaimName": "gpu-claim"}],
            "containers": [{
                "name": "main", "image": "example.com/test/sleep:v1", "imagePullPolicy": "Never",
                "resources": {"limits": {RESOURCE: "1"}, "claims": [{"name": "gpu"}]},
            }],
        },
    }))
    .expect("pod");
    let created = pods.create(&PostParams::default(), &pod).await.expect("pod");
    let allocation = json!({"status": {
        "allocation": {"devices": {"results": [{"request": "gpu", "driver": DRIVER, "pool": api.node, "device": "dev-1"}]}},
        "reservedFor": [{"resource": "pods", "name": "dra-sleeper", "uid": created.metadata.uid}],
    }});
    claims.patch_status("gpu-claim", &PatchParams::default(), &Patch::Merge(&allocation)).await.expect("allocate");
    // The resource claim controller's part of the pod's status, which
    // NodeRestriction keeps from the node: the node's status writes must
    // leave it alone (a `null` for it was refused, and the pod never ran).
    let claim_statuses = json!([{"name": "gpu", "resourceClaimName": "gpu-claim"}]);
    let controller = json!({"status": {"resourceClaimStatuses": claim_statuses}});
    pods.patch_status("dra-sleeper", &PatchParams::default(), &Patch::Merge(&controller))
        .await
        .expect("claim statuses");
    let running =
        |p: Option<&Pod>| p.is_some_and(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"));
    let ran = api.wait_for(&pods, "dra-sleeper", "Running", SOON, running).await.expect("pod");
    let kept = ran.status.as_ref().and_then(|s| s.resource_claim_statuses.as_ref()).map(serde_json::to_value);
    assert_eq!(kept.map(|v| v.expect("json")), Some(claim_statuses), "the controller's claim statuses are kept");
    let prepared = next_call(&mut calls).await;
    assert!(
        matches!(&prepared, Report::DraPrepare { claims, .. } if claims[0].0 == claim_uid && claims[0].1 == Ok(vec!["dev-1".to_owned()])),
        "{prepared:?}"
    );

    node.child.kill().await.expect("kill -9");
    let mut node = rustlet_on(&api, root.path(), &[]);
    // The restarted node takes the pod through its claims again (nothing
    // to prepare: the checkpoint says prepared) and runs its module again
    // (a WebAssembly instance lives in the node's process).
    node.lines_with_all(&["node started", "resource claims prepared", "container started"]).await;
    api.wait_for(&pods, "dra-sleeper", "Running", SOON, running).await.expect("pod");
    assert_eq!(reported_calls(&mut calls), [], "nothing prepared again");

    // PodResources: the device-plugin device and the claim's device.
    let channel = kubelet_api::uds::dial(root.path().join("pod-resources/kubelet.sock"), SOON).await.expect("dial");
    let mut lister = podresources::pod_resources_lister_client::PodResourcesListerClient::new(channel);
    let listed = lister
        .get(podresources::GetPodResourcesRequest { pod_name: "dra-sleeper".into(), pod_namespace: "default".into() })
        .await
        .expect("Get")
        .into_inner();
    let main = &listed.pod_resources.expect("pod").containers[0];
    assert_eq!(main.devices.len(), 1, "{main:?}");
    assert_eq!((main.devices[0].resource_name.as_str(), main.devices[0].device_ids.len()), (RESOURCE, 1));
    let claim_resource = &main.dynamic_resources[0];
    assert_eq!(claim_resource.claim_name, "gpu-claim");
    assert_eq!(claim_resource.claim_resources[0].device_name, "dev-1");
    assert_eq!(claim_resource.claim_resources[0].cdi_devices[0].name, format!("{DRIVER}/device=dev-1"));

    pods.delete("dra-sleeper", &DeleteParams::default()).await.expect("delete");
    api.wait_for(&pods, "dra-sleeper", "deleted", SOON, |p| p.is_none()).await;
    let released = next_call(&mut calls).await;
    assert!(
        matches!(&released, Report::DraUnprepare { claims, .. } if claims == &vec![claim_uid.clone()]),
        "{released:?}"
    );
    node.line_with("resource claim released").await;
    assert_eq!(reported_calls(&mut calls), [], "released once, nothing else");
    plugins.cancel();
}

/// Upstream's DRA test driver beside the binary on a real control plane
/// (1.32+; the real scheduler and claim controller): one named
/// ResourceClaim shared by two WebAssembly pods. It is allocated once and
/// prepared once; each pod's init container sees the claim's env (from the
/// driver's CDI spec, which the node resolves: the WebAssembly runtime has
/// no CDI); `kill -9` of the node and a restart prepare nothing again; the
/// driver is upgraded (stopped, a new process started) while the pods run;
/// the first pod's deletion keeps the claim, the last one's releases it
/// through the new driver (its log shows the `NodeUnprepareResources`
/// call; the test driver keeps what it prepared in memory, so the new
/// process has no spec to remove). The node's log holds no 403
/// (NodeRestriction refuses nothing it writes).
#[tokio::test]
async fn a_shared_claim_on_the_real_control_plane_survives_a_kill_9_and_a_driver_upgrade() {
    use k8s_openapi::api::core::v1::Node;
    use kube::api::DynamicObject;
    use rustlet_testkit::dra_test_driver::{self as upstream, SCHEDULED, TEST_DRIVER, in_version, resource};

    const TEST: &str = "a_shared_claim_on_the_real_control_plane_survives_a_kill_9_and_a_driver_upgrade";
    let Some(api) = TestApi::real(TEST).await else { return };
    let Some((binary, version)) = upstream::setting_up(TEST, &api).await else { return };
    let plane = api.control_plane().expect("real");
    let root = tempfile::tempdir().expect("tempdir");
    import_example(root.path(), "hello").await;
    import_example(root.path(), "sleep").await;
    let cdi = root.path().join("cdi");
    let cdi_arg = cdi.display().to_string();
    let extra = ["--cdi-spec-dir", cdi_arg.as_str()];
    let mut node = rustlet_on(&api, root.path(), &extra);
    node.line_with("node started").await;
    let nodes: Api<Node> = Api::all(api.admin.clone());
    api.wait_for(&nodes, &api.node, "registered", SOON, |n| n.is_some()).await.expect("node");
    // The driver reads its Node (the owner of its slices) as it starts.
    let driver = upstream::start(&binary, plane.admin_kubeconfig(), &api.node, root.path(), "old-driver.log");
    node.line_with("DRA driver instance connected").await;
    let slices: Api<DynamicObject> =
        Api::all_with(api.admin.clone(), &resource(version, "ResourceSlice", "resourceslices"));
    upstream::slice_devices(slices, &api.node, version, 4).await;

    let tag = std::process::id();
    let class = format!("rustlet-shared-{tag}");
    let classes: Api<DynamicObject> =
        Api::all_with(api.admin.clone(), &resource(version, "DeviceClass", "deviceclasses"));
    let device_class = json!({"kind": "DeviceClass", "metadata": {"name": class},
        "spec": {"selectors": [{"cel": {"expression": format!("device.driver == \"{TEST_DRIVER}\"")}}]}});
    classes.create(&PostParams::default(), &in_version(device_class, version)).await.expect("DeviceClass");
    let claim = format!("shared-{tag}");
    let claims: Api<DynamicObject> =
        Api::namespaced_with(api.admin.clone(), "default", &resource(version, "ResourceClaim", "resourceclaims"));
    let resource_claim = json!({"kind": "ResourceClaim", "metadata": {"name": claim, "namespace": "default"},
    "spec": {"devices": {
        "requests": [{"name": "gpu", "exactly": {"deviceClassName": class}}],
        "config": [{"opaque": {"driver": TEST_DRIVER, "parameters": {"a": "b"}}}],
    }}});
    let claim_uid = claims
        .create(&PostParams::default(), &in_version(resource_claim, version))
        .await
        .expect("claim")
        .metadata
        .uid
        .expect("uid");

    let pods: Api<Pod> = Api::namespaced(api.admin.clone(), "default");
    let pod = |name: &str| -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "default"},
            "spec": {
                "nodeSelector": {"kubernetes.io/hostname": api.node},
                "tolerations": [{"key": "kubernetes.io/arch", "operator": "Equal", "value": "wasm32-wasi"}],
                "terminationGracePeriodSeconds": 2,
                "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}],
                "initContainers": [{
                    "name": "show", "image": "example.com/test/hello:v1", "imagePullPolicy": "Never",
                    "volumeMounts": [{"name": "out", "mountPath": "/out"}],
                    "resources": {"claims": [{"name": "gpu"}]},
                }],
                "containers": [{
                    "name": "main", "image": "example.com/test/sleep:v1", "imagePullPolicy": "Never",
                    "resources": {"claims": [{"name": "gpu"}]},
                }],
                "volumes": [{"name": "out", "emptyDir": {}}],
            },
        }))
        .expect("pod")
    };
    let names = [format!("dra-first-{tag}"), format!("dra-second-{tag}")];
    for name in &names {
        pods.create(&PostParams::default(), &pod(name)).await.expect("pod");
    }
    let marker = format!("claim_{}_gpu=true", claim.replace(|c: char| !c.is_ascii_alphanumeric(), "_"));
    for name in &names {
        let running = api.wait_for(&pods, name, "Running", SCHEDULED, |p| pod_phase(p) == Some("Running")).await;
        let running = running.unwrap_or_else(|| {
            panic!("{name} did not run; the driver's log:\n{}", upstream::tail(&root.path().join("old-driver.log")))
        });
        let uid = running.metadata.uid.clone().expect("uid");
        let log = root.path().join(format!("logs/pods/default_{name}_{uid}/show/0.log"));
        let shown = rustlet_testkit::wait_file(&log, |t| t.contains("wrote hello.txt"), SOON).await;
        assert!(shown.contains("env: user_a=b") && shown.contains(&format!("env: {marker}")), "{marker} in {shown}");
    }
    let prepares = |node: &NodeProcess| {
        node.all_lines().iter().filter(|l| l.contains("resource claim prepared") && l.contains(&claim_uid)).count()
    };
    assert_eq!(prepares(&node), 1, "one prepare for both pods");
    let mut seen = node.all_lines();

    // kill -9 and a restart: both pods taken through their claims again,
    // nothing prepared again.
    node.child.kill().await.expect("kill -9");
    let mut node = rustlet_on(&api, root.path(), &extra);
    node.line_with("node started").await;
    node.line_with("resource claims prepared").await;
    node.line_with("resource claims prepared").await;
    assert_eq!(prepares(&node), 0, "the checkpoint says prepared");

    // The driver is upgraded while the pods run: the old process stops
    // (SIGTERM: it removes its sockets), a new one starts.
    let old = driver.id().expect("pid").to_string();
    let stopped = Command::new("kill").args(["-TERM", &old]).status().await.expect("kill");
    assert!(stopped.success());
    node.line_with("DRA driver instance deregistered").await;
    let _driver = upstream::start(&binary, plane.admin_kubeconfig(), &api.node, root.path(), "new-driver.log");
    node.line_with("DRA driver instance connected").await;

    // The first pod goes: the claim stays prepared for the second.
    pods.delete(&names[0], &DeleteParams::default()).await.expect("delete");
    api.wait_for(&pods, &names[0], "deleted", SCHEDULED, |p| p.is_none()).await;
    assert!(!node.all_lines().iter().any(|l| l.contains("resource claim released")), "still used by the second pod");
    assert_eq!(std::fs::read_dir(&cdi).map(|d| d.count()).unwrap_or(0), 1, "the driver's spec stays");
    // The last goes: released once, through the new driver.
    pods.delete(&names[1], &DeleteParams::default()).await.expect("delete");
    api.wait_for(&pods, &names[1], "deleted", SCHEDULED, |p| p.is_none()).await;
    let released = node.line_with("resource claim released").await;
    assert!(released.contains(&claim_uid), "{released}");
    // The drivers' side: one prepare by the old process, one release by
    // the new one, nothing else.
    let calls = |log: &str, method: &str| {
        let text = std::fs::read_to_string(root.path().join(log)).unwrap_or_default();
        let method = format!("DRAPlugin/{method}\"");
        text.lines().filter(|l| l.contains("handling request succeeded") && l.contains(&method)).count()
    };
    let unprepared = |t: &str| {
        t.lines().any(|l| l.contains("handling request succeeded") && l.contains("DRAPlugin/NodeUnprepareResources"))
    };
    rustlet_testkit::wait_file(&root.path().join("new-driver.log"), unprepared, SOON).await;
    assert_eq!(
        [calls("old-driver.log", "NodePrepareResources"), calls("old-driver.log", "NodeUnprepareResources")],
        [1, 0]
    );
    assert_eq!(
        [calls("new-driver.log", "NodePrepareResources"), calls("new-driver.log", "NodeUnprepareResources")],
        [0, 1]
    );

    seen.extend(node.all_lines());
    let refused: Vec<&String> =
        seen.iter().filter(|l| l.contains("403 ") || l.contains("Forbidden") || l.contains("forbidden")).collect();
    assert!(refused.is_empty(), "{refused:#?}");
}
