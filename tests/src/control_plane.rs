//! A real Kubernetes control plane for cluster tests: Debian's `etcd` and
//! the upstream `kube-apiserver` (plus `kube-scheduler` and
//! `kube-controller-manager` on demand), on free loopback ports with
//! temporary data dirs, configured like a kubeadm cluster's:
//! `--authorization-mode=Node,RBAC` and the `NodeRestriction` admission
//! plugin, token authentication for an administrator (`system:masters`)
//! and a pool of node identities (`system:node:<name>` in `system:nodes`).
//!
//! The Kubernetes binaries are found in `RUSTLET_KUBE_BIN_DIR`; `etcd` is
//! installed with `apt-get` (package `etcd-server`) when it is missing.
//! Without the binaries a test skips with the reason, unless
//! `RUSTLET_REQUIRE_KUBE=1` (CI), where it fails.
//!
//! One control plane serves every test of a test binary: it starts on the
//! first [`ControlPlane::shared`] call (a few seconds) and each test takes
//! its own node identity from the pool ([`ControlPlane::node`]), so tests
//! never see each other's pods. The processes stop when the test binary
//! exits, however it exits: each is watched by a small shell that kills it
//! once the test process's end of a pipe closes.

use std::io::Write as _;
use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use base64::Engine as _;

/// The user of [`ControlPlane::reader_token`].
pub const METRICS_READER: &str = "rustlet-metrics-reader";

/// Node identities in the pool (one per test that asks).
const NODE_POOL: usize = 256;
/// How long the API server may take to answer `/readyz` (it takes 3–5 s
/// here; a loaded CI machine is allowed much more).
const READY_DEADLINE: Duration = Duration::from_secs(180);

/// A node identity of the control plane.
#[derive(Clone, Debug)]
pub struct NodeIdentity {
    /// The node's name (`system:node:<name>`).
    pub name: String,
    /// Its bearer token.
    pub token: String,
}

/// A process the control plane runs, killed when the test binary exits.
struct Guarded {
    child: Child,
    /// Held open for the test binary's life: when it closes, the watcher
    /// shell kills the child.
    _lifeline: Option<ChildStdin>,
    _watcher: Option<Child>,
}

impl Guarded {
    /// Starts `command` with its output in `log`; once the test binary
    /// exits, the process is killed and `remove` (if any) deleted.
    fn spawn(mut command: Command, log: &Path, remove: Option<&Path>) -> Result<Guarded, String> {
        let log_file = std::fs::File::create(log).map_err(|e| format!("{}: {e}", log.display()))?;
        let err_file = log_file.try_clone().map_err(|e| e.to_string())?;
        let child = command
            .stdin(Stdio::null())
            .stdout(log_file)
            .stderr(err_file)
            .spawn()
            .map_err(|e| format!("cannot start {:?}: {e}", command.get_program()))?;
        // `cat` returns when this process's end of the pipe closes (the
        // test binary exited, even by a signal); then the child goes.
        let remove = remove.map(|p| p.display().to_string()).unwrap_or_default();
        let (lifeline, watcher) = crate::process::when_this_process_exits(
            "kill -9 \"$0\" 2>/dev/null; [ -n \"$1\" ] && rm -rf \"$1\"",
            &[child.id().to_string(), remove],
        );
        Ok(Guarded { child, _lifeline: lifeline, _watcher: watcher })
    }

    /// Fails with the log's tail if the process has exited.
    fn check_alive(&mut self, what: &str, log: &Path) -> Result<(), String> {
        match self.child.try_wait() {
            Ok(Some(status)) => Err(format!("{what} exited ({status}): {}", tail(log))),
            _ => Ok(()),
        }
    }
}

fn tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

/// How a control plane is started beyond the tests' defaults.
#[derive(Clone, Debug)]
pub struct Options {
    /// Where the API server writes its audit log: one JSON line per
    /// request (at `Metadata` level) of every user in `system:nodes`,
    /// nothing of other users. `None`: no audit log.
    pub audit_log: Option<PathBuf>,
    /// How long certificates kube-controller-manager signs are valid.
    pub signing_duration: Duration,
    /// kube-controller-manager's and kube-scheduler's API rate
    /// (`--kube-api-qps`, burst twice that); `None`: their defaults.
    pub controller_qps: Option<u32>,
}

impl Default for Options {
    fn default() -> Options {
        Options { audit_log: None, signing_duration: SIGNED_CERTIFICATE_LIFETIME, controller_qps: None }
    }
}

/// A running control plane.
pub struct ControlPlane {
    options: Options,
    dir: PathBuf,
    bin_dir: PathBuf,
    url: String,
    ca_pem: String,
    admin_token: String,
    /// A user (`rustlet-metrics-reader`) the API server knows and grants
    /// nothing by itself; tests bind it the roles they need.
    reader_token: String,
    nodes: Vec<NodeIdentity>,
    next_node: AtomicUsize,
    admin_kubeconfig: PathBuf,
    processes: Mutex<Vec<Guarded>>,
    scheduler: OnceLock<Result<(), String>>,
    controller_manager: OnceLock<Result<(), String>>,
    ca_params: rcgen::CertificateParams,
    ca_key_pem: String,
    /// The binaries' minor version (`33` for v1.33.3).
    minor: u32,
}

/// How long certificates kube-controller-manager signs are valid: short,
/// so that a test sees a node renew its certificates.
pub const SIGNED_CERTIFICATE_LIFETIME: Duration = Duration::from_secs(60);

static SHARED: OnceLock<Result<ControlPlane, String>> = OnceLock::new();

impl ControlPlane {
    /// The test binary's control plane, started on first use; `None` (after
    /// printing why `test` skips) when the binaries are not there and
    /// `RUSTLET_REQUIRE_KUBE` is not `1`.
    pub fn shared(test: &str) -> Option<&'static ControlPlane> {
        let plane = SHARED.get_or_init(|| {
            // Started from a thread of its own: the caller may be inside
            // any runtime, and the readiness check is async.
            std::thread::spawn(|| {
                let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build();
                runtime.map_err(|e| e.to_string()).and_then(|rt| rt.block_on(ControlPlane::start(Options::default())))
            })
            .join()
            .unwrap_or_else(|_| Err("the control plane starter panicked".into()))
        });
        crate::skip::or_skip(test, crate::skip::Need::Kube, plane.as_ref())
    }

    /// A control plane of its own (not the shared one) with `options`; its
    /// processes stop when this process exits.
    pub async fn start(options: Options) -> Result<ControlPlane, String> {
        let bin_dir = std::env::var_os("RUSTLET_KUBE_BIN_DIR")
            .map(PathBuf::from)
            .ok_or("RUSTLET_KUBE_BIN_DIR is not set (the directory of kube-apiserver, kube-scheduler, kube-controller-manager)")?;
        let apiserver = bin_dir.join("kube-apiserver");
        if !apiserver.is_file() {
            return Err(format!("{} is missing", apiserver.display()));
        }
        let minor = minor_version(&apiserver)?;
        let etcd = crate::debian::ensure_installed("/usr/bin/etcd", "etcd-server")?;
        let dir =
            tempfile::Builder::new().prefix("rustlet-control-plane-").tempdir().map_err(|e| e.to_string())?.keep();
        let started = Instant::now();
        let mut processes = Vec::new();

        // etcd.
        let (client_port, peer_port) = (free_port()?, free_port()?);
        let etcd_url = format!("http://127.0.0.1:{client_port}");
        let peer_url = format!("http://127.0.0.1:{peer_port}");
        let mut command = Command::new(etcd);
        command
            .arg("--data-dir")
            .arg(dir.join("etcd"))
            .args(["--listen-client-urls", &etcd_url, "--advertise-client-urls", &etcd_url])
            .args(["--listen-peer-urls", &peer_url, "--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &format!("default={peer_url}")])
            .env("ETCD_UNSUPPORTED_ARCH", std::env::consts::ARCH);
        processes.push(Guarded::spawn(command, &dir.join("etcd.log"), Some(&dir))?);

        // Certificates, keys and tokens.
        let pki = Pki::generate().map_err(|e| format!("certificates: {e}"))?;
        let write = |name: &str, text: &str| {
            let path = dir.join(name);
            std::fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))?;
            Ok::<PathBuf, String>(path)
        };
        let ca_file = write("ca.crt", &pki.ca_pem)?;
        write("ca.key", &pki.ca_key_pem)?;
        let cert_file = write("apiserver.crt", &pki.server_pem)?;
        let key_file = write("apiserver.key", &pki.server_key_pem)?;
        let sa_key_file = write("sa.key", &pki.sa_key_pem)?;
        let sa_pub_file = write("sa.pub", &pki.sa_pub_pem)?;
        let admin_token = random_token();
        let nodes: Vec<NodeIdentity> =
            (0..NODE_POOL).map(|i| NodeIdentity { name: format!("rustlet-node-{i}"), token: random_token() }).collect();
        let mut tokens = format!("{admin_token},admin,admin-uid,\"system:masters\"\n");
        let reader_token = random_token();
        tokens.push_str(&format!("{reader_token},{METRICS_READER},{METRICS_READER}-uid,\"system:authenticated\"\n"));
        for node in &nodes {
            tokens.push_str(&format!(
                "{},system:node:{},node-{},\"system:nodes,system:authenticated\"\n",
                node.token, node.name, node.name
            ));
        }
        let tokens_file = write("tokens.csv", &tokens)?;
        // What the API server shows nodes it proxies to (kubectl logs,
        // exec, nodes/proxy): a client certificate in system:masters.
        let (kubelet_client_pem, kubelet_client_key_pem) = pki
            .issue("kube-apiserver-kubelet-client", &["system:masters"])
            .map_err(|e| format!("certificates: {e}"))?;
        let kubelet_client_cert = write("apiserver-kubelet-client.crt", &kubelet_client_pem)?;
        let kubelet_client_key = write("apiserver-kubelet-client.key", &kubelet_client_key_pem)?;

        // kube-apiserver.
        let port = free_port()?;
        let url = format!("https://127.0.0.1:{port}");
        let mut command = Command::new(&apiserver);
        command
            .args(["--etcd-servers", &etcd_url, "--bind-address", "127.0.0.1", "--advertise-address", "127.0.0.1"])
            .args(["--secure-port", &port.to_string()])
            .arg("--tls-cert-file")
            .arg(&cert_file)
            .arg("--tls-private-key-file")
            .arg(&key_file)
            .arg("--client-ca-file")
            .arg(&ca_file)
            .arg("--token-auth-file")
            .arg(&tokens_file)
            .arg("--service-account-key-file")
            .arg(&sa_pub_file)
            .arg("--service-account-signing-key-file")
            .arg(&sa_key_file)
            .args(["--service-account-issuer", "https://kubernetes.default.svc"])
            .args(["--authorization-mode", "Node,RBAC", "--enable-admission-plugins", "NodeRestriction"])
            .args(["--endpoint-reconciler-type", "none", "--service-cluster-ip-range", "10.96.0.0/16"])
            .arg("--enable-bootstrap-token-auth")
            .arg("--kubelet-client-certificate")
            .arg(&kubelet_client_cert)
            .arg("--kubelet-client-key")
            .arg(&kubelet_client_key)
            .args(["--kubelet-preferred-address-types", "InternalIP"])
            .arg("--cert-dir")
            .arg(dir.join("apiserver-certs"))
            .args(dra_flags(minor, true));
        if let Some(log) = &options.audit_log {
            let policy = write(
                "audit-policy.yaml",
                "apiVersion: audit.k8s.io/v1\nkind: Policy\nomitStages: [RequestReceived]\nrules:\n\
                 - level: Metadata\n  userGroups: [\"system:nodes\"]\n- level: None\n",
            )?;
            command.arg("--audit-policy-file").arg(policy).arg("--audit-log-path").arg(log);
            command.args(["--audit-log-maxsize", "0", "--audit-log-format", "json"]);
        }
        let apiserver_log = dir.join("kube-apiserver.log");
        processes.push(Guarded::spawn(command, &apiserver_log, None)?);

        let admin_kubeconfig = dir.join("admin.kubeconfig");
        let ca_pem = pki.ca_pem.clone();
        write_kubeconfig(&admin_kubeconfig, &url, &ca_pem, &admin_token).map_err(|e| e.to_string())?;
        let plane = ControlPlane {
            options,
            dir,
            bin_dir,
            url,
            ca_pem,
            admin_token,
            reader_token,
            nodes,
            next_node: AtomicUsize::new(0),
            admin_kubeconfig,
            processes: Mutex::new(processes),
            scheduler: OnceLock::new(),
            controller_manager: OnceLock::new(),
            ca_params: pki.ca_params.clone(),
            ca_key_pem: pki.ca_key_pem.clone(),
            minor,
        };
        plane.wait_ready(&apiserver_log).await?;
        plane.seed().await?;
        eprintln!(
            "control plane: kube-apiserver {} ready in {:?} ({})",
            plane.url,
            started.elapsed(),
            plane.dir.display()
        );
        Ok(plane)
    }

    /// Waits until `/readyz` answers `ok` (polled: the API server announces
    /// readiness nowhere else), failing early if a process died.
    async fn wait_ready(&self, log: &Path) -> Result<(), String> {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let deadline = Instant::now() + READY_DEADLINE;
        loop {
            {
                let mut processes = self.processes.lock().unwrap_or_else(|p| p.into_inner());
                processes[0].check_alive("etcd", &self.dir.join("etcd.log"))?;
                processes[1].check_alive("kube-apiserver", log)?;
            }
            let last = match self.admin_client().await {
                Ok(client) => {
                    let request = http::Request::get("/readyz").body(Vec::new()).map_err(|e| e.to_string())?;
                    match client.request_text(request).await {
                        Ok(text) if text.trim() == "ok" => return Ok(()),
                        Ok(text) => text,
                        Err(error) => error.to_string(),
                    }
                }
                Err(error) => error,
            };
            if Instant::now() > deadline {
                return Err(format!("kube-apiserver not ready within {READY_DEADLINE:?}: {last}; log: {}", tail(log)));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// What kubeadm's controllers would have made: the `default` service
    /// account of the namespaces tests use.
    async fn seed(&self) -> Result<(), String> {
        use k8s_openapi::api::core::v1::ServiceAccount;
        use kube::api::{Api, PostParams};
        let client = self.admin_client().await?;
        for namespace in ["default", "kube-system"] {
            let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), namespace);
            let account: ServiceAccount = serde_json::from_value(serde_json::json!({"metadata": {"name": "default"}}))
                .map_err(|e| e.to_string())?;
            match accounts.create(&PostParams::default(), &account).await {
                Ok(_) => {}
                Err(kube::Error::Api(status)) if status.code == 409 => {}
                Err(error) => return Err(format!("creating serviceaccount {namespace}/default: {error}")),
            }
        }
        Ok(())
    }

    /// The API server's URL (`https://127.0.0.1:<port>`).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// `kubectl` of the same release, as the administrator.
    pub fn kubectl(&self) -> std::process::Command {
        let mut command = std::process::Command::new(self.bin_dir.join("kubectl"));
        command.arg("--kubeconfig").arg(self.admin_kubeconfig());
        command
    }

    /// The cluster CA's certificate file (PEM): what the API server's
    /// clients chain to, and a node's `--client-ca-file`.
    pub fn ca_file(&self) -> PathBuf {
        self.dir.join("ca.crt")
    }

    /// A client certificate and key (PEM) signed by the cluster CA for
    /// user `common_name` in `group` (one: rcgen keeps one value per
    /// attribute type).
    pub fn issue_client_certificate(&self, common_name: &str, group: &str) -> Result<(String, String), String> {
        let pki = Pki { ca_params: self.ca_params.clone(), ca_key_pem: self.ca_key_pem.clone(), ..Pki::empty() };
        pki.issue(common_name, &[group]).map_err(|e| e.to_string())
    }

    /// The administrator's kubeconfig.
    pub fn admin_kubeconfig(&self) -> &Path {
        &self.admin_kubeconfig
    }

    /// The administrator's bearer token.
    pub fn admin_token(&self) -> &str {
        &self.admin_token
    }

    /// The bearer token of user [`METRICS_READER`].
    pub fn reader_token(&self) -> &str {
        &self.reader_token
    }

    /// A node identity no other test of this binary has.
    pub fn node(&self) -> NodeIdentity {
        let i = self.next_node.fetch_add(1, Ordering::Relaxed);
        self.nodes.get(i).cloned().unwrap_or_else(|| panic!("more than {NODE_POOL} node identities asked for"))
    }

    /// Writes a kubeconfig for `token` at `path`.
    pub fn write_kubeconfig(&self, path: &Path, token: &str) -> std::io::Result<()> {
        write_kubeconfig(path, &self.url, &self.ca_pem, token)
    }

    /// A client with the administrator's identity.
    pub async fn admin_client(&self) -> Result<kube::Client, String> {
        self.client(&self.admin_token).await
    }

    /// A client with `token`, configured from a kubeconfig as a user
    /// would give it.
    pub async fn client(&self, token: &str) -> Result<kube::Client, String> {
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let path = dir.path().join("kubeconfig");
        self.write_kubeconfig(&path, token).map_err(|e| e.to_string())?;
        kubelet::cluster::from_kubeconfig(&path).await.map_err(|e| e.to_string())
    }

    /// The binaries' minor version (`33` for v1.33.3).
    pub fn minor_version(&self) -> u32 {
        self.minor
    }

    /// Whether the control plane serves structured DRA (1.32+, turned on
    /// where it is off by default).
    pub fn serves_structured_dra(&self) -> bool {
        self.minor >= 32
    }

    /// The directory of the Kubernetes binaries (`RUSTLET_KUBE_BIN_DIR`).
    pub fn bin_dir(&self) -> &Path {
        &self.bin_dir
    }

    /// The process ids of etcd and kube-apiserver.
    pub fn server_pids(&self) -> (u32, u32) {
        let processes = self.processes.lock().unwrap_or_else(|p| p.into_inner());
        (processes[0].child.id(), processes[1].child.id())
    }

    fn qps_flags(&self) -> Vec<String> {
        self.options
            .controller_qps
            .map_or_else(Vec::new, |qps| vec![format!("--kube-api-qps={qps}"), format!("--kube-api-burst={}", 2 * qps)])
    }

    /// Starts `kube-scheduler` (once per test binary).
    pub fn ensure_scheduler(&self) -> Result<(), String> {
        self.scheduler
            .get_or_init(|| {
                let mut command = Command::new(self.bin_dir.join("kube-scheduler"));
                command.arg("--kubeconfig").arg(&self.admin_kubeconfig).args([
                    "--leader-elect=false",
                    "--bind-address",
                    "127.0.0.1",
                    "--secure-port",
                    "0",
                ]);
                command.args(self.qps_flags());
                command.args(dra_flags(self.minor, false));
                let process = Guarded::spawn(command, &self.dir.join("kube-scheduler.log"), None)?;
                self.processes.lock().unwrap_or_else(|p| p.into_inner()).push(process);
                Ok(())
            })
            .clone()
    }

    /// Starts `kube-controller-manager` with its default controllers
    /// (node lifecycle, which lifts a Ready node's not-ready taint; CSR
    /// approval and signing; garbage collector, ...), once per test binary.
    /// The attach/detach controller is left out: the tests that attach
    /// volumes play its part by hand, and a controller started by another
    /// test of the same binary would race them for the VolumeAttachment
    /// and the Node's `volumesAttached`.
    /// Certificates it signs live [`SIGNED_CERTIFICATE_LIFETIME`] (or as
    /// [`Options`] say).
    pub fn ensure_controller_manager(&self) -> Result<(), String> {
        self.controller_manager
            .get_or_init(|| {
                let mut command = Command::new(self.bin_dir.join("kube-controller-manager"));
                command
                    .arg("--kubeconfig")
                    .arg(&self.admin_kubeconfig)
                    .args(["--leader-elect=false", "--bind-address", "127.0.0.1", "--secure-port", "0"])
                    .arg("--service-account-private-key-file")
                    .arg(self.dir.join("sa.key"))
                    .arg("--root-ca-file")
                    .arg(self.dir.join("ca.crt"))
                    .arg("--cluster-signing-cert-file")
                    .arg(self.dir.join("ca.crt"))
                    .arg("--cluster-signing-key-file")
                    .arg(self.dir.join("ca.key"))
                    .arg("--use-service-account-credentials=false")
                    .arg("--controllers=*,-persistentvolume-attach-detach-controller")
                    .arg(format!("--cluster-signing-duration={}s", self.options.signing_duration.as_secs()))
                    .args(self.qps_flags())
                    .args(dra_flags(self.minor, false));
                let process = Guarded::spawn(command, &self.dir.join("kube-controller-manager.log"), None)?;
                self.processes.lock().unwrap_or_else(|p| p.into_inner()).push(process);
                Ok(())
            })
            .clone()
    }
}

/// The minor version of a Kubernetes binary (`kube-apiserver --version`:
/// `Kubernetes v1.33.3`).
fn minor_version(binary: &Path) -> Result<u32, String> {
    let output = Command::new(binary).arg("--version").output().map_err(|e| format!("{}: {e}", binary.display()))?;
    let text = String::from_utf8_lossy(&output.stdout);
    text.split_whitespace()
        .find_map(|word| word.strip_prefix("v1.")?.split('.').next()?.parse().ok())
        .ok_or_else(|| format!("{} --version said {text:?}", binary.display()))
}

/// What turns structured DRA on, as upstream's DRA e2e cluster does: on
/// 1.32–1.33 the `DynamicResourceAllocation` gate (beta, off by default)
/// on every component, and the API server's beta versions of
/// `resource.k8s.io` (off by default); 1.34+ serves `v1` by default; 1.31
/// and older have no structured DRA this node speaks.
fn dra_flags(minor: u32, apiserver: bool) -> Vec<String> {
    let mut flags = Vec::new();
    if (32..34).contains(&minor) {
        flags.push("--feature-gates=DynamicResourceAllocation=true".to_owned());
        if apiserver {
            let mut versions = vec!["resource.k8s.io/v1beta1=true"];
            if minor >= 33 {
                versions.push("resource.k8s.io/v1beta2=true");
            }
            flags.push(format!("--runtime-config={}", versions.join(",")));
        }
    }
    flags
}

/// Writes a kubeconfig for the API at `url` (verified with `ca_pem`) and
/// bearer `token`.
pub fn write_kubeconfig(path: &Path, url: &str, ca_pem: &str, token: &str) -> std::io::Result<()> {
    let ca = base64::engine::general_purpose::STANDARD.encode(ca_pem);
    let mut file = std::fs::File::create(path)?;
    write!(
        file,
        "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: {url}\n    \
         certificate-authority-data: {ca}\nusers:\n- name: user\n  user:\n    token: {token}\ncontexts:\n\
         - name: test\n  context:\n    cluster: test\n    user: user\ncurrent-context: test\n"
    )
}

/// The host's address the default route leaves from, if it has one but
/// loopback (a UDP "connect" sends nothing). The API server proxies
/// `nodes/proxy` to no loopback address, so a node reached that way
/// advertises this one.
pub fn host_ip() -> Option<std::net::IpAddr> {
    let socket = std::net::UdpSocket::bind("0.0.0.0:0").ok()?;
    socket.connect("192.0.2.1:9").ok()?;
    socket.local_addr().ok().map(|a| a.ip()).filter(|ip| !ip.is_unspecified() && !ip.is_loopback())
}

/// A loopback port free now, for a server started a moment later: drawn
/// below the kernel's ephemeral range (32768 and up by default), so that
/// no outgoing connection of the busy test machine takes it in between (a
/// port from binding port 0 is an ephemeral one, and one was taken so:
/// "bind: address already in use"). Falls back to an ephemeral port.
fn free_port() -> Result<u16, String> {
    use std::sync::atomic::{AtomicU32, Ordering};
    static DRAWN: AtomicU32 = AtomicU32::new(0);
    let seed = uuid::Uuid::new_v4().as_u128() as u32;
    for _ in 0..100 {
        let n = DRAWN.fetch_add(1, Ordering::Relaxed);
        let port = 20_000 + (seed.wrapping_add(n.wrapping_mul(7_919)) % 12_000) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).map_err(|e| e.to_string())
}

fn random_token() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

/// The control plane's certificates and keys (PEM).
struct Pki {
    ca_params: rcgen::CertificateParams,
    ca_pem: String,
    ca_key_pem: String,
    server_pem: String,
    server_key_pem: String,
    sa_key_pem: String,
    sa_pub_pem: String,
}

impl Pki {
    fn generate() -> Result<Pki, rcgen::Error> {
        use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, KeyUsagePurpose, SanType};
        let ca_key = KeyPair::generate()?;
        let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params.distinguished_name.push(DnType::CommonName, "rustlet-test-ca");
        ca_params.key_usages =
            vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
        let ca = ca_params.clone().self_signed(&ca_key)?;
        let server_key = KeyPair::generate()?;
        let mut server_params = CertificateParams::new(vec!["localhost".to_owned(), "kubernetes".to_owned()])?;
        server_params.subject_alt_names.push(SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST)));
        server_params.distinguished_name.push(DnType::CommonName, "kube-apiserver");
        let server = server_params.signed_by(&server_key, &ca, &ca_key)?;
        let sa_key = KeyPair::generate()?;
        Ok(Pki {
            ca_params,
            ca_pem: ca.pem(),
            ca_key_pem: ca_key.serialize_pem(),
            server_pem: server.pem(),
            server_key_pem: server_key.serialize_pem(),
            sa_key_pem: sa_key.serialize_pem(),
            sa_pub_pem: sa_key.public_key_pem(),
        })
    }

    fn empty() -> Pki {
        Pki {
            ca_params: rcgen::CertificateParams::default(),
            ca_pem: String::new(),
            ca_key_pem: String::new(),
            server_pem: String::new(),
            server_key_pem: String::new(),
            sa_key_pem: String::new(),
            sa_pub_pem: String::new(),
        }
    }

    /// A client certificate for `common_name` in `groups`, signed by the CA.
    fn issue(&self, common_name: &str, groups: &[&str]) -> Result<(String, String), rcgen::Error> {
        use rcgen::{CertificateParams, DnType, ExtendedKeyUsagePurpose, KeyPair};
        let ca_key = KeyPair::from_pem(&self.ca_key_pem)?;
        let ca = self.ca_params.clone().self_signed(&ca_key)?;
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.distinguished_name.push(DnType::CommonName, common_name);
        for group in groups {
            params.distinguished_name.push(DnType::OrganizationName, *group);
        }
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let certificate = params.signed_by(&key, &ca, &ca_key)?;
        Ok((certificate.pem(), key.serialize_pem()))
    }
}
