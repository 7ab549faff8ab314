//! The `rustlet` binary as a user runs it: flags, start-up errors, the HTTP
//! endpoint, signals and the demo. Plugins are real servers on real sockets.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use rustlet_testkit::csi_driver::{CsiDriverConfig, RegisteredCsiDriver};
use rustlet_testkit::node_process::{NodeProcess, SOON, http_get as get, http_get_raw, local_socket};
use rustlet_testkit::other_user::{NOBODY, ReachableBinary};
use rustlet_testkit::report::{Report, Reporter};
use rustlet_testkit::skip::Need;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

fn rustlet() -> Command {
    rustlet_at(Path::new(env!("CARGO_BIN_EXE_rustlet")))
}

/// The binary at `program` (a copy of it), as [`rustlet`] runs it.
fn rustlet_at(program: &Path) -> Command {
    let mut cmd = Command::new(program);
    cmd.env("RUSTLET_LOG", "info").env_remove("RUSTLET_ROOT_DIR").kill_on_drop(true);
    cmd
}

/// A running `rustlet` with `args`.
fn running(args: &[&str]) -> NodeProcess {
    let mut command = rustlet();
    command.args(args);
    NodeProcess::start(command)
}

fn start_csi_driver(root: &Path, name: &str, reports: mpsc::UnboundedSender<Report>) -> CancellationToken {
    let stop = CancellationToken::new();
    let endpoint = root.join("plugins").join(name).join("csi.sock");
    let config = CsiDriverConfig { name: name.into(), node_id: "cli-node".into(), ..Default::default() };
    let socket = root.join("plugins_registry").join(format!("{name}.sock"));
    RegisteredCsiDriver::new(socket, &endpoint, config)
        .spawn(Reporter::Channel(reports), stop.clone())
        .expect("driver");
    stop
}

#[tokio::test]
async fn standalone_node_registers_plugins_and_serves_healthz_metrics_and_status() {
    let root = tempfile::tempdir().expect("tempdir");
    let root_str = root.path().to_str().expect("utf8");
    let mut node =
        running(&["--standalone", "--root-dir", root_str, "--healthz-port", "0", "--port", "0", "--node-name", "n1"]);
    let address = node.http_address().await;
    assert_eq!(get(&address, "/healthz").await, (200, "ok".to_owned()));

    let (tx, mut reports) = mpsc::unbounded_channel();
    let _driver = start_csi_driver(root.path(), "cli.csi.example.com", tx);
    let line = node.line_with("plugin registered").await;
    assert!(line.contains("plugin=cli.csi.example.com"), "{line}");
    let first_report = tokio::time::timeout(SOON, reports.recv()).await.expect("in time");
    assert!(matches!(first_report, Some(Report::GetInfo { .. })), "the node asked the plugin who it is");

    let (code, metrics) = get(&address, "/metrics").await;
    assert_eq!(code, 200);
    let socket = root.path().join("plugins_registry/cli.csi.example.com.sock");
    for state in ["actual_state_of_world", "desired_state_of_world"] {
        let series =
            format!("plugin_manager_total_plugins{{socket_path=\"{}\",state=\"{state}\"}} 1", socket.display());
        assert!(metrics.contains(&series), "missing {series} in:\n{metrics}");
    }
    assert!(metrics.contains("rustlet_plugin_manager_operations_total{operation=\"register\",result=\"success\"} 1"));
    // The device manager's families are served too (the ones labelled by
    // resource appear with their first resource: tests/device_manager.rs).
    assert!(
        metrics.contains("# TYPE rustlet_device_checkpoint_write_duration_seconds histogram"),
        "device manager metrics missing in:\n{metrics}"
    );

    // The health port serves /healthz and /metrics only: what the node
    // knows of its pods (env values, logs) is not for any local user.
    for path in ["/status", "/pods", "/node", "/containerLogs/default/p/c", "/configz"] {
        assert_eq!(get(&address, path).await.0, 404, "{path} on the health port");
    }
    let local = local_socket(root.path());
    {
        use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
        let meta = std::fs::symlink_metadata(&local).expect("the local socket");
        assert_eq!(meta.permissions().mode() & 0o777, 0o600, "the local socket is for its owner only");
        assert_eq!(meta.uid(), own_uid(), "owned by the node's user");
    }
    assert_eq!(get(&local, "/healthz").await, (200, "ok".to_owned()));
    let (code, status) = get(&local, "/status").await;
    assert_eq!(code, 200);
    let status: serde_json::Value = serde_json::from_str(&status).expect("json");
    assert_eq!(status["nodeName"], "n1");
    assert!(status["extendedResources"].is_object(), "{status}");
    assert!(root.path().join("device-plugins/kubelet.sock").exists(), "the device manager serves kubelet.sock");
    assert_eq!(status["plugins"][0]["state"], "Registered");
    assert_eq!(status["plugins"][0]["socketPath"], socket.display().to_string());
    assert_eq!(status["plugins"][0]["plugin"]["pluginType"], "CSIPlugin");
    assert_eq!(status["csiDrivers"][0]["name"], "cli.csi.example.com");
    assert_eq!(
        status["csiNode"]["annotations"]["csi.volume.kubernetes.io/nodeid"],
        r#"{"cli.csi.example.com":"cli-node"}"#
    );
}

/// This process's user (the owner of a file it creates), which is the
/// user of the nodes it starts.
fn own_uid() -> u32 {
    use std::os::unix::fs::MetadataExt as _;
    let probe = tempfile::NamedTempFile::new().expect("probe");
    probe.as_file().metadata().expect("metadata").uid()
}

/// The local socket serves only root and the node's own user, whatever its
/// file mode: a socket an operator opened up (0666) still refuses a
/// connection from another user, which the node logs and counts. Skipped
/// when the tests do not run as root (another user cannot be taken then).
#[tokio::test]
async fn the_local_socket_refuses_other_users_even_when_its_mode_lets_them_in() {
    use std::os::unix::fs::PermissionsExt as _;
    const TEST: &str = "the_local_socket_refuses_other_users_even_when_its_mode_lets_them_in";
    if own_uid() != 0 {
        return rustlet_testkit::skip::skip(TEST, Need::Root, "running a client as another user needs root");
    }
    let root = tempfile::tempdir().expect("tempdir");
    let root_dir = root.path().to_str().expect("utf8").to_owned();
    let mut node = running(&["--standalone", "--root-dir", &root_dir, "--healthz-port", "0", "--port", "0"]);
    let address = node.http_address().await;
    let local = local_socket(root.path());
    std::fs::set_permissions(root.path(), std::fs::Permissions::from_mode(0o711)).expect("chmod root dir");
    std::fs::set_permissions(&local, std::fs::Permissions::from_mode(0o666)).expect("chmod socket");
    let binary = ReachableBinary::new(Path::new(env!("CARGO_BIN_EXE_rustlet"))).expect("a copy uid 65534 reaches");
    let mut stranger = rustlet_at(binary.path());
    stranger.args(["get", "pods", "--root-dir", &root_dir]).uid(NOBODY).gid(NOBODY);
    let output = tokio::time::timeout(SOON, stranger.output()).await.expect("in time").expect("run");
    assert!(!output.status.success(), "uid 65534 read the node's pods");
    let line = node.line_with("local socket: refused a connection").await;
    assert!(line.contains("uid=65534"), "{line}");
    let (_, metrics) = get(&address, "/metrics").await;
    assert!(metrics.contains("rustlet_local_socket_refused_total 1"), "{metrics}");
    // Root still reads it.
    let (ok, _, stderr) = run_cli(&["get", "pods", "--root-dir", &root_dir]).await;
    assert!(ok && stderr.contains("No resources found"), "{stderr}");
}

/// The same, from a build directory no other user may enter (a checkout
/// under a 0700 home): the client another user runs is a copy it reaches.
#[test]
fn the_local_socket_test_passes_behind_a_directory_other_users_cannot_enter() {
    rustlet_testkit::other_user::rerun_behind_a_closed_directory(
        "the_local_socket_test_passes_behind_a_directory_other_users_cannot_enter",
        "the_local_socket_refuses_other_users_even_when_its_mode_lets_them_in",
    );
}

/// `/healthz` names a failing component and `/healthz/<check>` answers for
/// one, as the kubelet's do: here the registration directory is replaced by
/// a file, so it cannot be recreated and watched, until the file goes and
/// the node makes and watches a new directory.
#[tokio::test]
async fn healthz_names_a_failing_component_until_it_recovers() {
    let root = tempfile::tempdir().expect("tempdir");
    let args = [
        "--standalone",
        "--root-dir",
        root.path().to_str().expect("utf8"),
        "--healthz-port",
        "0",
        "--port",
        "0",
        "--plugin-resync-period",
        "1s",
    ];
    let mut node = running(&args);
    let address = node.http_address().await;
    let (code, body) = get(&address, "/healthz?verbose").await;
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("[+]plugin-manager ok") && body.contains("[+]signal-handler ok"), "{body}");
    assert!(body.ends_with("healthz check passed\n"), "{body}");
    assert_eq!(get(&address, "/healthz/plugin-manager").await, (200, "ok".to_owned()));
    assert_eq!(get(&address, "/healthz/nope").await.0, 404);

    let registry = root.path().join("plugins_registry");
    // The node recreates a removed directory at once, so removing it and
    // writing the file is a race with the node; it is run again until the
    // file wins (a bounded number of times, no waiting).
    let mut attempts = 0;
    while let Err(error) = std::fs::remove_dir(&registry).and_then(|()| std::fs::write(&registry, b"not a directory")) {
        attempts += 1;
        assert!(attempts < 10_000, "the node always recreated the directory first: {error}");
    }
    // (A recreation racing the removal may fail first for another reason;
    // the line of this one follows.)
    node.line_with("exists but is not a directory").await;
    let (code, body) = get(&address, "/healthz").await;
    assert_eq!(code, 500, "{body}");
    let want = format!(
        "[-]plugin-manager failed: plugin registration path {} exists but is not a directory",
        registry.display()
    );
    assert!(body.contains(&want), "{body}");
    assert!(body.contains("[+]signal-handler ok"), "{body}");
    assert!(body.ends_with("healthz check failed\n"), "{body}");
    let (code, body) = get(&address, "/healthz/plugin-manager").await;
    assert_eq!(code, 500);
    assert!(body.contains("exists but is not a directory"), "{body}");

    std::fs::remove_file(&registry).expect("rm");
    let line = node.line_with("watching the plugin registration directory").await;
    let mut rest = Vec::new();
    while let Ok(more) = node.lines.try_recv() {
        rest.push(more);
    }
    assert_eq!(get(&address, "/healthz").await, (200, "ok".to_owned()), "after {line}\nthen {rest:#?}");
}

#[tokio::test]
async fn sigterm_stops_the_node_gracefully() {
    let root = tempfile::tempdir().expect("tempdir");
    let mut node = running(&[
        "--standalone",
        "--root-dir",
        root.path().to_str().expect("utf8"),
        "--healthz-port",
        "0",
        "--port",
        "0",
    ]);
    node.line_with("node started").await;
    let pid = node.child.id().expect("pid").to_string();
    let status = std::process::Command::new("kill").args(["-TERM", &pid]).status().expect("kill");
    assert!(status.success());
    node.line_with("plugin manager stopped").await;
    let exit = tokio::time::timeout(SOON, node.child.wait()).await.expect("exits in time").expect("wait");
    assert!(exit.success(), "{exit:?}");
}

#[tokio::test]
async fn registration_dir_that_is_a_file_is_a_clear_start_up_error() {
    let root = tempfile::tempdir().expect("tempdir");
    std::fs::write(root.path().join("plugins_registry"), b"oops").expect("write");
    let output = rustlet()
        .args(["--standalone", "--root-dir", root.path().to_str().expect("utf8"), "--healthz-port", "0", "--port", "0"])
        .output()
        .await
        .expect("run");
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    let want = format!(
        "error: cannot start the plugin manager under root dir {}: plugin registration path {}/plugins_registry exists but is not a directory",
        root.path().display(),
        root.path().display()
    );
    assert!(stderr.contains(&want), "{stderr}");
}

#[tokio::test]
async fn the_mode_must_be_chosen() {
    let root = tempfile::tempdir().expect("tempdir");
    let output = rustlet().args(["--root-dir", root.path().to_str().expect("utf8")]).output().await.expect("run");
    assert_eq!(output.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&output.stderr)
            .contains("say how the node runs: --standalone (no API server) or --kubeconfig FILE (join a cluster)"),
        "{output:?}"
    );
    let output = rustlet().args(["--standalone", "--kubeconfig", "/nonexistent"]).output().await.expect("run");
    assert_eq!(output.status.code(), Some(2), "both modes at once is a usage error");
    assert!(String::from_utf8_lossy(&output.stderr).contains("cannot be used with"), "{output:?}");
}

/// Reservations and the hard eviction thresholds come off capacity in the
/// Node's allocatable (what `rustlet get node` shows and admission uses);
/// a resource that cannot be reserved or a bad threshold stops the start
/// with the flag named.
#[tokio::test]
async fn allocatable_is_capacity_less_reservations_and_hard_thresholds() {
    let root = tempfile::tempdir().expect("tempdir");
    let dir = root.path().to_str().expect("utf8");
    let mut node = running(&[
        "--standalone",
        "--root-dir",
        dir,
        "--healthz-port",
        "0",
        "--port",
        "0",
        "--system-reserved",
        "cpu=500m,memory=1Gi",
        "--kube-reserved",
        "memory=512Mi,ephemeral-storage=1Mi",
        "--eviction-hard",
        "memory.available<100Mi,nodefs.available<10%",
    ]);
    node.line_with("node started").await;
    let (code, body) = get(&local_socket(root.path()), "/node").await;
    assert_eq!(code, 200, "{body}");
    let object: serde_json::Value = serde_json::from_str(&body).expect("json");
    let kib = |map: &str, resource: &str| -> u128 {
        let text = object["status"][map][resource].as_str().unwrap_or_else(|| panic!("{map}.{resource}: {object}"));
        match text.strip_suffix("Ki") {
            Some(kib) => kib.parse::<u128>().expect("KiB"),
            None => text.parse::<u128>().expect("bytes") / 1024,
        }
    };
    let milli = |map: &str| -> u128 {
        let text = object["status"][map]["cpu"].as_str().expect("cpu");
        text.strip_suffix('m').map_or_else(|| text.parse::<u128>().expect("cpus") * 1000, |m| m.parse().expect("m"))
    };
    assert_eq!(milli("capacity") - milli("allocatable"), 500);
    assert_eq!(kib("capacity", "memory") - kib("allocatable", "memory"), (1 << 20) + (512 << 10) + (100 << 10));
    let storage = kib("capacity", "ephemeral-storage");
    let held = storage - kib("allocatable", "ephemeral-storage");
    // 1Mi and a tenth of the file system (rounded to whole KiB).
    assert!(held.abs_diff(1024 + storage / 10) <= 1, "held {held} KiB of {storage} KiB");

    for (flag, value, said) in [
        ("--system-reserved", "nvidia.com/gpu=1", "--system-reserved: cannot reserve \"nvidia.com/gpu\" resource"),
        ("--kube-reserved", "memory=lots", "--kube-reserved: memory=lots: not a quantity"),
        ("--eviction-hard", "memory.free<1Gi", "--eviction-hard: unknown eviction signal \"memory.free\""),
    ] {
        let output = rustlet().args(["--standalone", "--root-dir", dir, flag, value]).output().await.expect("run");
        assert_eq!(output.status.code(), Some(1), "{output:?}");
        assert!(String::from_utf8_lossy(&output.stderr).contains(said), "{flag}: {output:?}");
    }
}

/// Resource-management settings that cannot be stop the start with the
/// flag named: those the flag parser refuses (exit 2) and those the node
/// refuses (exit 1).
#[tokio::test]
async fn bad_resource_settings_are_refused_by_name() {
    let root = tempfile::tempdir().expect("tempdir");
    let dir = root.path().to_str().expect("utf8");
    for (args, code, said) in [
        (&["--container-log-max-files", "1"][..], 2, "--container-log-max-files"),
        (&["--container-log-max-size", "lots"], 2, "--container-log-max-size"),
        (&["--cgroup-driver", "upstart"], 2, "invalid value 'upstart' for '--cgroup-driver"),
        (&["--image-gc-high-threshold", "101"], 2, "--image-gc-high-threshold"),
        (
            &["--image-gc-high-threshold", "70", "--image-gc-low-threshold", "80"],
            1,
            "--image-gc-low-threshold (80) must be below --image-gc-high-threshold (70)",
        ),
        (&["--enforce-node-allocatable", "pods,memory"], 1, "--enforce-node-allocatable: unknown value \"memory\""),
        (&["--enforce-node-allocatable", "none,pods"], 1, "--enforce-node-allocatable: none must be the only value"),
        (
            &["--eviction-soft", "memory.available<1Gi"],
            1,
            "grace period must be specified for the soft eviction threshold memory.available",
        ),
    ] {
        let output = rustlet()
            // No cgroups made: every setting is checked before anything is.
            .args(["--standalone", "--root-dir", dir, "--cgroups-per-qos=false"])
            .args(["--container-runtime-endpoint", "unix:///nonexistent.sock"])
            .args(args)
            .output()
            .await
            .expect("run");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(code), "{args:?}: {stderr}");
        assert!(stderr.contains(said), "{args:?}: {stderr}");
    }
}

/// The flags of kubeadm's `kubeadm-flags.env`.
fn kubeadm_flags() -> Vec<String> {
    let env = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/kubeadm/kubeadm-flags.env"))
        .expect("kubeadm-flags.env");
    let line = env.lines().find_map(|l| l.strip_prefix("KUBELET_KUBEADM_ARGS=")).expect("KUBELET_KUBEADM_ARGS");
    line.trim_matches('"').split_whitespace().map(str::to_owned).collect()
}

/// The node started as kubeadm starts a kubelet: the kubeconfigs,
/// `--config` with kubeadm's `config.yaml`, then kubeadm's flags (node name, node IP, runtime
/// endpoint, pause image), then the test's own flags (a root dir, free
/// ports, a manifest dir of its own: flags on the command line win over
/// the file). The node says what it took from the file and which fields it
/// ignores, and it runs as `cp1` on `192.0.2.10`.
#[tokio::test]
async fn kubeadms_config_file_and_flags_start_the_node() {
    let root = tempfile::tempdir().expect("tempdir");
    let dir = root.path().to_str().expect("utf8");
    let manifests = root.path().join("manifests");
    std::fs::create_dir(&manifests).expect("mkdir");
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/kubeadm/config.yaml");
    // The drop-in's kubeconfigs (missing here: the node retries them while
    // its own parts run), then `--config`, then kubeadm's flags.
    let mut args: Vec<String> = vec![
        format!("--bootstrap-kubeconfig={dir}/bootstrap-kubelet.conf"),
        format!("--kubeconfig={dir}/kubelet.conf"),
        format!("--config={config}"),
    ];
    args.extend(kubeadm_flags());
    args.extend(["--root-dir", dir, "--healthz-port", "0", "--port", "0"].map(String::from));
    args.extend(["--pod-manifest-path".to_owned(), manifests.display().to_string()]);
    // kubeadm's CA is not on this machine; the test's own wins.
    let ca = root.path().join("ca.crt");
    std::fs::write(&ca, rustlet_testkit::https::throwaway_ca_pem()).expect("ca");
    args.push(format!("--client-ca-file={}", ca.display()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut node = running(&args);
    let read = node.line_with("settings from the configuration file").await;
    for applied in [
        "--cgroup-driver=systemd",
        "--cluster-dns=10.96.0.10",
        "--cluster-domain=cluster.local",
        "--rotate-certificates=true",
        "--healthz-bind-address=127.0.0.1",
        "--authentication-token-webhook=true",
        "--authorization-mode=Webhook",
    ] {
        assert!(read.contains(applied), "{applied} not applied: {read}");
    }
    for overridden in ["--healthz-port=10248", "--pod-manifest-path=/etc/kubernetes/manifests"] {
        let (_, after) = read.split_once("overridden_by_flags").expect("overridden list");
        assert!(after.contains(overridden), "{overridden} not overridden: {read}");
    }
    let ignored = node.line_with("KubeletConfiguration fields that Rustlet does not implement").await;
    for field in ["cpuManagerReconcilePeriod", "logging", "memorySwap", "shutdownGracePeriod", "syncFrequency"] {
        assert!(ignored.contains(field), "{field} not listed: {ignored}");
    }
    assert!(!ignored.contains("staticPodPath") && !ignored.contains("clusterDNS"), "{ignored}");
    node.line_with("--pod-infra-container-image: kept from image garbage collection").await;
    node.line_with("node started").await;
    let (code, body) = get(&local_socket(root.path()), "/node").await;
    assert_eq!(code, 200, "{body}");
    let object: serde_json::Value = serde_json::from_str(&body).expect("json");
    assert_eq!(object["metadata"]["name"], "cp1", "--hostname-override");
    assert_eq!(object["status"]["addresses"][0]["address"], "192.0.2.10", "--node-ip");
}

/// A file's settings reach the node (pods, reservations, thresholds), a
/// flag beats the file, and a file that is not a KubeletConfiguration or
/// holds a bad value stops the start with the file and the field named.
#[tokio::test]
async fn a_config_file_sets_the_node_and_flags_win() {
    let root = tempfile::tempdir().expect("tempdir");
    let dir = root.path().to_str().expect("utf8");
    let file = root.path().join("config.json");
    let config = serde_json::json!({
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "maxPods": 7,
        "systemReserved": {"memory": "1Gi"},
        "evictionHard": {"memory.available": "200Mi"},
        "healthzPort": 10248,
    });
    std::fs::write(&file, config.to_string()).expect("write");
    let file_arg = format!("--config={}", file.display());
    // The file's thresholds, not the test machines' (an environment
    // variable, like a flag, would win over the file).
    let mut command = rustlet();
    command.args(["--standalone", &file_arg, "--root-dir", dir, "--healthz-port", "0", "--port", "0"]);
    command.env_remove("RUSTLET_EVICTION_HARD");
    let mut node = NodeProcess::start(command);
    let address = node.http_address().await;
    assert!(!address.ends_with(":10248"), "--healthz-port 0 beats the file's 10248: {address}");
    node.line_with("node started").await;
    let (_, body) = get(&local_socket(root.path()), "/node").await;
    let object: serde_json::Value = serde_json::from_str(&body).expect("json");
    assert_eq!(object["status"]["allocatable"]["pods"], "7");
    let kib = |map: &str| {
        object["status"][map]["memory"].as_str().and_then(|m| m.strip_suffix("Ki")).and_then(|m| m.parse::<u64>().ok())
    };
    assert_eq!(kib("capacity").zip(kib("allocatable")).map(|(c, a)| c - a), Some((1 << 20) + (200 << 10)));

    for (text, said) in [
        ("apiVersion: v1\nkind: Pod\n", "expected kubelet.config.k8s.io/v1beta1 KubeletConfiguration"),
        (
            "apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\nmaxPods: many\n",
            "maxPods: \"many\" is not a number",
        ),
        (
            "apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\ncgroupDriver: upstart\n",
            "invalid value 'upstart' for '--cgroup-driver",
        ),
    ] {
        let bad = root.path().join("bad.yaml");
        std::fs::write(&bad, text).expect("write");
        let output = rustlet()
            .args(["--standalone", &format!("--config={}", bad.display()), "--root-dir", dir])
            .output()
            .await
            .expect("run");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{stderr}");
        assert!(stderr.contains(&bad.display().to_string()) && stderr.contains(said), "{said}: {stderr}");
    }
    let missing = rustlet().args(["--standalone", "--config=/nonexistent/config.yaml"]).output().await.expect("run");
    assert_eq!(missing.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&missing.stderr).contains("cannot read /nonexistent/config.yaml"), "{missing:?}");
}

#[tokio::test]
async fn bad_durations_are_refused_by_the_flag_parser() {
    let output =
        rustlet().args(["--standalone", "--plugin-get-info-timeout", "5 parsecs"]).output().await.expect("run");
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("is not a duration such as 500ms"), "{output:?}");
    let output = rustlet().args(["--standalone", "--plugin-get-info-timeout", "25h"]).output().await.expect("run");
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("must be between 1ms and 24h"), "{output:?}");
}

/// Whether `line` is a record of the node's log, text or JSON, at any
/// level: `2026-11-27T18:00:00.000000Z  WARN target: message` or
/// `{"timestamp":...`.
fn looks_like_a_log_line(line: &str) -> bool {
    // Colours (`ESC [ ... m`) left out: a terminal's log lines have them.
    let mut plain = String::new();
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            chars.by_ref().find(|&c| c == 'm');
        } else {
            plain.push(c);
        }
    }
    let line = plain.trim_start();
    let timestamped =
        line.len() > 20 && line.as_bytes()[..4].iter().all(u8::is_ascii_digit) && line.as_bytes()[4] == b'-';
    let leveled =
        ["TRACE", "DEBUG", "INFO", "WARN", "ERROR"].iter().any(|level| line.split_whitespace().nth(1) == Some(level));
    (timestamped && leveled) || line.starts_with("{\"timestamp\"")
}

#[test]
fn log_lines_are_told_from_the_story() {
    assert!(looks_like_a_log_line("2026-11-27T18:00:00.123456Z  WARN kubelet::node: slow start"));
    assert!(looks_like_a_log_line("2026-11-27T18:00:00.123456Z ERROR x: y"));
    assert!(looks_like_a_log_line(r#"{"timestamp":"2026-11-27T18:00:00Z","level":"INFO"}"#));
    assert!(looks_like_a_log_line("\u{1b}[2m2026-11-27T18:00:00.123456Z\u{1b}[0m \u{1b}[32m INFO\u{1b}[0m x: y"));
    assert!(!looks_like_a_log_line("-> registered CSIPlugin plugin hostpath.csi.rustlet.dev"));
    assert!(!looks_like_a_log_line("2 pods ran; the WARN in a story line is not a record"));
}

/// The README's first command as a newcomer runs it (no `RUSTLET_LOG`):
/// the story alone on the screen, the node's log in the file it names.
#[tokio::test]
async fn the_demo_tells_its_story_and_keeps_the_log_in_a_file() {
    let output = tokio::time::timeout(SOON * 2, rustlet().env_remove("RUSTLET_LOG").args(["demo", "--once"]).output())
        .await
        .expect("demo finishes")
        .expect("run");
    let (stdout, stderr) = (String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    assert!(output.status.success(), "{stdout}\n{stderr}");
    let first = stdout.lines().next().unwrap_or_default();
    let path = first
        .strip_prefix("Rustlet demo: the node's log goes to ")
        .and_then(|rest| rest.split(" (").next())
        .unwrap_or_else(|| panic!("the first line names the log file: {first:?}"));
    assert!(stdout.contains("-> registered CSIPlugin plugin hostpath.csi.rustlet.dev"), "{stdout}");
    let log_lines: Vec<&str> = stdout.lines().chain(stderr.lines()).filter(|l| looks_like_a_log_line(l)).collect();
    assert!(log_lines.is_empty(), "no log lines on the screen: {log_lines:#?}\n{stdout}\n{stderr}");
    let log = std::fs::read_to_string(path).expect("the log file");
    let _ = std::fs::remove_file(path);
    assert!(log.contains("plugin registered"), "{log}");
}

/// The README's first command, in its `--once` form.
#[tokio::test]
async fn demo_runs_its_scenario_to_completion() {
    let output = tokio::time::timeout(SOON * 2, rustlet().args(["demo", "--once"]).output())
        .await
        .expect("demo finishes")
        .expect("run");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&output.stderr));
    for needle in [
        "-> registered CSIPlugin plugin hostpath.csi.rustlet.dev",
        "-> registered CSIPlugin plugin nfs.csi.rustlet.dev",
        "-> turned down, the plugin was told: no handler registered for plugin type: GadgetPlugin",
        "-> registered on kubelet.sock: capacity 3, allocatable 3",
        "-> gpu-1 reported unhealthy: capacity 3, allocatable 2",
        r#"-> pod demo-pod container app allocated ["gpu-0", "gpu-2"]"#,
        "-> pod removed: 2 devices freed",
        "-> claim default/demo-gpu prepared by the newest instance (v1-1): CDI devices [\"gpu.dra.rustlet.dev/device=gpu-0\"]",
        "-> the old instance stopped: the driver stays usable (true)",
        "-> claim released",
        "allocatable devices: gpu.rustlet.dev/demo gpu-0 (NUMA [0]); gpu.rustlet.dev/demo gpu-2 (NUMA [1])",
        "-> deregistered CSIPlugin plugin hostpath.csi.rustlet.dev",
        "demo complete",
    ] {
        assert!(stdout.contains(needle), "missing {needle:?} in:\n{stdout}");
    }
}

/// Runs `rustlet ARGS` to completion; returns (success, stdout, stderr).
async fn run_cli(args: &[&str]) -> (bool, String, String) {
    let output = tokio::time::timeout(SOON, rustlet().args(args).output()).await.expect("in time").expect("run");
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[tokio::test]
async fn get_and_logs_find_the_node_through_its_root_dir() {
    let root = tempfile::tempdir().expect("tempdir");
    let root_dir = root.path().to_str().expect("utf8").to_owned();
    let (ok, _, stderr) = run_cli(&["get", "pods", "--root-dir", &root_dir]).await;
    assert!(!ok && stderr.contains("cannot reach a node through"), "{stderr}");

    let manifests = root.path().join("manifests");
    std::fs::create_dir_all(&manifests).expect("mkdir");
    std::fs::write(
        manifests.join("pods.yaml"),
        "apiVersion: v1\nkind: Pod\nmetadata: {name: huge}\nspec:\n  containers:\n  - {name: main, image: x, resources: {requests: {cpu: '5000'}}}\n\
         ---\napiVersion: v1\nkind: Pod\nmetadata: {name: duo}\nspec:\n  containers: [{name: a, image: x}, {name: b, image: x}]\n",
    )
    .expect("write");
    let manifest_dir = manifests.to_str().expect("utf8").to_owned();
    let mut node = running(&[
        "--standalone",
        "--root-dir",
        &root_dir,
        "--pod-manifest-path",
        &manifest_dir,
        "--node-name",
        "Cli-Node",
        "--healthz-port",
        "0",
        "--port",
        "0",
    ]);
    node.lines_with_all(&["pod rejected", "node started"]).await;

    let (ok, table, stderr) = run_cli(&["get", "pods", "--root-dir", &root_dir]).await;
    assert!(ok, "{stderr}");
    let lines: Vec<&str> = table.lines().collect();
    assert!(
        lines[0].starts_with("NAME ") && lines[0].contains("READY   STATUS") && lines[0].ends_with("AGE"),
        "{table}"
    );
    let huge = lines.iter().find(|l| l.starts_with("huge-cli-node ")).expect("the rejected pod is listed");
    assert!(huge.contains(" 0/1 ") && huge.contains(" OutOfcpu "), "{table}");
    assert!(lines.iter().any(|l| l.starts_with("duo-cli-node ") && l.contains(" 0/2 ")), "{table}");

    let (ok, wide, _) = run_cli(&["get", "pods", "-o", "wide", "-A", "--root-dir", &root_dir]).await;
    assert!(ok && wide.lines().next().is_some_and(|h| h.starts_with("NAMESPACE ") && h.contains(" NODE ")), "{wide}");
    assert!(wide.contains(" Cli-Node "), "{wide}");
    let (ok, json, _) = run_cli(&["get", "pods", "huge-cli-node", "-o", "json", "--root-dir", &root_dir]).await;
    assert!(ok);
    let list: serde_json::Value = serde_json::from_str(&json).expect("json");
    assert_eq!(list["items"][0]["status"]["reason"], "OutOfcpu");
    let (ok, _, stderr) = run_cli(&["get", "pods", "nope", "--root-dir", &root_dir]).await;
    assert!(!ok && stderr.contains("pods \"nope\" not found"), "{stderr}");

    let (ok, node_table, _) = run_cli(&["get", "node", "--root-dir", &root_dir]).await;
    assert!(ok);
    let row = node_table.lines().nth(1).expect("a row");
    assert!(row.starts_with("Cli-Node ") && row.contains(" Ready "), "{node_table}");
    let (ok, node_json, _) = run_cli(&["get", "no", "-o", "json", "--root-dir", &root_dir]).await;
    assert!(ok);
    let node_object: serde_json::Value = serde_json::from_str(&node_json).expect("json");
    assert_eq!(node_object["kind"], "Node");
    assert_eq!(node_object["status"]["capacity"]["pods"], "110");

    // Logs: a container must be named when there are several; this node has
    // no provider, so there are none yet.
    let (ok, _, stderr) = run_cli(&["logs", "duo-cli-node", "--root-dir", &root_dir]).await;
    assert!(
        !ok && stderr.contains("a container name must be specified for pod duo-cli-node, choose one of: [a b]"),
        "{stderr}"
    );
    let (ok, _, stderr) = run_cli(&["logs", "duo-cli-node", "-c", "a", "--root-dir", &root_dir]).await;
    assert!(!ok && stderr.contains("has no logs yet"), "{stderr}");
    let (ok, _, stderr) = run_cli(&["logs", "duo-cli-node", "-c", "zzz", "--root-dir", &root_dir]).await;
    assert!(!ok && stderr.contains("container zzz is not valid for pod duo-cli-node"), "{stderr}");
    // A log written in the CRI format is served as text.
    let uid = list["items"][0]["metadata"]["uid"].as_str().expect("uid").to_owned();
    let (ok, duo_json, _) = run_cli(&["get", "pods", "duo-cli-node", "-o", "json", "--root-dir", &root_dir]).await;
    assert!(ok);
    let duo: serde_json::Value = serde_json::from_str(&duo_json).expect("json");
    let duo_uid = duo["items"][0]["metadata"]["uid"].as_str().expect("uid");
    assert_ne!(duo_uid, uid);
    let dir = root.path().join(format!("logs/pods/default_duo-cli-node_{duo_uid}/a"));
    std::fs::create_dir_all(&dir).expect("mkdir");
    std::fs::write(dir.join("0.log"), "2026-01-01T00:00:00Z stdout F first\n2026-01-01T00:00:01Z stderr F second\n")
        .expect("write");
    let (ok, text, stderr) = run_cli(&["logs", "duo-cli-node", "-c", "a", "--root-dir", &root_dir]).await;
    assert!(ok, "{stderr}");
    assert_eq!(text, "first\nsecond\n");
    let (ok, text, _) = run_cli(&["logs", "duo-cli-node", "-c", "a", "--tail", "1", "--root-dir", &root_dir]).await;
    assert!(ok);
    assert_eq!(text, "second\n");
    // As the kubelet answers an HTTP/1.1 client: chunked, no Content-Length
    // (the API server's WebSocket log copier drops a body that ends in the
    // same read as it arrives).
    let address = local_socket(root.path());
    let answer = http11_get(&address, "/containerLogs/default/duo-cli-node/a").await;
    let (head, body) = answer.split_once("\r\n\r\n").expect("an HTTP answer");
    let head = head.to_ascii_lowercase();
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert!(head.contains("transfer-encoding: chunked") && !head.contains("content-length"), "{head}");
    assert!(body.contains("first\nsecond\n"), "{body:?}");
    // A log that never ends (a FIFO its writer keeps open) is still
    // answered for `limitBytes`: the node reads as it sends and stops at
    // the limit, instead of reading the whole log first.
    let endless_dir = root.path().join(format!("logs/pods/default_duo-cli-node_{duo_uid}/b"));
    std::fs::create_dir_all(&endless_dir).expect("mkdir");
    let endless = endless_dir.join("0.log");
    let made = std::process::Command::new("mkfifo").arg(&endless).status().expect("mkfifo");
    assert!(made.success());
    // Detached: it ends when the node closes the pipe (EPIPE).
    std::thread::spawn(move || {
        use std::io::Write as _;
        let Ok(mut pipe) = std::fs::OpenOptions::new().write(true).open(&endless) else { return };
        while pipe.write_all(b"2026-01-01T00:00:00Z stdout F hello world\n").is_ok() {}
    });
    let answer = http11_get(&address, "/containerLogs/default/duo-cli-node/b?limitBytes=5").await;
    let (head, body) = answer.split_once("\r\n\r\n").expect("an HTTP answer");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(body.contains("hello") && !body.contains("hello w"), "{body:?}");
}

/// One HTTP/1.1 GET of `path` at `address`; the whole answer, raw.
async fn http11_get(address: &str, path: &str) -> String {
    String::from_utf8_lossy(&http_get_raw(address, path).await).into_owned()
}

/// A root dir with the `wait` example imported and a manifest directory
/// holding the `waiter` pod (it prints a line, waits for `go` in its
/// `signal` volume, prints another and exits): (root, root dir as text,
/// the signal directory, the manifest directory).
async fn waiter_root() -> (tempfile::TempDir, String, std::path::PathBuf, std::path::PathBuf) {
    let root = tempfile::tempdir().expect("tempdir");
    let root_dir = root.path().to_str().expect("utf8").to_owned();
    let layout = root.path().join("layout");
    let module = rustlet_wasi::examples::binary("wait").expect("module");
    rustlet_wasi::import::write_layout(&layout, &[("example.com/test/wait:v1", &module)]).expect("layout");
    let (ok, _, stderr) = run_cli(&["images", "import", layout.to_str().expect("utf8"), "--root-dir", &root_dir]).await;
    assert!(ok, "{stderr}");
    let signal = root.path().join("signal");
    let manifests = root.path().join("manifests");
    std::fs::create_dir_all(&signal).expect("mkdir");
    std::fs::create_dir_all(&manifests).expect("mkdir");
    std::fs::write(
        manifests.join("waiter.yaml"),
        format!(
            "apiVersion: v1\nkind: Pod\nmetadata: {{name: waiter}}\nspec:\n  restartPolicy: Never\n  containers:\n  \
             - name: main\n    image: example.com/test/wait:v1\n    imagePullPolicy: Never\n    \
             volumeMounts: [{{name: signal, mountPath: /signal}}]\n  volumes:\n  \
             - {{name: signal, hostPath: {{path: {}, type: Directory}}}}\n",
            signal.display()
        ),
    )
    .expect("write");
    (root, root_dir, signal, manifests)
}

/// `rustlet logs -f` prints what the container wrote, then each line as it
/// is written, and ends when the container does. The module (`wait`) prints
/// a line, waits for a file the test creates in its volume, prints another
/// and exits.
#[tokio::test]
async fn logs_follow_prints_lines_as_written_until_the_container_ends() {
    let (_root, root_dir, signal, manifests) = waiter_root().await;
    let (ok, listed, stderr) = run_cli(&["images", "list", "-q", "--root-dir", &root_dir]).await;
    assert!(ok, "{stderr}");
    assert_eq!(listed, "example.com/test/wait:v1\n");

    let manifest_dir = manifests.to_str().expect("utf8").to_owned();
    let mut node = running(&[
        "--standalone",
        "--root-dir",
        &root_dir,
        "--pod-manifest-path",
        &manifest_dir,
        "--node-name",
        "n1",
        "--healthz-port",
        "0",
        "--port",
        "0",
    ]);
    node.line_with("container started").await;

    let mut follow = rustlet()
        .args(["logs", "waiter-n1", "-f", "--root-dir", &root_dir])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let mut out = BufReader::new(follow.stdout.take().expect("stdout")).lines();
    let mut next_line =
        async || tokio::time::timeout(SOON, out.next_line()).await.expect("a line in time").expect("read");
    assert_eq!(next_line().await.as_deref(), Some("waiting for go"));
    // Still following: the container runs until the file appears.
    assert!(follow.try_wait().expect("try_wait").is_none());
    std::fs::write(signal.join("go"), b"").expect("write");
    assert_eq!(next_line().await.as_deref(), Some("got go"));
    assert_eq!(next_line().await, None, "the follow ends with the container");
    let status = tokio::time::timeout(SOON, follow.wait()).await.expect("exits in time").expect("wait");
    assert!(status.success(), "{status}");

    // Following a container that has ended prints its log and returns.
    let (ok, text, stderr) = run_cli(&["logs", "waiter-n1", "--follow", "--root-dir", &root_dir]).await;
    assert!(ok, "{stderr}");
    assert_eq!(text, "waiting for go\ngot go\n");
}

/// The node process's CPU time (user + system), from `/proc/<pid>/stat`.
fn process_cpu(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("stat");
    // Fields after the command name (which is in parentheses): utime and
    // stime are the 12th and 13th, in clock ticks.
    let rest = &stat[stat.rfind(')').expect("comm") + 2..];
    let fields: Vec<u64> = rest.split(' ').skip(11).take(2).map(|f| f.parse().expect("ticks")).collect();
    Duration::from_secs_f64((fields[0] + fields[1]) as f64 / CLOCK_TICKS_PER_SECOND)
}

/// `sysconf(_SC_CLK_TCK)`: 100 on every architecture Linux runs Rust on.
const CLOCK_TICKS_PER_SECOND: f64 = 100.0;

/// A module that never stops computing, limited to 200m, uses about a fifth
/// of a CPU: the node process, which runs nothing else, is measured over a
/// few seconds from outside.
#[tokio::test]
async fn a_cpu_limit_caps_a_busy_module() {
    let root = tempfile::tempdir().expect("tempdir");
    let root_dir = root.path().to_str().expect("utf8").to_owned();
    let layout = root.path().join("layout");
    let module = rustlet_wasi::examples::binary("spin").expect("module");
    rustlet_wasi::import::write_layout(&layout, &[("example.com/test/spin:v1", &module)]).expect("layout");
    let (ok, _, stderr) = run_cli(&["images", "import", layout.to_str().expect("utf8"), "--root-dir", &root_dir]).await;
    assert!(ok, "{stderr}");
    let manifests = root.path().join("manifests");
    std::fs::create_dir_all(&manifests).expect("mkdir");
    std::fs::write(
        manifests.join("spin.yaml"),
        "apiVersion: v1\nkind: Pod\nmetadata: {name: spin}\nspec:\n  containers:\n  - name: main\n    \
         image: example.com/test/spin:v1\n    imagePullPolicy: Never\n    resources: {limits: {cpu: 200m}}\n",
    )
    .expect("write");
    let manifest_dir = manifests.to_str().expect("utf8").to_owned();
    let mut node = running(&[
        "--standalone",
        "--root-dir",
        &root_dir,
        "--pod-manifest-path",
        &manifest_dir,
        "--healthz-port",
        "0",
        "--port",
        "0",
    ]);
    node.line_with("container started").await;
    let pid = node.child.id().expect("pid");
    // A measuring window, not a wait for an event: the rate is what is
    // checked. A busy machine can only lower the share the module gets.
    let (cpu0, wall0) = (process_cpu(pid), std::time::Instant::now());
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (cpu1, wall1) = (process_cpu(pid), std::time::Instant::now());
    let share = (cpu1 - cpu0).as_secs_f64() / (wall1 - wall0).as_secs_f64();
    eprintln!("the node used {share:.3} of a CPU with a module limited to 0.2");
    assert!(share < 0.35, "a module limited to 200m made the node use {share:.3} of a CPU");
}

/// The node's inotify instances (from `/proc/<pid>/fd`).
fn inotify_instances(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|fds| {
            fds.flatten()
                .filter(|fd| std::fs::read_link(fd.path()).is_ok_and(|l| l.to_string_lossy().contains("inotify")))
                .count()
        })
        .unwrap_or(0)
}

/// Opens a log follow on the node's local socket and reads until `first`
/// arrives; the connection stays open.
async fn open_follow(socket: &str, path: &str, first: &str) -> (tokio::net::UnixStream, String) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut stream = tokio::net::UnixStream::connect(socket).await.expect("connect");
    stream
        .write_all(format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").as_bytes())
        .await
        .expect("send");
    let mut seen = Vec::new();
    let read = async {
        let mut chunk = [0u8; 4096];
        while !String::from_utf8_lossy(&seen).contains(first) {
            let n = stream.read(&mut chunk).await.expect("read");
            if n == 0 {
                break;
            }
            seen.extend_from_slice(&chunk[..n]);
        }
    };
    tokio::time::timeout(SOON, read).await.expect("the follow answers in time");
    (stream, String::from_utf8_lossy(&seen).into_owned())
}

/// `logs -f` costs no inotify instance per follower: twenty followers of
/// one container add at most one to the node (before, each took its own,
/// and the per-user default is 128). Sessions are bounded
/// (`--max-streaming-sessions`): one more is answered 429 and counted,
/// and the places come back when the followers end with the container.
#[tokio::test]
async fn log_followers_share_one_watcher_and_sessions_are_bounded() {
    const FOLLOWERS: usize = 20;
    let (root, root_dir, signal, manifests) = waiter_root().await;
    let limit = FOLLOWERS.to_string();
    let mut node = running(&[
        "--standalone",
        "--root-dir",
        &root_dir,
        "--pod-manifest-path",
        manifests.to_str().expect("utf8"),
        "--node-name",
        "n1",
        "--healthz-port",
        "0",
        "--port",
        "0",
        "--max-streaming-sessions",
        &limit,
    ]);
    let address = node.http_address().await;
    node.line_with("container started").await;
    let pid = node.child.id().expect("pid");
    let before = inotify_instances(pid);
    let socket = local_socket(root.path());
    let path = "/containerLogs/default/waiter-n1/main?follow=true";
    let mut followers = Vec::new();
    for _ in 0..FOLLOWERS {
        followers.push(open_follow(&socket, path, "waiting for go").await.0);
    }
    let during = inotify_instances(pid);
    assert!(during <= before + 1, "{FOLLOWERS} followers took {} inotify instances", during - before);
    let (_, metrics) = get(&address, "/metrics").await;
    assert!(metrics.contains(&format!("kubelet_api_streaming_sessions {FOLLOWERS}")), "{metrics}");
    // One more is refused.
    let (code, body) = get(&socket, path).await;
    assert_eq!(code, 429, "{body}");
    assert!(body.contains("too many streaming sessions on this node (the limit is 20)"), "{body}");
    let (_, metrics) = get(&address, "/metrics").await;
    assert!(metrics.contains("rustlet_streaming_sessions_refused_total 1"), "{metrics}");

    // The container ends: every follower gets the last line and the end.
    std::fs::write(signal.join("go"), b"").expect("write");
    for mut follower in followers {
        use tokio::io::AsyncReadExt as _;
        let mut rest = Vec::new();
        tokio::time::timeout(SOON, follower.read_to_end(&mut rest)).await.expect("ends in time").expect("read");
        assert!(String::from_utf8_lossy(&rest).contains("got go"), "{}", String::from_utf8_lossy(&rest));
    }
    let deadline = tokio::time::Instant::now() + SOON;
    loop {
        let (_, metrics) = get(&address, "/metrics").await;
        if metrics.contains("kubelet_api_streaming_sessions 0") {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "sessions still counted: {metrics}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A memory cgroup made for a test (v1 `memory/` or v2), removed when
/// dropped (once its processes are gone).
struct MemoryCgroup {
    dir: std::path::PathBuf,
    v2: bool,
}

impl MemoryCgroup {
    /// A cgroup limited to `bytes`, or `None` where none can be made here
    /// (not root, no memory controller).
    fn make(bytes: u64) -> Option<MemoryCgroup> {
        let name = format!("rustlet-test-{}", std::process::id());
        let v1 = std::path::Path::new("/sys/fs/cgroup/memory");
        let (dir, v2, limit_file) = if v1.join("memory.limit_in_bytes").exists() {
            (v1.join(&name), false, "memory.limit_in_bytes")
        } else if std::path::Path::new("/sys/fs/cgroup/cgroup.controllers").exists() {
            (std::path::Path::new("/sys/fs/cgroup").join(&name), true, "memory.max")
        } else {
            return None;
        };
        std::fs::create_dir(&dir).ok()?;
        let group = MemoryCgroup { dir, v2 };
        std::fs::write(group.dir.join(limit_file), bytes.to_string()).ok()?;
        if !group.v2 {
            // No swap to hide in: the limit is the memory.
            let _ = std::fs::write(group.dir.join("memory.memsw.limit_in_bytes"), bytes.to_string());
        }
        Some(group)
    }

    fn add(&self, pid: u32) {
        std::fs::write(self.dir.join("cgroup.procs"), pid.to_string()).expect("move the node into the cgroup");
    }

    /// How many processes the kernel's OOM killer killed in it.
    fn oom_kills(&self) -> u64 {
        let (file, key) = if self.v2 { ("memory.events", "oom_kill") } else { ("memory.oom_control", "oom_kill") };
        std::fs::read_to_string(self.dir.join(file))
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix(key).and_then(|v| v.trim().parse().ok()))
            .unwrap_or(0)
    }
}

impl Drop for MemoryCgroup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// One WebAssembly pod cannot take the node's memory: the node runs in a
/// memory cgroup of 2 GiB beside a sleeper pod while a pod without a
/// memory limit grows its linear memory (touching every page) and a table,
/// 1 MiB at a time, without end. The pod is OOMKilled at its default limit;
/// the node and the neighbour live, and the kernel never had to kill
/// anything. (Before, the kernel killed the node, and every pod with it.)
/// Skipped where no memory cgroup can be made.
#[tokio::test]
async fn a_pod_growing_without_end_is_oomkilled_alone_in_a_node_in_a_2_gib_cgroup() {
    let Some(cgroup) = MemoryCgroup::make(2 << 30) else {
        return rustlet_testkit::skip::skip(
            "a_pod_growing_without_end_is_oomkilled_alone_in_a_node_in_a_2_gib_cgroup",
            Need::Cgroups,
            "no memory cgroup can be made here",
        );
    };
    let root = tempfile::tempdir().expect("tempdir");
    let root_dir = root.path().to_str().expect("utf8").to_owned();
    let grower = wat::parse_str(
        r#"(module
             (import "wasi_snapshot_preview1" "sched_yield" (func $yield (result i32)))
             (memory (export "memory") 1)
             (table 1 funcref)
             (func (export "_start")
               (local $page i32) (local $addr i32)
               (loop $more
                 (local.set $page (memory.grow (i32.const 16)))
                 (if (i32.eq (local.get $page) (i32.const -1)) (then unreachable))
                 (drop (table.grow (ref.null func) (i32.const 16384)))
                 (local.set $addr (i32.mul (local.get $page) (i32.const 65536)))
                 (block $done
                   (loop $touch
                     (i32.store8 (local.get $addr) (i32.const 1))
                     (local.set $addr (i32.add (local.get $addr) (i32.const 4096)))
                     (br_if $done (i32.ge_u (local.get $addr) (i32.mul (memory.size) (i32.const 65536))))
                     (br $touch)))
                 (drop (call $yield))
                 (br $more))))"#,
    )
    .expect("wat");
    let sleep = rustlet_wasi::examples::binary("sleep").expect("module");
    let layout = root.path().join("layout");
    rustlet_wasi::import::write_layout(
        &layout,
        &[("example.com/test/grow:v1", &grower), ("example.com/test/sleep:v1", &sleep)],
    )
    .expect("layout");
    let (ok, _, stderr) = run_cli(&["images", "import", layout.to_str().expect("utf8"), "--root-dir", &root_dir]).await;
    assert!(ok, "{stderr}");
    let manifests = root.path().join("manifests");
    std::fs::create_dir_all(&manifests).expect("mkdir");
    let mut node = running(&[
        "--standalone",
        "--root-dir",
        &root_dir,
        "--pod-manifest-path",
        manifests.to_str().expect("utf8"),
        "--node-name",
        "n1",
        "--healthz-port",
        "0",
        "--port",
        "0",
    ]);
    node.http_address().await;
    cgroup.add(node.child.id().expect("pid"));
    let manifest = |name: &str, image: &str, policy: &str| {
        format!(
            "apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}}}\nspec:\n  restartPolicy: {policy}\n  containers:\n  \
             - name: main\n    image: {image}\n    imagePullPolicy: Never\n"
        )
    };
    std::fs::write(manifests.join("neighbour.yaml"), manifest("neighbour", "example.com/test/sleep:v1", "Always"))
        .expect("write");
    std::fs::write(manifests.join("grower.yaml"), manifest("grower", "example.com/test/grow:v1", "Never"))
        .expect("write");
    let socket = local_socket(root.path());
    let deadline = tokio::time::Instant::now() + SOON * 2;
    let (grower, neighbour) = loop {
        let (_, body) = get(&socket, "/pods").await;
        let list: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
        let find = |name: &str| {
            list["items"].as_array().into_iter().flatten().find(|p| p["metadata"]["name"] == name).cloned()
        };
        if let (Some(grower), Some(neighbour)) = (find("grower-n1"), find("neighbour-n1"))
            && grower["status"]["phase"] == "Failed"
        {
            break (grower, neighbour);
        }
        assert!(node.child.try_wait().expect("try_wait").is_none(), "the node died");
        assert!(tokio::time::Instant::now() < deadline, "the grower did not end in time: {body}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let terminated = &grower["status"]["containerStatuses"][0]["state"]["terminated"];
    assert_eq!(terminated["reason"], "OOMKilled", "{grower}");
    assert!(terminated["message"].as_str().is_some_and(|m| m.contains("memory limit")), "{grower}");
    assert_eq!(neighbour["status"]["phase"], "Running", "{neighbour}");
    assert!(node.child.try_wait().expect("try_wait").is_none(), "the node lives");
    let (code, _) = get(&socket, "/healthz").await;
    assert_eq!(code, 200);
    assert_eq!(cgroup.oom_kills(), 0, "the kernel never had to kill in the node's cgroup");
    node.child.kill().await.expect("kill");
    let _ = node.child.wait().await;
}

/// Installed as `kubelet`, the binary answers `kubelet --version` as the
/// kubelet does, in the form kubeadm's preflight parses (`^\s*Kubernetes
/// v<major>.<minor>.<patch>[-\w.+]*\s*$`): the newest conformed release, or
/// the one `RUSTLET_KUBERNETES_VERSION` names for an older control plane.
/// Under its own name, `--version` is Rustlet's.
#[test]
fn installed_as_kubelet_it_answers_kubeadms_version_check() {
    let dir = tempfile::tempdir().expect("tempdir");
    let kubelet = dir.path().join("kubelet");
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_rustlet"), &kubelet).expect("symlink");
    let version = |env: Option<&str>| {
        let mut command = std::process::Command::new(&kubelet);
        command.arg("--version");
        match env {
            Some(value) => command.env("RUSTLET_KUBERNETES_VERSION", value),
            None => command.env_remove("RUSTLET_KUBERNETES_VERSION"),
        };
        let output = command.output().expect("run kubelet --version");
        assert!(output.status.success(), "{output:?}");
        String::from_utf8(output.stdout).expect("utf8").trim().to_owned()
    };
    let pkg = env!("CARGO_PKG_VERSION");
    assert_eq!(version(None), format!("Kubernetes v1.33.3+rustlet.{pkg}"));
    assert_eq!(version(Some("1.28")), format!("Kubernetes v1.28.7+rustlet.{pkg}"));
    assert_eq!(version(Some("v1.31.2")), format!("Kubernetes v1.28.7+rustlet.{pkg}"), "newest not newer than 1.31");
    // kubeadm's pattern, checked by hand: the version is semver with build
    // metadata of word characters, dots and pluses.
    let line = version(None);
    let semver = line.strip_prefix("Kubernetes v").expect("the prefix");
    let (core, rest) = semver.split_once('+').expect("build metadata");
    assert_eq!(core.split('.').filter(|p| p.parse::<u32>().is_ok()).count(), 3, "{core}");
    assert!(rest.chars().all(|c| c.is_alphanumeric() || matches!(c, '_' | '.' | '+' | '-')), "{rest}");
    let own = std::process::Command::new(env!("CARGO_BIN_EXE_rustlet")).arg("--version").output().expect("run");
    assert!(String::from_utf8_lossy(&own.stdout).starts_with("rustlet v1.33.3+rustlet."), "{own:?}");
}
