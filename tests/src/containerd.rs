//! A private containerd for the CRI tests: Debian's `containerd` and `runc`
//! (installed with `apt-get` when missing), started with a config of its
//! own under a temp dir. That dir holds its root, state, socket, a CNI
//! config and `certs.d` (registry hosts). The CRI plugin is set with
//! `restrict_oom_score_adj = true`: this VM refuses a negative
//! oom_score_adj even for root, and without it every sandbox fails.
//!
//! One containerd serves every test of a test binary ([`Containerd::shared`]).
//! A test that runs a whole node takes one of its own
//! ([`Containerd::private`]): a node starting releases every pod container
//! it does not know, as the kubelet does, and would stop the other tests'.
//! When the binary exits, a watcher shell kills it and the shims it left,
//! unmounts what they mounted under its dir, and removes the dir. A test
//! registry is made reachable over plain HTTP with
//! [`Containerd::trust_registry`] (a `hosts.toml` for its host).
//!
//! Images come from the test's registry: [`push_busybox`] builds an OCI
//! image from Debian's static busybox (`busybox-static`), with the applets
//! as links; [`PAUSE_SCRIPT`] makes the same binary a pause container.

use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// A running containerd.
pub struct Containerd {
    dir: PathBuf,
    socket: PathBuf,
    binary: PathBuf,
    config_path: PathBuf,
    log: PathBuf,
    process: Child,
    starts: usize,
    /// The pod network's CNI configuration (a bridge of its own).
    network: String,
    _lifeline: Option<ChildStdin>,
    _watcher: Option<Child>,
}

static SHARED: OnceLock<Result<Containerd, String>> = OnceLock::new();

/// The sandbox ("pause") image, imported at start.
pub const PAUSE_IMAGE: &str = "rustlet.test/pause:v1";

/// What the pause container runs: waits until it is told to stop (as PID 1
/// it must trap TERM itself).
pub const PAUSE_SCRIPT: &str = "trap 'exit 0' TERM INT; while :; do sleep 3600 & wait $!; done";

impl Containerd {
    /// The test binary's containerd, started on first use; `None` (after
    /// printing why `test` skips) when it cannot run here and
    /// `RUSTLET_REQUIRE_CONTAINERD` is not `1`.
    pub fn shared(test: &str) -> Option<&'static Containerd> {
        or_skip(test, SHARED.get_or_init(|| Containerd::start(true)).as_ref().map_err(Clone::clone))
    }

    /// A containerd of the caller's own whose CNI configuration dir
    /// starts empty: its `NetworkReady` condition is false until something
    /// writes [`Containerd::network_config`] into [`Containerd::cni_dir`]
    /// (as a network plugin's pod does).
    pub fn private_without_network(test: &str) -> Option<Containerd> {
        or_skip(test, Containerd::start(false))
    }

    /// Where this containerd reads its CNI configuration.
    pub fn cni_dir(&self) -> PathBuf {
        self.dir.join("cni")
    }

    /// A CNI configuration list for this containerd's pod network (its own
    /// bridge and subnet, `10.<n>.0.0/24`).
    pub fn network_config(&self) -> &str {
        &self.network
    }

    fn start(with_network: bool) -> Result<Containerd, String> {
        if !crate::skip::is_root() {
            return Err("containerd needs root".into());
        }
        let binary = crate::debian::ensure_installed("/usr/bin/containerd", "containerd")?;
        crate::debian::ensure_installed("/usr/sbin/runc", "runc")?;
        crate::debian::ensure_installed("/usr/lib/cni/bridge", "containernetworking-plugins")?;
        crate::debian::ensure_installed("/bin/busybox", "busybox-static")?;
        let dir = tempfile::Builder::new().prefix("rustlet-containerd-").tempdir().map_err(|e| e.to_string())?.keep();
        let socket = dir.join("containerd.sock");
        std::fs::create_dir_all(dir.join("cni")).map_err(|e| e.to_string())?;
        std::fs::create_dir_all(dir.join("certs.d")).map_err(|e| e.to_string())?;
        // A bridge of this containerd's own (its name and subnet from the
        // process id and a count, so that two containerds never share one).
        static STARTED: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let count = STARTED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let n = (std::process::id() * 7 + count * 53) % 230 + 20;
        let cni = serde_json::json!({
            "cniVersion": "0.4.0",
            "name": format!("rustlet-test-{n}"),
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": format!("rtl{n}"),
                    "isGateway": true,
                    "ipMasq": false,
                    "ipam": {"type": "host-local", "ranges": [[{"subnet": format!("10.{n}.0.0/24")}]], "dataDir": dir.join("cni-ipam").display().to_string()},
                },
                {"type": "portmap", "capabilities": {"portMappings": true}},
            ],
        });
        if with_network {
            std::fs::write(dir.join("cni/10-rustlet.conflist"), cni.to_string()).map_err(|e| e.to_string())?;
        }
        let config = format!(
            r#"version = 2
root = "{root}"
state = "{state}"
[grpc]
  address = "{socket}"
[ttrpc]
  address = "{socket}.ttrpc"
[plugins."io.containerd.grpc.v1.cri"]
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  sandbox_image = "{pause}"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{cni}"
  [plugins."io.containerd.grpc.v1.cri".registry]
    config_path = "{certs}"
"#,
            root = dir.join("root").display(),
            state = dir.join("state").display(),
            socket = socket.display(),
            cni = dir.join("cni").display(),
            certs = dir.join("certs.d").display(),
            pause = PAUSE_IMAGE,
        );
        let config_path = dir.join("config.toml");
        std::fs::write(&config_path, config).map_err(|e| e.to_string())?;
        let log = dir.join("containerd.log");
        let process = spawn(&binary, &config_path, &log)?;
        // When this test binary exits (its end of the pipe closes), in
        // order: container processes first (by their cgroups, named by the task
        // ids under the state dir), then containerd and its shims, then the
        // mounts under the dir (deepest first), the dir and the bridge.
        let cleanup = "for id in $(ls \"$1/state/io.containerd.runtime.v2.task/k8s.io\" 2>/dev/null); do \
              for procs in /sys/fs/cgroup/*/k8s.io/$id/cgroup.procs /sys/fs/cgroup/k8s.io/$id/cgroup.procs; do \
                [ -f \"$procs\" ] && kill -9 $(cat \"$procs\") 2>/dev/null; \
              done; \
            done; \
            kill -9 \"$0\" 2>/dev/null; pkill -9 -f \"$1/config.toml\" 2>/dev/null; \
            pkill -9 -f \"address $1/containerd.sock\" 2>/dev/null; sleep 0.2; \
            grep -F \" $1\" /proc/self/mounts | cut -d' ' -f2 | sort -r | \
            while read -r m; do umount -l \"$m\" 2>/dev/null; done; rm -rf \"$1\"; ip link del \"$2\" 2>/dev/null";
        let (lifeline, watcher) = crate::process::when_this_process_exits(
            cleanup,
            &[process.id().to_string(), dir.display().to_string(), format!("rtl{n}")],
        );
        let mut containerd = Containerd {
            dir,
            socket,
            binary,
            config_path,
            log,
            process,
            starts: 1,
            network: cni.to_string(),
            _lifeline: lifeline,
            _watcher: watcher,
        };
        containerd.wait_ready()?;
        containerd.import_pause()?;
        Ok(containerd)
    }

    /// A containerd of the caller's own (to stop and start again), unlike
    /// [`Containerd::shared`]; `None` (after printing why `test` skips)
    /// when it cannot run here and `RUSTLET_REQUIRE_CONTAINERD` is not `1`.
    pub fn private(test: &str) -> Option<Containerd> {
        or_skip(test, Containerd::start(true))
    }

    /// Stops containerd (its shims and containers go on, as when the
    /// service stops).
    pub fn stop(&mut self) {
        let _ = Command::new("kill").arg(self.process.id().to_string()).status();
        let _ = self.process.wait();
    }

    /// Starts containerd again, with the same config and state.
    pub fn restart(&mut self) -> Result<(), String> {
        self.starts += 1;
        self.log = self.dir.join(format!("containerd-{}.log", self.starts));
        self.process = spawn(&self.binary, &self.config_path, &self.log)?;
        self.wait_ready()
    }

    fn wait_ready(&mut self) -> Result<(), String> {
        let log = self.log.clone();
        let started = Instant::now();
        // The log line is containerd's own word that it serves; a liveness
        // bound, checked on every change of the log.
        let deadline = Duration::from_secs(60);
        loop {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            if text.contains("containerd successfully booted") && self.socket.exists() {
                eprintln!("containerd ready in {:?} ({})", started.elapsed(), self.dir.display());
                return Ok(());
            }
            if let Ok(Some(status)) = self.process.try_wait() {
                return Err(format!("containerd exited ({status}): {}", tail(&text)));
            }
            if started.elapsed() > deadline {
                return Err(format!("containerd not ready within {deadline:?}: {}", tail(&text)));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Imports the pause image (busybox running [`PAUSE_SCRIPT`]) as
    /// [`PAUSE_IMAGE`] into the CRI's namespace, so that no sandbox pulls.
    fn import_pause(&self) -> Result<(), String> {
        let archive = self.dir.join("pause.tar");
        let bytes = busybox_archive(PAUSE_IMAGE, &["/bin/sh", "-c", PAUSE_SCRIPT], &[])?;
        std::fs::write(&archive, bytes).map_err(|e| e.to_string())?;
        let output = Command::new("ctr")
            .arg("--address")
            .arg(&self.socket)
            .args(["--namespace", "k8s.io", "images", "import", "--platform", "linux/amd64"])
            .arg(&archive)
            .output()
            .map_err(|e| format!("ctr: {e}"))?;
        if output.status.success() {
            Ok(())
        } else {
            Err(format!("ctr images import: {}", String::from_utf8_lossy(&output.stderr).trim()))
        }
    }

    /// The CRI endpoint (`unix://…`).
    pub fn endpoint(&self) -> String {
        format!("unix://{}", self.socket.display())
    }

    /// The socket's path.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// containerd's log since its last start (for failure messages).
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Lets containerd pull from the registry at `host` (`127.0.0.1:port`)
    /// over plain HTTP.
    pub fn trust_registry(&self, host: &str) {
        let dir = self.dir.join("certs.d").join(host);
        std::fs::create_dir_all(&dir).expect("certs.d");
        let hosts = format!(
            "server = \"http://{host}\"\n\n[host.\"http://{host}\"]\n  capabilities = [\"pull\", \"resolve\"]\n"
        );
        std::fs::write(dir.join("hosts.toml"), hosts).expect("hosts.toml");
    }
}

/// The containerd, or `None` after saying why `test` skips (a panic when
/// `RUSTLET_REQUIRE_CONTAINERD=1`).
fn or_skip<T>(test: &str, started: Result<T, String>) -> Option<T> {
    crate::skip::or_skip(test, crate::skip::Need::Containerd, started)
}

/// Starts `binary --config config_path`, its output in `log`.
fn spawn(binary: &Path, config_path: &Path, log: &Path) -> Result<Child, String> {
    let log_file = std::fs::File::create(log).map_err(|e| e.to_string())?;
    let err_file = log_file.try_clone().map_err(|e| e.to_string())?;
    Command::new(binary)
        .arg("--config")
        .arg(config_path)
        .stdin(Stdio::null())
        .stdout(log_file)
        .stderr(err_file)
        .spawn()
        .map_err(|e| format!("cannot start containerd: {e}"))
}

fn tail(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(10)..].join("\n")
}

/// The busybox applets the test images link.
const APPLETS: &[&str] = &[
    "sh", "sleep", "echo", "cat", "ls", "env", "true", "false", "test", "id", "hostname", "kill", "wc", "grep", "head",
    "printf", "mkdir", "touch", "dd", "nc", "wget", "ip", "date", "httpd", "rm", "stat", "readlink", "ps", "mount",
    "umount",
];

/// An uncompressed layer tar: Debian's static busybox at `/bin/busybox`,
/// its applets linked in `/bin`, and an `/etc/passwd`.
pub fn busybox_layer() -> Result<Vec<u8>, String> {
    let busybox = std::fs::read("/bin/busybox").map_err(|e| format!("/bin/busybox: {e}"))?;
    let mut tar = tar::Builder::new(Vec::new());
    for name in ["bin", "etc", "tmp", "proc", "sys", "dev"] {
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(tar::EntryType::Directory);
        header.set_mode(0o755);
        header.set_size(0);
        header.set_cksum();
        tar.append_data(&mut header, name, std::io::empty()).map_err(|e| e.to_string())?;
    }
    let mut header = tar::Header::new_gnu();
    header.set_size(busybox.len() as u64);
    header.set_mode(0o755);
    header.set_cksum();
    tar.append_data(&mut header, "bin/busybox", busybox.as_slice()).map_err(|e| e.to_string())?;
    for applet in APPLETS {
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(tar::EntryType::Symlink);
        header.set_mode(0o777);
        header.set_size(0);
        tar.append_link(&mut header, format!("bin/{applet}"), "busybox").map_err(|e| e.to_string())?;
    }
    let passwd = b"root:x:0:0:root:/:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n";
    let mut header = tar::Header::new_gnu();
    header.set_size(passwd.len() as u64);
    header.set_mode(0o644);
    header.set_cksum();
    tar.append_data(&mut header, "etc/passwd", passwd.as_slice()).map_err(|e| e.to_string())?;
    tar.into_inner().map_err(|e| e.to_string())
}

/// A linux/amd64 image config with `PATH=/bin`, `entrypoint` (empty: none)
/// and `cmd`.
fn image_config(entrypoint: &[&str], cmd: &[&str]) -> serde_json::Value {
    serde_json::json!({
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Env": ["PATH=/bin"],
            "Entrypoint": if entrypoint.is_empty() { serde_json::Value::Null } else { serde_json::json!(entrypoint) },
            "Cmd": cmd,
        },
    })
}

/// Pushes the busybox image ([`busybox_layer`], `entrypoint`, `cmd`) to
/// `registry` as `repository:tag`; returns the reference to pull.
pub async fn push_busybox(
    registry: &crate::registry::Registry,
    repository: &str,
    tag: &str,
    entrypoint: &[&str],
    cmd: &[&str],
) -> Result<String, String> {
    registry.push_layer_image(repository, tag, busybox_layer()?, image_config(entrypoint, cmd)).await?;
    Ok(registry.reference(repository, tag))
}

/// An OCI image layout, as a tar, holding the busybox layer with
/// `entrypoint` and `cmd`, named `name` (for `ctr images import`).
fn busybox_archive(name: &str, entrypoint: &[&str], cmd: &[&str]) -> Result<Vec<u8>, String> {
    let digest = rustlet_wasi::store::digest_of;
    let layer = busybox_layer()?;
    let mut config = image_config(entrypoint, cmd);
    config["rootfs"] = serde_json::json!({"type": "layers", "diff_ids": [digest(&layer)]});
    let config = serde_json::to_vec(&config).map_err(|e| e.to_string())?;
    let manifest = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": digest(&config), "size": config.len()},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": digest(&layer), "size": layer.len()}],
    }))
    .map_err(|e| e.to_string())?;
    let index = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": digest(&manifest),
            "size": manifest.len(),
            "platform": {"architecture": "amd64", "os": "linux"},
            "annotations": {"io.containerd.image.name": name, "org.opencontainers.image.ref.name": name.rsplit(':').next().unwrap_or("latest")},
        }],
    }))
    .map_err(|e| e.to_string())?;
    let mut tar = tar::Builder::new(Vec::new());
    let mut add = |path: String, bytes: &[u8]| {
        let mut header = tar::Header::new_gnu();
        header.set_size(bytes.len() as u64);
        header.set_mode(0o644);
        header.set_cksum();
        tar.append_data(&mut header, path, bytes).map_err(|e| e.to_string())
    };
    add("oci-layout".into(), br#"{"imageLayoutVersion":"1.0.0"}"#)?;
    add("index.json".into(), &index)?;
    for blob in [&layer, &config, &manifest] {
        add(format!("blobs/sha256/{}", digest(blob).trim_start_matches("sha256:")), blob)?;
    }
    tar.into_inner().map_err(|e| e.to_string())
}
