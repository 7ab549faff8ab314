//! The device manager against the fake device plugin binary: registration
//! through `kubelet.sock` and through `plugins_registry`, health, capacity,
//! replacement, stream end and the grace period, allocation, container
//! starts, the checkpoint and the manager's health checks.
//!
//! Nothing here depends on timing: a test waits for an event (a plugin
//! report, a capacity change, a counter) with a generous deadline. The grace
//! period is an hour unless a test is about the removal, which it then
//! checks through the ordered record of capacity changes, never by catching
//! a passing state.

mod common;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use kubelet::device_manager::{
    AllocateError, Capacities, CapacityChange, CheckpointWriteError, ContainerStartError, DeviceManager,
    DeviceManagerConfig, ResourceCapacity,
};
use kubelet::health::ComponentHealth;
use kubelet::plugin_manager::{PluginManager, PluginType};
use rustlet_testkit::process::PluginProcess;
use rustlet_testkit::report::Report;
use tempfile::TempDir;
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

const GPU: &str = "vendor.example.com/gpu";

/// A grace period no test outlives: the state during the grace period is
/// stable for as long as a test looks at it.
const LONG_GRACE: Duration = Duration::from_secs(3600);

/// A grace period for tests of the removal itself.
const SHORT_GRACE: Duration = Duration::from_millis(300);

/// The call deadline of tests where a plugin never answers (other tests
/// keep a generous one, so a busy machine cannot make a call miss it).
const HANG_DEADLINE: Duration = Duration::from_secs(2);

struct Node {
    root: TempDir,
    dir: PathBuf,
    devices: DeviceManager,
    shutdown: CancellationToken,
}

impl Node {
    async fn start() -> Node {
        Self::start_with(|_| {}).await
    }

    async fn start_with(tweak: impl FnOnce(&mut DeviceManagerConfig)) -> Node {
        let root = tempfile::Builder::new().prefix("rustlet-dm-").tempdir().expect("tempdir");
        let dir = root.path().join("device-plugins");
        let mut config = DeviceManagerConfig::new(&dir);
        config.call_timeout = Duration::from_secs(10);
        config.grace_period = LONG_GRACE;
        tweak(&mut config);
        let shutdown = CancellationToken::new();
        let devices = DeviceManager::start(config, shutdown.clone()).expect("start device manager");
        Node { root, dir, devices, shutdown }
    }

    fn socket(&self, name: &str) -> String {
        self.dir.join(name).display().to_string()
    }

    async fn plugin(&self, socket: &str, extra: &[&str]) -> PluginProcess {
        let mut args = vec!["--socket".to_owned(), self.socket(socket)];
        args.extend(extra.iter().map(|s| (*s).to_owned()));
        PluginProcess::spawn(device_plugin_bin(), &args).await.expect("start fake-device-plugin")
    }

    async fn wait_capacity(&self, what: &str, mut pred: impl FnMut(&Capacities) -> bool) -> Capacities {
        let mut rx = self.devices.capacity();
        let result = tokio::time::timeout(SOON, rx.wait_for(|c| pred(c))).await.map(|r| r.map(|c| c.clone()));
        match result {
            Ok(Ok(c)) => c,
            _ => panic!("timed out waiting for {what}; capacity: {:?}", *rx.borrow()),
        }
    }

    /// The manager's health check called `name`.
    fn health(&self, name: &str) -> kubelet::health::HealthCheck {
        self.devices
            .health_checks()
            .into_iter()
            .find_map(|(n, check)| (n == name).then_some(check))
            .unwrap_or_else(|| panic!("no health check {name}"))
    }
}

/// Waits until the health check satisfies `pred`.
async fn wait_health(
    check: &kubelet::health::HealthCheck,
    what: &str,
    pred: impl FnMut(&ComponentHealth) -> bool,
) -> ComponentHealth {
    let mut rx = check.watch();
    match tokio::time::timeout(SOON, rx.wait_for(pred)).await {
        Ok(Ok(health)) => health.clone(),
        _ => panic!("timed out waiting for {what}; health: {:?}", check.get()),
    }
}

/// The changes of `resource`'s capacity, in order, up to and including the
/// first one that satisfies `last`.
async fn changes_until(
    changes: &mut broadcast::Receiver<CapacityChange>,
    resource: &str,
    mut last: impl FnMut(ResourceCapacity) -> bool,
) -> Vec<ResourceCapacity> {
    let mut seen = Vec::new();
    let wait = async {
        loop {
            match changes.recv().await {
                Ok(change) if change.resource == resource => {
                    seen.push(change.capacity);
                    if last(change.capacity) {
                        return;
                    }
                }
                Ok(_) => {}
                Err(error) => panic!("change record: {error}"),
            }
        }
    };
    let done = tokio::time::timeout(SOON, wait).await;
    assert!(done.is_ok(), "timed out waiting for a change of {resource}; changes so far: {seen:?}");
    seen
}

fn capacity(capacity: u64, allocatable: u64) -> ResourceCapacity {
    ResourceCapacity { capacity, allocatable }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

fn cap(capacity: u64, allocatable: u64) -> Option<ResourceCapacity> {
    Some(ResourceCapacity { capacity, allocatable })
}

async fn registered(plugin: &mut PluginProcess) -> String {
    match plugin.wait_for(SOON, |r| matches!(r, Report::DeviceRegistered { .. })).await.expect("Register returned") {
        Report::DeviceRegistered { error, .. } => error,
        other => panic!("unexpected {other:?}"),
    }
}

#[tokio::test]
async fn plugin_registered_on_kubelet_sock_publishes_capacity_and_topology() {
    let node = Node::start().await;
    let mut plugin = node
        .plugin(
            "gpu.sock",
            &[
                "--resource",
                GPU,
                "--device",
                "gpu-0:Healthy:0",
                "--device",
                "gpu-1:Unhealthy:1",
                "--device",
                "gpu-2:Healthy:1",
            ],
        )
        .await;
    assert_eq!(registered(&mut plugin).await, "", "Register succeeds");
    node.wait_capacity("3 devices, 2 healthy", |c| c.get(GPU).copied() == cap(3, 2)).await;
    let devices = node.devices.devices(GPU);
    assert_eq!(
        devices.iter().map(|d| (d.id.as_str(), d.numa_nodes.clone())).collect::<Vec<_>>(),
        [("gpu-0", vec![0]), ("gpu-1", vec![1]), ("gpu-2", vec![1])]
    );
    assert!(node.devices.plugin_options(GPU).is_some());
}

/// Register answers only once the plugin is connected: the node has opened
/// the stream by the time the plugin hears back.
#[tokio::test]
async fn register_returns_after_the_stream_is_open() {
    let node = Node::start().await;
    let mut plugin = node.plugin("gpu.sock", &["--resource", GPU, "--count", "1"]).await;
    let first = plugin
        .wait_for(SOON, |r| matches!(r, Report::ListAndWatchOpened { .. } | Report::DeviceRegistered { .. }))
        .await
        .expect("report");
    assert!(matches!(first, Report::ListAndWatchOpened { .. }), "{first:?}");
    assert_eq!(registered(&mut plugin).await, "");
}

#[tokio::test]
async fn unsupported_version_is_refused_with_upstream_text() {
    let node = Node::start().await;
    let mut plugin = node.plugin("gpu.sock", &["--resource", GPU, "--count", "1", "--version", "v1alpha"]).await;
    assert_eq!(
        registered(&mut plugin).await,
        r#"requested API version "v1alpha" is not supported by kubelet. Supported version is ["v1beta1"]"#
    );
    assert!(node.devices.capacity().borrow().is_empty());
}

#[tokio::test]
async fn invalid_resource_names_are_refused_with_upstream_text() {
    let node = Node::start().await;
    for (i, name) in
        ["gpu", "kubernetes.io/gpu", "requests.vendor.com/gpu", "Vendor.com/gpu", "vendor.com/-x"].iter().enumerate()
    {
        let mut plugin = node.plugin(&format!("bad{i}.sock"), &["--resource", name, "--count", "1"]).await;
        assert_eq!(registered(&mut plugin).await, format!("the ResourceName {name:?} is invalid"));
    }
    assert!(node.devices.capacity().borrow().is_empty());
}

#[tokio::test]
async fn endpoints_escaping_the_plugin_directory_are_refused() {
    let node = Node::start().await;
    for endpoint in ["../gpu.sock", "sub/gpu.sock", "/tmp/gpu.sock"] {
        let mut plugin = node.plugin("gpu.sock", &["--resource", GPU, "--count", "1", "--endpoint", endpoint]).await;
        assert_eq!(
            registered(&mut plugin).await,
            format!(
                "endpoint {endpoint:?} for resource {GPU} must be a socket file name in the device plugin directory, without '/' or '..'"
            )
        );
    }
}

#[tokio::test]
async fn health_changes_move_allocatable() {
    let node = Node::start().await;
    let mut plugin =
        node.plugin("gpu.sock", &["--resource", GPU, "--device", "a:Healthy", "--device", "b:Healthy"]).await;
    assert_eq!(registered(&mut plugin).await, "");
    node.wait_capacity("2 healthy", |c| c.get(GPU).copied() == cap(2, 2)).await;
    plugin.send("health a Unhealthy").await.expect("send");
    node.wait_capacity("1 healthy", |c| c.get(GPU).copied() == cap(2, 1)).await;
    plugin.send("health a Healthy").await.expect("send");
    node.wait_capacity("2 healthy again", |c| c.get(GPU).copied() == cap(2, 2)).await;
}

/// Bad input: duplicate and empty IDs in ListAndWatch are dropped.
#[tokio::test]
async fn duplicate_and_empty_device_ids_are_dropped() {
    let node = Node::start().await;
    let mut plugin = node.plugin("gpu.sock", &["--resource", GPU, "--count", "1"]).await;
    assert_eq!(registered(&mut plugin).await, "");
    plugin.send("devices a:Healthy a:Unhealthy :Healthy b:Unhealthy").await.expect("send");
    node.wait_capacity("a and b", |c| c.get(GPU).copied() == cap(2, 1)).await;
    let ids: Vec<_> = node.devices.devices(GPU).into_iter().map(|d| d.id).collect();
    assert_eq!(ids, ["a", "b"]);
}

/// Bad input: 100,000 devices in one message.
#[tokio::test]
async fn a_hundred_thousand_devices() {
    let node = Node::start().await;
    let mut plugin = node.plugin("gpu.sock", &["--resource", GPU, "--count", "100000"]).await;
    assert_eq!(registered(&mut plugin).await, "");
    node.wait_capacity("100,000 devices", |c| c.get(GPU).copied() == cap(100_000, 100_000)).await;
}

/// The stream ends (plugin crash): every device unhealthy at once, and after
/// the grace period the resource reported as zero, in that order.
#[tokio::test]
async fn crashed_plugin_devices_turn_unhealthy_then_the_resource_is_removed() {
    let node = Node::start_with(|c| c.grace_period = SHORT_GRACE).await;
    let mut plugin = node.plugin("gpu.sock", &["--resource", GPU, "--count", "3"]).await;
    assert_eq!(registered(&mut plugin).await, "");
    node.wait_capacity("3 healthy", |c| c.get(GPU).copied() == cap(3, 3)).await;
    let mut changes = node.devices.capacity_changes();
    plugin.send("crash").await.expect("send");
    let seen = changes_until(&mut changes, GPU, |c| c == capacity(0, 0)).await;
    assert_eq!(seen, [capacity(3, 0), capacity(0, 0)], "unhealthy, then removed");
    assert!(node.devices.devices(GPU).is_empty());
    let mut timers = node.devices.grace_timers();
    tokio::time::timeout(SOON, timers.wait_for(|t| t.fired == 1 && t.running == 0))
        .await
        .expect("the grace timer fired")
        .expect("alive");
}

/// A plugin that comes back within the grace period keeps the resource, and
/// the grace timer is cancelled (it never fires).
#[tokio::test]
async fn plugin_back_within_the_grace_period_keeps_the_resource() {
    let node = Node::start().await;
    let mut plugin = node.plugin("gpu.sock", &["--resource", GPU, "--count", "2"]).await;
    assert_eq!(registered(&mut plugin).await, "");
    node.wait_capacity("2 healthy", |c| c.get(GPU).copied() == cap(2, 2)).await;
    let mut changes = node.devices.capacity_changes();
    let mut timers = node.devices.grace_timers();
    plugin.send("crash").await.expect("send");
    tokio::time::timeout(SOON, timers.wait_for(|t| t.running == 1)).await.expect("grace timer started").expect("alive");
    let mut again = node.plugin("gpu-2.sock", &["--resource", GPU, "--count", "2"]).await;
    assert_eq!(registered(&mut again).await, "");
    let seen = changes_until(&mut changes, GPU, |c| c == capacity(2, 2)).await;
    assert_eq!(seen, [capacity(2, 0), capacity(2, 2)], "unhealthy, then healthy again, never removed");
    let timers = tokio::time::timeout(SOON, timers.wait_for(|t| t.running == 0))
        .await
        .expect("grace timer cancelled")
        .expect("alive");
    assert_eq!(timers.fired, 0, "the grace timer never ran out");
}

/// A second registration for the same resource replaces the first: the old
/// stream is closed, capacity never dips (every change is checked), the new
/// device set wins.
#[tokio::test]
async fn second_registration_replaces_the_first_cleanly() {
    let node = Node::start().await;
    let mut first = node.plugin("gpu-a.sock", &["--resource", GPU, "--count", "2"]).await;
    assert_eq!(registered(&mut first).await, "");
    node.wait_capacity("first plugin's devices", |c| c.get(GPU).copied() == cap(2, 2)).await;
    let mut changes = node.devices.capacity_changes();
    let mut second = node.plugin("gpu-b.sock", &["--resource", GPU, "--count", "3"]).await;
    assert_eq!(registered(&mut second).await, "");
    first.wait_for(SOON, |r| matches!(r, Report::ListAndWatchClosed { .. })).await.expect("old stream closed");
    let seen = changes_until(&mut changes, GPU, |c| c == capacity(3, 3)).await;
    assert_eq!(seen, [capacity(3, 3)], "straight from the first plugin's devices to the second's");
}

/// Bad input: GetDevicePluginOptions never answers. Register fails at the
/// deadline; another plugin registers meanwhile.
#[tokio::test]
async fn options_that_never_answer_time_out_without_blocking_others() {
    let node = Node::start_with(|c| c.call_timeout = HANG_DEADLINE).await;
    let mut hung = node.plugin("hung.sock", &["--resource", GPU, "--count", "1", "--behaviour", "hang-options"]).await;
    let mut fine = node.plugin("fine.sock", &["--resource", "vendor.example.com/fine", "--count", "1"]).await;
    assert_eq!(registered(&mut fine).await, "");
    assert_eq!(
        registered(&mut hung).await,
        format!("device plugin for resource {GPU}: GetDevicePluginOptions did not answer within 2s")
    );
}

/// Type `DevicePlugin` through the plugin watcher lands in the same manager.
#[tokio::test]
async fn device_plugin_registered_through_plugins_registry() {
    let node = Node::start().await;
    let registry = node.root.path().join("plugins_registry");
    let mut manager = PluginManager::new(test_config(&registry));
    manager.add_handler(PluginType::DevicePlugin, Arc::new(node.devices.plugin_handler())).expect("handler");
    let (handle, _task) = manager.start(node.shutdown.clone()).expect("plugin manager");
    let registration = registry.join("gpu-reg.sock");
    let _plugin = node
        .plugin(
            "gpu.sock",
            &[
                "--resource",
                GPU,
                "--count",
                "4",
                "--register",
                "watcher",
                "--registration-socket",
                registration.to_str().expect("utf8"),
            ],
        )
        .await;
    node.wait_capacity("4 devices", |c| c.get(GPU).copied() == cap(4, 4)).await;
    std::fs::remove_file(&registration).expect("remove registration socket");
    node.wait_capacity("deregistered: unhealthy", |c| c.get(GPU).copied() == cap(4, 0)).await;
    drop(handle);
}

#[tokio::test]
async fn device_plugin_with_a_bad_version_is_turned_down_by_the_watcher_path() {
    let node = Node::start().await;
    let registry = node.root.path().join("plugins_registry");
    let mut manager = PluginManager::new(test_config(&registry));
    manager.add_handler(PluginType::DevicePlugin, Arc::new(node.devices.plugin_handler())).expect("handler");
    let (_handle, _task) = manager.start(node.shutdown.clone()).expect("plugin manager");
    let registration = registry.join("old-reg.sock");
    let mut plugin = node
        .plugin(
            "old.sock",
            &[
                "--resource",
                GPU,
                "--count",
                "1",
                "--register",
                "watcher",
                "--version",
                "v1alpha",
                "--registration-socket",
                registration.to_str().expect("utf8"),
            ],
        )
        .await;
    let report = plugin.wait_for(SOON, |r| matches!(r, Report::Notified { .. })).await.expect("notified");
    let Report::Notified { registered, error, .. } = report else { unreachable!() };
    assert!(!registered);
    assert_eq!(
        error,
        r#"RegisterPlugin error -- plugin validation failed with err: manager version, v1beta1, is not among plugin supported versions ["v1alpha"]"#
    );
}

/// kubelet.sock removed under the node is recreated, and plugins can
/// register again.
#[tokio::test]
async fn removed_kubelet_sock_is_recreated() {
    let node = Node::start().await;
    let mut generation = node.devices.registration_server_generation();
    assert_eq!(*generation.borrow_and_update(), 1);
    std::fs::remove_file(node.devices.socket_path()).expect("rm kubelet.sock");
    tokio::time::timeout(SOON, generation.wait_for(|g| *g == 2)).await.expect("in time").expect("alive");
    let mut plugin = node.plugin("gpu.sock", &["--resource", GPU, "--count", "1"]).await;
    assert_eq!(registered(&mut plugin).await, "");
}

/// Bad input: a Register call from a client that sends the raw socket path
/// as the HTTP/2 `:authority`, as grpc-go vendored in Kubernetes 1.28 does.
#[tokio::test]
async fn register_from_a_client_sending_the_raw_socket_path_as_authority() {
    use prost::Message as _;
    let node = Node::start().await;
    let _plugin = node.plugin("gpu.sock", &["--resource", GPU, "--count", "2", "--register", "none"]).await;
    let request = kubelet_api::deviceplugin::v1beta1::RegisterRequest {
        version: "v1beta1".into(),
        endpoint: "gpu.sock".into(),
        resource_name: GPU.into(),
        options: None,
    };
    let socket = node.devices.socket_path();
    let authority = socket.display().to_string();
    assert!(authority.starts_with('/'));
    let (status, message) = rustlet_testkit::raw_h2::unary_call(
        &socket,
        "/v1beta1.Registration/Register",
        &authority,
        &request.encode_to_vec(),
    )
    .await
    .expect("the call is answered");
    assert_eq!((status.as_str(), message.as_str()), ("0", ""));
    node.wait_capacity("2 devices", |c| c.get(GPU).copied() == cap(2, 2)).await;
}

/// The trap itself: a plain tonic server (without `AuthorityFix`) refuses
/// the same call, so the fix above is needed.
#[tokio::test]
async fn a_plain_tonic_server_refuses_a_raw_path_authority() {
    use kubelet_api::deviceplugin::v1beta1::registration_server::{Registration, RegistrationServer};
    use kubelet_api::deviceplugin::v1beta1::{Empty, RegisterRequest};
    use prost::Message as _;

    struct Accept;
    #[tonic::async_trait]
    impl Registration for Accept {
        async fn register(&self, _: tonic::Request<RegisterRequest>) -> Result<tonic::Response<Empty>, tonic::Status> {
            Ok(tonic::Response::new(Empty {}))
        }
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("plain.sock");
    let listener = tokio::net::UnixListener::bind(&socket).expect("bind");
    let stop = CancellationToken::new();
    let server =
        tonic::transport::Server::builder().add_service(RegistrationServer::new(Accept)).serve_with_incoming_shutdown(
            tokio_stream::wrappers::UnixListenerStream::new(listener),
            stop.clone().cancelled_owned(),
        );
    let server = tokio::spawn(server);
    let message = RegisterRequest::default().encode_to_vec();
    let raw = rustlet_testkit::raw_h2::unary_call(
        &socket,
        "/v1beta1.Registration/Register",
        &socket.display().to_string(),
        &message,
    )
    .await;
    assert!(raw.is_err(), "a plain server refuses a raw path authority: {raw:?}");
    let fine =
        rustlet_testkit::raw_h2::unary_call(&socket, "/v1beta1.Registration/Register", "localhost", &message).await;
    assert_eq!(fine, Ok(("0".to_owned(), String::new())), "and accepts a valid one");
    stop.cancel();
    let _ = server.await;
}

// ----- allocation -----

use kubelet::device_manager::{ContainerKind, ContainerRequest, PodContainer, PodDeviceRequest};

fn request(pod: &str, container: &str, kind: ContainerKind, count: u64) -> ContainerRequest {
    ContainerRequest {
        pod_uid: format!("uid-{pod}"),
        pod_name: pod.to_owned(),
        container_name: container.to_owned(),
        kind,
        limits: [(GPU.to_owned(), count), ("cpu".to_owned(), 2)].into_iter().collect(),
    }
}

/// A node with a GPU plugin of `count` healthy devices, registered and
/// published.
async fn gpu_node(count: u64, extra: &[&str]) -> (Node, PluginProcess) {
    gpu_node_with(count, extra, |_| {}).await
}

async fn gpu_node_with(
    count: u64,
    extra: &[&str],
    tweak: impl FnOnce(&mut DeviceManagerConfig),
) -> (Node, PluginProcess) {
    let node = Node::start_with(tweak).await;
    let count_arg = count.to_string();
    let mut args = vec!["--count", count_arg.as_str()];
    args.extend_from_slice(extra);
    let plugin = gpu_plugin(&node, &args).await;
    node.wait_capacity("all devices healthy", |c| c.get(GPU).copied() == cap(count, count)).await;
    (node, plugin)
}

async fn gpu_plugin(node: &Node, extra: &[&str]) -> PluginProcess {
    let mut args = vec!["--resource", GPU];
    args.extend_from_slice(extra);
    let mut plugin = node.plugin("gpu.sock", &args).await;
    assert_eq!(registered(&mut plugin).await, "");
    plugin
}

#[tokio::test]
async fn allocation_gives_devices_and_their_run_options() {
    let (node, _plugin) = gpu_node(4, &[]).await;
    let options = node.devices.allocate(&request("p1", "c1", ContainerKind::App, 2)).await.expect("allocated");
    assert_eq!(options.envs.get("FAKE_DEVICES").map(String::as_str), Some("dev-0,dev-1"));
    assert_eq!(options.mounts.len(), 2);
    assert_eq!(options.devices[0].container_path, "/dev/fake-dev-0");
    assert_eq!(options.cdi_devices, [format!("{GPU}=dev-0"), format!("{GPU}=dev-1")]);
    assert!(options.conflicts.is_empty());
    assert_eq!(node.devices.allocated("uid-p1", "c1")[GPU], ["dev-0", "dev-1"]);
    // Asking again with the same count is idempotent.
    let again = node.devices.allocate(&request("p1", "c1", ContainerKind::App, 2)).await.expect("same again");
    assert_eq!(again, options);
}

/// The kubelet's allocation error texts (see docs/conformance.md).
#[tokio::test]
async fn allocation_errors_say_what_upstream_says() {
    let (node, mut plugin) = gpu_node_with(2, &[], |c| c.grace_period = SHORT_GRACE).await;
    let err = node.devices.allocate(&request("big", "c", ContainerKind::App, 3)).await.expect_err("too many");
    assert_eq!(
        err.to_string(),
        format!("requested number of devices unavailable for {GPU}. Requested: 3, Available: 2")
    );
    node.devices.allocate(&request("p", "c", ContainerKind::App, 1)).await.expect("one");
    let err = node.devices.allocate(&request("p", "c", ContainerKind::App, 2)).await.expect_err("changed");
    assert_eq!(err.to_string(), format!(r#"pod "p" container "c" changed request for resource "{GPU}" from 1 to 2"#));
    plugin.send("health dev-0 Unhealthy").await.expect("send");
    plugin.send("health dev-1 Unhealthy").await.expect("send");
    node.wait_capacity("none healthy", |c| c.get(GPU).copied() == cap(2, 0)).await;
    let err = node.devices.allocate(&request("q", "c", ContainerKind::App, 1)).await.expect_err("unhealthy");
    assert_eq!(err.to_string(), format!("no healthy devices present; cannot allocate unhealthy devices {GPU}"));
    plugin.send("crash").await.expect("send");
    // Removed after the grace period: the final state, so waiting for it
    // cannot miss it.
    node.wait_capacity("removed after grace", |c| c.get(GPU).copied() == cap(0, 0)).await;
    let err = node.devices.allocate(&request("r", "c", ContainerKind::App, 1)).await.expect_err("unregistered");
    assert_eq!(err.to_string(), format!("cannot allocate unregistered device {GPU}"));
    // A resource no plugin ever registered is not a device resource: ignored.
    let mut other = request("s", "c", ContainerKind::App, 0);
    other.limits.insert("example.com/not-a-device".into(), 1);
    assert_eq!(node.devices.allocate(&other).await.expect("ignored"), Default::default());
}

/// Init containers' devices are reused by later containers of the pod;
/// a sidecar keeps its devices; app containers stay disjoint.
#[tokio::test]
async fn init_devices_are_reused_and_app_containers_stay_disjoint() {
    let (node, _plugin) = gpu_node(4, &[]).await;
    let d = &node.devices;
    d.allocate(&request("p", "init", ContainerKind::Init, 2)).await.expect("init");
    d.allocate(&request("p", "sidecar", ContainerKind::RestartableInit, 1)).await.expect("sidecar");
    d.allocate(&request("p", "app1", ContainerKind::App, 2)).await.expect("app1");
    d.allocate(&request("p", "app2", ContainerKind::App, 1)).await.expect("app2");
    let held = |c: &str| d.allocated("uid-p", c)[GPU].clone();
    assert_eq!(held("init"), ["dev-0", "dev-1"]);
    assert_eq!(held("sidecar"), ["dev-0"], "reuses an init device");
    assert_eq!(held("app1"), ["dev-1", "dev-2"], "reuses the other init device, not the sidecar's");
    assert_eq!(held("app2"), ["dev-3"]);
    let err = d.allocate(&request("other", "c", ContainerKind::App, 1)).await.expect_err("all taken");
    assert!(err.to_string().ends_with("Requested: 1, Available: 0"), "{err}");
    assert_eq!(d.free_pod("uid-p"), 6);
    d.allocate(&request("other", "c", ContainerKind::App, 4)).await.expect("all free again");
}

#[tokio::test]
async fn devices_on_one_numa_node_are_preferred() {
    let node = Node::start().await;
    let _plugin = gpu_plugin(
        &node,
        &[
            "--device",
            "a:Healthy:0",
            "--device",
            "b:Healthy:1",
            "--device",
            "c:Healthy:1",
            "--device",
            "d:Healthy:0",
            "--device",
            "e:Healthy:1",
        ],
    )
    .await;
    node.wait_capacity("5 devices", |c| c.get(GPU).copied() == cap(5, 5)).await;
    node.devices.allocate(&request("p", "c", ContainerKind::App, 3)).await.expect("allocated");
    assert_eq!(node.devices.allocated("uid-p", "c")[GPU], ["b", "c", "e"], "all on NUMA node 1");
}

#[tokio::test]
async fn preferred_allocation_is_asked_and_validated() {
    let (node, _plugin) = gpu_node(4, &["--preferred"]).await;
    node.devices.allocate(&request("p", "c", ContainerKind::App, 2)).await.expect("allocated");
    assert_eq!(node.devices.allocated("uid-p", "c")[GPU], ["dev-3", "dev-2"], "the plugin's preference");
}

/// Bad input: a preferred allocation naming unknown (and duplicate) devices.
#[tokio::test]
async fn preferred_allocation_naming_unknown_devices_is_ignored() {
    let (node, _plugin) = gpu_node(3, &["--preferred", "--behaviour", "prefer-unknown"]).await;
    node.devices.allocate(&request("p", "c", ContainerKind::App, 2)).await.expect("allocated");
    assert_eq!(node.devices.allocated("uid-p", "c")[GPU], ["dev-0", "dev-1"]);
}

/// Bad input: GetPreferredAllocation never answers: after its deadline the
/// node chooses by itself.
#[tokio::test]
async fn preferred_allocation_that_never_answers_falls_back_to_our_choice() {
    let (node, _plugin) =
        gpu_node_with(3, &["--preferred", "--behaviour", "hang-preferred"], |c| c.call_timeout = HANG_DEADLINE).await;
    node.devices.allocate(&request("p", "c", ContainerKind::App, 2)).await.expect("allocated after the deadline");
    assert_eq!(node.devices.allocated("uid-p", "c")[GPU], ["dev-0", "dev-1"]);
}

/// Upstream calls PreStartContainer at every container start (restarts
/// too), never from Allocate: allocating, then starting the container twice,
/// makes exactly two calls, with the container's devices.
#[tokio::test]
async fn pre_start_container_is_called_at_every_container_start() {
    let (node, mut plugin) = gpu_node(2, &["--pre-start"]).await;
    let allocated = node.devices.allocate(&request("p", "c", ContainerKind::App, 1)).await.expect("allocated");
    for start in 1..=2 {
        let options = node.devices.container_run_options("uid-p", "c").await.expect("started");
        assert_eq!(options, allocated, "start {start}: the allocation's run options");
    }
    // A marker: the plugin reports calls in the order it gets them, so the
    // PreStartContainer calls are the ones between the two Allocates.
    node.devices.allocate(&request("q", "c", ContainerKind::App, 1)).await.expect("allocated");
    let mut calls = Vec::new();
    plugin.wait_for(SOON, |r| matches!(r, Report::Allocate { .. })).await.expect("first Allocate");
    plugin
        .wait_for(SOON, |r| match r {
            Report::PreStartContainer { .. } => {
                calls.push(r.clone());
                false
            }
            Report::Allocate { .. } => true,
            _ => false,
        })
        .await
        .expect("second Allocate");
    let expected = Report::PreStartContainer { resource: GPU.into(), devices: vec!["dev-0".into()] };
    assert_eq!(calls, [expected.clone(), expected], "one call per start, none from Allocate");
    // A container without devices starts with empty options and no call.
    assert_eq!(node.devices.container_run_options("uid-p", "other").await.expect("no devices"), Default::default());
}

/// Bad input: the plugin that asked for PreStartContainer is gone when the
/// container starts: the start fails, naming the resource.
#[tokio::test]
async fn a_container_start_fails_while_its_pre_start_plugin_is_gone() {
    let (node, mut plugin) = gpu_node(1, &["--pre-start"]).await;
    node.devices.allocate(&request("p", "c", ContainerKind::App, 1)).await.expect("allocated");
    plugin.send("crash").await.expect("send");
    node.wait_capacity("unhealthy (grace period of an hour)", |c| c.get(GPU).copied() == cap(1, 0)).await;
    let err = node.devices.container_run_options("uid-p", "c").await.expect_err("plugin gone");
    assert!(matches!(err, ContainerStartError::PluginGone { .. }), "{err:?}");
    assert_eq!(
        err.to_string(),
        format!(
            "the device plugin for resource {GPU} requires PreStartContainer but is not connected (pod uid-p container c)"
        )
    );
}

fn pod_container(name: &str, kind: ContainerKind, count: u64) -> PodContainer {
    PodContainer { name: name.into(), kind, limits: [(GPU.to_owned(), count)].into_iter().collect() }
}

fn pod(name: &str, containers: Vec<PodContainer>) -> PodDeviceRequest {
    PodDeviceRequest { pod_uid: format!("uid-{name}"), pod_name: name.into(), containers }
}

/// `allocate_pod` allocates init containers first, then sidecars and app
/// containers, whatever order the caller lists them in: init-device reuse
/// comes out as in `init_devices_are_reused_and_app_containers_stay_disjoint`.
#[tokio::test]
async fn allocate_pod_allocates_init_containers_first_whatever_the_order_given() {
    let (node, _plugin) = gpu_node(4, &[]).await;
    let request = pod(
        "p",
        vec![
            pod_container("app1", ContainerKind::App, 2),
            pod_container("sidecar", ContainerKind::RestartableInit, 1),
            pod_container("app2", ContainerKind::App, 1),
            pod_container("init", ContainerKind::Init, 2),
        ],
    );
    let devices = node.devices.allocate_pod(&request).await.expect("allocated");
    let held = |c: &str| node.devices.allocated("uid-p", c)[GPU].clone();
    assert_eq!(held("init"), ["dev-0", "dev-1"]);
    assert_eq!(held("sidecar"), ["dev-0"], "reuses an init device");
    assert_eq!(held("app1"), ["dev-1", "dev-2"], "reuses the other init device, not the sidecar's");
    assert_eq!(held("app2"), ["dev-3"]);
    let env = |c: &str| devices[c].envs["FAKE_DEVICES"].clone();
    assert_eq!(
        [env("init"), env("sidecar"), env("app1"), env("app2")],
        ["dev-0,dev-1", "dev-0", "dev-1,dev-2", "dev-3"],
        "each container's run options"
    );
    // Asking again is idempotent.
    assert_eq!(node.devices.allocate_pod(&request).await.expect("same again"), devices);
}

/// A pod whose last container cannot be allocated keeps nothing: its
/// earlier containers' devices are released and out of the checkpoint.
#[tokio::test]
async fn a_pod_that_cannot_be_allocated_keeps_nothing() {
    let (node, _plugin) = gpu_node(3, &[]).await;
    let request = pod(
        "p",
        vec![
            pod_container("init", ContainerKind::Init, 1),
            pod_container("app1", ContainerKind::App, 2),
            pod_container("app2", ContainerKind::App, 2),
        ],
    );
    let err = node.devices.allocate_pod(&request).await.expect_err("app2 does not fit");
    assert_eq!(
        err.to_string(),
        format!("requested number of devices unavailable for {GPU}. Requested: 2, Available: 1")
    );
    for container in ["init", "app1", "app2"] {
        assert!(node.devices.allocated("uid-p", container).is_empty(), "{container} kept devices");
    }
    node.devices.persisted().await.expect("written");
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(node.dir.join("kubelet_internal_checkpoint")).expect("checkpoint"))
            .expect("json");
    assert_eq!(json["Data"]["PodDeviceEntries"], serde_json::json!([]), "nothing of the pod on disk");
    let all = pod("q", vec![pod_container("c", ContainerKind::App, 3)]);
    node.devices.allocate_pod(&all).await.expect("every device free again");
}

/// Bad input: Allocate never answers, or the plugin dies mid-allocation:
/// the deadline fires, nothing is recorded, the devices stay free.
#[tokio::test]
async fn allocate_that_never_answers_records_nothing() {
    let (node, mut plugin) =
        gpu_node_with(2, &["--behaviour", "hang-allocate"], |c| c.call_timeout = HANG_DEADLINE).await;
    let err = node.devices.allocate(&request("p", "c", ContainerKind::App, 2)).await.expect_err("deadline");
    assert_eq!(err.to_string(), format!("Allocate for resource {GPU} did not answer within 2s"));
    assert!(node.devices.allocated("uid-p", "c").is_empty());
    plugin.wait_for(SOON, |r| matches!(r, Report::Allocate { .. })).await.expect("p's Allocate");
    // Dies while an allocation waits on it (not before: then the allocation
    // would find no healthy device).
    let pending = tokio::spawn({
        let devices = node.devices.clone();
        async move { devices.allocate(&request("q", "c", ContainerKind::App, 2)).await }
    });
    plugin.wait_for(SOON, |r| matches!(r, Report::Allocate { .. })).await.expect("q's Allocate");
    plugin.send("crash").await.expect("send");
    let err = pending.await.expect("task").expect_err("plugin died");
    assert!(matches!(err, AllocateError::Rpc { .. } | AllocateError::Timeout { .. }), "{err}");
    assert!(node.devices.allocated("uid-q", "c").is_empty());
}

/// An allocation whose caller gives up midway (its future is dropped while
/// the plugin has not answered) keeps nothing reserved or recorded.
#[tokio::test]
async fn an_allocation_dropped_midway_releases_its_devices() {
    let node = Node::start_with(|c| c.call_timeout = Duration::from_secs(30)).await;
    let mut hanging = gpu_plugin(&node, &["--count", "1", "--behaviour", "hang-allocate"]).await;
    node.wait_capacity("1 device", |c| c.get(GPU).copied() == cap(1, 1)).await;
    let pending = tokio::spawn({
        let devices = node.devices.clone();
        async move { devices.allocate(&request("p", "c", ContainerKind::App, 1)).await }
    });
    // The plugin holds the Allocate: the device is reserved for "p" now.
    hanging.wait_for(SOON, |r| matches!(r, Report::Allocate { .. })).await.expect("Allocate called");
    pending.abort();
    assert!(pending.await.expect_err("aborted").is_cancelled());
    assert!(node.devices.allocated("uid-p", "c").is_empty());

    // A plugin that answers replaces the hanging one: the device is free.
    let mut answering = node.plugin("gpu-2.sock", &["--resource", GPU, "--count", "1"]).await;
    assert_eq!(registered(&mut answering).await, "");
    node.devices.allocate(&request("q", "c", ContainerKind::App, 1)).await.expect("the device was released");
    assert_eq!(node.devices.allocated("uid-q", "c")[GPU], ["dev-0"]);
}

/// Bad input: an Allocate answer with the wrong container count.
#[tokio::test]
async fn allocate_answer_with_the_wrong_container_count_records_nothing() {
    let (node, _plugin) = gpu_node(2, &["--behaviour", "wrong-container-count"]).await;
    let err = node.devices.allocate(&request("p", "c", ContainerKind::App, 1)).await.expect_err("bad answer");
    assert_eq!(
        err.to_string(),
        format!("Allocate for resource {GPU} returned an unusable answer: expected 1 container response, got 2")
    );
    assert!(node.devices.allocated("uid-p", "c").is_empty());
}

/// 1,000 pods asking for one device each at once: every pod gets its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_concurrent_allocations_get_distinct_devices() {
    // 1,000 calls share the plugin's one connection.
    let node = Node::start_with(|c| c.call_timeout = Duration::from_secs(30)).await;
    let _plugin = gpu_plugin(&node, &["--count", "1000"]).await;
    node.wait_capacity("1000 devices", |c| c.get(GPU).copied() == cap(1000, 1000)).await;
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..1000 {
        let devices = node.devices.clone();
        tasks.spawn(async move {
            devices.allocate(&request(&format!("p{i}"), "c", ContainerKind::App, 1)).await.map(|_| i)
        });
    }
    let mut seen = std::collections::BTreeSet::new();
    while let Some(result) = tasks.join_next().await {
        let i = result.expect("task").expect("allocated");
        let held = node.devices.allocated(&format!("uid-p{i}"), "c")[GPU].clone();
        assert_eq!(held.len(), 1);
        assert!(seen.insert(held[0].clone()), "device {} given twice", held[0]);
    }
    assert_eq!(seen.len(), 1000);
}

// ----- metrics -----

fn metrics_text(node: &Node) -> String {
    let mut registry = prometheus_client::registry::Registry::default();
    node.devices.register_metrics(&mut registry);
    kubelet::metrics::encode_text(&registry).expect("encode")
}

/// Upstream's device-plugin metrics: registrations counted as they arrive
/// (refused ones too), the `Allocate` call timed per resource; and the
/// checkpoint write time.
#[tokio::test]
async fn registrations_allocate_calls_and_checkpoint_writes_are_measured() {
    let node = Node::start().await;
    let mut refused = node.plugin("bad.sock", &["--resource", "no-domain", "--count", "1"]).await;
    assert!(registered(&mut refused).await.contains("invalid"), "refused");
    let _plugin = gpu_plugin(&node, &["--count", "2"]).await;
    node.wait_capacity("2 devices", |c| c.get(GPU).copied() == cap(2, 2)).await;
    node.devices.allocate(&request("p", "c", ContainerKind::App, 1)).await.expect("allocated");

    let text = metrics_text(&node);
    for line in [
        "kubelet_device_plugin_registration_total{resource_name=\"no-domain\"} 1",
        "kubelet_device_plugin_registration_total{resource_name=\"vendor.example.com/gpu\"} 1",
        "kubelet_device_plugin_alloc_duration_seconds_count{resource_name=\"vendor.example.com/gpu\"} 1",
        "kubelet_device_plugin_alloc_duration_seconds_bucket{le=\"10.0\",resource_name=\"vendor.example.com/gpu\"} 1",
    ] {
        assert!(text.contains(line), "missing {line} in:\n{text}");
    }
    let writes: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("rustlet_device_checkpoint_write_duration_seconds_count "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no checkpoint write count in:\n{text}"));
    assert!(writes >= 1, "the allocation waited for a write: {writes}");
}

// ----- checkpoint -----

/// Allocations survive a restart; each resource starts at zero until its
/// plugin registers again, and restored devices are not handed out twice.
#[tokio::test]
async fn allocations_survive_a_restart() {
    let (node, mut plugin) = gpu_node(3, &[]).await;
    let before = node.devices.allocate(&request("p", "c", ContainerKind::App, 2)).await.expect("allocated");
    node.shutdown.cancel();
    node.devices.stopped().await;
    plugin.kill().await;

    let config = DeviceManagerConfig::new(&node.dir);
    let shutdown = CancellationToken::new();
    let restarted = DeviceManager::start(config, shutdown.clone()).expect("restart");
    assert_eq!(restarted.allocated("uid-p", "c")[GPU], ["dev-0", "dev-1"]);
    assert_eq!(restarted.capacity().borrow().get(GPU).copied(), cap(0, 0), "starts at zero");
    let again = restarted.allocate(&request("p", "c", ContainerKind::App, 2)).await.expect("idempotent after restart");
    assert_eq!(again, before, "the run options come back too");

    let mut back = PluginProcess::spawn(
        device_plugin_bin(),
        ["--socket", &node.socket("gpu-2.sock"), "--resource", GPU, "--count", "3"],
    )
    .await
    .expect("plugin");
    assert_eq!(registered(&mut back).await, "");
    let mut rx = restarted.capacity();
    tokio::time::timeout(SOON, rx.wait_for(|c| c.get(GPU).copied() == cap(3, 3)))
        .await
        .expect("in time")
        .expect("alive");
    restarted.allocate(&request("q", "c", ContainerKind::App, 1)).await.expect("the free one");
    assert_eq!(restarted.allocated("uid-q", "c")[GPU], ["dev-2"]);
    let err = restarted.allocate(&request("r", "c", ContainerKind::App, 1)).await.expect_err("none left");
    assert!(err.to_string().ends_with("Requested: 1, Available: 0"), "{err}");
    shutdown.cancel();
}

/// A resource registered but never allocated is in the checkpoint too: after
/// a restart it is listed at zero until its plugin is back. Shutdown waits
/// for the writes asked for before it.
#[tokio::test]
async fn a_registered_resource_without_allocations_is_listed_after_a_restart() {
    let (node, mut plugin) = gpu_node(2, &[]).await;
    node.shutdown.cancel();
    node.devices.stopped().await;
    plugin.kill().await;
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(node.dir.join("kubelet_internal_checkpoint")).expect("checkpoint"))
            .expect("json");
    assert_eq!(json["Data"]["RegisteredDevices"][GPU], serde_json::json!(["dev-0", "dev-1"]));
    assert_eq!(json["Data"]["PodDeviceEntries"], serde_json::json!([]));

    // Restarted twice, with a write in between (the plugin never came
    // back): still listed, with its device IDs.
    for restart in 1..=2 {
        let shutdown = CancellationToken::new();
        let restarted = DeviceManager::start(DeviceManagerConfig::new(&node.dir), shutdown.clone()).expect("restart");
        assert_eq!(restarted.capacity().borrow().get(GPU).copied(), cap(0, 0), "restart {restart}: listed, at zero");
        let written = restarted.persisted().await;
        assert!(written.is_ok(), "{written:?}");
        let json: serde_json::Value =
            serde_json::from_slice(&std::fs::read(node.dir.join("kubelet_internal_checkpoint")).expect("checkpoint"))
                .expect("json");
        assert_eq!(json["Data"]["RegisteredDevices"][GPU], serde_json::json!(["dev-0", "dev-1"]), "restart {restart}");
        shutdown.cancel();
        restarted.stopped().await;
        let err = restarted.persisted().await.expect_err("no writes after shutdown");
        assert!(matches!(err, CheckpointWriteError::ShuttingDown), "{err:?}");
        assert_eq!(err.to_string(), "the device manager is shutting down");
    }
}

/// Bad input: a corrupt checkpoint is moved aside and the node starts clean.
#[tokio::test]
async fn corrupt_checkpoint_is_moved_aside_and_the_node_starts_clean() {
    let root = tempfile::tempdir().expect("tempdir");
    let dir = root.path().join("device-plugins");
    std::fs::create_dir_all(&dir).expect("mkdir");
    std::fs::write(
        dir.join("kubelet_internal_checkpoint"),
        br#"{"Data":{"PodDeviceEntries":[],"RegisteredDevices":{}},"Checksum":7}"#,
    )
    .expect("write");
    let shutdown = CancellationToken::new();
    let devices = DeviceManager::start(DeviceManagerConfig::new(&dir), shutdown.clone()).expect("starts anyway");
    assert!(devices.capacity().borrow().is_empty());
    let names: Vec<String> = std::fs::read_dir(&dir)
        .expect("list")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert!(names.iter().any(|n| n.starts_with("kubelet_internal_checkpoint.corrupt-")), "{names:?}");
    shutdown.cancel();
}

/// Bad input: kill -9 during allocation, then restart: no allocation that
/// was reported done is lost, and no device is given twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_during_allocation_loses_nothing_and_duplicates_nothing() {
    use tokio::io::AsyncBufReadExt;
    let root = tempfile::tempdir().expect("tempdir");
    let dir = root.path().join("device-plugins");
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_device-allocator"))
        .args(["--dir", dir.to_str().expect("utf8"), "--count", "1000"])
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn");
    let mut lines = tokio::io::BufReader::new(child.stdout.take().expect("stdout")).lines();
    let mut reported = std::collections::BTreeMap::new();
    let read = async {
        while let Some(line) = lines.next_line().await.expect("read") {
            if let Some(rest) = line.strip_prefix("allocated ") {
                let (pod, device) = rest.split_once(' ').expect("pod device");
                reported.insert(pod.to_owned(), device.to_owned());
                if reported.len() == 50 {
                    break;
                }
            }
        }
    };
    tokio::time::timeout(SOON, read).await.expect("50 allocations reported");
    child.start_kill().expect("SIGKILL");
    child.wait().await.expect("reaped");

    let shutdown = CancellationToken::new();
    let restarted = DeviceManager::start(DeviceManagerConfig::new(&dir), shutdown.clone()).expect("restart");
    let mut owners = std::collections::BTreeMap::new();
    for (pod, device) in &reported {
        let held = restarted.allocated(pod, "c");
        assert_eq!(held.get("crash.example.com/dev").map(|d| d.join(",")), Some(device.clone()), "{pod} lost");
    }
    for i in 0..2000 {
        let pod = format!("p{i}");
        for device in restarted.allocated(&pod, "c").into_values().flatten() {
            if let Some(other) = owners.insert(device.clone(), pod.clone()) {
                panic!("device {device} held by both {other} and {pod}");
            }
        }
    }
    assert!(owners.len() >= 50);
    shutdown.cancel();
}

/// After a restart the checkpoint holds pods the node no longer runs:
/// `retain_pods` frees them (and says which), and the checkpoint forgets
/// them, so a second restart restores only the live pod.
#[tokio::test]
async fn retain_pods_frees_the_orphans_restored_from_the_checkpoint() {
    let (node, mut plugin) = gpu_node(3, &[]).await;
    for pod in ["p", "q", "r"] {
        node.devices.allocate(&request(pod, "c", ContainerKind::App, 1)).await.expect("allocated");
    }
    node.shutdown.cancel();
    node.devices.stopped().await;
    plugin.kill().await;

    let shutdown = CancellationToken::new();
    let restarted = DeviceManager::start(DeviceManagerConfig::new(&node.dir), shutdown.clone()).expect("restart");
    assert_eq!(restarted.allocated("uid-p", "c")[GPU], ["dev-0"], "restored");
    let freed = restarted.retain_pods(["uid-q"]);
    assert_eq!(freed, [("uid-p".to_owned(), 1), ("uid-r".to_owned(), 1)].into_iter().collect());
    assert!(restarted.allocated("uid-p", "c").is_empty());
    assert!(restarted.allocated("uid-r", "c").is_empty());
    assert_eq!(restarted.allocated("uid-q", "c")[GPU], ["dev-1"], "the live pod keeps its device");
    assert!(restarted.retain_pods(["uid-q"]).is_empty(), "nothing left to free");
    restarted.persisted().await.expect("written");
    shutdown.cancel();
    restarted.stopped().await;

    let shutdown = CancellationToken::new();
    let again = DeviceManager::start(DeviceManagerConfig::new(&node.dir), shutdown.clone()).expect("restart again");
    assert!(again.allocated("uid-p", "c").is_empty(), "the orphans are out of the checkpoint");
    assert!(again.allocated("uid-r", "c").is_empty());
    assert_eq!(again.allocated("uid-q", "c")[GPU], ["dev-1"]);
    shutdown.cancel();
}

/// Bad input: the checkpoint cannot be written (a directory sits where the
/// temporary file goes). The allocation fails with the typed error and
/// records nothing; the `device-checkpoint` health check fails with the
/// error until a write succeeds again.
#[tokio::test]
async fn a_checkpoint_that_cannot_be_written_fails_the_allocation_and_the_health_check() {
    let (node, _plugin) = gpu_node(2, &[]).await;
    let health = node.health("device-checkpoint");
    assert!(health.get().is_healthy());
    // The writes the registration asked for are done: no temporary file is
    // in the way of the blocker.
    node.devices.persisted().await.expect("written");
    let blocker =
        kubelet::durable::temporary_name(&node.dir.join("kubelet_internal_checkpoint")).expect("a temporary name");
    std::fs::create_dir(&blocker).expect("mkdir");
    let err = node.devices.allocate(&request("p", "c", ContainerKind::App, 1)).await.expect_err("not durable");
    let AllocateError::Checkpoint(CheckpointWriteError::Io { path, .. }) = &err else {
        panic!("expected a checkpoint write error, got {err:?}");
    };
    assert_eq!(path, &node.dir.join("kubelet_internal_checkpoint"));
    assert!(
        err.to_string().starts_with(&format!(
            "the allocation was not recorded: cannot write device checkpoint {}: ",
            path.display()
        )),
        "{err}"
    );
    assert!(node.devices.allocated("uid-p", "c").is_empty(), "nothing recorded");
    let failing = wait_health(&health, "checkpoint failing", |h| !h.is_healthy()).await;
    let ComponentHealth::Failing { reason } = failing else { unreachable!() };
    assert!(reason.starts_with(&format!("cannot write device checkpoint {}: ", path.display())), "{reason}");

    std::fs::remove_dir(&blocker).expect("rmdir");
    node.devices.persisted().await.expect("written again");
    assert!(health.get().is_healthy(), "healthy after a good write");
    node.devices.allocate(&request("p", "c", ContainerKind::App, 2)).await.expect("both devices are free");
}

/// kubelet.sock removed and something else put in its place: the server
/// cannot rebind, says so through its health check, keeps retrying, and
/// serves again (plugins register) once the path is free.
#[tokio::test]
async fn kubelet_sock_that_cannot_be_rebound_is_retried_until_it_can() {
    let node = Node::start().await;
    let health = node.health("device-registration-server");
    assert!(health.get().is_healthy());
    let socket = node.devices.socket_path();
    // The server may rebind between the removal and the mkdir; then remove
    // its new socket and try again until the directory is in place.
    loop {
        match std::fs::remove_file(&socket) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => panic!("rm kubelet.sock: {e}"),
        }
        match std::fs::create_dir(&socket) {
            Ok(()) => break,
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => panic!("mkdir kubelet.sock: {e}"),
        }
    }
    let failing = wait_health(&health, "registration server failing", |h| !h.is_healthy()).await;
    let ComponentHealth::Failing { reason } = failing else { unreachable!() };
    assert!(
        reason.starts_with(&format!(
            "cannot serve device plugin registration: bind {}: a non-socket file is in the way; retrying in ",
            socket.display()
        )),
        "{reason}"
    );
    let mut generation = node.devices.registration_server_generation();
    let before = *generation.borrow_and_update();

    std::fs::remove_dir(&socket).expect("rmdir");
    tokio::time::timeout(SOON, generation.wait_for(|g| *g > before)).await.expect("rebound in time").expect("alive");
    wait_health(&health, "registration server healthy", ComponentHealth::is_healthy).await;
    let mut plugin = node.plugin("gpu.sock", &["--resource", GPU, "--count", "1"]).await;
    assert_eq!(registered(&mut plugin).await, "");
}

/// Beyond upstream: `kubelet.sock` is 0660 (not the umask's), and a
/// `Register` call is taken only from root or a user in
/// `--plugin-allowed-uids`, for an endpoint socket of that user's that no
/// one else may write to. A plugin run as uid 65534 (with `kubelet.sock`
/// opened up to it by hand) is refused with the reason; a root plugin
/// whose socket is world-writable too; a node that allows uid 65534 takes
/// its plugin.
#[tokio::test]
async fn register_is_taken_only_from_trusted_users() {
    const TRUSTED_USERS: &str = "register_is_taken_only_from_trusted_users";
    use std::os::unix::fs::PermissionsExt as _;
    if !rustlet_testkit::skip::root(TRUSTED_USERS, "running a plugin as another user needs root") {
        return;
    }
    let nobody = 65534;
    let opened_up = |node: &Node| {
        let kubelet_sock = node.dir.join("kubelet.sock");
        let mode = std::fs::metadata(&kubelet_sock).expect("kubelet.sock").permissions().mode() & 0o777;
        assert_eq!(mode, 0o660, "kubelet.sock's mode is set, not left to the umask");
        std::fs::set_permissions(node.root.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
        std::fs::set_permissions(&node.dir, std::fs::Permissions::from_mode(0o777)).expect("chmod");
        std::fs::set_permissions(&kubelet_sock, std::fs::Permissions::from_mode(0o666)).expect("chmod");
    };
    let node = Node::start().await;
    opened_up(&node);
    let args = ["--socket", &node.socket("nobody.sock"), "--resource", "example.com/nobody"];
    let mut plugin = PluginProcess::spawn_as(device_plugin_bin(), args, Some(nobody), None).await.expect("plugin");
    let error = registered(&mut plugin).await;
    assert!(error.contains("runs as uid 65534, which is neither root nor in --plugin-allowed-uids"), "{error}");
    let args = ["--socket", &node.socket("open.sock"), "--resource", "example.com/open"];
    let mut open = PluginProcess::spawn_as(device_plugin_bin(), args, None, Some(0)).await.expect("plugin");
    let error = registered(&mut open).await;
    assert!(error.contains("lets users other than its owner write to it"), "{error}");
    assert!(node.devices.capacity().borrow().is_empty(), "no resource was advertised");

    let node = Node::start_with(|config| config.trust = kubelet::plugin_trust::PluginTrust::new([nobody])).await;
    opened_up(&node);
    let args = ["--socket", &node.socket("nobody.sock"), "--resource", "example.com/nobody"];
    let mut plugin = PluginProcess::spawn_as(device_plugin_bin(), args, Some(nobody), None).await.expect("plugin");
    let error = registered(&mut plugin).await;
    assert_eq!(error, "", "registered");
    node.wait_capacity("the allowed plugin's devices", |c| c.contains_key("example.com/nobody")).await;
}

/// The same, from a build directory no other user may enter (a checkout
/// under a 0700 home): the plugin uid 65534 runs is a copy it reaches.
#[test]
fn register_from_other_users_is_checked_behind_a_directory_they_cannot_enter() {
    rustlet_testkit::other_user::rerun_behind_a_closed_directory(
        "register_from_other_users_is_checked_behind_a_directory_they_cannot_enter",
        "register_is_taken_only_from_trusted_users",
    );
}
