//! Kubelet API benchmark: prints figures beside a floor from the same run;
//! asserts nothing about time.
//!
//! A standalone node (release build) serves its kubelet API on loopback
//! with a self-signed certificate, anonymous requests allowed and
//! AlwaysAllow (so the figures are the server's, not an API server's
//! TokenReview). Measured:
//! - **request on a kept-alive connection**: `GET /healthz`, sequential;
//! - **new connection**: TCP + TLS 1.3 handshake + `GET /healthz`;
//! - **log**: `GET /containerLogs/...` of a 20 MB CRI-format log (200,000
//!   lines) on a kept-alive connection, and with `tailLines=100`;
//! - **stats**: `GET /stats/summary` and `GET /metrics/resource` with 100
//!   pods on the node.
//!
//! The floor: the same client against a bare server in the same process
//! (the same rustls configuration and hyper, answering `ok` to anything,
//! and the log file's bytes for the log path) — the TLS and HTTP stack
//! with nothing of the node's (authentication, routing, reading the pod
//! store, decoding the log).
//!
//! - **through the API server** (when `RUSTLET_KUBE_BIN_DIR` names the
//!   Kubernetes binaries): a node in cluster mode on a real kube-apiserver
//!   running a WebAssembly pod; `kubectl logs` of a 10 MB log and `kubectl
//!   exec POD -- talk x` (a fresh instance, stdin empty, exit 0) round
//!   trips, beside the API server's own floor in the same run (`kubectl get
//!   pod`), each a whole kubectl process.
//! - **idle cost**: the node process's CPU over 10 s with nothing asked.
//!
//! Run: `cargo bench -p rustlet --bench kubelet_api` (`RUSTLET_BENCH_QUICK=1`:
//! fewer rounds).

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::figures;
use kubelet::node::{NodeBuilder, NodeConfig};
use kubelet::server::{AuthorizationMode, KubeletApiConfig};
use rustlet_testkit::https::{Credentials, Session};
use tokio_util::sync::CancellationToken;

fn rounds() -> usize {
    if std::env::var("RUSTLET_BENCH_QUICK").is_ok_and(|v| v == "1") { 200 } else { 2000 }
}

const LOG_LINES: usize = 200_000;
const PODS: usize = 100;

/// A bare TLS + HTTP/1.1 server with the node's certificate: `ok` to
/// anything, the log's bytes for `/log`.
async fn floor_server(cert_dir: &std::path::Path, log: Arc<Vec<u8>>) -> SocketAddr {
    use hyper_util::rt::TokioIo;
    let key = kubelet::pki::tls::load_pair(&cert_dir.join("kubelet.crt"), &cert_dir.join("kubelet.key"))
        .expect("the node's certificate");
    let serving = kubelet::pki::tls::ServingCertificate::new(Some(key));
    let config = kubelet::pki::tls::server_config(serving, None).expect("tls");
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let address = listener.local_addr().expect("address");
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else { return };
            let (acceptor, log) = (acceptor.clone(), log.clone());
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(stream).await else { return };
                let service = hyper::service::service_fn(move |request: http::Request<hyper::body::Incoming>| {
                    let body = if request.uri().path() == "/log" { log.as_ref().clone() } else { b"ok".to_vec() };
                    async move {
                        Ok::<_, std::convert::Infallible>(http::Response::new(http_body_util::Full::new(
                            bytes::Bytes::from(body),
                        )))
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(tls), service).await;
            });
        }
    });
    address
}

async fn kept_alive(address: SocketAddr, path: &str, n: usize) -> common::Figures {
    let mut session = Session::connect(address, Credentials::Anonymous).await.expect("connect");
    let mut samples = Vec::with_capacity(n);
    for _ in 0..n {
        let began = Instant::now();
        let (code, _) = session.request("GET", path).await.expect("request");
        samples.push(began.elapsed());
        assert_eq!(code, 200, "{path}");
    }
    figures(samples)
}

async fn fresh(address: SocketAddr, n: usize) -> common::Figures {
    let mut samples = Vec::with_capacity(n);
    for _ in 0..n {
        let began = Instant::now();
        let (code, _) =
            rustlet_testkit::https::get(address, "/healthz", Credentials::Anonymous).await.expect("request");
        samples.push(began.elapsed());
        assert_eq!(code, 200);
    }
    figures(samples)
}

fn line(what: &str, ours: &common::Figures, floor: &common::Figures) {
    println!("{what}");
    println!("  rustlet  {}", ours.in_us());
    println!("  floor    {}", floor.in_us());
    println!("  p50 ratio {:.2}×", ours.p50.as_secs_f64() / floor.p50.as_secs_f64().max(1e-9));
}

#[tokio::main]
async fn main() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let n = rounds();
    let root = rustlet_testkit::node_root::tempdir("rustlet-bench-");
    let mut config = NodeConfig::new(root.path(), "bench-node");
    config.http_address = None;
    let mut api = KubeletApiConfig::new(root.path());
    api.address = "127.0.0.1:0".parse().expect("address");
    api.auth.anonymous = true;
    api.auth.authorization = AuthorizationMode::AlwaysAllow;
    api.auth.token_webhook = false;
    config.kubelet_api = Some(api);
    let shutdown = CancellationToken::new();
    let node = NodeBuilder::new(config).start(shutdown.clone()).await.expect("node");
    let address = node.kubelet_api_address().expect("kubelet API");

    // 100 pods (no provider: they wait, but they are the node's pods), and
    // a long log for the first.
    for i in 0..PODS {
        let pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": format!("p{i}"), "namespace": "default", "uid": format!("uid-{i}")},
            "spec": {"containers": [{"name": "main", "image": "example.com/x:v1"}]},
        }))
        .expect("pod");
        node.pods().apply(pod);
    }
    let dir = kubelet::pod::pod_log_dir(root.path(), "default", "p0", "uid-0").join("main");
    std::fs::create_dir_all(&dir).expect("log dir");
    let mut log = String::with_capacity(LOG_LINES * 100);
    for i in 0..LOG_LINES {
        log.push_str(&format!("2026-11-24T10:00:00.{i:09}Z stdout F line {i:>8} {}\n", "x".repeat(50)));
    }
    std::fs::write(dir.join("0.log"), &log).expect("log");
    let log_bytes = log.len();
    let floor = floor_server(&root.path().join("pki"), Arc::new(log.into_bytes())).await;
    // Until the pods are in the store.
    let deadline = Instant::now() + Duration::from_secs(60);
    while node.pods().store().list().len() < PODS {
        assert!(Instant::now() < deadline, "pods not applied");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    println!("kubelet API benchmark (release build, 2 cores; {n} rounds per figure, one client at a time)");
    // Warm-up.
    let _ = kept_alive(address, "/healthz", 50).await;
    let _ = kept_alive(floor, "/healthz", 50).await;
    line(
        "GET /healthz, kept-alive connection",
        &kept_alive(address, "/healthz", n).await,
        &kept_alive(floor, "/healthz", n).await,
    );
    let fresh_n = (n / 4).max(50);
    line("new connection: TCP + TLS + GET /healthz", &fresh(address, fresh_n).await, &fresh(floor, fresh_n).await);

    let logs_n = (n / 100).max(5);
    let path = "/containerLogs/default/p0/main";
    let ours = kept_alive(address, path, logs_n).await;
    let bare = kept_alive(floor, "/log", logs_n).await;
    println!("GET {path}: {:.1} MB log, {LOG_LINES} lines", log_bytes as f64 / 1e6);
    println!("  rustlet  {}  ({:.0} MB/s at p50)", ours.in_ms(), log_bytes as f64 / 1e6 / ours.p50.as_secs_f64());
    println!(
        "  floor    {}  ({:.0} MB/s at p50, the file's bytes as they are)",
        bare.in_ms(),
        log_bytes as f64 / 1e6 / bare.p50.as_secs_f64()
    );
    let tail = kept_alive(address, &format!("{path}?tailLines=100"), logs_n).await;
    println!("GET {path}?tailLines=100\n  rustlet  {}", tail.in_ms());

    let stats_n = (n / 10).max(20);
    let summary = kept_alive(address, "/stats/summary", stats_n).await;
    let metrics = kept_alive(address, "/metrics/resource", stats_n).await;
    let bare = kept_alive(floor, "/healthz", stats_n).await;
    println!("GET /stats/summary with {PODS} pods\n  rustlet  {}", summary.in_us());
    println!("GET /metrics/resource with {PODS} pods\n  rustlet  {}", metrics.in_us());
    println!("  floor (a request answered `ok`)  {}", bare.in_us());
    let idle_from = common::process_cpu();
    tokio::time::sleep(Duration::from_secs(10)).await;
    println!(
        "idle: {:?} of CPU in 10 s (the node and its kubelet API, nothing asked)",
        common::process_cpu().saturating_sub(idle_from)
    );
    if std::env::var_os("RUSTLET_KUBE_BIN_DIR").is_some() {
        through_the_api_server(n).await;
    } else {
        println!("through the API server: skipped (RUSTLET_KUBE_BIN_DIR is not set)");
    }
    println!(
        "RSS after: {:.0} MiB; CPU of this process (node, client and floor): {:?}",
        common::rss_mib(),
        common::process_cpu()
    );
    shutdown.cancel();
    node.stopped().await;
}

/// `kubectl logs` and `kubectl exec` through a real kube-apiserver, beside
/// `kubectl get pod` as the floor.
async fn through_the_api_server(n: usize) {
    use kubelet::cluster::{ApiSource, ClusterSettings};
    use rustlet_testkit::control_plane::ControlPlane;
    let Some(plane) = ControlPlane::shared("kubelet_api bench") else { return };
    let identity = plane.node();
    let root = rustlet_testkit::node_root::tempdir("rustlet-bench-");
    let wasi = rustlet_wasi::WasiProvider::new(rustlet_wasi::WasiConfig::new(root.path())).expect("wasi");
    let layout = root.path().join("layout");
    let module = rustlet_wasi::examples::binary("talk").expect("module");
    rustlet_wasi::import::write_layout(&layout, &[("example.com/wasm/talk:v1", &module)]).expect("layout");
    rustlet_wasi::import::import(wasi.images(), &layout, None).expect("import");
    let mut config = NodeConfig::new(root.path(), identity.name.clone());
    config.http_address = None;
    config.node_ips = vec![std::net::IpAddr::from([127, 0, 0, 1])];
    let mut api = KubeletApiConfig::new(root.path());
    api.address = "127.0.0.1:0".parse().expect("address");
    api.client_ca = Some(plane.ca_file());
    config.kubelet_api = Some(api);
    let client = plane.client(&identity.token).await.expect("node client");
    let shutdown = CancellationToken::new();
    let _node = NodeBuilder::new(config)
        .provider(Arc::new(wasi))
        .cluster(ClusterSettings::new(ApiSource::Client(client)))
        .start(shutdown.clone())
        .await
        .expect("node");
    let name = format!("bench-{}", identity.name);
    let manifest = serde_json::json!({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
        "spec": {"nodeName": identity.name, "automountServiceAccountToken": false, "terminationGracePeriodSeconds": 1,
                 "containers": [{"name": "main", "image": "example.com/wasm/talk:v1", "imagePullPolicy": "Never"}]},
    });
    let file = root.path().join("pod.json");
    std::fs::write(&file, manifest.to_string()).expect("manifest");
    let kubectl = |args: &[&str]| {
        let output = plane.kubectl().args(args).output().expect("kubectl");
        assert!(output.status.success(), "kubectl {args:?}: {}", String::from_utf8_lossy(&output.stderr));
        output.stdout
    };
    kubectl(&["apply", "-f", &file.display().to_string()]);
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let phase = kubectl(&["get", "pod", &name, "-o", "jsonpath={.status.phase}"]);
        if phase == b"Running" {
            break;
        }
        assert!(Instant::now() < deadline, "the bench pod is not Running");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // 10 MB more in the container's log (the module writes its ticks too).
    let logs = root.path().join("logs");
    let log = walk(&logs).into_iter().find(|p| p.extension().is_some_and(|e| e == "log")).expect("the pod's log");
    let mut text = String::with_capacity(10_200_000);
    let mut i = 0;
    while text.len() < 10_000_000 {
        text.push_str(&format!("2026-11-24T10:00:00.{i:09}Z stdout F line {i:>8} {}\n", "x".repeat(50)));
        i += 1;
    }
    {
        use std::io::Write as _;
        let mut file = std::fs::OpenOptions::new().append(true).open(&log).expect("log");
        file.write_all(text.as_bytes()).expect("append");
    }
    let rounds = (n / 200).max(5);
    let time = |args: &[&str]| {
        let mut samples = Vec::new();
        for _ in 0..rounds {
            let began = Instant::now();
            kubectl(args);
            samples.push(began.elapsed());
        }
        figures(samples)
    };
    let floor = time(&["get", "pod", &name, "-o", "name"]);
    let logs = time(&["logs", &name]);
    let exec = time(&["exec", &name, "--", "talk", "x"]);
    println!("through kube-apiserver v1.28.7 (each a whole kubectl process, {rounds} rounds)");
    println!("  kubectl logs (10 MB)   {}", logs.in_ms());
    println!("  kubectl exec -- talk x {}", exec.in_ms());
    println!("  floor: kubectl get pod {}", floor.in_ms());
    shutdown.cancel();
}

fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            found.extend(walk(&path));
        } else {
            found.push(path);
        }
    }
    found
}
