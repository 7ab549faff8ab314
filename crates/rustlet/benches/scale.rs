//! Scale benchmark: what N nodes cost one real control plane. Prints
//! figures, asserts nothing about them.
//!
//! For each N (`RUSTLET_SCALE_NODES`, default `10,50,100`;
//! `RUSTLET_BENCH_QUICK=1`: 10) and each kind of node, in a child process of
//! its own (this program with `--part`):
//! - a control plane of its own: etcd, kube-apiserver, kube-scheduler and
//!   kube-controller-manager from `RUSTLET_KUBE_BIN_DIR` (built by the user;
//!   nothing here builds them), the API server writing an audit log of
//!   every request the nodes make (`Metadata` level, users in
//!   `system:nodes` only);
//! - N nodes as separate processes, each with its own identity
//!   (`system:node:<name>`, a bearer token), root dir, node IP on the
//!   loopback (`127.0.1.x`) and ports: **rustlet** (this workspace's binary,
//!   the WebAssembly provider, the `sleep` example imported), or, where
//!   `RUSTLET_SCALE_KUBEMARK` (default `$RUSTLET_KUBE_BIN_DIR/kubemark`)
//!   is a file, **kubemark**'s hollow kubelet (upstream's kubelet code with a
//!   fake runtime: upstream's own instrument for this);
//! - three phases of `RUSTLET_SCALE_PHASE_SECS` each (default 120; quick:
//!   30; `RUSTLET_SCALE_PHASES` chooses, `RUSTLET_SCALE_IDLE_SECS` sets the
//!   idle one's): **idle** (no pods); **churn** (a Deployment of
//!   `RUSTLET_SCALE_PODS_PER_NODE` × N pods, default 5 per node, scaled up
//!   to all Running and down to none, again and again, by the ReplicaSet
//!   controller at its own rate); **volumes** (a Deployment of as many pods,
//!   each mounting a ConfigMap, a Secret and a projected service-account
//!   token beside the automatic one, all Running, then held);
//! - per phase, per node and per minute: the API requests by verb and
//!   resource (from the audit log: the API server's own record, per user),
//!   watches open at the phase's end, bytes sent to and received from the
//!   API server (the kernel's TCP counters of each node process's
//!   connections, read every second: a connection opened and closed
//!   within one second is missed); the nodes' RSS and CPU, the API
//!   server's and etcd's CPU; and pod start (the benchmark's watch sees
//!   the pod → sees every container running: upstream's SLO form) p50/p99.
//!
//! Run: `RUSTLET_KUBE_BIN_DIR=... cargo bench -p rustlet --bench scale`
//! (`RUSTLET_SCALE_KEEP=1` keeps each run's audit log and node logs).
//! Without the binaries it says so and ends (fails under
//! `RUSTLET_REQUIRE_KUBE=1`).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{Read as _, Seek as _};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt as _;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod, Secret};
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use rustlet_testkit::control_plane::{ControlPlane, Options};
use tokio::process::{Child, Command};

type BoxError = Box<dyn std::error::Error + Send + Sync>;
const IMAGE: &str = "example.com/scale/sleep:v1";
/// How long nodes and pods may take to get where a phase needs them: a
/// liveness bound, not a figure.
const PATIENCE: Duration = Duration::from_secs(600);

fn quick() -> bool {
    std::env::var("RUSTLET_BENCH_QUICK").is_ok_and(|v| v == "1")
}

fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.trim().parse().ok()).unwrap_or(default)
}

fn phase_length() -> Duration {
    Duration::from_secs(env_number("RUSTLET_SCALE_PHASE_SECS", if quick() { 30 } else { 120 }))
}

/// How long the idle phase lasts (`RUSTLET_SCALE_IDLE_SECS`, default the
/// phase length): ten minutes take in what a quiet node does less often
/// than a minute (each watch's renewal every 5–10 min, the Node status
/// report every 5).
fn idle_length() -> Duration {
    std::env::var("RUSTLET_SCALE_IDLE_SECS")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .map_or_else(phase_length, Duration::from_secs)
}

/// Whether phase `name` runs (`RUSTLET_SCALE_PHASES`, default
/// `idle,churn,volumes`).
fn runs(name: &str) -> bool {
    std::env::var("RUSTLET_SCALE_PHASES").map_or(true, |list| list.split(',').any(|p| p.trim() == name))
}

fn pods_per_node() -> usize {
    env_number("RUSTLET_SCALE_PODS_PER_NODE", 5) as usize
}

fn kubemark(bin_dir: &Path) -> Option<PathBuf> {
    let path = std::env::var_os("RUSTLET_SCALE_KUBEMARK").map_or_else(|| bin_dir.join("kubemark"), PathBuf::from);
    path.is_file().then_some(path)
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Rustlet,
    Kubemark,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Rustlet => "rustlet",
            Kind::Kubemark => "kubemark",
        }
    }
}

/// One node process.
struct NodeProc {
    child: Child,
    pid: u32,
}

/// Starts node `i` of `kind` as `name`, with its files under `dir`.
async fn start_node(
    kind: Kind,
    i: usize,
    name: &str,
    token: &str,
    plane: &ControlPlane,
    dir: &Path,
) -> Result<NodeProc, BoxError> {
    let root = dir.join(format!("node-{i}"));
    std::fs::create_dir_all(&root)?;
    let kubeconfig = root.join("kubeconfig");
    plane.write_kubeconfig(&kubeconfig, token)?;
    let log = std::fs::File::create(root.join("node.log"))?;
    let mut command = match kind {
        Kind::Rustlet => {
            let rustlet = Path::new(env!("CARGO_BIN_EXE_rustlet"));
            rustlet_testkit::node_process::import_example(rustlet, &root, "example.com/scale", "sleep").await;
            let ip = format!("127.0.1.{}", i + 1);
            let mut command = Command::new(rustlet);
            command
                .env("RUSTLET_LOG", "warn")
                .env("RUSTLET_EVICTION_HARD", rustlet_testkit::node_process::TEST_EVICTION_HARD)
                .env_remove("RUSTLET_ROOT_DIR")
                .arg("--kubeconfig")
                .arg(&kubeconfig)
                .arg("--root-dir")
                .arg(&root)
                .args(["--node-name", name, "--node-ip", &ip, "--address", &ip, "--healthz-port", "0"]);
            command
        }
        Kind::Kubemark => {
            let binary = kubemark(plane.bin_dir()).ok_or("no kubemark binary")?;
            let mut command = Command::new(binary);
            let port = 20_000 + 2 * i;
            command
                .env("TMPDIR", &root)
                .args(["--morph=kubelet", "--name", name, "--use-host-image-service=false"])
                .arg(format!("--kubeconfig={}", kubeconfig.display()))
                .arg(format!("--kubelet-port={port}"))
                .arg(format!("--kubelet-read-only-port={}", port + 1))
                .arg("--v=1");
            command
        }
    };
    let child =
        command.stdin(std::process::Stdio::null()).stdout(log.try_clone()?).stderr(log).kill_on_drop(true).spawn()?;
    let pid = child.id().ok_or("the node exited at once")?;
    Ok(NodeProc { child, pid })
}

/// CPU time (user + system) of process `pid`.
fn cpu_of(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<u64> = after.split_whitespace().map(|f| f.parse().unwrap_or(0)).collect();
    // After the name: state is field 3 overall, utime 14, stime 15.
    let ticks = fields.get(11).copied().unwrap_or(0) + fields.get(12).copied().unwrap_or(0);
    Duration::from_millis(ticks * 10)
}

/// Resident memory of process `pid`, in MiB.
fn rss_mib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
        .unwrap_or(0.0)
        / 1024.0
}

/// Bytes each process sent to and received from the API server, over every
/// connection seen (the last reading of one that closed is kept).
#[derive(Default)]
struct Traffic {
    sockets: HashMap<(u32, String), (u64, u64)>,
}

impl Traffic {
    /// One reading of `ss` for connections to `port`.
    fn sample(&mut self, port: u16) {
        let Ok(output) = std::process::Command::new("ss")
            .args(["-tinpH", "state", "established", &format!("( dport = :{port} )")])
            .output()
        else {
            return;
        };
        let text = String::from_utf8_lossy(&output.stdout);
        let mut current: Option<(u32, String)> = None;
        for line in text.lines() {
            if !line.starts_with(char::is_whitespace) {
                let pid = line
                    .split("pid=")
                    .nth(1)
                    .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
                    .and_then(|p| p.parse().ok());
                let local = line.split_whitespace().nth(2).unwrap_or_default().to_owned();
                current = pid.map(|pid| (pid, local));
                continue;
            }
            let Some(key) = current.take() else { continue };
            let field = |name: &str| {
                line.split_whitespace()
                    .find_map(|f| f.strip_prefix(name))
                    .and_then(|v| v.parse::<u64>().ok())
                    .unwrap_or(0)
            };
            self.sockets.insert(key, (field("bytes_acked:"), field("bytes_received:")));
        }
    }

    /// (sent, received) by `pid`, over every connection seen.
    fn of(&self, pid: u32) -> (u64, u64) {
        self.sockets
            .iter()
            .filter(|((p, _), _)| *p == pid)
            .fold((0, 0), |(s, r), (_, (sent, received))| (s + sent, r + received))
    }
}

/// What the audit log says of the nodes' requests.
struct Audit {
    file: std::fs::File,
    offset: u64,
    /// Watches started and not yet ended, by audit id → node.
    open_watches: HashMap<String, String>,
}

/// Requests counted in a stretch of the audit log.
#[derive(Default)]
struct Requests {
    /// (verb, resource) → count.
    by_kind: BTreeMap<(String, String), u64>,
    failed: u64,
    /// (verb, resource, code) → count, of those that failed.
    failures: BTreeMap<(String, String, u64), u64>,
}

impl Audit {
    fn open(path: &Path) -> Result<Audit, BoxError> {
        Ok(Audit { file: std::fs::File::open(path)?, offset: 0, open_watches: HashMap::new() })
    }

    /// Reads what was written since the last read.
    fn read(&mut self) -> Requests {
        let mut text = String::new();
        let _ = self.file.seek(std::io::SeekFrom::Start(self.offset));
        let _ = self.file.read_to_string(&mut text);
        // Only whole lines: the writer may be in the middle of one.
        let whole = text.rfind('\n').map_or(0, |i| i + 1);
        self.offset += whole as u64;
        let mut requests = Requests::default();
        for line in text[..whole].lines() {
            let Ok(event) = serde_json::from_str::<serde_json::Value>(line) else { continue };
            let user = event["user"]["username"].as_str().unwrap_or_default();
            let Some(node) = user.strip_prefix("system:node:") else { continue };
            let verb = event["verb"].as_str().unwrap_or_default().to_owned();
            let id = event["auditID"].as_str().unwrap_or_default().to_owned();
            let stage = event["stage"].as_str().unwrap_or_default();
            let object = &event["objectRef"];
            let mut resource = object["resource"].as_str().unwrap_or("(none)").to_owned();
            if let Some(sub) = object["subresource"].as_str() {
                resource = format!("{resource}/{sub}");
            }
            match (verb.as_str(), stage) {
                ("watch", "ResponseStarted") => {
                    self.open_watches.insert(id, node.to_owned());
                    *requests.by_kind.entry((verb, resource)).or_default() += 1;
                }
                ("watch", _) => {
                    self.open_watches.remove(&id);
                }
                (_, "ResponseComplete" | "Panic") => {
                    if let Some(code) = event["responseStatus"]["code"].as_u64().filter(|c| *c >= 400) {
                        requests.failed += 1;
                        *requests.failures.entry((verb.clone(), resource.clone(), code)).or_default() += 1;
                    }
                    *requests.by_kind.entry((verb, resource)).or_default() += 1;
                }
                _ => {}
            }
        }
        requests
    }
}

/// When the benchmark's watch saw each pod first and with every container
/// running.
#[derive(Default)]
struct PodTimes {
    seen: HashMap<String, Instant>,
    running: HashMap<String, Instant>,
    /// Pods that exist now: uid → app label.
    present: HashMap<String, String>,
    /// Every pod seen: uid → app label.
    app: HashMap<String, String>,
}

fn all_running(pod: &Pod) -> bool {
    let Some(status) = &pod.status else { return false };
    let statuses = status.container_statuses.as_deref().unwrap_or_default();
    status.phase.as_deref() == Some("Running")
        && !statuses.is_empty()
        && statuses.iter().all(|c| c.state.as_ref().is_some_and(|s| s.running.is_some()))
}

fn watch_pods(client: kube::Client, times: Arc<Mutex<PodTimes>>, changed: Arc<tokio::sync::Notify>) {
    tokio::spawn(async move {
        let api: Api<Pod> = Api::namespaced(client, "default");
        let mut events = std::pin::pin!(watcher(api, watcher::Config::default()));
        while let Some(event) = events.next().await {
            let now = Instant::now();
            let mut times = times.lock().unwrap_or_else(|p| p.into_inner());
            let note = |pod: &Pod, times: &mut PodTimes| {
                let uid = pod.metadata.uid.clone().unwrap_or_default();
                let app = pod.metadata.labels.as_ref().and_then(|l| l.get("app")).cloned().unwrap_or_default();
                times.seen.entry(uid.clone()).or_insert(now);
                if all_running(pod) {
                    times.running.entry(uid.clone()).or_insert(now);
                }
                times.app.insert(uid.clone(), app.clone());
                times.present.insert(uid, app);
            };
            match event {
                Ok(watcher::Event::Apply(pod) | watcher::Event::InitApply(pod)) => note(&pod, &mut times),
                Ok(watcher::Event::Delete(pod)) => {
                    times.present.remove(pod.metadata.uid.as_deref().unwrap_or_default());
                }
                _ => {}
            }
            drop(times);
            changed.notify_waiters();
        }
    });
}

/// Waits until `done` holds of the pod times (checked at each pod event).
async fn wait_pods(
    times: &Arc<Mutex<PodTimes>>,
    changed: &tokio::sync::Notify,
    what: &str,
    done: impl Fn(&PodTimes) -> bool,
) -> Result<(), BoxError> {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let notified = changed.notified();
        if done(&times.lock().unwrap_or_else(|p| p.into_inner())) {
            return Ok(());
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!("pods not {what} within {PATIENCE:?}").into());
        }
        let _ = tokio::time::timeout(left.min(Duration::from_secs(5)), notified).await;
    }
}

fn count(times: &PodTimes, app: &str, running: bool) -> usize {
    times.present.iter().filter(|(uid, a)| *a == app && (!running || times.running.contains_key(*uid))).count()
}

/// p50 and p99 (nearest rank) of `values`, in seconds.
fn percentiles(mut values: Vec<f64>) -> String {
    if values.is_empty() {
        return "no pods".into();
    }
    values.sort_by(f64::total_cmp);
    let at = |q: f64| values[((q * values.len() as f64).ceil() as usize).clamp(1, values.len()) - 1];
    format!("p50 {:.2} s, p99 {:.2} s, max {:.2} s (n={})", at(0.5), at(0.99), at(1.0), values.len())
}

fn starts_since(times: &Arc<Mutex<PodTimes>>, since: Instant, app: &str) -> Vec<f64> {
    let times = times.lock().unwrap_or_else(|p| p.into_inner());
    times
        .running
        .iter()
        .filter(|(uid, _)| times.app.get(*uid).is_some_and(|a| a == app))
        .filter_map(|(uid, running)| {
            let seen = times.seen.get(uid)?;
            (*seen >= since).then(|| running.duration_since(*seen).as_secs_f64())
        })
        .collect()
}

fn deployment(name: &str, replicas: usize, volumes: bool) -> Result<Deployment, BoxError> {
    let mut pod = serde_json::json!({
        "terminationGracePeriodSeconds": 2,
        "tolerations": [{"key": "kubernetes.io/arch", "operator": "Exists"}],
        "containers": [{"name": "main", "image": IMAGE, "imagePullPolicy": "IfNotPresent"}]
    });
    if volumes {
        pod["containers"][0]["volumeMounts"] = serde_json::json!([
            {"name": "config", "mountPath": "/config"},
            {"name": "secret", "mountPath": "/secret"},
            {"name": "token", "mountPath": "/token"}
        ]);
        pod["volumes"] = serde_json::json!([
            {"name": "config", "configMap": {"name": "scale-config"}},
            {"name": "secret", "secret": {"secretName": "scale-secret"}},
            {"name": "token", "projected": {"sources": [
                {"serviceAccountToken": {"path": "token", "expirationSeconds": 3600}}
            ]}}
        ]);
    }
    Ok(serde_json::from_value(serde_json::json!({
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name}}, "spec": pod}
        }
    }))?)
}

async fn scale(api: &Api<Deployment>, name: &str, replicas: usize) -> Result<(), BoxError> {
    let patch = serde_json::json!({"spec": {"replicas": replicas}});
    api.patch(name, &PatchParams::default(), &Patch::Merge(&patch)).await?;
    Ok(())
}

/// The state at a phase's start.
struct Mark {
    at: Instant,
    cpu: Vec<Duration>,
    traffic: Vec<(u64, u64)>,
    servers: (Duration, Duration),
}

struct Run<'a> {
    kind: Kind,
    nodes: &'a [NodeProc],
    audit: Audit,
    traffic: Arc<Mutex<Traffic>>,
    servers: (u32, u32),
    /// The API server's port.
    port: u16,
}

impl Run<'_> {
    fn mark(&mut self) -> Mark {
        let _ = self.audit.read();
        let mut traffic = self.traffic.lock().unwrap_or_else(|p| p.into_inner());
        traffic.sample(self.port);
        Mark {
            at: Instant::now(),
            cpu: self.nodes.iter().map(|n| cpu_of(n.pid)).collect(),
            traffic: self.nodes.iter().map(|n| traffic.of(n.pid)).collect(),
            servers: (cpu_of(self.servers.0), cpu_of(self.servers.1)),
        }
    }

    /// Prints what the nodes cost since `mark`.
    fn report(&mut self, phase: &str, mark: &Mark, extra: &str) {
        let requests = self.audit.read();
        let minutes = mark.at.elapsed().as_secs_f64() / 60.0;
        let n = self.nodes.len() as f64;
        let per = |v: f64| v / n / minutes;
        let total: u64 = requests.by_kind.values().sum();
        let events: u64 = requests.by_kind.iter().filter(|((_, r), _)| r == "events").map(|(_, c)| c).sum();
        let mut traffic = self.traffic.lock().unwrap_or_else(|p| p.into_inner());
        traffic.sample(self.port);
        let (mut sent, mut received) = (0u64, 0u64);
        for (node, (s0, r0)) in self.nodes.iter().zip(&mark.traffic) {
            let (s1, r1) = traffic.of(node.pid);
            sent += s1.saturating_sub(*s0);
            received += r1.saturating_sub(*r0);
        }
        drop(traffic);
        let cpu: f64 =
            self.nodes.iter().zip(&mark.cpu).map(|(node, c0)| (cpu_of(node.pid) - *c0).as_secs_f64()).sum::<f64>();
        let rss: Vec<f64> = self.nodes.iter().map(|node| rss_mib(node.pid)).collect();
        let seconds = mark.at.elapsed().as_secs_f64();
        let apiserver = (cpu_of(self.servers.1) - mark.servers.1).as_secs_f64() / seconds * 100.0;
        let etcd = (cpu_of(self.servers.0) - mark.servers.0).as_secs_f64() / seconds * 100.0;
        let watches = self.audit.open_watches.len() as f64 / n;
        println!(
            "  {} N={} {phase} ({seconds:.0} s): per node per minute {:.1} requests ({:.1} without events; {} failed in all), {:.1} KiB sent, {:.1} KiB received; {watches:.1} watches open per node",
            self.kind.name(),
            self.nodes.len(),
            per(total as f64),
            per((total - events) as f64),
            requests.failed,
            per(sent as f64) / 1024.0,
            per(received as f64) / 1024.0,
        );
        let mut kinds: Vec<_> = requests.by_kind.iter().collect();
        kinds.sort_by(|a, b| b.1.cmp(a.1));
        let kinds: Vec<String> =
            kinds.iter().map(|((verb, resource), c)| format!("{verb} {resource} {:.2}", per(**c as f64))).collect();
        println!("    by verb and resource: {}", kinds.join(", "));
        if !requests.failures.is_empty() {
            let failures: Vec<String> = requests
                .failures
                .iter()
                .map(|((verb, resource, code), c)| format!("{verb} {resource} {code}: {c}"))
                .collect();
            println!("    failed (in all): {}", failures.join(", "));
        }
        println!(
            "    node RSS avg {:.1} MiB (max {:.1}), node CPU avg {:.2}% of a core; kube-apiserver {apiserver:.1}%, etcd {etcd:.1}% of a core{extra}",
            rss.iter().sum::<f64>() / n,
            rss.iter().copied().fold(0.0, f64::max),
            cpu / n / seconds * 100.0,
        );
    }
}

/// Returns once a node process has exited, saying which and how (its
/// log's last line).
async fn first_exit(nodes: &mut [NodeProc], dir: &Path) -> String {
    let waits = nodes.iter_mut().enumerate().map(|(i, node)| Box::pin(async move { (i, node.child.wait().await) }));
    let ((i, status), _, _) = futures_util::future::select_all(waits).await;
    let log = std::fs::read_to_string(dir.join(format!("node-{i}/node.log"))).unwrap_or_default();
    format!("node {i} exited ({status:?}): {}", log.lines().last().unwrap_or_default())
}

async fn wait_nodes_ready(client: kube::Client, n: usize) -> Result<Duration, BoxError> {
    let began = Instant::now();
    let api: Api<Node> = Api::all(client);
    let mut ready: HashSet<String> = HashSet::new();
    let mut events = std::pin::pin!(watcher(api, watcher::Config::default()));
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while ready.len() < n {
        let event = tokio::time::timeout_at(deadline, events.next())
            .await
            .map_err(|_| format!("{} of {n} nodes Ready within {PATIENCE:?}", ready.len()))?;
        if let Some(Ok(watcher::Event::Apply(node) | watcher::Event::InitApply(node))) = event {
            let is_ready = node
                .status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
            let name = node.metadata.name.unwrap_or_default();
            if is_ready {
                ready.insert(name);
            } else {
                ready.remove(&name);
            }
        }
    }
    Ok(began.elapsed())
}

/// Pod churn: the Deployment scaled up to all Running and down to none,
/// again and again, for a phase.
async fn churn(
    run: &mut Run<'_>,
    deployments: &Api<Deployment>,
    times: &Arc<Mutex<PodTimes>>,
    changed: &tokio::sync::Notify,
    pods: usize,
) -> Result<(), BoxError> {
    let phase = phase_length();
    deployments.create(&PostParams::default(), &deployment("churn", 0, false)?).await?;
    let mark = run.mark();
    let mut cycles = 0;
    while mark.at.elapsed() < phase {
        scale(deployments, "churn", pods).await?;
        wait_pods(times, changed, "all running", |t| count(t, "churn", true) == pods).await?;
        scale(deployments, "churn", 0).await?;
        wait_pods(times, changed, "all gone", |t| count(t, "churn", false) == 0).await?;
        cycles += 1;
    }
    let starts = percentiles(starts_since(times, mark.at, "churn"));
    run.report("churn", &mark, &format!("; {cycles} cycles of {pods} pods up and down; pod start {starts}"));

    Ok(())
}

/// Pods with a ConfigMap, a Secret and a projected token started, then held
/// for a phase.
async fn volumes(
    run: &mut Run<'_>,
    deployments: &Api<Deployment>,
    times: &Arc<Mutex<PodTimes>>,
    changed: &tokio::sync::Notify,
    pods: usize,
) -> Result<(), BoxError> {
    let phase = phase_length();
    let n = run.nodes.len();
    let kind = run.kind;
    let before = Instant::now();
    deployments.create(&PostParams::default(), &deployment("volumes", pods, true)?).await?;
    wait_pods(times, changed, "all running", |t| count(t, "volumes", true) == pods).await?;
    let starts = percentiles(starts_since(times, before, "volumes"));
    println!(
        "  {} N={n}: {pods} pods with configMap, secret and projected token volumes all running in {:.1} s; pod start {starts}",
        kind.name(),
        before.elapsed().as_secs_f64()
    );
    let mark = run.mark();
    tokio::time::sleep(phase).await;
    run.report("volumes", &mark, &format!(" ({pods} pods with volumes running)"));

    Ok(())
}

async fn part(kind: Kind, n: usize) -> Result<(), BoxError> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let dir = rustlet_testkit::node_root::tempdir("rustlet-bench-scale-");
    let audit_path = dir.path().join("audit.log");
    let options = Options {
        audit_log: Some(audit_path.clone()),
        signing_duration: Duration::from_secs(365 * 24 * 3600),
        controller_qps: None,
    };
    let plane = ControlPlane::start(options).await?;
    plane.ensure_scheduler()?;
    plane.ensure_controller_manager()?;
    let client = plane.admin_client().await.map_err(|e| format!("admin client: {e}"))?;
    let configs: Api<ConfigMap> = Api::namespaced(client.clone(), "default");
    let config = serde_json::from_value(
        serde_json::json!({"metadata": {"name": "scale-config"}, "data": {"greeting": "hello"}}),
    )?;
    configs.create(&PostParams::default(), &config).await?;
    let secrets: Api<Secret> = Api::namespaced(client.clone(), "default");
    let secret = serde_json::from_value(
        serde_json::json!({"metadata": {"name": "scale-secret"}, "stringData": {"password": "s3cret"}}),
    )?;
    secrets.create(&PostParams::default(), &secret).await?;

    // Each node process holds a few inotify instances (two for Rustlet:
    // the plugin and device-plugin directories); the kernel's default of
    // 128 per user is far below a hundred nodes on one machine.
    let instances: usize = std::fs::read_to_string("/proc/sys/fs/inotify/max_user_instances")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(usize::MAX);
    let needed = 4 * n + 128;
    if instances < needed {
        return Err(format!(
            "fs.inotify.max_user_instances is {instances}, {n} node processes need about {needed}: \
             raise it first (`sysctl -w fs.inotify.max_user_instances={}`)",
            needed.next_power_of_two()
        )
        .into());
    }
    let began = Instant::now();
    let mut nodes = Vec::new();
    for i in 0..n {
        let identity = plane.node();
        nodes.push(start_node(kind, i, &identity.name, &identity.token, &plane, dir.path()).await?);
    }
    let ready = tokio::select! {
        ready = wait_nodes_ready(client.clone(), n) => ready?,
        exited = first_exit(&mut nodes, dir.path()) => return Err(exited.into()),
    };
    println!(
        "  {} N={n}: all started and Ready in {:.1} s (the last Ready {:.1} s after its start began)",
        kind.name(),
        began.elapsed().as_secs_f64(),
        ready.as_secs_f64()
    );
    // What pods with the automatic token volume need from the controllers.
    let deadline = Instant::now() + PATIENCE;
    while configs.get_opt("kube-root-ca.crt").await?.is_none() {
        if Instant::now() > deadline {
            return Err("kube-root-ca.crt was never published".into());
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    let traffic = Arc::new(Mutex::new(Traffic::default()));
    let port: u16 = plane.url().rsplit(':').next().and_then(|p| p.parse().ok()).ok_or("the API server's port")?;
    let sampler = {
        let traffic = traffic.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                tick.tick().await;
                let traffic = traffic.clone();
                let _ =
                    tokio::task::spawn_blocking(move || traffic.lock().unwrap_or_else(|p| p.into_inner()).sample(port))
                        .await;
            }
        })
    };
    let servers = plane.server_pids();
    let mut run = Run { kind, nodes: &nodes, audit: Audit::open(&audit_path)?, traffic, servers, port };
    let times = Arc::new(Mutex::new(PodTimes::default()));
    let changed = Arc::new(tokio::sync::Notify::new());
    watch_pods(client.clone(), times.clone(), changed.clone());
    let pods = pods_per_node() * n;
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), "default");

    if runs("idle") {
        let mark = run.mark();
        tokio::time::sleep(idle_length()).await;
        run.report("idle", &mark, "");
    }
    if runs("churn") {
        churn(&mut run, &deployments, &times, &changed, pods).await?;
    }
    if runs("volumes") {
        volumes(&mut run, &deployments, &times, &changed, pods).await?;
    }

    sampler.abort();
    for mut node in nodes {
        let _ = node.child.kill().await;
    }
    if std::env::var_os("RUSTLET_SCALE_KEEP").is_some() {
        println!("  (kept: {}: the audit log and each node's log)", dir.keep().display());
    }
    Ok(())
}

fn orchestrate() -> Result<(), BoxError> {
    let bin_dir = std::env::var_os("RUSTLET_KUBE_BIN_DIR").map(PathBuf::from);
    let Some(bin_dir) = bin_dir.filter(|d| d.join("kube-apiserver").is_file()) else {
        println!(
            "scale benchmark: skipped: RUSTLET_KUBE_BIN_DIR does not name a directory with kube-apiserver, \
             kube-scheduler and kube-controller-manager (docs/testing.md, \"Against a real kube-apiserver\")"
        );
        if std::env::var("RUSTLET_REQUIRE_KUBE").is_ok_and(|v| v == "1") {
            return Err("RUSTLET_REQUIRE_KUBE=1 and no Kubernetes binaries".into());
        }
        return Ok(());
    };
    let counts: Vec<usize> = match std::env::var("RUSTLET_SCALE_NODES") {
        Ok(list) => list.split(',').filter_map(|c| c.trim().parse().ok()).collect(),
        Err(_) if quick() => vec![10],
        Err(_) => vec![10, 50, 100],
    };
    let mut kinds = vec![Kind::Rustlet];
    match kubemark(&bin_dir) {
        Some(_) => kinds.push(Kind::Kubemark),
        None => {
            println!("(no kubemark binary: RUSTLET_SCALE_KUBEMARK or $RUSTLET_KUBE_BIN_DIR/kubemark; Rustlet alone)")
        }
    }
    println!(
        "scale benchmark: {} CPUs; phases of {} s (idle {} s); {} pods per node; nodes {counts:?}",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        phase_length().as_secs(),
        idle_length().as_secs(),
        pods_per_node()
    );
    for n in counts {
        for kind in &kinds {
            println!("\n{} nodes of {}:", n, kind.name());
            let status = std::process::Command::new(std::env::current_exe()?)
                .args(["--part", kind.name(), &n.to_string()])
                .status()?;
            if !status.success() {
                println!("  ({} N={n} ended with {status})", kind.name());
            }
        }
    }
    Ok(())
}

fn main() -> Result<(), BoxError> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) != Some("--part") {
        return orchestrate();
    }
    let kind = match args.get(1).map(String::as_str) {
        Some("kubemark") => Kind::Kubemark,
        _ => Kind::Rustlet,
    };
    let n: usize = args.get(2).and_then(|n| n.parse().ok()).ok_or("--part <rustlet|kubemark> <nodes>")?;
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let result = runtime.block_on(part(kind, n));
    if let Err(error) = &result {
        println!("  {} N={n} failed: {error}", kind.name());
    }
    result
}
