//! Resource management benchmark (issue 33): prints figures beside a floor
//! from the same run; asserts nothing about time.
//!
//! On a containerd of its own (Debian's 1.6 with runc, as root), the
//! busybox image in a loopback registry:
//! - **the CRI floor**: one `RunPodSandbox` (host network), p50;
//! - **cgroup work per pod start**: `PodCgroups::ensure_pod` (the pod's
//!   group made with its limits, the burstable group's shares updated) and
//!   `remove_pod`, with 110 and with 500 pod groups already there, p50;
//! - **one eviction-signal pass**: `observe` (meminfo, the `kubepods`
//!   group, statvfs, the process count), p50; and what a pass adds when a
//!   memory threshold is met: the running containers' stats (one
//!   `ContainerStats` each, at once) and the ranking, for 110 and 500 pods;
//! - **the node at idle**: the binary (`--container-runtime-endpoint`) with
//!   110 host-network busybox pods running: its CPU (share of one core)
//!   and RSS over 30 s. Anchor: the Go kubelet 1.28.7 on this VM used
//!   1.4–1.9% of a core and 79–84 MB with 20 pods;
//! - **a scrape of each metrics page** (`/metrics`, `/metrics/cadvisor`,
//!   `/metrics/probes`, and `/metrics/resource` for comparison) over the
//!   kubelet API's TLS, on a kept-alive connection as Prometheus scrapes:
//!   p50 and the page's size, with those 110 pods and on the same node
//!   idle (no pods).
//!
//! Run: `cargo bench -p rustlet --bench resources` (`RUSTLET_BENCH_QUICK=1`:
//! fewer runs, 10 s of idle).

use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kubelet::cgroups::{PodCgroups, QosCgroupSettings};
use kubelet::eviction::Signal;
use kubelet::eviction::manager::{Candidate, EvictionSettings, observe, rank};
use kubelet::provider::Provider;
use kubelet_api::cri::v1 as cri;
use kubelet_api::cri::v1::runtime_service_client::RuntimeServiceClient;
use rustlet_cri::{CriConfig, CriProvider};
use rustlet_testkit::cgroups::TestCgroupRoot;
use rustlet_testkit::containerd::{Containerd, push_busybox};
use rustlet_testkit::node_process::{NodeProcess, http_get, local_socket};
use rustlet_testkit::registry::Registry;

const IDLE_PODS: usize = 110;

fn quick() -> bool {
    std::env::var("RUSTLET_BENCH_QUICK").is_ok_and(|v| v == "1")
}

fn p50(samples: &mut [Duration]) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

fn us(d: Duration) -> String {
    format!("{:.1} µs", d.as_secs_f64() * 1e6)
}

fn burstable(uid: &str) -> Pod {
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": uid, "namespace": "default", "uid": uid},
        "spec": {"containers": [{"name": "main", "resources": {"requests": {"cpu": "100m", "memory": "16Mi"}, "limits": {"memory": "64Mi"}}}]},
    }))
    .expect("pod")
}

/// A pod whose one container runs as `container_id`.
fn running_pod(uid: &str, container_id: &str) -> Pod {
    let mut pod = burstable(uid);
    pod.status = Some(
        serde_json::from_value(serde_json::json!({
            "phase": "Running",
            "containerStatuses": [{
                "name": "main", "image": "busybox", "imageID": "", "ready": true, "restartCount": 0,
                "containerID": format!("containerd://{container_id}"),
                "state": {"running": {"startedAt": "2026-11-26T12:00:00Z"}},
            }],
        }))
        .expect("status"),
    );
    pod
}

/// The CRI floor: `RunPodSandbox` of a host-network sandbox; returns its id.
async fn sandbox(runtime: &mut RuntimeServiceClient<kubelet_api::uds::UdsChannel>, name: &str) -> String {
    let request = cri::RunPodSandboxRequest { config: Some(sandbox_config(name)), runtime_handler: String::new() };
    runtime.run_pod_sandbox(request).await.expect("RunPodSandbox").into_inner().pod_sandbox_id
}

/// A host-network sandbox's config.
fn sandbox_config(name: &str) -> cri::PodSandboxConfig {
    cri::PodSandboxConfig {
        metadata: Some(cri::PodSandboxMetadata {
            name: name.into(),
            uid: format!("resources-{name}"),
            namespace: "default".into(),
            attempt: 0,
        }),
        linux: Some(cri::LinuxPodSandboxConfig {
            security_context: Some(cri::LinuxSandboxSecurityContext {
                namespace_options: Some(cri::NamespaceOption {
                    network: cri::NamespaceMode::Node as i32,
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

async fn remove_sandbox(runtime: &mut RuntimeServiceClient<kubelet_api::uds::UdsChannel>, id: String) {
    let stop = cri::StopPodSandboxRequest { pod_sandbox_id: id.clone() };
    runtime.stop_pod_sandbox(stop).await.expect("StopPodSandbox");
    let remove = cri::RemovePodSandboxRequest { pod_sandbox_id: id };
    runtime.remove_pod_sandbox(remove).await.expect("RemovePodSandbox");
}

/// The process's CPU time (user + system) and RSS.
fn cpu_and_rss(pid: u32) -> (Duration, u64) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("stat");
    let fields: Vec<&str> =
        stat.rsplit_once(')').map(|(_, rest)| rest).unwrap_or_default().split_whitespace().collect();
    // utime and stime are fields 14 and 15 (1-based), 11 and 12 after the name.
    let ticks: u64 = fields[11].parse::<u64>().unwrap_or(0) + fields[12].parse::<u64>().unwrap_or(0);
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    let rss_kib = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0);
    (Duration::from_millis(ticks * 10), rss_kib * 1024)
}

#[tokio::main]
async fn main() {
    let Some(containerd) = Containerd::private("the resources benchmark") else { return };
    let Some(cgroup_root) = TestCgroupRoot::new("resources benchmark") else { return };
    let registry = Registry::start().await.expect("registry");
    containerd.trust_registry(&registry.host());
    let image = push_busybox(&registry, "bench/busybox", "v1", &[], &["sh"]).await.expect("push");
    let runs = if quick() { 10 } else { 50 };
    println!("Resources benchmark on {} ({runs} runs per figure)", containerd.endpoint());

    // The CRI floor.
    let channel = kubelet_api::uds::dial(containerd.socket(), Duration::from_secs(10)).await.expect("dial");
    let mut runtime = RuntimeServiceClient::new(channel);
    let mut floor = Vec::new();
    for i in 0..runs.min(20) {
        let started = Instant::now();
        let id = sandbox(&mut runtime, &format!("floor-{i}")).await;
        floor.push(started.elapsed());
        remove_sandbox(&mut runtime, id).await;
    }
    let floor = p50(&mut floor);
    println!("  the CRI floor (RunPodSandbox, host network):   p50 {:>10}", us(floor));

    // Cgroup work per pod start, with 110 and 500 pod groups there.
    let settings =
        QosCgroupSettings { root: cgroup_root.name.clone(), pod_pids_limit: Some(1024), ..QosCgroupSettings::new() };
    let cgroups = PodCgroups::start(cgroup_root.fs.clone(), settings).expect("kubepods");
    let mut made = 0;
    for present in [110, 500] {
        while made < present {
            cgroups.ensure_pod(&burstable(&format!("present-{made}"))).expect("a pod group");
            made += 1;
        }
        let (mut ensure, mut remove) = (Vec::new(), Vec::new());
        for i in 0..runs {
            let pod = burstable(&format!("timed-{present}-{i}"));
            let started = Instant::now();
            cgroups.ensure_pod(&pod).expect("ensure");
            ensure.push(started.elapsed());
            let started = Instant::now();
            cgroups.remove_pod(pod.metadata.uid.as_deref().expect("uid")).expect("remove");
            remove.push(started.elapsed());
        }
        let (ensure, remove) = (p50(&mut ensure), p50(&mut remove));
        println!(
            "  cgroup work per pod, {present} groups there: make {:>10} ({:.1}% of the floor), remove {:>10}",
            us(ensure),
            ensure.as_secs_f64() * 100.0 / floor.as_secs_f64(),
            us(remove)
        );
    }
    for i in 0..made {
        cgroups.remove_pod(&format!("present-{i}")).expect("cleanup");
    }

    // One eviction-signal pass.
    let root = tempfile::tempdir().expect("tempdir");
    let mut eviction = EvictionSettings::new(root.path());
    eviction.kubepods = Some((cgroup_root.fs.clone(), cgroups.kubepods()));
    let mut passes = Vec::new();
    for _ in 0..runs {
        let started = Instant::now();
        let observed = observe(&eviction, None);
        passes.push(started.elapsed());
        assert!(observed.contains_key(&Signal::MemoryAvailable), "memory is measured");
    }
    println!("  one eviction-signal pass (observe):           p50 {:>10}", us(p50(&mut passes)));
    // What a pass adds under memory pressure: every running container's
    // stats (one real container, read once per pod) and the ranking.
    let provider = CriProvider::new(CriConfig::new(containerd.endpoint()));
    let probe = burstable("probe");
    let mut container = probe.spec.as_ref().expect("spec").containers[0].clone();
    container.image = Some(image.clone());
    provider.prepare_image(&probe, &container).await.expect("pull");
    let id = sandbox(&mut runtime, "stats").await;
    let config = cri::ContainerConfig {
        metadata: Some(cri::ContainerMetadata { name: "main".into(), attempt: 0 }),
        image: Some(cri::ImageSpec { image: image.clone(), ..Default::default() }),
        command: vec!["sleep".into(), "600".into()],
        ..Default::default()
    };
    let created = runtime
        .create_container(cri::CreateContainerRequest {
            pod_sandbox_id: id.clone(),
            config: Some(config),
            sandbox_config: Some(sandbox_config("stats")),
        })
        .await
        .expect("CreateContainer")
        .into_inner()
        .container_id;
    runtime.start_container(cri::StartContainerRequest { container_id: created.clone() }).await.expect("start");
    let dyn_provider: Arc<dyn Provider> = Arc::new(provider.clone());
    for pods in [110, 500] {
        let all: Vec<Pod> = (0..pods).map(|i| running_pod(&format!("p{i}"), &created)).collect();
        let mut reads = Vec::new();
        let mut ranks = Vec::new();
        for _ in 0..runs.min(10) {
            let started = Instant::now();
            let (usage, failed) = kubelet::pod::usage::pod_usage(all.clone(), Some(&dyn_provider)).await;
            reads.push(started.elapsed());
            assert!(!failed, "every container's stats read");
            let mut candidates: Vec<Candidate> = all
                .iter()
                .zip(&usage)
                .map(|(pod, u)| Candidate {
                    pod: pod.clone(),
                    usage: u.containers.first().and_then(|c| c.stats.memory_working_set_bytes).map(u128::from),
                    request: 16 << 20,
                    containers: Vec::new(),
                })
                .collect();
            let started = Instant::now();
            rank(Signal::MemoryAvailable, &mut candidates);
            ranks.push(started.elapsed());
        }
        println!(
            "  under memory pressure, {pods} pods: stats {:>10}, ranking {:>10}",
            us(p50(&mut reads)),
            us(p50(&mut ranks))
        );
    }
    remove_sandbox(&mut runtime, id).await;

    // The node at idle with 110 container pods.
    let node_root = tempfile::tempdir().expect("tempdir");
    let manifests = node_root.path().join("manifests");
    std::fs::create_dir_all(&manifests).expect("mkdir");
    for i in 0..IDLE_PODS {
        let manifest = format!(
            "apiVersion: v1\nkind: Pod\nmetadata: {{name: idle-{i}}}\nspec:\n  hostNetwork: true\n  terminationGracePeriodSeconds: 1\n  containers:\n  - name: main\n    image: {image}\n    command: [sleep, '3600']\n    resources: {{requests: {{cpu: 10m, memory: 8Mi}}}}\n"
        );
        std::fs::write(manifests.join(format!("idle-{i}.yaml")), manifest).expect("manifest");
    }
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_rustlet"));
    command
        .env("RUSTLET_LOG", "warn")
        .env_remove("RUSTLET_ROOT_DIR")
        .arg("--standalone")
        .arg("--root-dir")
        .arg(node_root.path())
        .arg("--pod-manifest-path")
        .arg(&manifests)
        .args(["--node-name", "idle", "--healthz-port", "0", "--port", "0"])
        // The scrapes carry no credentials (standalone: AlwaysAllow).
        .arg("--anonymous-auth")
        .arg("--container-runtime-endpoint")
        .arg(containerd.endpoint())
        .arg("--cgroup-root")
        .arg(&cgroup_root.name)
        .kill_on_drop(true);
    let node = NodeProcess::start(command);
    let pid = node.child.id().expect("pid");
    let socket = local_socket(node_root.path());
    let started = Instant::now();
    while !std::path::Path::new(&socket).exists() {
        assert!(started.elapsed() < Duration::from_secs(120), "the node never served its local socket");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    loop {
        let (code, body) = http_get(&socket, "/pods").await;
        let running = if code == 200 {
            let list: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
            list["items"]
                .as_array()
                .map(|items| {
                    items.iter().filter(|p| p["status"]["containerStatuses"][0]["state"]["running"].is_object()).count()
                })
                .unwrap_or(0)
        } else {
            0
        };
        if running == IDLE_PODS {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(900), "{running} of {IDLE_PODS} pods running after 15 minutes");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    println!("  {IDLE_PODS} container pods running in {:.0} s", started.elapsed().as_secs_f64());
    // Settle, then measure.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let window = Duration::from_secs(if quick() { 10 } else { 30 });
    let (cpu_before, _) = cpu_and_rss(pid);
    let at = Instant::now();
    tokio::time::sleep(window).await;
    let (cpu_after, rss) = cpu_and_rss(pid);
    let share = (cpu_after - cpu_before).as_secs_f64() * 100.0 / at.elapsed().as_secs_f64();
    println!(
        "  the node at idle with {IDLE_PODS} container pods: {share:.2}% of a core, RSS {:.0} MB over {} s",
        rss as f64 / 1e6,
        window.as_secs()
    );
    println!("  anchor: the Go kubelet 1.28.7 on this VM, 20 pods: 1.4-1.9% of a core, 79-84 MB");
    let kubelet_api = kubelet_api_address(&socket).await;
    let busy = scrapes(kubelet_api, runs).await;
    for i in 0..IDLE_PODS {
        std::fs::remove_file(manifests.join(format!("idle-{i}.yaml"))).expect("rm");
    }
    let started = Instant::now();
    loop {
        let (_, body) = http_get(&socket, "/pods").await;
        let list: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
        if list["items"].as_array().is_some_and(Vec::is_empty) || started.elapsed() > Duration::from_secs(600) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let idle = scrapes(kubelet_api, runs).await;
    println!("  a scrape of each page over TLS (p50, size), with {IDLE_PODS} container pods / with none:");
    for ((path, (busy_time, busy_size)), (_, (idle_time, idle_size))) in busy.iter().zip(&idle) {
        println!(
            "    {path:<18} {:>10} {:>8} KiB   / {:>10} {:>8} KiB",
            us(*busy_time),
            busy_size / 1024,
            us(*idle_time),
            idle_size / 1024
        );
    }
    drop(node);
}

/// The kubelet API's address, from the Node the local socket describes.
async fn kubelet_api_address(socket: &str) -> std::net::SocketAddr {
    let (_, body) = http_get(socket, "/node").await;
    let node: serde_json::Value = serde_json::from_str(&body).expect("the Node");
    let port = node["status"]["daemonEndpoints"]["kubeletEndpoint"]["Port"].as_u64().expect("the kubelet port");
    std::net::SocketAddr::from(([127, 0, 0, 1], u16::try_from(port).expect("a port")))
}

/// The p50 time and the size of a scrape of each metrics page.
async fn scrapes(address: std::net::SocketAddr, runs: usize) -> Vec<(&'static str, (Duration, usize))> {
    use rustlet_testkit::https::{Credentials, Session};
    let mut session = Session::connect(address, Credentials::Anonymous).await.expect("the kubelet API");
    let mut pages = Vec::new();
    for path in ["/metrics", "/metrics/cadvisor", "/metrics/probes", "/metrics/resource"] {
        let mut times = Vec::new();
        let mut size = 0;
        for _ in 0..runs.clamp(5, 50) {
            let started = Instant::now();
            let (code, body) = session.request("GET", path).await.expect("a scrape");
            times.push(started.elapsed());
            assert_eq!(code, 200, "{path}: {body}");
            size = body.len();
        }
        pages.push((path, (p50(&mut times), size)));
    }
    pages
}
