//! The binary with `--container-runtime-endpoint`: Linux containers through
//! a real containerd (private to this test binary, see
//! `rustlet_testkit::containerd`) beside WebAssembly pods on one node.

use std::path::Path;
use std::time::Duration;

use rustlet_testkit::cgroups::TestCgroupRoot;
use rustlet_testkit::containerd::{Containerd, push_busybox};
use rustlet_testkit::node_process::{NodeProcess, http_get, local_socket};
use rustlet_testkit::registry::Registry;
use serde_json::Value;
use tokio::process::Command;

/// A liveness bound: a pull and two starts take a second or two here.
const SOON: Duration = Duration::from_secs(120);

/// The pods the node at `address` serves, by name.
async fn pods(address: &str) -> Vec<Value> {
    let (code, body) = http_get(address, "/pods").await;
    assert_eq!(code, 200, "{body}");
    let list: Value = serde_json::from_str(&body).expect("a PodList");
    list["items"].as_array().cloned().unwrap_or_default()
}

fn running(pod: &Value) -> bool {
    pod["status"]["containerStatuses"][0]["state"]["running"].is_object()
}

/// `rustlet --standalone` as node `mixed` on `containerd`, with static
/// pods from `manifests`, its pods' cgroups under `cgroups`.
fn node_command(root: &Path, manifests: &Path, containerd: &Containerd, cgroups: &TestCgroupRoot) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_rustlet"));
    command
        .env("RUSTLET_LOG", "info")
        .env_remove("RUSTLET_ROOT_DIR")
        .arg("--standalone")
        .arg("--root-dir")
        .arg(root)
        .arg("--pod-manifest-path")
        .arg(manifests)
        .args(["--node-name", "mixed", "--healthz-port", "0", "--port", "0", "--anonymous-auth"])
        .arg("--container-runtime-endpoint")
        .arg(containerd.endpoint())
        .arg("--cgroup-root")
        .arg(&cgroups.name);
    command
}

/// Polls the node's `/pods` until pod `name` satisfies `pred` (its status
/// trails the log line the test waited on by milliseconds).
async fn wait_pod(address: &str, name: &str, pred: impl Fn(&Value) -> bool) -> Value {
    let deadline = tokio::time::Instant::now() + SOON;
    loop {
        let listed = pods(address).await;
        if let Some(pod) = listed.iter().find(|p| p["metadata"]["name"] == name && pred(p)) {
            return pod.clone();
        }
        assert!(tokio::time::Instant::now() < deadline, "{name} not as expected: {listed:#?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `kill -9` of the node while a container runs: the container keeps
/// running in containerd and the restarted node adopts it (same container,
/// same start, restart count 0) instead of starting another.
#[tokio::test]
async fn a_killed_node_adopts_its_running_containers() {
    let Some(containerd) = Containerd::private("a_killed_node_adopts_its_running_containers") else {
        return;
    };
    let Some(cgroups) = TestCgroupRoot::new("a_killed_node_adopts_its_running_containers") else { return };
    let registry = Registry::start().await.expect("registry");
    containerd.trust_registry(&registry.host());
    let image = push_busybox(&registry, "test/busybox", "v1", &[], &["sh"]).await.expect("push");
    let root = tempfile::tempdir().expect("tempdir");
    let manifests = root.path().join("manifests");
    std::fs::create_dir_all(&manifests).expect("mkdir");
    let manifest = format!(
        "apiVersion: v1\nkind: Pod\nmetadata: {{name: steady}}\nspec:\n  terminationGracePeriodSeconds: 1\n  containers:\n  - name: main\n    image: {image}\n    command: [sh, -c, 'exec sleep 600']\n"
    );
    std::fs::write(manifests.join("steady.yaml"), manifest).expect("write");
    let mut node = NodeProcess::start(node_command(root.path(), &manifests, &containerd, &cgroups));
    node.http_address().await;
    let address = local_socket(root.path());
    node.line_with("container started").await;
    let first = wait_pod(&address, "steady-mixed", running).await;
    let status = |pod: &Value| {
        let status = &pod["status"]["containerStatuses"][0];
        (status["containerID"].clone(), status["state"]["running"]["startedAt"].clone(), status["restartCount"].clone())
    };
    let before = status(&first);

    node.child.kill().await.expect("kill -9");
    let mut node = NodeProcess::start(node_command(root.path(), &manifests, &containerd, &cgroups));
    // Adoption and the endpoint come up in either order.
    node.lines_with_all(&["container adopted, not restarted", "node started"]).await;
    let again = wait_pod(&address, "steady-mixed", running).await;
    assert_eq!(status(&again), before, "the same container, never restarted");
    // Its cgroup is the same group, found again.
    let uid = again["metadata"]["uid"].as_str().expect("uid").to_owned();
    let group = format!("{}/kubepods/besteffort/pod{uid}", cgroups.name);
    assert!(cgroups.fs.exists(&group), "{group} kept across the restart");

    std::fs::remove_file(manifests.join("steady.yaml")).expect("rm");
    node.line_with("pod cgroup removed").await;
    assert!(!cgroups.fs.exists(&group), "{group} went with the pod");
}

#[tokio::test]
async fn a_container_pod_and_a_webassembly_pod_run_on_one_node() {
    let Some(containerd) = Containerd::private("a_container_pod_and_a_webassembly_pod_run_on_one_node") else {
        return;
    };
    let Some(cgroups) = TestCgroupRoot::new("a_container_pod_and_a_webassembly_pod_run_on_one_node") else { return };
    let registry = Registry::start().await.expect("registry");
    containerd.trust_registry(&registry.host());
    let image = push_busybox(&registry, "test/busybox", "v1", &[], &["sh"]).await.expect("push");
    let root = tempfile::tempdir().expect("tempdir");
    rustlet_testkit::node_process::import_example(
        Path::new(env!("CARGO_BIN_EXE_rustlet")),
        root.path(),
        "example.com/test",
        "check",
    )
    .await;
    // What the WebAssembly pod's exec probe (a fresh instance of `check`)
    // looks for.
    let ctl = root.path().join("ctl");
    std::fs::create_dir_all(&ctl).expect("mkdir");
    std::fs::write(ctl.join("healthy"), "").expect("write");
    let manifests = root.path().join("manifests");
    std::fs::create_dir_all(&manifests).expect("mkdir");
    let ctl = ctl.display();
    let manifest = format!(
        "apiVersion: v1
kind: Pod
metadata: {{name: box}}
spec:
  terminationGracePeriodSeconds: 1
  containers:
  - name: main
    image: {image}
    command: [sh, -c, 'echo container says hi; touch /tmp/ready; exec sleep 600']
    readinessProbe: {{exec: {{command: [test, -e, /tmp/ready]}}, periodSeconds: 1}}
---
apiVersion: v1
kind: Pod
metadata: {{name: wasm}}
spec:
  runtimeClassName: wasmtime
  volumes: [{{name: ctl, hostPath: {{path: '{ctl}'}}}}]
  containers:
  - name: main
    image: 'example.com/test/check:v1'
    imagePullPolicy: Never
    volumeMounts: [{{name: ctl, mountPath: /ctl}}]
    readinessProbe: {{exec: {{command: [check, now]}}, periodSeconds: 1}}
---
apiVersion: v1
kind: Pod
metadata: {{name: unknown-class}}
spec:
  runtimeClassName: kata
  containers:
  - {{name: main, image: {image}}}
---
apiVersion: v1
kind: Pod
metadata: {{name: strict-groups}}
spec:
  securityContext: {{supplementalGroupsPolicy: Strict}}
  containers:
  - {{name: main, image: {image}}}
"
    );
    std::fs::write(manifests.join("pods.yaml"), manifest).expect("write");
    let mut node = NodeProcess::start(node_command(root.path(), &manifests, &containerd, &cgroups));
    let runtime = node.line_with("container runtime").await;
    assert!(runtime.contains("runtime=containerd"), "{runtime}");
    node.http_address().await;
    let address = local_socket(root.path());

    // Both start (two starts logged); their statuses follow at once. The
    // pod whose class has no runtime here says so.
    node.line_with("container started").await;
    node.line_with("container started").await;
    let deadline = tokio::time::Instant::now() + SOON;
    let listed = loop {
        let listed = pods(&address).await;
        let named = |name: &str| listed.iter().find(|p| p["metadata"]["name"] == name).cloned();
        let unknown_says = named("unknown-class-mixed").is_some_and(|p| {
            p["status"]["containerStatuses"][0]["state"]["waiting"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("RuntimeClass \"kata\""))
        });
        if named("box-mixed").is_some_and(|p| running(&p))
            && named("wasm-mixed").is_some_and(|p| running(&p))
            && unknown_says
        {
            break listed;
        }
        assert!(tokio::time::Instant::now() < deadline, "not as expected: {listed:#?}\n{}", containerd.log());
        // The status is a few milliseconds behind the log line.
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let id = |name: &str| {
        listed.iter().find(|p| p["metadata"]["name"] == name).expect("pod")["status"]["containerStatuses"][0]["containerID"]
            .clone()
    };
    assert_ne!(id("box-mixed"), id("wasm-mixed"));
    // The container's output is where `rustlet logs` reads it.
    // (containerd's shim copies the output into the log file on its own
    // time, which a loaded machine can make later than the status.)
    let root_dir = root.path().to_str().expect("utf8");
    let deadline = tokio::time::Instant::now() + SOON;
    loop {
        let output = Command::new(env!("CARGO_BIN_EXE_rustlet"))
            .args(["logs", "box-mixed", "--root-dir", root_dir])
            .output()
            .await
            .expect("rustlet logs");
        let (stdout, stderr) = (String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
        if !stdout.is_empty() || tokio::time::Instant::now() >= deadline {
            assert!(output.status.success(), "{stderr}");
            assert_eq!(stdout, "container says hi\n", "{stderr}");
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Each pod's exec probe went to its own runtime (ExecSync; a fresh
    // instance of the module): both become ready.
    let ready = |p: &Value| p["status"]["containerStatuses"][0]["ready"] == true;
    wait_pod(&address, "box-mixed", ready).await;
    wait_pod(&address, "wasm-mixed", ready).await;
    // `get pods -o wide` says which runtime runs each.
    let output = Command::new(env!("CARGO_BIN_EXE_rustlet"))
        .args(["get", "pods", "-o", "wide", "--root-dir", root_dir])
        .output()
        .await
        .expect("rustlet get pods");
    let table = String::from_utf8_lossy(&output.stdout).into_owned();
    let row = |name: &str| table.lines().find(|l| l.starts_with(name)).unwrap_or_default().to_owned();
    assert!(table.lines().next().is_some_and(|h| h.ends_with("RUNTIME")), "{table}");
    assert!(row("box-mixed").ends_with("containerd"), "{table}");
    assert!(row("wasm-mixed").ends_with("wasmtime"), "{table}");

    // `/metrics/cadvisor` has both containers: the CRI one with its
    // sandbox's cgroup and network, the WebAssembly one from the provider's
    // accounting (its pod under `/rustlet/pod<uid>`).
    let (_, node_object) = http_get(&address, "/node").await;
    let node_object: Value = serde_json::from_str(&node_object).expect("the Node");
    let port = node_object["status"]["daemonEndpoints"]["kubeletEndpoint"]["Port"].as_u64().expect("the kubelet port");
    let api = std::net::SocketAddr::from(([127, 0, 0, 1], u16::try_from(port).expect("a port")));
    let anonymous = rustlet_testkit::https::Credentials::Anonymous;
    let (code, page) = rustlet_testkit::https::get(api, "/metrics/cadvisor", anonymous).await.expect("scrape");
    assert_eq!(code, 200, "{page}");
    let series = |name: &str, pod: &str, container: &str| {
        page.lines()
            .filter(|l| l.starts_with(&format!("{name}{{")))
            .filter(|l| l.contains(&format!("pod=\"{pod}\"")) && l.contains(&format!("container=\"{container}\"")))
            .filter_map(|l| l.split(' ').nth(1).and_then(|v| v.parse::<f64>().ok()))
            .next()
    };
    for pod in ["box-mixed", "wasm-mixed"] {
        assert!(series("container_cpu_usage_seconds_total", pod, "main").is_some_and(|v| v >= 0.0), "{pod}: {page}");
        assert!(series("container_memory_working_set_bytes", pod, "main").is_some_and(|v| v > 0.0), "{pod}: {page}");
        assert!(series("container_start_time_seconds", pod, "main").is_some_and(|v| v > 1.7e9), "{pod}: {page}");
    }
    assert!(page.contains("id=\"/rustlet/pod"), "the WebAssembly pod has no cgroup of its own: {page}");
    assert!(page.contains("/kubepods/"), "the container pod's cgroup: {page}");

    // `/stats/summary` with what upstream's readers dereference: the
    // node's RSS and page faults, the `kubelet`, `runtime` and `pods` system
    // containers, rlimit.
    let (code, summary) =
        rustlet_testkit::https::get(api, "/stats/summary", rustlet_testkit::https::Credentials::Anonymous)
            .await
            .expect("summary");
    assert_eq!(code, 200, "{summary}");
    let summary: Value = serde_json::from_str(&summary).expect("json");
    let node_stats = &summary["node"];
    let positive = |v: &Value| v.as_u64().is_some_and(|n| n > 0);
    for key in ["usageBytes", "workingSetBytes", "rssBytes", "pageFaults", "availableBytes"] {
        assert!(positive(&node_stats["memory"][key]), "node memory {key}: {node_stats}");
    }
    assert!(node_stats["memory"]["majorPageFaults"].is_u64(), "{node_stats}");
    assert!(positive(&node_stats["rlimit"]["maxpid"]) && positive(&node_stats["rlimit"]["curproc"]), "{node_stats}");
    assert!(node_stats["network"]["interfaces"].is_array(), "{node_stats}");
    assert!(positive(&node_stats["runtime"]["imageFs"]["capacityBytes"]), "{node_stats}");
    let system = |name: &str| {
        node_stats["systemContainers"].as_array().into_iter().flatten().find(|c| c["name"] == name).cloned()
    };
    let kubelet = system("kubelet").unwrap_or_else(|| panic!("the kubelet system container: {node_stats}"));
    for key in ["usageBytes", "workingSetBytes", "rssBytes", "pageFaults"] {
        assert!(positive(&kubelet["memory"][key]), "kubelet memory {key}: {kubelet}");
    }
    assert!(positive(&kubelet["cpu"]["usageCoreNanoSeconds"]), "{kubelet}");
    // The runtime: containerd, the process at the other end of its socket.
    let runtime = system("runtime").unwrap_or_else(|| panic!("the runtime system container: {node_stats}"));
    assert!(positive(&runtime["memory"]["rssBytes"]) && positive(&runtime["cpu"]["usageCoreNanoSeconds"]), "{runtime}");
    assert_ne!(runtime["memory"]["rssBytes"], kubelet["memory"]["rssBytes"], "another process than the node's");
    let pods_container = system("pods").unwrap_or_else(|| panic!("the pods system container: {node_stats}"));
    assert!(positive(&pods_container["memory"]["workingSetBytes"]), "{pods_container}");
    let stats_of =
        |pod: &str| summary["pods"].as_array().into_iter().flatten().find(|p| p["podRef"]["name"] == pod).cloned();
    let boxed = stats_of("box-mixed").unwrap_or_else(|| panic!("box-mixed in {summary}"));
    assert!(positive(&boxed["containers"][0]["memory"]["rssBytes"]), "containerd's RSS: {boxed}");
    assert!(positive(&boxed["memory"]["workingSetBytes"]), "the pod's cgroup: {boxed}");

    // containerd 1.6 says nothing of `supplementalGroupsPolicy: Strict`:
    // the Node says it is not supported and the pod asking for it is
    // refused with upstream's reason.
    let features = &node_object["status"]["features"];
    assert_eq!(features["supplementalGroupsPolicy"], false, "{node_object}");
    let strict = wait_pod(&address, "strict-groups-mixed", |p| p["status"]["phase"] == "Failed").await;
    assert_eq!(strict["status"]["reason"], "SupplementalGroupsPolicyNotSupported", "{strict}");
    assert_eq!(
        strict["status"]["message"], "Pod was rejected: SupplementalGroupsPolicy=Strict is not supported in this node",
        "{strict}"
    );

    // Removing the manifests removes both pods and the sandbox.
    std::fs::remove_file(manifests.join("pods.yaml")).expect("rm");
    node.line_with("pod sandbox removed").await;
}

/// The runtime stops while the node runs: the `container-runtime` check
/// of `/healthz` fails with upstream's words and the Node is not Ready;
/// when it is back, both recover.
#[tokio::test]
async fn a_stopped_runtime_is_a_failing_check_and_a_node_not_ready() {
    let Some(mut containerd) = Containerd::private("a_stopped_runtime_is_a_failing_check_and_a_node_not_ready") else {
        return;
    };
    let Some(cgroups) = TestCgroupRoot::new("a_stopped_runtime_is_a_failing_check_and_a_node_not_ready") else {
        return;
    };
    let root = tempfile::tempdir().expect("tempdir");
    let manifests = root.path().join("manifests");
    std::fs::create_dir_all(&manifests).expect("mkdir");
    let mut command = node_command(root.path(), &manifests, &containerd, &cgroups);
    command.args(["--runtime-status-period", "200ms"]);
    let mut node = NodeProcess::start(command);
    node.lines_with_all(&["container runtime is up", "node started"]).await;
    let address = local_socket(root.path());
    assert_eq!(http_get(&address, "/healthz").await, (200, "ok".to_owned()));

    containerd.stop();
    node.line_with("container runtime is not ready").await;
    let (code, body) = http_get(&address, "/healthz").await;
    assert_eq!(code, 500, "{body}");
    assert!(body.contains("[-]container-runtime failed: container runtime is down"), "{body}");
    let (_, node_json) = http_get(&address, "/node").await;
    let node_object: Value = serde_json::from_str(&node_json).expect("a Node");
    let ready = node_object["status"]["conditions"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["type"] == "Ready"))
        .cloned()
        .expect("Ready");
    assert_eq!(ready["status"], "False", "{ready}");
    assert!(ready["message"].as_str().is_some_and(|m| m.contains("container runtime is down")), "{ready}");

    containerd.restart().expect("containerd again");
    node.line_with("container runtime is up").await;
    assert_eq!(http_get(&address, "/healthz").await, (200, "ok".to_owned()));
}
