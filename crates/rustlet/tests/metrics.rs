//! The node as Prometheus sees it: a real Prometheus (Debian's package)
//! scrapes a cluster-mode node through the kubelet API's TLS with a bearer
//! token allowed `get nodes/metrics` and nothing else, with the scrape jobs
//! kube-prometheus gives a kubelet (`/metrics`, `/metrics/cadvisor`,
//! `/metrics/probes`, `honor_labels`, the `metrics_path` label, job
//! `kubelet`). Container pods run on a real containerd: one with a
//! persistent volume claim on a CSI driver, one whose readiness probe
//! fails. The test then asks Prometheus for the expressions of the
//! kubelet's alerts and of the "Compute Resources / Pod" dashboard (their
//! kubelet parts: kube-state-metrics is not here) and checks that each
//! gives this node's series with sane values.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, PersistentVolume, PersistentVolumeClaim, Pod};
use kube::api::{Api, PostParams};
use rustlet_sample_plugins::csi_driver::{CsiDriverConfig, RegisteredCsiDriver};
use rustlet_sample_plugins::report::Reporter;
use rustlet_testkit::cgroups::TestCgroupRoot;
use rustlet_testkit::containerd::{Containerd, push_busybox};
use rustlet_testkit::node_process::NodeProcess;
use rustlet_testkit::prometheus::{Prometheus, Sample, prometheus_or_skip};
use rustlet_testkit::registry::registry_or_skip;
use rustlet_testkit::test_api::TestApi;
use serde_json::json;
use tokio::process::Command;

/// A liveness bound: pods start in seconds, Prometheus scrapes every second.
const SOON: Duration = Duration::from_secs(180);
const DRIVER: &str = "metrics.csi.rustlet.dev";

/// kube-prometheus' kubelet jobs (one per endpoint, each relabelled to job
/// `kubelet` as the operator names it), scraping every second, and one
/// job with a token the node must refuse.
fn scrape_config(target: &str, node: &str, token_file: &Path, refused_token_file: &Path) -> String {
    let job = |name: &str, path: &str, token: &Path, job_label: &str| {
        format!(
            "- job_name: {name}
  honor_labels: true
  scheme: https
  metrics_path: {path}
  tls_config: {{insecure_skip_verify: true}}
  authorization: {{credentials_file: {token}}}
  static_configs:
  - targets: ['{target}']
    labels: {{node: {node}, namespace: kube-system, service: kubelet, endpoint: https-metrics}}
  relabel_configs:
  - {{source_labels: [__metrics_path__], target_label: metrics_path}}
  - {{target_label: job, replacement: {job_label}}}
",
            token = token.display()
        )
    };
    format!(
        "global: {{scrape_interval: 1s, scrape_timeout: 1s, evaluation_interval: 1s}}\nscrape_configs:\n{}{}{}{}",
        job("kubelet-metrics", "/metrics", token_file, "kubelet"),
        job("kubelet-cadvisor", "/metrics/cadvisor", token_file, "kubelet"),
        job("kubelet-probes", "/metrics/probes", token_file, "kubelet"),
        job("kubelet-refused", "/metrics", refused_token_file, "kubelet-refused"),
    )
}

/// Waits until `expr` gives series that `check` accepts (it says why not);
/// returns them.
async fn until(
    prometheus: &Prometheus,
    what: &str,
    expr: &str,
    check: impl Fn(&[Sample]) -> Result<(), String>,
) -> Vec<Sample> {
    let deadline = tokio::time::Instant::now() + SOON;
    loop {
        let answer = prometheus.query(expr).await;
        let verdict = match &answer {
            Ok(samples) if samples.is_empty() => Err("no series".to_owned()),
            Ok(samples) => check(samples),
            Err(error) => Err(error.clone()),
        };
        match verdict {
            Ok(()) => {
                eprintln!("{what}: {:?}", answer.as_ref().map(|s| s.iter().map(|s| s.value).collect::<Vec<_>>()));
                return answer.unwrap_or_default();
            }
            Err(why) if tokio::time::Instant::now() > deadline => {
                panic!("{what}: {expr}\n{why}\ntargets: {:?}", prometheus.targets().await)
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(250)).await,
        }
    }
}

/// Every series is this node's (by its `node` label) and its value passes `ok`.
fn of_node(node: &str, ok: impl Fn(f64) -> bool) -> impl Fn(&[Sample]) -> Result<(), String> {
    let node = node.to_owned();
    move |samples: &[Sample]| {
        for sample in samples {
            if sample.labels.get("node") != Some(&node) {
                return Err(format!("not node {node}: {sample:?}"));
            }
            if !ok(sample.value) {
                return Err(format!("value out of range: {sample:?}"));
            }
        }
        Ok(())
    }
}

fn one_with(labels: &[(&str, &str)], ok: impl Fn(f64) -> bool) -> impl Fn(&[Sample]) -> Result<(), String> {
    let labels: Vec<(String, String)> = labels.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
    move |samples: &[Sample]| {
        let found = samples
            .iter()
            .find(|s| labels.iter().all(|(k, v)| s.labels.get(k) == Some(v)))
            .ok_or_else(|| format!("no series with {labels:?} in {samples:?}"))?;
        if ok(found.value) { Ok(()) } else { Err(format!("value out of range: {found:?}")) }
    }
}

/// Free bytes of the file system holding `path`, as `df` counts them.
fn df_available(path: &Path) -> f64 {
    let stats = rustix::fs::statvfs(path).expect("statvfs");
    (stats.f_bavail * stats.f_frsize) as f64
}

/// The working set of cgroup `group` (v1: `memory.usage_in_bytes` less
/// `total_inactive_file`; v2: `memory.current` less `inactive_file`).
fn cgroup_working_set(group: &str) -> f64 {
    let fs = kubelet::cgroups::CgroupFs::detect().expect("cgroups");
    fs.memory(group).expect("the pod's cgroup").working_set as f64
}

#[tokio::test]
async fn prometheus_scrapes_the_node_and_the_kubelet_alerts_and_dashboards_read_it() {
    const TEST: &str = "prometheus_scrapes_the_node_and_the_kubelet_alerts_and_dashboards_read_it";
    run(TestApi::fake().await, TEST).await;
}

#[tokio::test]
async fn prometheus_scrapes_the_node_on_the_real_api_server() {
    const TEST: &str = "prometheus_scrapes_the_node_on_the_real_api_server";
    let Some(api) = TestApi::real(TEST).await else { return };
    run(api, TEST).await;
}

async fn run(api: TestApi, test: &str) {
    let Some(containerd) = Containerd::shared(test) else { return };
    let Some(cgroups) = TestCgroupRoot::new(test) else { return };
    let Some(registry) = registry_or_skip(test, None).await else { return };
    containerd.trust_registry(&registry.host());
    let image = push_busybox(&registry, "test/busybox", "v1", &[], &["sh"]).await.expect("push");
    let root = tempfile::tempdir().expect("tempdir");
    let stop = tokio_util::sync::CancellationToken::new();
    let _stop = stop.clone().drop_guard();

    // The CSI driver (NodeGetVolumeStats: statvfs of the published path).
    let config = CsiDriverConfig { name: DRIVER.into(), node_id: api.node.clone(), ..CsiDriverConfig::default() };
    RegisteredCsiDriver::new(
        root.path().join("plugins_registry").join("metrics-csi.sock"),
        root.path().join("plugins").join("metrics-csi").join("csi.sock"),
        config,
    )
    .spawn(Reporter::Discard, stop.child_token())
    .expect("csi driver");
    api.csi_driver_object(DRIVER, json!({"attachRequired": false, "volumeLifecycleModes": ["Persistent"]})).await;

    let mut command = Command::new(env!("CARGO_BIN_EXE_rustlet"));
    command
        .env("RUSTLET_LOG", "info")
        .env_remove("RUSTLET_ROOT_DIR")
        .arg("--kubeconfig")
        .arg(&api.node_kubeconfig)
        .args(["--node-name", &api.node, "--healthz-port", "0", "--port", "0"])
        .args(["--authentication-token-webhook", "--authorization-mode=Webhook", "--anonymous-auth=false"])
        .args(["--volume-stats-agg-period", "1s"])
        .arg("--root-dir")
        .arg(root.path())
        .arg("--container-runtime-endpoint")
        .arg(containerd.endpoint())
        .arg("--cgroup-root")
        .arg(&cgroups.name);
    let mut node = NodeProcess::start(command);
    node.line_with("node started").await;
    let nodes: Api<Node> = Api::all(api.admin.clone());
    let registered = api
        .wait_for(&nodes, &api.node, "registered with its kubelet port", SOON, |n| {
            n.and_then(|n| n.status.as_ref()).and_then(|s| s.daemon_endpoints.as_ref()).is_some()
        })
        .await
        .expect("the Node");
    let port = registered.status.and_then(|s| s.daemon_endpoints).and_then(|d| d.kubelet_endpoint).expect("port").port;
    let target = format!("127.0.0.1:{port}");

    // Prometheus, with a token allowed `get nodes/metrics` and one that is
    // not (the node's own: nodes may not read each other's metrics here).
    let token = api.metrics_reader_token().await;
    let token_file = root.path().join("prometheus.token");
    std::fs::write(&token_file, &token).expect("token");
    let refused_file = root.path().join("refused.token");
    let other = match &api.server {
        rustlet_testkit::test_api::Server::Fake(server) => server.service_account_token("monitoring", "nobody", &[]),
        rustlet_testkit::test_api::Server::Real(_) => "not-a-token".to_owned(),
    };
    std::fs::write(&refused_file, other).expect("token");
    let Some(prometheus) =
        prometheus_or_skip(test, &scrape_config(&target, &api.node, &token_file, &refused_file)).await
    else {
        return;
    };
    // Scraped before the pods start: their starts fall between scrapes.
    until(&prometheus, "up", "up{job=\"kubelet\", metrics_path=\"/metrics\"} == 1", of_node(&api.node, |v| v == 1.0))
        .await;

    // The claim: a PV on the driver, bound by hand (the binder's work).
    let pv_name = format!("pv-metrics-{}", api.node);
    let volume: PersistentVolume = serde_json::from_value(json!({
        "metadata": {"name": pv_name},
        "spec": {
            "capacity": {"storage": "1Gi"},
            "accessModes": ["ReadWriteOnce"],
            "claimRef": {"namespace": "default", "name": "metrics-data"},
            "csi": {"driver": DRIVER, "volumeHandle": format!("handle-{}", api.node)},
        },
    }))
    .expect("pv");
    Api::<PersistentVolume>::all(api.admin.clone()).create(&PostParams::default(), &volume).await.expect("pv");
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(api.admin.clone(), "default");
    let claim: PersistentVolumeClaim = serde_json::from_value(json!({
        "metadata": {"name": "metrics-data", "namespace": "default"},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}, "volumeName": pv_name},
    }))
    .expect("pvc");
    let mut bound = claims.create(&PostParams::default(), &claim).await.expect("pvc");
    bound.status = Some(serde_json::from_value(json!({"phase": "Bound"})).expect("status"));
    claims.replace_status("metrics-data", &PostParams::default(), &bound).await.expect("bound");

    // `web` holds ~20 MiB (dd's buffer, blocked on a pipe nobody reads)
    // and writes to its claim; `unready`'s readiness probe always fails.
    let pods: Api<Pod> = Api::namespaced(api.admin.clone(), "default");
    let web: Pod = serde_json::from_value(json!({
        "metadata": {"name": "web", "namespace": "default"},
        "spec": {
            "nodeName": api.node,
            "automountServiceAccountToken": false,
            "terminationGracePeriodSeconds": 1,
            "containers": [{
                "name": "app",
                "image": image,
                "command": ["sh", "-c", "echo hello > /data/hello; dd if=/dev/zero bs=20M count=1 | sleep 3600"],
                "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}, "limits": {"memory": "128Mi"}},
                "volumeMounts": [{"name": "data", "mountPath": "/data"}],
            }],
            "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "metrics-data"}}],
        },
    }))
    .expect("pod");
    let unready: Pod = serde_json::from_value(json!({
        "metadata": {"name": "unready", "namespace": "default"},
        "spec": {
            "nodeName": api.node,
            "automountServiceAccountToken": false,
            "terminationGracePeriodSeconds": 1,
            "containers": [{
                "name": "app",
                "image": image,
                "command": ["sleep", "3600"],
                "readinessProbe": {"exec": {"command": ["false"]}, "periodSeconds": 1},
            }],
        },
    }))
    .expect("pod");
    for pod in [&web, &unready] {
        pods.create(&PostParams::default(), pod).await.expect("pod");
    }
    for name in ["web", "unready"] {
        api.wait_for(&pods, name, "Running", SOON, |p| {
            p.and_then(|p| p.status.as_ref()).and_then(|s| s.phase.as_deref()) == Some("Running")
        })
        .await;
    }
    let web_uid = pods.get("web").await.expect("web").metadata.uid.expect("uid");
    let node_name = api.node.as_str();
    let kubelet = "job=\"kubelet\", metrics_path=\"/metrics\"";
    let cadvisor = "job=\"kubelet\", metrics_path=\"/metrics/cadvisor\"";

    // KubeletTooManyPods (its kubelet side: the capacity comes from
    // kube-state-metrics): the running pods per node.
    until(
        &prometheus,
        "KubeletTooManyPods, running pods by node",
        &format!(
            "max by (cluster, instance) (kubelet_running_pods{{{kubelet}}} > 1) * on (cluster, instance) \
             group_left(node) max by (cluster, instance, node) (kubelet_node_name{{{kubelet}}})"
        ),
        of_node(node_name, |v| v >= 2.0),
    )
    .await;
    until(
        &prometheus,
        "Kubelet dashboard: running containers",
        &format!("sum(kubelet_running_containers{{{kubelet}, container_state=\"running\"}})"),
        |s: &[Sample]| if s[0].value >= 2.0 { Ok(()) } else { Err(format!("{s:?}")) },
    )
    .await;
    // KubeletPlegDurationHigh's recording rule: a relist's 99th percentile,
    // by node, far below the alert's 10 s.
    until(
        &prometheus,
        "node_quantile:kubelet_pleg_relist_duration_seconds:histogram_quantile (0.99)",
        &format!(
            "histogram_quantile(0.99, sum(rate(kubelet_pleg_relist_duration_seconds_bucket{{{kubelet}}}[5m])) by \
             (cluster, instance, le) * on(cluster, instance) group_left (node) max by (cluster, instance, node) \
             (kubelet_node_name{{{kubelet}}}))"
        ),
        of_node(node_name, |v| v.is_finite() && (0.0..10.0).contains(&v)),
    )
    .await;
    // KubeletPodStartUpLatencyHigh, without its `> 60`: the pod workers'
    // 99th percentile by node.
    until(
        &prometheus,
        "KubeletPodStartUpLatencyHigh's quantile",
        &format!(
            "histogram_quantile(0.99, sum by (cluster, instance, le) (topk by (cluster, instance, le, \
             operation_type) (1, rate(kubelet_pod_worker_duration_seconds_bucket{{{kubelet}}}[5m])))) * \
             on(cluster, instance) group_left(node) topk by (cluster, instance, node) (1, \
             kubelet_node_name{{{kubelet}}})"
        ),
        of_node(node_name, |v| v.is_finite() && (0.0..60.0).contains(&v)),
    )
    .await;
    // The certificate alerts: the TTL is there (+Inf: this node's client
    // is a token, its serving certificate self-signed), no renewal failed.
    until(
        &prometheus,
        "kubelet_certificate_manager_client_ttl_seconds",
        "kubelet_certificate_manager_client_ttl_seconds",
        of_node(node_name, |v| v > 604_800.0),
    )
    .await;
    for counter in
        ["kubelet_certificate_manager_client_expiration_renew_errors", "kubelet_server_expiration_renew_errors"]
    {
        until(&prometheus, counter, &format!("increase({counter}[5m])"), of_node(node_name, |v| v == 0.0)).await;
    }
    for firing in [
        "kubelet_certificate_manager_client_ttl_seconds < 604800",
        "kubelet_certificate_manager_server_ttl_seconds < 604800",
    ] {
        assert!(prometheus.query(firing).await.expect("query").is_empty(), "{firing} fires");
    }
    // KubePersistentVolumeFillingUp's parts: the claim's free fraction,
    // and its free bytes within 1% of what df says of the published path.
    let fraction = until(
        &prometheus,
        "KubePersistentVolumeFillingUp: available / capacity",
        &format!(
            "kubelet_volume_stats_available_bytes{{{kubelet}}} / kubelet_volume_stats_capacity_bytes{{{kubelet}}}"
        ),
        one_with(&[("namespace", "default"), ("persistentvolumeclaim", "metrics-data")], |v| v > 0.0 && v <= 1.0),
    )
    .await;
    assert!(fraction.iter().all(|s| s.labels.get("node").map(String::as_str) == Some(node_name)), "{fraction:?}");
    until(
        &prometheus,
        "kubelet_volume_stats_used_bytes",
        &format!("kubelet_volume_stats_used_bytes{{{kubelet}, persistentvolumeclaim=\"metrics-data\"}} > 0"),
        of_node(node_name, |v| v > 0.0),
    )
    .await;
    let published =
        root.path().join("pods").join(&web_uid).join("volumes/kubernetes.io~csi").join(&pv_name).join("mount");
    assert!(published.join("hello").exists(), "the pod wrote into its claim at {}", published.display());
    until(
        &prometheus,
        "the claim's available bytes beside df",
        &format!("kubelet_volume_stats_available_bytes{{{kubelet}, persistentvolumeclaim=\"metrics-data\"}}"),
        |s: &[Sample]| {
            let df = df_available(&published);
            if (s[0].value - df).abs() <= df * 0.01 { Ok(()) } else { Err(format!("{} vs df {df}", s[0].value)) }
        },
    )
    .await;
    until(
        &prometheus,
        "kubelet_volume_stats_inodes_free / inodes",
        &format!("kubelet_volume_stats_inodes_free{{{kubelet}}} / kubelet_volume_stats_inodes{{{kubelet}}}"),
        one_with(&[("persistentvolumeclaim", "metrics-data")], |v| v > 0.0 && v <= 1.0),
    )
    .await;

    // The Pod dashboard: CPU (the rule's kubelet side), memory (WSS, RSS),
    // network.
    until(
        &prometheus,
        "Pod dashboard: CPU usage",
        &format!(
            "sum by (cluster, namespace, pod, container) (rate(container_cpu_usage_seconds_total{{{cadvisor}, \
             image!=\"\"}}[5m]))"
        ),
        one_with(&[("namespace", "default"), ("pod", "web"), ("container", "app")], |v| v >= 0.0),
    )
    .await;
    until(
        &prometheus,
        "Pod dashboard: memory usage (WSS)",
        &format!(
            "sum(max by (cluster, namespace, pod, container)(container_memory_working_set_bytes{{{cadvisor}, \
             namespace=\"default\", pod=\"web\", container!=\"\", image!=\"\"}})) by (container)"
        ),
        one_with(&[("container", "app")], |v| v > 10.0 * 1024.0 * 1024.0),
    )
    .await;
    until(
        &prometheus,
        "Pod dashboard: memory quota (RSS)",
        &format!(
            "sum(max by (cluster, namespace, pod, container)(container_memory_rss{{{cadvisor}, namespace=\"default\", \
             pod=\"web\", container != \"\", container != \"POD\"}})) by (container)"
        ),
        one_with(&[("container", "app")], |v| v > 0.0),
    )
    .await;
    until(
        &prometheus,
        "Pod dashboard: receive bandwidth",
        &format!(
            "sum((8 * irate(container_network_receive_bytes_total{{{cadvisor}, namespace=\"default\", \
             pod=~\"web\"}}[1m]))) by (pod)"
        ),
        one_with(&[("pod", "web")], |v| v >= 0.0),
    )
    .await;
    until(
        &prometheus,
        "Pod dashboard: transmit bandwidth",
        &format!(
            "sum((8 * rate(container_network_transmit_bytes_total{{{cadvisor}, namespace=\"default\", \
             pod=~\"web\"}}[1m]))) by (pod)"
        ),
        one_with(&[("pod", "web")], |v| v >= 0.0),
    )
    .await;
    // The pod's working set (its cgroup's series, `container=""`) within
    // 10% of what its cgroup says now.
    let group = kubelet::cgroups::pod_group(
        &format!("{}/kubepods", cgroups.name.trim_end_matches('/')),
        &pods.get("web").await.expect("web"),
    );
    until(
        &prometheus,
        "the pod's working set beside its cgroup's",
        &format!(
            "container_memory_working_set_bytes{{{cadvisor}, namespace=\"default\", pod=\"web\", container=\"\"}}"
        ),
        |s: &[Sample]| {
            let cgroup = cgroup_working_set(&group);
            let scraped = s[0].value;
            if (scraped - cgroup).abs() <= cgroup * 0.10 {
                Ok(())
            } else {
                Err(format!("{scraped} vs the cgroup's {cgroup} ({group})"))
            }
        },
    )
    .await;
    until(&prometheus, "machine_cpu_cores", "machine_cpu_cores", of_node(node_name, |v| v >= 1.0)).await;

    // The same figures in `/stats/summary` (an administrator's token: the
    // metrics reader may not read stats).
    let admin_token = match &api.server {
        rustlet_testkit::test_api::Server::Fake(server) => server.admin_token().to_owned(),
        rustlet_testkit::test_api::Server::Real(plane) => plane.admin_token().to_owned(),
    };
    let address: std::net::SocketAddr = target.parse().expect("an address");
    let credentials = rustlet_testkit::https::Credentials::Token(&admin_token);
    let (code, summary) = rustlet_testkit::https::get(address, "/stats/summary", credentials).await.expect("summary");
    assert_eq!(code, 200, "{summary}");
    let summary: serde_json::Value = serde_json::from_str(&summary).expect("json");
    let web_stats =
        summary["pods"].as_array().into_iter().flatten().find(|p| p["podRef"]["name"] == "web").expect("web");
    let volume = &web_stats["volume"][0];
    assert_eq!(volume["pvcRef"], json!({"name": "metrics-data", "namespace": "default"}), "{web_stats}");
    assert_eq!(volume["name"], "data", "{web_stats}");
    let available = volume["availableBytes"].as_f64().expect("availableBytes");
    let df = df_available(&published);
    assert!((available - df).abs() <= df * 0.01, "{available} vs df {df}");
    until(&prometheus, "machine_memory_bytes", "machine_memory_bytes", of_node(node_name, |v| v > 1e8)).await;

    // /metrics/probes: the failing readiness probe, counted.
    until(
        &prometheus,
        "prober_probe_total (failed readiness)",
        "prober_probe_total{job=\"kubelet\", metrics_path=\"/metrics/probes\", probe_type=\"Readiness\", \
         result=\"failed\", namespace=\"default\", pod=\"unready\", container=\"app\"}",
        of_node(node_name, |v| v >= 1.0),
    )
    .await;
    // The Kubelet dashboard's operations, pod starts, RPC rate.
    for (what, expr) in [
        (
            "operation rate",
            format!("sum(rate(kubelet_runtime_operations_total{{{kubelet}}}[1m])) by (operation_type, instance)"),
        ),
        (
            "pod start rate",
            format!("sum(rate(kubelet_pod_start_duration_seconds_count{{{kubelet}}}[5m])) by (instance)"),
        ),
        ("RPC rate 2xx", format!("sum(rate(rest_client_requests_total{{{kubelet}, code=~\"2..\"}}[1m]))")),
        (
            "requests to the kubelet API",
            format!("sum(kubelet_http_requests_total{{{kubelet}, path=\"metrics/cadvisor\"}})"),
        ),
    ] {
        until(
            &prometheus,
            what,
            &expr,
            |s: &[Sample]| {
                if s.iter().any(|s| s.value > 0.0) { Ok(()) } else { Err(format!("{s:?}")) }
            },
        )
        .await;
    }
    for (operation, at_least) in [("run_podsandbox", 2.0), ("start_container", 2.0)] {
        until(
            &prometheus,
            operation,
            &format!("kubelet_runtime_operations_total{{{kubelet}, operation_type=\"{operation}\"}}"),
            of_node(node_name, |v| v >= at_least),
        )
        .await;
    }

    // The same API, the same authorization: a token not allowed
    // `get nodes/metrics` gets nothing.
    let targets = prometheus.targets().await.expect("targets");
    let refused: Vec<_> = targets.iter().filter(|t| t.0 == "kubelet-refused").collect();
    assert!(
        refused.iter().all(|t| t.2 != "up") && refused.iter().any(|t| t.3.contains("401") || t.3.contains("403")),
        "{targets:?}"
    );
    let ups: BTreeMap<&str, &str> =
        targets.iter().filter(|t| t.0 != "kubelet-refused").map(|t| (t.1.as_str(), t.2.as_str())).collect();
    assert_eq!(ups.values().filter(|h| **h == "up").count(), 3, "{targets:?}");

    for name in ["web", "unready"] {
        let _ = pods.delete(name, &Default::default()).await;
    }
    let _ = claims.delete("metrics-data", &Default::default()).await;
    let _ = Api::<PersistentVolume>::all(api.admin.clone()).delete(&pv_name, &Default::default()).await;
}
