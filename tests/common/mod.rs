//! The fixture shared by the integration tests: a plugin manager with the CSI
//! handler and a recording handler for type `Example`, in a temp root dir,
//! plus helpers to start the test plugin binaries and to wait on events with
//! deadlines (never sleeps).
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use kubelet::csi::{CsiDriverRegistry, CsiHandlerConfig, CsiPluginHandler, InMemoryNodeInfo};
use kubelet::plugin_manager::{
    HandlerError, PluginCounts, PluginEvent, PluginHandler, PluginInfo, PluginManager, PluginManagerConfig,
    PluginManagerHandle, PluginStatus, PluginType,
};
use rustlet_testkit::process::PluginProcess;
use tempfile::TempDir;
use tokio::sync::{Semaphore, broadcast, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// The deadline for anything that should happen "at once".
pub const SOON: Duration = Duration::from_secs(20);

pub const EXAMPLE_TYPE: &str = "Example";

pub fn registration_plugin_bin() -> &'static str {
    env!("CARGO_BIN_EXE_fake-registration-plugin")
}

pub fn device_plugin_bin() -> &'static str {
    env!("CARGO_BIN_EXE_fake-device-plugin")
}

pub fn csi_driver_bin() -> &'static str {
    env!("CARGO_BIN_EXE_fake-csi-driver")
}

/// Starts the fake device plugin serving `count` devices of `resource` on
/// `<device_dir>/gpu.sock` and waits until it registered and `devices`
/// advertises them all.
pub async fn gpu_plugin(
    devices: &kubelet::device_manager::DeviceManager,
    device_dir: &Path,
    resource: &str,
    count: u64,
) -> PluginProcess {
    let socket = device_dir.join("gpu.sock").display().to_string();
    let count_arg = count.to_string();
    let mut plugin =
        PluginProcess::spawn(device_plugin_bin(), ["--socket", &socket, "--resource", resource, "--count", &count_arg])
            .await
            .expect("start fake-device-plugin");
    plugin
        .wait_for(SOON, |r| matches!(r, rustlet_testkit::report::Report::DeviceRegistered { .. }))
        .await
        .expect("registered");
    let mut capacity = devices.capacity();
    tokio::time::timeout(SOON, capacity.wait_for(|c| c.get(resource).is_some_and(|c| c.allocatable == count)))
        .await
        .expect("devices advertised in time")
        .expect("device manager alive");
    plugin
}

/// Starts the registration plugin binary with `args`.
pub async fn registration_plugin(args: &[&str]) -> PluginProcess {
    PluginProcess::spawn(registration_plugin_bin(), args).await.expect("start fake-registration-plugin")
}

/// Starts the CSI driver binary with `args`.
pub async fn csi_driver(args: &[&str]) -> PluginProcess {
    PluginProcess::spawn(csi_driver_bin(), args).await.expect("start fake-csi-driver")
}

/// One call a handler received.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Call {
    Validate(String),
    Register(String, PathBuf),
    Deregister(String, PathBuf),
}

/// A handler for type `Example` that records its calls; `register` can be
/// held at a gate so a test can act while a registration is in progress.
#[derive(Default)]
pub struct RecordingHandler {
    calls: Mutex<Vec<Call>>,
    changed: watch::Sender<usize>,
    gate: Mutex<Option<Arc<Semaphore>>>,
    hang_deregistrations: std::sync::atomic::AtomicBool,
}

impl RecordingHandler {
    pub fn calls(&self) -> Vec<Call> {
        self.calls.lock().expect("lock").clone()
    }

    fn record(&self, call: Call) {
        let mut calls = self.calls.lock().expect("lock");
        calls.push(call);
        self.changed.send_replace(calls.len());
    }

    /// Waits until the recorded calls satisfy `pred`.
    pub async fn wait_calls(&self, what: &str, mut pred: impl FnMut(&[Call]) -> bool) -> Vec<Call> {
        let mut rx = self.changed.subscribe();
        let wait = async {
            loop {
                let calls = self.calls();
                if pred(&calls) {
                    return calls;
                }
                rx.changed().await.expect("handler alive");
            }
        };
        tokio::time::timeout(SOON, wait)
            .await
            .unwrap_or_else(|_| panic!("timed out waiting for {what}; calls: {:?}", self.calls()))
    }

    /// From now on, `deregister` never returns.
    pub fn hang_deregistrations(&self) {
        self.hang_deregistrations.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// From now on, `register` waits until [`release`](Self::release).
    pub fn hold_registrations(&self) -> Arc<Semaphore> {
        let gate = Arc::new(Semaphore::new(0));
        *self.gate.lock().expect("lock") = Some(gate.clone());
        gate
    }
}

#[async_trait]
impl PluginHandler for RecordingHandler {
    async fn validate(&self, plugin: &PluginInfo) -> Result<(), HandlerError> {
        self.record(Call::Validate(plugin.name.clone()));
        if plugin.name.starts_with("invalid") {
            return Err(format!("names starting with 'invalid' are refused (got {:?})", plugin.name).into());
        }
        Ok(())
    }

    async fn register(&self, plugin: &PluginInfo) -> Result<(), HandlerError> {
        self.record(Call::Register(plugin.name.clone(), plugin.socket_path.clone()));
        if plugin.name.starts_with("unregisterable") {
            return Err(format!("names starting with 'unregisterable' cannot register (got {:?})", plugin.name).into());
        }
        let gate = self.gate.lock().expect("lock").clone();
        if let Some(gate) = gate {
            gate.acquire().await.expect("gate open").forget();
        }
        Ok(())
    }

    async fn deregister(&self, plugin: &PluginInfo) {
        self.record(Call::Deregister(plugin.name.clone(), plugin.socket_path.clone()));
        if self.hang_deregistrations.load(std::sync::atomic::Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
    }
}

/// A plugin manager in a temp root dir.
pub struct TestNode {
    pub root: TempDir,
    pub registry_dir: PathBuf,
    pub handle: PluginManagerHandle,
    pub csi_drivers: CsiDriverRegistry,
    pub node_info: InMemoryNodeInfo,
    pub example: Arc<RecordingHandler>,
    shutdown: CancellationToken,
    task: Option<JoinHandle<()>>,
}

/// A temp root dir whose `plugins_registry` exists, for plugins started
/// before the node.
pub fn root_dir() -> (TempDir, PathBuf) {
    let root = rustlet_testkit::node_root::tempdir("rustlet-test-");
    let registry = root.path().join("plugins_registry");
    std::fs::create_dir_all(&registry).expect("mkdir");
    (root, registry)
}

/// Test settings: short backoff, and deadlines that are liveness bounds (a
/// busy machine must not fail a registration that should succeed); tests of
/// hung plugins set [`HANG_DEADLINE`] themselves. The periodic resync is an
/// hour away, so every test proves event-driven behaviour.
pub fn test_config(registry_dir: &Path) -> PluginManagerConfig {
    let mut config = PluginManagerConfig::new(registry_dir);
    config.dial_timeout = LIVENESS_DEADLINE;
    config.get_info_timeout = LIVENESS_DEADLINE;
    config.notify_timeout = LIVENESS_DEADLINE;
    config.initial_backoff = Duration::from_millis(100);
    config.max_backoff = Duration::from_millis(1600);
    config.resync_period = Duration::from_secs(3600);
    config.shutdown_grace = Duration::from_millis(300);
    config
}

/// A deadline on a call that should succeed: far beyond what it takes even on
/// a loaded machine.
pub const LIVENESS_DEADLINE: Duration = Duration::from_secs(10);

/// The deadline tests of hung plugins give the call that hangs.
pub const HANG_DEADLINE: Duration = Duration::from_millis(500);

/// What a [`TestNode`] is started with.
pub struct TestNodeConfig {
    pub plugins: PluginManagerConfig,
    pub csi: CsiHandlerConfig,
}

impl TestNode {
    pub async fn start() -> TestNode {
        let (root, registry) = root_dir();
        Self::start_in(root, registry, |_| {}).await
    }

    pub async fn start_in(root: TempDir, registry_dir: PathBuf, tweak: impl FnOnce(&mut TestNodeConfig)) -> TestNode {
        let _ = rlimit::increase_nofile_limit(u64::MAX);
        let mut test_node_config = TestNodeConfig {
            plugins: test_config(&registry_dir),
            csi: CsiHandlerConfig { node_get_info_timeout: LIVENESS_DEADLINE },
        };
        tweak(&mut test_node_config);
        let TestNodeConfig { plugins: config, csi: csi_config } = test_node_config;
        let csi_drivers = CsiDriverRegistry::new();
        let node_info = InMemoryNodeInfo::new();
        let csi = CsiPluginHandler::new(csi_drivers.clone(), Arc::new(node_info.clone()), csi_config);
        let example = Arc::new(RecordingHandler::default());
        let mut manager = PluginManager::new(config);
        manager.add_handler(PluginType::Csi, Arc::new(csi)).expect("csi handler");
        manager.add_handler(PluginType::Other(EXAMPLE_TYPE.into()), example.clone()).expect("example handler");
        let shutdown = CancellationToken::new();
        let (handle, task) = manager.start(shutdown.clone()).expect("start plugin manager");
        TestNode { root, registry_dir, handle, csi_drivers, node_info, example, shutdown, task: Some(task) }
    }

    pub fn socket(&self, name: &str) -> PathBuf {
        self.registry_dir.join(name)
    }

    pub fn socket_str(&self, name: &str) -> String {
        self.socket(name).display().to_string()
    }

    /// Waits until the published counters satisfy `pred`.
    pub async fn wait_counts(&self, what: &str, pred: impl FnMut(&PluginCounts) -> bool) -> PluginCounts {
        let mut rx = self.handle.counts();
        let result = tokio::time::timeout(SOON * 3, rx.wait_for(pred)).await.map(|r| r.map(|c| *c));
        match result {
            Ok(Ok(counts)) => counts,
            _ => panic!("timed out waiting for {what}; counts: {:?}", *rx.borrow()),
        }
    }

    pub fn status(&self) -> Vec<PluginStatus> {
        self.handle.status()
    }

    pub async fn status_of(&self, socket: &Path) -> Option<PluginStatus> {
        self.status().into_iter().find(|s| s.socket_path == socket)
    }

    pub fn events(&self) -> broadcast::Receiver<PluginEvent> {
        self.handle.subscribe()
    }

    /// Starts shutting down and waits until the manager stopped taking work.
    pub async fn begin_shutdown(&self) {
        self.shutdown.cancel();
        tokio::time::timeout(SOON, self.handle.closed()).await.expect("manager closes in time");
    }

    pub async fn stop(mut self) {
        self.shutdown.cancel();
        if let Some(task) = self.task.take() {
            tokio::time::timeout(SOON, task).await.expect("stops in time").expect("task ok");
        }
    }
}

impl Drop for TestNode {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// Waits for the next event matching `pred`.
pub async fn next_event(
    events: &mut broadcast::Receiver<PluginEvent>,
    what: &str,
    mut pred: impl FnMut(&PluginEvent) -> bool,
) -> PluginEvent {
    let wait = async {
        loop {
            match events.recv().await {
                Ok(event) if pred(&event) => return event,
                Ok(_) => {}
                Err(e) => panic!("event stream: {e}"),
            }
        }
    };
    tokio::time::timeout(SOON, wait).await.unwrap_or_else(|_| panic!("timed out waiting for {what}"))
}

pub fn registered_at(socket: &Path) -> impl FnMut(&PluginEvent) -> bool + '_ {
    move |e| matches!(e, PluginEvent::Registered(info) if info.socket_path == socket)
}

pub fn deregistered_at(socket: &Path) -> impl FnMut(&PluginEvent) -> bool + '_ {
    move |e| matches!(e, PluginEvent::Deregistered(info) if info.socket_path == socket)
}

pub fn failed_at(socket: &Path) -> impl FnMut(&PluginEvent) -> bool + '_ {
    move |e| matches!(e, PluginEvent::RegistrationFailed { socket_path, .. } if socket_path == socket)
}

thread_local! {
    /// Where the current thread's log lines go while a `LogCapture` lives.
    static CAPTURE: std::cell::RefCell<Option<Arc<Mutex<Vec<u8>>>>> = const { std::cell::RefCell::new(None) };
}

/// Captured log output of the current thread (use a current-thread runtime so
/// every task logs here).
///
/// One global subscriber asks, at every event, whether the thread captures.
/// A subscriber scoped to the test (`set_default`) would be simpler, but when
/// the tests of one binary run on parallel threads (`cargo test`), tracing's
/// per-call-site cache can record "nobody is interested" for a call site
/// first hit by another test, and this test then misses its events.
pub struct LogCapture {
    buffer: Arc<Mutex<Vec<u8>>>,
}

impl LogCapture {
    pub fn start() -> LogCapture {
        static INSTALL: std::sync::Once = std::sync::Once::new();
        INSTALL.call_once(|| {
            use tracing_subscriber::Layer as _;
            use tracing_subscriber::layer::SubscriberExt as _;
            let capture = tracing_subscriber::fmt::layer().with_ansi(false).with_writer(|| CaptureWriter).with_filter(
                tracing_subscriber::filter::dynamic_filter_fn(|meta, _| {
                    *meta.level() <= tracing::Level::DEBUG && CAPTURE.with(|c| c.borrow().is_some())
                }),
            );
            tracing::subscriber::set_global_default(tracing_subscriber::registry().with(capture))
                .expect("no other global subscriber in the test binaries");
        });
        let buffer = Arc::new(Mutex::new(Vec::new()));
        CAPTURE.with(|c| *c.borrow_mut() = Some(buffer.clone()));
        LogCapture { buffer }
    }

    pub fn lines(&self) -> Vec<String> {
        String::from_utf8_lossy(&self.buffer.lock().expect("lock")).lines().map(str::to_owned).collect()
    }
}

impl Drop for LogCapture {
    fn drop(&mut self) {
        CAPTURE.with(|c| *c.borrow_mut() = None);
    }
}

struct CaptureWriter;

impl std::io::Write for CaptureWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        CAPTURE.with(|c| {
            if let Some(buffer) = &*c.borrow() {
                buffer.lock().expect("lock").extend_from_slice(buf);
            }
        });
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Waits until the file at `path` exists and its content satisfies `pred`
/// (checked on every inotify event of its directory, within [`SOON`]).
pub async fn wait_file(path: &Path, pred: impl FnMut(&str) -> bool) -> String {
    rustlet_testkit::wait_file(path, pred, SOON).await
}
