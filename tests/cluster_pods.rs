//! Cluster mode, pods: pods bound to the node in the API run through the
//! lifecycle (real host processes), their statuses reach the API, and a
//! deletion is finished the kubelet's way, through kube-rs with the node's
//! identity: against the real kube-apiserver and the in-process one where
//! the test needs nothing more, against the in-process one alone where it
//! injects faults (errors, latency, broken watches, compaction).

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, PostParams};
use kubelet::cluster::{PodSyncConfig, PodSyncMetrics, pod_sync};
use kubelet::pod::{Allocatable, PodConfig, PodLifecycle, Pods};
use kubelet::provider::Provider;
use rustlet_testkit::apiserver::{ApiServer, Fault};
use rustlet_testkit::host_provider::HostProcessProvider;
use rustlet_testkit::test_api::{TestApi, json_of};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

/// A liveness bound: these take milliseconds.
const SOON: Duration = Duration::from_secs(20);

struct ClusterNode {
    api: TestApi,
    admin: Api<Pod>,
    pods: Pods,
    sync: pod_sync::PodSync,
    metrics: PodSyncMetrics,
    /// The provider, for what it was asked.
    host: Arc<HostProcessProvider>,
    shutdown: CancellationToken,
    _root: tempfile::TempDir,
}

impl Drop for ClusterNode {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

impl ClusterNode {
    /// The in-process server, for what only it does (faults, request logs).
    fn server(&self) -> &ApiServer {
        self.api.fake_server().expect("a test of the in-process server")
    }
}

/// A node on the in-process server (node `n1`).
async fn cluster_node() -> ClusterNode {
    cluster_node_on(TestApi::fake().await).await
}

/// Pods (host processes) and the pod sync for `api`'s node.
async fn cluster_node_on(api: TestApi) -> ClusterNode {
    let root = rustlet_testkit::node_root::tempdir("rustlet-node-");
    let shutdown = CancellationToken::new();
    let host = Arc::new(HostProcessProvider::new());
    let provider: Arc<dyn Provider> = host.clone();
    let config = PodConfig::new(root.path(), Allocatable { cpu_milli: 2000, memory: 4 << 30, pods: 110 });
    let pods = Pods::start(PodLifecycle::new(config, Some(provider), None), shutdown.clone()).await;
    let sync_config = PodSyncConfig {
        retry_initial: Duration::from_millis(10),
        retry_max: Duration::from_millis(100),
        ..PodSyncConfig::new(&api.node)
    };
    let metrics = sync_config.metrics.clone();
    let sync = pod_sync::start(api.node_client.clone(), sync_config, pods.clone(), shutdown.clone());
    let admin = Api::namespaced(api.admin.clone(), "default");
    ClusterNode { api, admin, pods, sync, metrics, host, shutdown, _root: root }
}

fn pod(name: &str, node: &str, cpu: &str) -> Pod {
    let spec = json!({
        "automountServiceAccountToken": false,
        "terminationGracePeriodSeconds": 10,
        "containers": [{"name": "main", "image": "busybox", "command": ["sleep", "600"],
                        "resources": {"requests": {"cpu": cpu}}}]
    });
    rustlet_testkit::pod_state::bound_pod(name, node, spec)
}

fn pod_key(name: &str) -> (&'static str, &'static str, &'static str, &str) {
    ("", "pods", "default", name)
}

fn running(pod: &Value) -> bool {
    pod["status"]["phase"] == "Running" && pod["status"]["containerStatuses"][0]["state"]["running"].is_object()
}

async fn a_bound_pod_runs_and_its_status_reaches_the_api(api: TestApi) {
    let node = cluster_node_on(api).await;
    let name = node.api.node.clone();
    let elsewhere = format!("{name}-other");
    node.admin.create(&PostParams::default(), &pod("web", &name, "100m")).await.expect("create");
    node.admin.create(&PostParams::default(), &pod("other", &elsewhere, "100m")).await.expect("create");
    let web = node
        .api
        .wait_for(&node.admin, "web", "Running", SOON, |p| p.is_some_and(|p| running(&json_of(p))))
        .await
        .expect("pod");
    let web = json_of(&web);
    let conditions = web["status"]["conditions"].as_array().expect("conditions");
    assert!(conditions.iter().any(|c| c["type"] == "Ready" && c["status"] == "True"), "{web}");
    // A pod bound to another node is not this node's business.
    let other = json_of(&node.admin.get("other").await.expect("other"));
    assert_eq!(other["status"]["phase"], "Pending");
    assert!(other["status"]["containerStatuses"].is_null());
}
rustlet_testkit::on_both_api_servers!(
    a_bound_pod_runs_and_its_status_reaches_the_api_on,
    a_bound_pod_runs_and_its_status_reaches_the_api
);

async fn a_rejected_pod_is_failed_with_its_reason_in_the_api(api: TestApi) {
    let node = cluster_node_on(api).await;
    let name = node.api.node.clone();
    node.admin.create(&PostParams::default(), &pod("huge", &name, "5")).await.expect("create");
    let huge = node
        .api
        .wait_for(&node.admin, "huge", "Failed", SOON, |p| p.is_some_and(|p| json_of(p)["status"]["phase"] == "Failed"))
        .await
        .expect("pod");
    let huge = json_of(&huge);
    assert_eq!(huge["status"]["reason"], "OutOfcpu");
    let message = huge["status"]["message"].as_str().expect("message");
    assert!(message.starts_with("Pod was rejected: Node didn't have enough resource: cpu"), "{message}");
}
rustlet_testkit::on_both_api_servers!(
    a_rejected_pod_is_failed_with_its_reason_in_the_api_on,
    a_rejected_pod_is_failed_with_its_reason_in_the_api
);

#[tokio::test]
async fn a_deleted_pod_is_stopped_released_and_deleted_for_good() {
    let node = cluster_node().await;
    let created = node.admin.create(&PostParams::default(), &pod("web", "n1", "100m")).await.expect("create");
    node.server().wait_object(pod_key("web"), SOON, |p| p.is_some_and(running)).await.expect("running");
    // A status patch fails twice on the way: retried, counted.
    node.server().inject(Fault::status(Some(http::Method::PATCH), "/pods/web/status", 500, 2));
    // The user deletes it: the API marks it, the node stops it within its
    // grace period and deletes it with grace 0 and its UID.
    node.admin.delete("web", &DeleteParams::default()).await.expect("delete");
    node.server()
        .wait_object(pod_key("web"), SOON, |p| p.is_none())
        .await
        .unwrap_or_else(|seen| panic!("the pod stayed: {seen:?}"));
    let final_delete = node
        .server()
        .requests()
        .into_iter()
        .filter(|r| {
            r.method == http::Method::DELETE && r.uri.trim_end_matches('?').ends_with("/pods/web") && r.status == 200
        })
        .count();
    assert_eq!(final_delete, 2, "the user's delete and the node's: {:?}", node.server().requests());
    // A new pod of the same name is a different pod: it runs.
    let again = node.admin.create(&PostParams::default(), &pod("web", "n1", "100m")).await.expect("create");
    assert_ne!(again.metadata.uid, created.metadata.uid);
    node.server().wait_object(pod_key("web"), SOON, |p| p.is_some_and(running)).await.expect("the new one runs");
    // Counted before the new pod's status went out (one task sends both).
    assert_eq!(node.sync.stats().deletions.load(std::sync::atomic::Ordering::Relaxed), 1);
}

/// The API refuses one pod's status writes (422, then 403): that pod is
/// retried with backoff while another pod's status goes out, and every
/// refusal is counted on the node's metrics.
#[tokio::test]
async fn a_refused_status_write_is_retried_counted_and_holds_back_no_other_pod() {
    let node = cluster_node().await;
    node.server().inject(Fault::status(Some(http::Method::PATCH), "/pods/refused/status", 422, 3));
    node.server().inject(Fault::status(Some(http::Method::PATCH), "/pods/refused/status", 403, usize::MAX));
    node.admin.create(&PostParams::default(), &pod("refused", "n1", "100m")).await.expect("create");
    // Four refusals at least (three 422s, then 403s) before the other pod
    // is even created: its writes go out while these keep failing.
    let refusals = |requests: &[rustlet_testkit::apiserver::Logged]| {
        requests.iter().filter(|r| r.uri.contains("/pods/refused/status") && r.status >= 400).count()
    };
    node.server()
        .wait_requests(SOON, |r| refusals(r) >= 4)
        .await
        .unwrap_or_else(|seen| panic!("refusals: {}", refusals(&seen)));
    node.admin.create(&PostParams::default(), &pod("other", "n1", "100m")).await.expect("create");
    node.server()
        .wait_object(pod_key("other"), SOON, |p| p.is_some_and(running))
        .await
        .unwrap_or_else(|seen| panic!("the other pod's status never went out: {seen:?}"));
    let stuck = node.server().object("", "pods", "default", "refused").expect("pod");
    assert!(stuck["status"]["containerStatuses"].is_null(), "no write of it was accepted yet: {stuck}");
    // The API accepts it again: its status arrives.
    node.server().clear_faults();
    node.server().wait_object(pod_key("refused"), SOON, |p| p.is_some_and(running)).await.expect("running");
    let mut registry = prometheus_client::registry::Registry::default();
    node.metrics.register(&mut registry);
    let text = kubelet::metrics::encode_text(&registry).expect("encode");
    let value = |name: &str| -> u64 {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("{name} not in {text}"))
    };
    let refusals = value("rustlet_pod_status_writes_refused_total");
    assert!(refusals >= 4, "{text}");
    assert_eq!(
        value("rustlet_pod_status_write_errors_total{code=\"422\"}"),
        3,
        "the three 422s, each counted once: {text}"
    );
    assert_eq!(value("rustlet_pod_status_write_errors_total{code=\"403\"}"), refusals - 3, "{text}");
    // The other pod's write is counted by now (the refused pod's last one
    // may still be on its way back from the server).
    assert!(value("rustlet_pod_status_writes_total") >= 1, "accepted writes: {text}");
}

/// The watch breaks, reconnecting fails for a while, and the history it
/// would resume from is compacted away (410): the node relists, stops the
/// pod deleted meanwhile and runs the one created meanwhile.
#[tokio::test]
async fn a_watch_that_expires_is_relisted_and_nothing_is_missed() {
    let node = cluster_node().await;
    let first = node.admin.create(&PostParams::default(), &pod("first", "n1", "100m")).await.expect("create");
    node.server().wait_object(pod_key("first"), SOON, |p| p.is_some_and(running)).await.expect("running");
    let first_uid = first.metadata.uid.expect("uid");
    // Node-side pod reads fail three times; the watch is cut.
    node.server().inject(Fault::status(Some(http::Method::GET), "/api/v1/pods", 500, 3));
    node.server().drop_watches();
    let now = DeleteParams { grace_period_seconds: Some(0), ..DeleteParams::default() };
    node.admin.delete("first", &now).await.expect("delete");
    node.admin.create(&PostParams::default(), &pod("second", "n1", "100m")).await.expect("create");
    node.server().compact();
    node.server().wait_object(pod_key("second"), SOON, |p| p.is_some_and(running)).await.expect("the new pod runs");
    let gone = node.pods.store().wait_for(SOON, |pods| !pods.contains_key(&first_uid)).await;
    assert!(gone.is_some(), "the pod deleted while the watch was down still runs on the node");
}

/// 1,000 pods bound at once to a node whose API answers every status patch
/// 20 ms late: every pod reaches Running in the API (writes go out in
/// parallel), and no second ever holds more status writes than the token
/// bucket allows (`--kube-api-burst` + `--kube-api-qps`).
#[tokio::test]
async fn status_writes_go_out_in_parallel_and_never_above_the_api_qps() {
    const PODS: usize = 1000;
    const QPS: f64 = 200.0;
    const BURST: u32 = 20;
    const IMAGE: &str = "example.com/test/sleep:v1";
    let server = ApiServer::start().await.expect("start");
    server.inject(Fault::slow(Some(http::Method::PATCH), "/status", Duration::from_millis(20), usize::MAX));
    let root = rustlet_testkit::node_root::tempdir("rustlet-node-");
    let shutdown = CancellationToken::new();
    let provider = Arc::new(rustlet_wasi::WasiProvider::new(rustlet_wasi::WasiConfig::new(root.path())).expect("wasi"));
    let layout = root.path().join("layout");
    let sleep = rustlet_wasi::examples::binary("sleep").expect("example");
    rustlet_wasi::import::write_layout(&layout, &[(IMAGE, &sleep)]).expect("layout");
    rustlet_wasi::import::import(provider.images(), &layout, None).expect("import");
    let config = PodConfig::new(root.path(), Allocatable { cpu_milli: 64_000, memory: 64 << 30, pods: PODS + 10 });
    let pods = Pods::start(PodLifecycle::new(config, Some(provider), None), shutdown.clone()).await;
    let node_client = server.client(&server.node_token("n1")).await.expect("client");
    let sync_config = PodSyncConfig { api_qps: QPS, api_burst: BURST, ..PodSyncConfig::new("n1") };
    let _sync = pod_sync::start(node_client, sync_config, pods.clone(), shutdown.clone());
    let admin: Api<Pod> = Api::namespaced(server.client(server.admin_token()).await.expect("client"), "default");

    let began = std::time::Instant::now();
    {
        use futures_util::StreamExt as _;
        let created: Vec<Result<Pod, kube::Error>> = futures_util::stream::iter(0..PODS)
            .map(|i| {
                let admin = admin.clone();
                let pod: Pod = serde_json::from_value(json!({
                    "metadata": {"name": format!("p{i}"), "namespace": "default"},
                    "spec": {"nodeName": "n1", "containers": [{"name": "main", "image": IMAGE, "imagePullPolicy": "Never",
                                                               "resources": {"limits": {"memory": "16Mi"}}}]},
                }))
                .expect("pod");
                async move { admin.create(&PostParams::default(), &pod).await }
            })
            .buffer_unordered(32)
            .collect()
            .await;
        for result in created {
            result.expect("create");
        }
    }
    // Liveness bound, not a speed claim (the benchmark has the figures).
    let mut changes = server.changes();
    let all_running = async {
        loop {
            let running = (0..PODS)
                .filter(|i| {
                    server
                        .object("", "pods", "default", &format!("p{i}"))
                        .is_some_and(|p| p["status"]["phase"] == "Running")
                })
                .count();
            if running == PODS {
                return;
            }
            // Wait for the next change before counting again.
            let _ = changes.recv().await;
            while changes.try_recv().is_ok() {}
        }
    };
    tokio::time::timeout(Duration::from_secs(180), all_running).await.expect("every pod Running in the API");
    eprintln!("{PODS} pods Running in the API after {:.2} s", began.elapsed().as_secs_f64());
    // No pod's status needs more than a few writes (a write that does not
    // converge, say, would repeat).
    let mut per_pod: std::collections::BTreeMap<String, usize> = Default::default();
    for r in server.requests().into_iter().filter(|r| r.method == http::Method::PATCH && r.uri.contains("/status")) {
        *per_pod.entry(r.uri.split('?').next().unwrap_or_default().to_owned()).or_default() += 1;
    }
    let most = per_pod.values().copied().max().unwrap_or(0);
    assert!(most <= 4, "a pod got {most} status writes on its way to Running");

    let mut writes: Vec<std::time::Instant> = server
        .requests()
        .into_iter()
        .filter(|r| r.method == http::Method::PATCH && r.uri.contains("/status"))
        .map(|r| r.received)
        .collect();
    writes.sort();
    assert!(writes.len() >= PODS, "at least one status write per pod: {}", writes.len());
    // In any second: at most the burst plus a second's worth (a little
    // slack for when the server saw them).
    let most = f64::from(BURST) + QPS;
    let mut busiest = 0;
    for (i, start) in writes.iter().enumerate() {
        let in_window = writes[i..].iter().take_while(|t| t.duration_since(*start) < Duration::from_secs(1)).count();
        busiest = busiest.max(in_window);
    }
    assert!(busiest as f64 <= most * 1.05, "{busiest} status writes in one second; at most {most} allowed");
    shutdown.cancel();
}

/// The events written so far about pod `name`, following a watch until
/// `pred` holds of them (or panicking with them after `deadline`).
async fn wait_events(
    api: &TestApi,
    name: &str,
    deadline: Duration,
    pred: impl Fn(&[k8s_openapi::api::core::v1::Event]) -> bool,
) -> Vec<k8s_openapi::api::core::v1::Event> {
    use futures_util::StreamExt as _;
    use k8s_openapi::api::core::v1::Event;
    use kube::runtime::watcher;
    let events: Api<Event> = Api::namespaced(api.admin.clone(), "default");
    let mut stream = watcher(events, watcher::Config::default()).boxed();
    let mut seen: std::collections::BTreeMap<String, Event> = std::collections::BTreeMap::new();
    let about = |e: &Event| e.involved_object.name.as_deref() == Some(name);
    let wait = async {
        while let Some(event) = stream.next().await {
            match event {
                Ok(watcher::Event::Apply(e) | watcher::Event::InitApply(e)) if about(&e) => {
                    seen.insert(e.metadata.name.clone().unwrap_or_default(), e);
                }
                Ok(watcher::Event::Delete(e)) => {
                    seen.remove(e.metadata.name.as_deref().unwrap_or_default());
                }
                _ => continue,
            }
            let now: Vec<Event> = seen.values().cloned().collect();
            if pred(&now) {
                return now;
            }
        }
        Vec::new()
    };
    match tokio::time::timeout(deadline, wait).await {
        Ok(found) => found,
        Err(_) => panic!("events of {name} not as expected within {deadline:?}: {seen:#?}"),
    }
}

/// Pod events reach the API as the kubelet writes them (core/v1, source
/// `kubelet` on the node): the container's image, creation and start, then
/// a crash loop's back-offs as one Event whose count rises (aggregation),
/// however often the container restarts; a pull failure and its back-off;
/// a failing probe. `kubectl describe pod` shows them; the node's events
/// are there too.
async fn pod_events_reach_the_api_aggregated(api: TestApi) {
    use kubelet::cluster::{ApiSource, ClusterSettings};
    use kubelet::node::{NodeBuilder, NodeConfig};
    let root = rustlet_testkit::node_root::tempdir("rustlet-node-");
    let mut config = NodeConfig::new(root.path(), api.node.clone());
    config.http_address = None;
    config.pods.restart_backoff = kubelet::pod::BackoffConfig {
        initial: Duration::from_millis(20),
        max: Duration::from_millis(100),
        reset_after: Duration::from_secs(600),
    };
    let shutdown = CancellationToken::new();
    let _stop = shutdown.clone().drop_guard();
    let provider = HostProcessProvider::new();
    provider.failing_images.lock().expect("lock").insert("missing:v1".into(), "manifest unknown".into());
    let _node = NodeBuilder::new(config)
        .provider(Arc::new(provider))
        .cluster(ClusterSettings::new(ApiSource::Client(api.node_client.clone())))
        .start(shutdown.clone())
        .await
        .expect("node");
    let name = format!("crashy-{}", api.node);
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "nodeName": api.node, "automountServiceAccountToken": false, "restartPolicy": "Always",
            "containers": [{"name": "main", "image": "busybox", "command": ["sh", "-c", "exit 1"]}],
        }
    }))
    .expect("pod");
    let pods: Api<Pod> = Api::namespaced(api.admin.clone(), "default");
    pods.create(&PostParams::default(), &pod).await.expect("create");
    let reason = |e: &k8s_openapi::api::core::v1::Event| e.reason.clone().unwrap_or_default();
    let count = |e: &k8s_openapi::api::core::v1::Event| e.count.unwrap_or(1);
    let events = wait_events(&api, &name, SOON, |events| {
        let reasons: Vec<String> = events.iter().map(reason).collect();
        ["Pulling", "Pulled", "Created", "Started"].iter().all(|r| reasons.iter().any(|x| x == r))
            && events.iter().any(|e| reason(e) == "BackOff" && count(e) >= 3)
    })
    .await;
    let started = events.iter().find(|e| reason(e) == "Started").expect("Started");
    assert_eq!(started.involved_object.field_path.as_deref(), Some("spec.containers{main}"));
    let source = started.source.as_ref().expect("source");
    assert_eq!((source.component.as_deref(), source.host.as_deref()), (Some("kubelet"), Some(api.node.as_str())));
    let backoffs = events.iter().filter(|e| reason(e) == "BackOff").count();
    assert_eq!(backoffs, 1, "a crash loop's back-offs are one Event whose count rises: {events:#?}");
    // `kubectl describe pod` (the real one) shows them from the kubelet.
    if let Some(plane) = api.control_plane() {
        let output = plane.kubectl().args(["describe", "pod", "-n", "default", &name]).output().expect("kubectl");
        let text = String::from_utf8_lossy(&output.stdout);
        assert!(output.status.success(), "{text}{}", String::from_utf8_lossy(&output.stderr));
        // (Not the first line naming BackOff: that may be the state's
        // CrashLoopBackOff.)
        let back_off =
            text.lines().find(|l| l.contains("Back-off restarting failed container main")).unwrap_or_default();
        assert!(back_off.contains("BackOff") && back_off.contains("kubelet"), "{text}");
        assert!(text.lines().any(|l| l.contains("Started") && l.contains("Started container main")), "{text}");
    }
    // A pull failure and a probe failure, as `kubectl describe` shows them.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port();
    let (missing, unhealthy) = (format!("missing-{}", api.node), format!("unhealthy-{}", api.node));
    for (name, container) in [
        (&missing, json!({"name": "main", "image": "missing:v1", "command": ["sleep", "600"]})),
        (
            &unhealthy,
            json!({"name": "main", "image": "busybox", "command": ["sleep", "600"],
                   "readinessProbe": {"httpGet": {"port": closed, "path": "/"}, "periodSeconds": 1, "failureThreshold": 1}}),
        ),
    ] {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"nodeName": api.node, "automountServiceAccountToken": false, "terminationGracePeriodSeconds": 1,
                     "containers": [container]},
        }))
        .expect("pod");
        pods.create(&PostParams::default(), &pod).await.expect("create");
    }
    let has = |events: &[k8s_openapi::api::core::v1::Event], reason_: &str, text: &str| {
        events.iter().any(|e| reason(e) == reason_ && e.message.as_deref().is_some_and(|m| m.contains(text)))
    };
    wait_events(&api, &missing, SOON, |events| {
        has(events, "Failed", "Failed to pull image \"missing:v1\": manifest unknown")
            && has(events, "BackOff", "Back-off pulling image \"missing:v1\"")
    })
    .await;
    wait_events(&api, &unhealthy, SOON, |events| has(events, "Unhealthy", "Readiness probe failed: Get")).await;

    // A liveness probe redirected to another host (upstream's "should
    // *not* be restarted with a non-local redirect http liveness probe"):
    // not followed, a success, and a `ProbeWarning` with the body.
    let redirector = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let port = redirector.local_addr().expect("addr").port();
    tokio::spawn(async move {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        while let Ok((mut stream, _)) = redirector.accept().await {
            let mut request = [0u8; 1024];
            let _ = stream.read(&mut request).await;
            let body = "<a href=\"http://0.0.0.0/\">Found</a>.\n\n";
            let answer = format!(
                "HTTP/1.1 302 Found\r\nLocation: http://0.0.0.0/\r\nContent-Type: text/html\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = stream.write_all(answer.as_bytes()).await;
        }
    });
    let redirected = format!("redirected-{}", api.node);
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": redirected, "namespace": "default"},
        "spec": {"nodeName": api.node, "automountServiceAccountToken": false, "terminationGracePeriodSeconds": 1,
                 "containers": [{"name": "main", "image": "busybox", "command": ["sleep", "600"],
                                 "livenessProbe": {"httpGet": {"port": port, "path": "/redirect?loc=http%3A%2F%2F0.0.0.0%2F"},
                                                   "periodSeconds": 1, "failureThreshold": 1}}]},
    }))
    .expect("pod");
    pods.create(&PostParams::default(), &pod).await.expect("create");
    let warning =
        "Liveness probe warning: Probe terminated redirects, Response body: <a href=\"http://0.0.0.0/\">Found</a>.";
    let events = wait_events(&api, &redirected, SOON, |events| {
        events.iter().any(|e| reason(e) == "ProbeWarning" && count(e) >= 2)
    })
    .await;
    assert!(has(&events, "ProbeWarning", warning), "{events:#?}");
    assert!(!events.iter().any(|e| reason(e) == "Killing" || reason(e) == "Unhealthy"), "never restarted: {events:#?}");
    let restarts =
        pods.get(&redirected).await.expect("pod").status.and_then(|s| s.container_statuses).map(|c| c[0].restart_count);
    assert_eq!(restarts, Some(0));
    if let Some(plane) = api.control_plane() {
        for (name, line) in [(&missing, "Failed to pull image"), (&unhealthy, "Readiness probe failed")] {
            let output = plane.kubectl().args(["describe", "pod", "-n", "default", name]).output().expect("kubectl");
            let text = String::from_utf8_lossy(&output.stdout);
            assert!(text.lines().any(|l| l.contains("Warning") && l.contains(line)), "{text}");
        }
    }
    for name in [&missing, &unhealthy] {
        pods.delete(name, &DeleteParams::default()).await.expect("delete");
    }
    // The node's own events, as upstream's: its start and its conditions.
    wait_events(&api, &api.node, SOON, |events| {
        let reasons: Vec<String> = events.iter().map(reason).collect();
        ["Starting", "NodeHasSufficientMemory", "NodeReady"].iter().all(|r| reasons.iter().any(|x| x == r))
    })
    .await;
    pods.delete(&name, &DeleteParams::default()).await.expect("delete");
    api.wait_for(&pods, &name, "gone", SOON, |p| p.is_none()).await;
}
rustlet_testkit::on_both_api_servers!(pod_events_reach_the_api_aggregated_on, pod_events_reach_the_api_aggregated);

/// The node's `kubelet_api_streaming_sessions` gauge.
async fn streaming_sessions(
    address: std::net::SocketAddr,
    credentials: rustlet_testkit::https::Credentials<'_>,
) -> f64 {
    rustlet_testkit::https::metric(address, "kubelet_api_streaming_sessions", credentials).await.expect("the gauge")
}

/// Runs kubectl of the control plane; its stdout (panics on failure with
/// stderr). Async: the node answering it runs on the test's runtime.
/// A token of a new service account allowed `get` on `nodes/<subresource>`
/// only (a ClusterRole and its binding), once the API says it is allowed.
async fn token_with_node_subresource(api: &TestApi, subresource: &str) -> String {
    use k8s_openapi::api::authentication::v1::TokenRequest;
    use k8s_openapi::api::authorization::v1::SubjectAccessReview;
    use k8s_openapi::api::core::v1::ServiceAccount;
    use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
    let name = format!("node-{subresource}-reader");
    let accounts: Api<ServiceAccount> = Api::namespaced(api.admin.clone(), "default");
    let account = serde_json::from_value(json!({"metadata": {"name": name}})).expect("account");
    accounts.create(&PostParams::default(), &account).await.expect("service account");
    let role = serde_json::from_value(json!({"metadata": {"name": name},
        "rules": [{"apiGroups": [""], "resources": [format!("nodes/{subresource}")], "verbs": ["get"]}]}))
    .expect("role");
    Api::<ClusterRole>::all(api.admin.clone()).create(&PostParams::default(), &role).await.expect("cluster role");
    let binding = serde_json::from_value(json!({"metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": "default"}]}))
    .expect("binding");
    Api::<ClusterRoleBinding>::all(api.admin.clone()).create(&PostParams::default(), &binding).await.expect("binding");
    let request: TokenRequest = serde_json::from_value(json!({"spec": {"audiences": []}})).expect("token request");
    let answer = accounts.create_token_request(&name, &PostParams::default(), &request).await.expect("token");
    let token = answer.status.expect("status").token;
    // RBAC's cache takes the binding in a moment: asked until it has.
    let review: SubjectAccessReview = serde_json::from_value(json!({"spec": {
        "user": format!("system:serviceaccount:default:{name}"),
        "resourceAttributes": {"verb": "get", "resource": "nodes", "subresource": subresource, "name": api.node}}}))
    .expect("review");
    let reviews: Api<SubjectAccessReview> = Api::all(api.admin.clone());
    let allowed = async {
        loop {
            let answer = reviews.create(&PostParams::default(), &review).await.expect("review");
            if answer.status.is_some_and(|s| s.allowed) {
                return;
            }
            tokio::task::yield_now().await;
        }
    };
    tokio::time::timeout(SOON, allowed).await.expect("RBAC allows the account in time");
    token
}

async fn kubectl(plane: &rustlet_testkit::control_plane::ControlPlane, args: &[&str]) -> String {
    let run = tokio::process::Command::from(plane.kubectl()).args(args).kill_on_drop(true).output();
    let output = tokio::time::timeout(SOON, run)
        .await
        .unwrap_or_else(|_| panic!("kubectl {args:?} did not end within {SOON:?}"))
        .expect("run kubectl");
    let (stdout, stderr) = (String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    assert!(output.status.success(), "kubectl {args:?} failed: {stdout}{stderr}");
    stdout.into_owned()
}

/// The kubelet API as a cluster uses it, on the real kube-apiserver:
/// `kubectl logs` with every option goes through the API server to the
/// node's HTTPS port (advertised in the Node's daemonEndpoints, the API
/// server authenticated by its client certificate and authorized by a
/// SubjectAccessReview); `nodes/proxy` reaches `/pods`, `/runningpods/`,
/// `/stats/summary`, `/metrics/resource`, `/configz`, `/healthz` and
/// `/logs/` (the log dir and the log query); direct
/// clients get 401 without credentials, 403 when the API denies them,
/// 200 with a token or certificate it allows, and 400/404 for bad requests.
#[tokio::test]
async fn the_kubelet_api_serves_kubectl_through_the_real_api_server() {
    use kubelet::cluster::{ApiSource, ClusterSettings};
    use kubelet::node::{NodeBuilder, NodeConfig};
    use kubelet::server::KubeletApiConfig;
    use rustlet_testkit::https::{Credentials, get};
    let Some(api) = TestApi::real("the_kubelet_api_serves_kubectl_through_the_real_api_server").await else {
        return;
    };
    let plane = api.control_plane().expect("real");
    let root = rustlet_testkit::node_root::tempdir("rustlet-node-");
    let mut config = NodeConfig::new(root.path(), api.node.clone());
    config.http_address = None;
    // The API server proxies nodes/proxy to no loopback address: the
    // node uses the host's own address where it has one.
    let host_ip = rustlet_testkit::control_plane::host_ip();
    let ip = host_ip.unwrap_or(std::net::IpAddr::from([127, 0, 0, 1]));
    config.node_ips = vec![ip];
    let mut kubelet_api = KubeletApiConfig::new(root.path());
    kubelet_api.address = std::net::SocketAddr::new(ip, 0);
    kubelet_api.client_ca = Some(plane.ca_file());
    // The node's log dir, with the log query on (no journal: the query's
    // file heuristics answer).
    let log_dir = root.path().join("var-log");
    std::fs::create_dir_all(log_dir.join("containerd")).expect("log dir");
    std::fs::write(log_dir.join("kubelet.log"), "I0101 kubelet started\n").expect("kubelet.log");
    std::fs::write(log_dir.join("containerd/containerd.log"), "containerd up\n").expect("containerd.log");
    kubelet_api.system_logs = kubelet::server::SystemLogSettings {
        handler: true,
        query: true,
        dir: log_dir.clone(),
        journalctl: log_dir.join("no-journalctl"),
    };
    config.kubelet_api = Some(kubelet_api);
    let shutdown = CancellationToken::new();
    let _stop = shutdown.clone().drop_guard();
    let node = NodeBuilder::new(config)
        .provider(Arc::new(HostProcessProvider::new()))
        .cluster(ClusterSettings::new(ApiSource::Client(api.node_client.clone())))
        .start(shutdown.clone())
        .await
        .expect("node");
    let address = node.kubelet_api_address().expect("the kubelet API is served");
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(api.admin.clone());
    api.wait_for(&nodes, &api.node, "advertising its kubelet port", SOON, |n| {
        let port =
            n.and_then(|n| n.status.as_ref()?.daemon_endpoints.as_ref()?.kubelet_endpoint.as_ref().map(|e| e.port));
        port == Some(i32::from(address.port()))
    })
    .await;

    // A pod whose log grows when the test says so, and one that restarted.
    let flag = root.path().join("go-on");
    let counter = root.path().join("runs");
    let (talker, restarted) = (format!("talker-{}", api.node), format!("restarted-{}", api.node));
    let script = format!(
        "echo alpha; echo beta; echo gamma; while [ ! -e {flag} ]; do sleep 0.05; done; echo delta; exec sleep 600",
        flag = flag.display()
    );
    let again = format!(
        "n=$(cat {c} 2>/dev/null || echo 0); n=$((n+1)); echo $n > {c}; echo run $n; [ $n -ge 2 ] && exec sleep 600; exit 1",
        c = counter.display()
    );
    let pods: Api<Pod> = Api::namespaced(api.admin.clone(), "default");
    for (name, script) in [(&talker, &script), (&restarted, &again)] {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"nodeName": api.node, "automountServiceAccountToken": false, "terminationGracePeriodSeconds": 1,
                     "containers": [{"name": "main", "image": "busybox", "command": ["sh", "-c", script]}]},
        }))
        .expect("pod");
        pods.create(&PostParams::default(), &pod).await.expect("create");
    }
    api.wait_for(&pods, &talker, "running", SOON, |p| p.is_some_and(|p| running(&json_of(p)))).await;
    api.wait_for(&pods, &restarted, "running after a restart", SOON, |p| {
        let status = p.and_then(|p| p.status.as_ref()?.container_statuses.as_ref()?.first().cloned());
        status.is_some_and(|s| s.restart_count >= 1 && s.state.as_ref().is_some_and(|s| s.running.is_some()))
    })
    .await;
    // The pod runs; its first lines may still be on their way to the log.
    let deadline = tokio::time::Instant::now() + SOON;
    loop {
        let all = kubectl(plane, &["logs", &talker]).await;
        if all == "alpha\nbeta\ngamma\n" {
            break;
        }
        assert!(all.len() < 17 && tokio::time::Instant::now() < deadline, "kubectl logs: {all:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(kubectl(plane, &["logs", &talker, "--tail=1"]).await, "gamma\n");
    assert_eq!(kubectl(plane, &["logs", &talker, "--limit-bytes=3"]).await, "alp");
    assert_eq!(kubectl(plane, &["logs", &talker, "--since=1h"]).await, "alpha\nbeta\ngamma\n");
    let future = (jiff::Timestamp::now() + jiff::SignedDuration::from_secs(3600)).to_string();
    assert_eq!(
        kubectl(plane, &["logs", &talker, &format!("--since-time={future}")]).await,
        "",
        "nothing after the future"
    );
    let stamped = kubectl(plane, &["logs", &talker, "--timestamps"]).await;
    assert_eq!(stamped.lines().count(), 3, "{stamped}");
    for (line, text) in stamped.lines().zip(["alpha", "beta", "gamma"]) {
        let (time, rest) = line.split_once(' ').expect("timestamp and text");
        assert!(time.parse::<jiff::Timestamp>().is_ok(), "an RFC 3339 time: {line}");
        assert_eq!(rest, text);
    }
    assert_eq!(kubectl(plane, &["logs", &restarted, "--previous"]).await, "run 1\n");
    assert_eq!(kubectl(plane, &["logs", &restarted]).await, "run 2\n");
    // -f: what is there, then each line as it is written.
    let mut follow = tokio::process::Command::from(plane.kubectl());
    follow.args(["logs", "-f", &talker]).stdout(std::process::Stdio::piped()).kill_on_drop(true);
    let mut follow = follow.spawn().expect("kubectl logs -f");
    let mut lines = tokio::io::BufReader::new(follow.stdout.take().expect("stdout"));
    let mut seen = Vec::new();
    let read = async {
        use tokio::io::AsyncBufReadExt as _;
        loop {
            let mut line = String::new();
            if lines.read_line(&mut line).await.expect("read") == 0 {
                break;
            }
            seen.push(line.trim_end().to_owned());
            if seen.len() == 3 {
                std::fs::write(&flag, "").expect("let the container go on");
            }
            if seen.len() == 4 {
                break;
            }
        }
    };
    tokio::time::timeout(SOON, read).await.expect("kubectl logs -f shows the new line");
    assert_eq!(seen, ["alpha", "beta", "gamma", "delta"]);
    // A client that goes away mid-follow leaves nothing behind: the
    // session's task ends (and closes the log file).
    let (cert_pem, key_pem) = plane.issue_client_certificate("cert-admin", "system:masters").expect("certificate");
    let admin_cert = || Credentials::Certificate { cert_pem: &cert_pem, key_pem: &key_pem };
    assert_eq!(streaming_sessions(address, admin_cert()).await, 1.0, "the follow is a session");
    drop(follow);
    let deadline = tokio::time::Instant::now() + SOON;
    while streaming_sessions(address, admin_cert()).await != 0.0 {
        assert!(tokio::time::Instant::now() < deadline, "the follow of a client that left did not end");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // nodes/proxy: the node's endpoints through the API server.
    if host_ip.is_none() {
        rustlet_testkit::skip::skip_check(
            "the_kubelet_api_serves_kubectl_through_the_real_api_server",
            "nodes/proxy",
            rustlet_testkit::skip::Need::HostAddress,
            "the API server does not proxy to loopback",
        );
    }
    if host_ip.is_some() {
        let raw = |path: &str| {
            let path = format!("/api/v1/nodes/{}/proxy{path}", api.node);
            async move { kubectl(plane, &["get", "--raw", &path]).await }
        };
        assert_eq!(raw("/healthz").await, "ok");
        let listed: Value = serde_json::from_str(&raw("/pods").await).expect("a PodList");
        assert!(listed["items"].as_array().expect("items").iter().any(|p| p["metadata"]["name"] == talker.as_str()));
        let running_pods: Value = serde_json::from_str(&raw("/runningpods/").await).expect("a PodList");
        assert!(
            running_pods["items"].as_array().expect("items").iter().any(|p| p["metadata"]["name"] == talker.as_str())
        );
        let summary: Value = serde_json::from_str(&raw("/stats/summary").await).expect("a summary");
        assert_eq!(summary["node"]["nodeName"], api.node.as_str());
        assert!(summary["node"]["cpu"]["usageCoreNanoSeconds"].as_u64().is_some_and(|n| n > 0), "{summary}");
        assert!(summary["node"]["memory"]["workingSetBytes"].as_u64().is_some_and(|n| n > 0), "{summary}");
        assert!(summary["node"]["fs"]["capacityBytes"].as_u64().is_some_and(|n| n > 0), "{summary}");
        // What upstream's e2e resource monitor dereferences.
        assert!(summary["node"]["memory"]["rssBytes"].as_u64().is_some_and(|n| n > 0), "{summary}");
        let kubelet_container = summary["node"]["systemContainers"]
            .as_array()
            .and_then(|c| c.iter().find(|c| c["name"] == "kubelet"))
            .unwrap_or_else(|| panic!("the kubelet system container: {summary}"));
        assert!(kubelet_container["memory"]["rssBytes"].as_u64().is_some_and(|n| n > 0), "{summary}");
        let pod_stats = summary["pods"].as_array().expect("pods");
        let talker_stats = pod_stats.iter().find(|p| p["podRef"]["name"] == talker.as_str()).expect("the pod's stats");
        assert_eq!(talker_stats["containers"][0]["name"], "main");
        let metrics = raw("/metrics/resource").await;
        for series in ["node_cpu_usage_seconds_total", "node_memory_working_set_bytes"] {
            let value: f64 = metrics
                .lines()
                .find(|l| l.starts_with(&format!("{series} ")))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("{series} in {metrics}"));
            assert!(value > 0.0, "{series} = {value}");
        }
        assert!(
            metrics.contains("container_start_time_seconds{container=\"main\",namespace=\"default\",pod=\"talker-"),
            "{metrics}"
        );
        let configz: Value = serde_json::from_str(&raw("/configz").await).expect("configz");
        assert_eq!(configz["kubeletconfig"]["authorization"]["mode"], "Webhook");
        // The node's logs: the dir listed, a file, the log query.
        let listing = raw("/logs/").await;
        assert!(
            listing.contains("<a href=\"containerd/\">containerd/</a>\n<a href=\"kubelet.log\">kubelet.log</a>"),
            "{listing}"
        );
        assert_eq!(raw("/logs/containerd/containerd.log").await, "containerd up\n");
        assert_eq!(raw("/logs/?query=kubelet").await, "I0101 kubelet started\n");
        assert_eq!(raw("/logs/?query=containerd&query=kubelet").await, "containerd up\nI0101 kubelet started\n");
        assert_eq!(configz["kubeletconfig"]["port"], address.port());
    }

    // Direct clients.
    let logs = format!("/containerLogs/default/{talker}/main");
    let (code, body) = get(address, &logs, Credentials::Anonymous).await.expect("request");
    assert_eq!((code, body.as_str()), (401, "Unauthorized"), "no credentials");
    let (code, body) = get(address, &logs, Credentials::Token("not-a-token")).await.expect("request");
    assert_eq!(code, 401, "a token the API does not know: {body}");
    let other_node = plane.node();
    let (code, body) = get(address, &logs, Credentials::Token(&other_node.token)).await.expect("request");
    assert_eq!(code, 403, "{body}");
    assert!(
        body.contains(&format!("user=system:node:{}, verb=get, resource=nodes, subresource=proxy", other_node.name)),
        "{body}"
    );
    // 1.33's fine-grained authorization: `nodes/healthz` opens /healthz,
    // as `nodes/proxy` does; `nodes/configz` does not.
    for (subresource, want) in [("healthz", 200), ("proxy", 200), ("configz", 403)] {
        let token = token_with_node_subresource(&api, subresource).await;
        let (code, body) = get(address, "/healthz", Credentials::Token(&token)).await.expect("request");
        assert_eq!(code, want, "/healthz with nodes/{subresource}: {body}");
        if want == 403 {
            assert!(body.contains("subresource(s)=[healthz proxy]"), "{body}");
        }
    }
    let (code, body) = get(address, &logs, Credentials::Token(plane.admin_token())).await.expect("request");
    assert_eq!((code, body.as_str()), (200, "alpha\nbeta\ngamma\ndelta\n"), "the administrator's token");
    let (code, body) = get(address, "/stats/summary", admin_cert()).await.expect("request");
    assert_eq!(code, 200, "a client certificate the CA signed: {body}");
    let (code, body) = get(address, "/no/such/endpoint", admin_cert()).await.expect("request");
    assert_eq!(code, 404, "{body}");
    let (code, body) = get(address, "/logs/?query", admin_cert()).await.expect("request");
    assert_eq!((code, body.trim()), (400, "query: Invalid value: []string{\"\"}: query cannot be empty"));
    let (code, body) = get(address, "/logs/?query=kubelet&boot=1", admin_cert()).await.expect("request");
    assert_eq!((code, body.trim()), (406, "boot: Invalid value: 1: must be less than 1"));
    let (code, body) = get(address, &format!("{logs}?tailLines=x"), admin_cert()).await.expect("request");
    assert_eq!((code, body.trim()), (400, "tailLines=x is not a number"));
    let (code, body) = get(address, "/containerLogs/default/nobody/main", admin_cert()).await.expect("request");
    assert_eq!(code, 404, "{body}");
    let (code, body) =
        get(address, &format!("/containerLogs/default/{talker}/sidecar"), admin_cert()).await.expect("request");
    assert_eq!(code, 400, "{body}");
    let (code, body) = get(address, &format!("/exec/default/{talker}/nosuch?command=ls&output=1"), admin_cert())
        .await
        .expect("request");
    assert_eq!(code, 404, "exec into a missing container: {body}");
    let (code, body) =
        get(address, &format!("/exec/default/{talker}/main?command=ls"), admin_cert()).await.expect("request");
    assert_eq!(code, 400, "{body}");
    let status: Value = serde_json::from_str(&body).expect("a v1.Status");
    assert_eq!(status["message"], "you must specify at least 1 of stdin, stdout, stderr");
    // A certificate from another CA fails the handshake.
    let stranger = {
        let key = rcgen::KeyPair::generate().expect("key");
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        params.distinguished_name.push(rcgen::DnType::CommonName, "stranger");
        (params.self_signed(&key).expect("cert").pem(), key.serialize_pem())
    };
    let refused = get(address, "/pods", Credentials::Certificate { cert_pem: &stranger.0, key_pem: &stranger.1 }).await;
    assert!(refused.is_err(), "a certificate the CA did not sign is refused: {refused:?}");

    for name in [&talker, &restarted] {
        pods.delete(name, &DeleteParams::default()).await.expect("delete");
    }
    for name in [&talker, &restarted] {
        api.wait_for(&pods, name, "gone", SOON, |p| p.is_none()).await;
    }
}

/// A container's resources, as the e2e resize specs write them.
fn sized(requests: (&str, &str), limits: (&str, &str)) -> Value {
    json!({"requests": {"cpu": requests.0, "memory": requests.1}, "limits": {"cpu": limits.0, "memory": limits.1}})
}

/// A resize of `container` through the `resize` subresource (a strategic
/// merge patch, as `kubectl patch --subresource resize` sends).
async fn resize(admin: &Api<Pod>, pod: &str, containers: Value) -> Result<Pod, kube::Error> {
    use kube::api::{Patch, PatchParams};
    let patch = json!({"spec": {"containers": containers}});
    admin.patch_subresource("resize", pod, &PatchParams::default(), &Patch::Strategic(patch)).await
}

/// Whether every container's status reports its spec's resources, no
/// resize condition is left and the pod is ready: upstream's test that a
/// resize was actuated.
fn resized(pod: &Value) -> bool {
    let specs = pod["spec"]["containers"].as_array().cloned().unwrap_or_default();
    let statuses = pod["status"]["containerStatuses"].as_array().cloned().unwrap_or_default();
    let conditions = pod["status"]["conditions"].as_array().cloned().unwrap_or_default();
    specs.len() == statuses.len()
        && specs.iter().zip(&statuses).all(|(spec, status)| spec["resources"] == status["resources"])
        && !conditions.iter().any(|c| c["type"].as_str().is_some_and(|t| t.starts_with("PodResize")))
        && conditions.iter().any(|c| c["type"] == "Ready" && c["status"] == "True")
}

fn condition(pod: &Value, kind: &str) -> Value {
    let conditions = pod["status"]["conditions"].as_array().cloned().unwrap_or_default();
    conditions.into_iter().find(|c| c["type"] == kind).unwrap_or(Value::Null)
}

/// In-place resize through the API, as upstream's "Pod InPlace Resize
/// Container" specs drive it: the container statuses report each
/// container's size from the start; a resize the node can take is
/// allocated and actuated (in place where the resize policy allows, the
/// container restarted once where it says `RestartContainer`) and the
/// statuses follow; a size the node could never give is `Infeasible` and
/// one that waits for room is `Deferred`, with upstream's messages, until
/// another pod leaves. The API's own checks (a memory limit lowered
/// without a restart) answer as upstream's. On a control plane older than
/// 1.33 (resize off) the subresource is refused and the pod runs on.
async fn a_resize_is_actuated_or_held_back_with_its_reason(api: TestApi) {
    let node = cluster_node_on(api).await;
    let name = node.api.node.clone();
    let resizable: Pod = serde_json::from_value(json!({
        "metadata": {"name": "resizable", "namespace": "default"},
        "spec": {
            "nodeName": name,
            "automountServiceAccountToken": false,
            "terminationGracePeriodSeconds": 1,
            "initContainers": [
                {"name": "side", "image": "busybox", "command": ["sleep", "600"], "restartPolicy": "Always",
                 "resources": sized(("50m", "16Mi"), ("100m", "32Mi")),
                 "resizePolicy": [{"resourceName": "cpu", "restartPolicy": "NotRequired"},
                                  {"resourceName": "memory", "restartPolicy": "NotRequired"}]},
            ],
            "containers": [
                {"name": "c1", "image": "busybox", "command": ["sleep", "600"],
                 "resources": sized(("100m", "64Mi"), ("200m", "128Mi")),
                 "resizePolicy": [{"resourceName": "cpu", "restartPolicy": "NotRequired"},
                                  {"resourceName": "memory", "restartPolicy": "NotRequired"}]},
                {"name": "c2", "image": "busybox", "command": ["sleep", "600"],
                 "resources": sized(("100m", "32Mi"), ("100m", "64Mi")),
                 "resizePolicy": [{"resourceName": "cpu", "restartPolicy": "NotRequired"},
                                  {"resourceName": "memory", "restartPolicy": "RestartContainer"}]},
            ]
        }
    }))
    .expect("pod");
    let mut resizable = resizable;
    if node.api.control_plane().is_some_and(|plane| plane.minor_version() < 29) {
        // Sidecars are off before 1.29: the server drops an init
        // container's restartPolicy, and this one would never end. (This
        // server has no resize subresource either; only that is checked.)
        resizable.spec.as_mut().expect("spec").init_containers = None;
    }
    node.admin.create(&PostParams::default(), &resizable).await.expect("create");
    let wait = |what: &'static str, pred: Box<dyn Fn(&Value) -> bool + Send + Sync>| {
        let (api, admin) = (&node.api, &node.admin);
        async move {
            let pod = api.wait_for(admin, "resizable", what, SOON, |p| p.is_some_and(|p| pred(&json_of(p)))).await;
            json_of(&pod.expect("pod"))
        }
    };
    let started = wait("running with its sizes", Box::new(resized)).await;
    if node.api.fake_server().is_some() {
        // (The real server keeps it only with an alpha gate on.)
        assert_eq!(
            started["status"]["containerStatuses"][0]["allocatedResources"],
            json!({"cpu": "100m", "memory": "64Mi"})
        );
    }
    if node.api.control_plane().is_some_and(|plane| plane.minor_version() < 33) {
        let refused = resize(
            &node.admin,
            "resizable",
            json!([{"name": "c1", "resources": sized(("200m", "64Mi"), ("200m", "128Mi"))}]),
        )
        .await;
        assert!(matches!(refused, Err(kube::Error::Api(ref e)) if e.code == 404), "{refused:?}");
        let still = json_of(&node.admin.get("resizable").await.expect("pod"));
        assert!(running(&still), "{still}");
        return;
    }

    // The API refuses a memory limit lowered in place.
    let lowered =
        resize(&node.admin, "resizable", json!([{"name": "c1", "resources": {"limits": {"memory": "100Mi"}}}])).await;
    let message = match lowered {
        Err(kube::Error::Api(e)) => e.message,
        other => panic!("a lowered memory limit was taken: {other:?}"),
    };
    assert!(message.contains("memory limits cannot be decreased unless resizePolicy is RestartContainer"), "{message}");

    // c1 more cpu in place, c2 more memory by a restart.
    resize(
        &node.admin,
        "resizable",
        json!([{"name": "c1", "resources": sized(("300m", "64Mi"), ("400m", "128Mi"))},
               {"name": "c2", "resources": sized(("100m", "48Mi"), ("100m", "96Mi"))}]),
    )
    .await
    .expect("resize");
    // The sidecar (a restartable init container) more cpu, in place too.
    {
        use kube::api::{Patch, PatchParams};
        let patch = json!({"spec": {"initContainers": [{"name": "side", "resources": sized(("100m", "16Mi"), ("150m", "32Mi"))}]}});
        node.admin
            .patch_subresource("resize", "resizable", &PatchParams::default(), &Patch::Strategic(patch))
            .await
            .expect("resize the sidecar");
    }
    let done = wait(
        "resized",
        Box::new(|p| {
            resized(p)
                && p["status"]["containerStatuses"][0]["resources"]["limits"]["cpu"] == "400m"
                && p["status"]["initContainerStatuses"][0]["resources"]["limits"]["cpu"] == "150m"
        }),
    )
    .await;
    let side = &done["status"]["initContainerStatuses"][0];
    assert_eq!(side["restartCount"], 0, "the sidecar was resized in place: {done}");
    assert_eq!(side["resources"]["requests"]["cpu"], "100m", "{done}");
    let statuses = &done["status"]["containerStatuses"];
    assert_eq!(statuses[0]["restartCount"], 0, "c1 was resized in place: {done}");
    assert_eq!(statuses[1]["restartCount"], 1, "c2 was restarted for its memory: {done}");
    assert_eq!(statuses[1]["resources"]["limits"]["memory"], "96Mi");
    let c1_id = statuses[0]["containerID"].as_str().expect("c1's id").to_owned();
    let updates = node.host.updates.lock().expect("lock").clone();
    assert!(
        updates.iter().any(|(id, size)| c1_id.ends_with(&id.0)
            && size.limits.as_ref().and_then(|l| l.get("cpu")).map(|q| q.0.as_str()) == Some("400m")),
        "c1 was updated in place to 400m: {updates:?}"
    );

    // More cpu than the node has at all: Infeasible, until the spec changes.
    resize(&node.admin, "resizable", json!([{"name": "c1", "resources": sized(("5", "64Mi"), ("5", "128Mi"))}]))
        .await
        .expect("resize");
    let infeasible = wait("infeasible", Box::new(|p| condition(p, "PodResizePending")["reason"] == "Infeasible")).await;
    assert_eq!(
        condition(&infeasible, "PodResizePending")["message"],
        "Node didn't have enough capacity: cpu, requested: 5200, capacity: 2000"
    );
    assert_eq!(infeasible["status"]["containerStatuses"][0]["resources"]["requests"]["cpu"], "300m");

    // Room taken by another pod: Deferred until it leaves.
    node.admin.create(&PostParams::default(), &pod("hog", &name, "1500m")).await.expect("hog");
    node.api
        .wait_for(&node.admin, "hog", "Running", SOON, |p| p.is_some_and(|p| running(&json_of(p))))
        .await
        .expect("hog");
    resize(&node.admin, "resizable", json!([{"name": "c1", "resources": sized(("500m", "64Mi"), ("500m", "128Mi"))}]))
        .await
        .expect("resize");
    let deferred = wait("deferred", Box::new(|p| condition(p, "PodResizePending")["reason"] == "Deferred")).await;
    assert_eq!(
        condition(&deferred, "PodResizePending")["message"],
        "Node didn't have enough resource: cpu, requested: 700, used: 1500, capacity: 2000"
    );
    node.admin.delete("hog", &DeleteParams::default()).await.expect("delete hog");
    let taken = wait(
        "resized once the hog left",
        Box::new(|p| resized(p) && p["status"]["containerStatuses"][0]["resources"]["requests"]["cpu"] == "500m"),
    )
    .await;
    assert_eq!(taken["status"]["containerStatuses"][0]["restartCount"], 0, "{taken}");
}
rustlet_testkit::on_both_api_servers!(
    a_resize_is_actuated_or_held_back_with_its_reason_on,
    a_resize_is_actuated_or_held_back_with_its_reason
);

/// Upstream's "should never report success for a pending container" and
/// "should never report container start when an init container fails",
/// with host processes (`pod_deletion` has the rules and the scenarios).
async fn a_deleted_pods_statuses_never_report_success_or_revert(api: TestApi) {
    let node = cluster_node_on(api).await;
    let errors = rustlet_testkit::pod_deletion::run_scenarios(&node.admin, &node.api.node, "busybox", SOON).await;
    assert!(errors.is_empty(), "{}", errors.join("\n"));
    // A pod the node saw fail, deleted while its first status is still on
    // the way: the deletion carries the failure, not the stale first
    // status.
    let name = "failed-then-deleted";
    let spec = json!({"metadata": {"name": name}, "spec": {"nodeName": node.api.node, "restartPolicy": "Never",
        "automountServiceAccountToken": false, "terminationGracePeriodSeconds": 1,
        "containers": [{"name": "fail", "image": "busybox", "command": ["sh", "-c", "exit 1"]}]}});
    let created =
        node.admin.create(&PostParams::default(), &serde_json::from_value(spec).expect("pod")).await.expect("create");
    let uid = created.metadata.uid.clone().expect("uid");
    let failed = node
        .pods
        .store()
        .wait_for(SOON, |pods| {
            pods.get(&uid).is_some_and(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Failed"))
        })
        .await;
    assert!(failed.is_some(), "the node saw the pod fail");
    let deleted = rustlet_testkit::pod_deletion::delete_and_watch(&node.admin, &created, SOON).await;
    assert_eq!(deleted["status"]["phase"], "Failed", "{}", deleted["status"]);
    assert_eq!(
        deleted["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"], 1,
        "{}",
        deleted["status"]
    );
}
rustlet_testkit::on_both_api_servers!(
    a_deleted_pods_statuses_never_report_success_or_revert_on,
    a_deleted_pods_statuses_never_report_success_or_revert
);

/// The same scenarios with every status write slow (300 ms): a pod stopped
/// and released while its previous status is on the way still gets its
/// last status into the API before its deletion is finished.
#[tokio::test]
async fn a_deleted_pods_last_status_reaches_the_api_behind_a_slow_write() {
    let node = cluster_node().await;
    node.server().inject(Fault::slow(Some(http::Method::PATCH), "/status", Duration::from_millis(300), 10_000));
    let errors = rustlet_testkit::pod_deletion::run_scenarios(&node.admin, &node.api.node, "busybox", SOON).await;
    assert!(errors.is_empty(), "{}", errors.join("\n"));
}
