//! Rustlet's WebAssembly provider: pods whose containers are WebAssembly
//! modules (WASI preview 1) or components (WASI preview 2 CLI world),
//! pulled from OCI registries into a content-addressed store under the
//! node's root dir and run under wasmtime.
//!
//! ```no_run
//! # async fn example() -> Result<(), rustlet_wasi::StartError> {
//! use std::sync::Arc;
//! use kubelet::node::{NodeBuilder, NodeConfig};
//! use rustlet_wasi::{WasiConfig, WasiProvider};
//!
//! let config = NodeConfig::new("/tmp/rustlet", "node-a");
//! let provider = WasiProvider::new(WasiConfig::new(&config.root_dir))?;
//! let builder = NodeBuilder::new(config).provider(Arc::new(provider));
//! # let _ = builder; Ok(()) }
//! ```
//!
//! What a container gets:
//! - argv: `command` + `args` (argv\[0\] is `command[0]`, else the
//!   container's name followed by `args`, else the image's entrypoint);
//! - env: the run options' (device env included);
//! - every volume and directory device mount preopened at its container
//!   path (`readOnly` honoured), `workingDir` as the initial directory;
//! - stdout and stderr in its CRI log file;
//! - `resources.limits.memory` as a cap on all its linear memories and
//!   tables together (exceeding it ends the container with reason
//!   `OOMKilled`); without one, [`DEFAULT_MEMORY_LIMIT`] (configurable).
//!
//! A pod's instances (its containers and their exec instances) also share
//! one budget: the sum of its containers' limits (or defaults), enforced as
//! a cap: one pod growing without end is OOMKilled at its budget, and its
//! neighbours and the node go on. Admission counts what upstream's does,
//! the containers' requests, plus a small measured overhead per running
//! instance ([`INSTANCE_OVERHEAD`], as a RuntimeClass's declared
//! `overhead`); the budget is not reserved, so pods without requests are
//! admitted as upstream admits BestEffort pods.

#![deny(missing_docs)]

pub mod cpu;
pub mod dense;
pub mod examples;
pub mod import;
pub mod logs;
pub mod pull;
pub mod runtime;
pub mod store;

/// Takes `mutex` whether or not an earlier holder panicked. A panic in
/// one pod's call (a bug, or a guest that drove the host somewhere
/// unexpected) must not turn every later call of every other pod into a
/// panic too, as `.lock().expect(..)` would; what the locks here guard
/// (maps of instances, images and flights) stays usable after a panic
/// between two of its operations.
pub(crate) fn lock<T>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use k8s_openapi::api::core::v1::{Container, Pod, Taint};
use k8s_openapi::jiff::Timestamp;
use kubelet_provider::{
    ContainerExit, ContainerId, ContainerLaunch, ContainerStats, ExecOutput, PreparedImage, Provider, ProviderError,
    ProviderErrorKind, PullSecrets, RunningContainer, SessionStreams, StreamRequest, StreamSession, StreamingEndpoint,
};
use tokio::sync::watch;

use crate::logs::CriLog;
use crate::pull::{PullPolicy, Puller};
pub use crate::runtime::StartError;
use crate::runtime::{Compiled, Output, RunSpec, Runtime, STOPPED_EXIT_CODE, ended};
use crate::store::ImageStore;

/// The node label (and taint) value that marks a WebAssembly node, as
/// Krustlet did.
pub(crate) const WASM_ARCH: &str = "wasm32-wasi";

/// The provider's settings.
#[derive(Clone, Debug)]
pub struct WasiConfig {
    /// The node's root dir (images go under `images/`).
    pub root_dir: PathBuf,
    /// Registry credentials: a docker `config.json` (default
    /// `<root-dir>/config.json`, where the kubelet looks too).
    pub credentials_file: PathBuf,
    /// Pulled images unused for this long are removed (upstream's image
    /// minimum GC age is 2 minutes); imported images are kept.
    pub image_gc_min_age: Duration,
    /// How often unused images are looked for.
    pub image_gc_period: Duration,
    /// Threads that run modules (default: one per cpu).
    pub threads: usize,
    /// The kernel's limit on the process's memory mappings (default: read
    /// from `/proc/sys/vm/max_map_count`); it bounds how many pods the
    /// provider can hold ([`Provider::pod_ceiling`]).
    pub max_map_count: Option<u64>,
    /// The memory limit of a container that sets none
    /// ([`DEFAULT_MEMORY_LIMIT`]).
    pub default_memory_limit: u64,
}

/// The memory limit of a container that sets none: all its linear
/// memories and tables together. (A process-based kubelet lets such a
/// container use what the node has; here modules run in the node's own
/// process, so an unbounded one would take the node with it.)
pub const DEFAULT_MEMORY_LIMIT: u64 = 256 << 20;

/// How often the provider looks whether removed pods left heap to give
/// back.
const TRIM_TICK: Duration = Duration::from_secs(2);
/// Removals after which the heap is trimmed even while more go on.
const TRIM_AFTER: u64 = 1000;

/// Mappings kept for the node's own use (libraries, threads' stacks, heap
/// arenas, sockets' buffers) when counting what pods may take.
pub const RESERVED_MAPPINGS: u64 = 8192;
/// Mappings each pod is counted for: one linear memory (async stacks share
/// slabs of 64, two mappings per slab; adjacent memories often share one).
/// Measured: 0.03–0.05 per idle pod of one container. A pod with several
/// containers, exec instances or a component with several core modules
/// takes more; the reserve above absorbs some of that.
pub const MAPPINGS_PER_POD: u64 = 1;
/// Address space each pod is counted for against a finite `RLIMIT_AS`: an
/// async stack and room for a small linear memory.
pub(crate) const ADDRESS_SPACE_PER_POD: u64 = 4 << 20;
/// Memory each running instance costs beyond its linear memory (its
/// stack's touched pages, store, WASI context and the node's bookkeeping),
/// added to the pod's memory request in admission. Measured: 78 KiB per
/// idle pod of the `sleep` example with 10,000 pods, module included.
pub const INSTANCE_OVERHEAD: u128 = 128 << 10;

/// The most pods the process can hold, from `vm.max_map_count` and
/// `RLIMIT_AS`, and why.
fn pod_ceiling(max_map_count: Option<u64>) -> Option<(usize, String)> {
    let map_count = max_map_count
        .or_else(|| std::fs::read_to_string("/proc/sys/vm/max_map_count").ok().and_then(|v| v.trim().parse().ok()));
    let by_maps = map_count.map(|count| {
        (
            count.saturating_sub(RESERVED_MAPPINGS) / MAPPINGS_PER_POD,
            format!(
                "vm.max_map_count {count}: {RESERVED_MAPPINGS} mappings kept for the node, {MAPPINGS_PER_POD} per WebAssembly pod"
            ),
        )
    });
    let by_space = rlimit::getrlimit(rlimit::Resource::AS).ok().filter(|(soft, _)| *soft != rlimit::INFINITY).map(
        |(soft, _)| {
            (
                soft.saturating_sub(1 << 30) / ADDRESS_SPACE_PER_POD,
                format!(
                    "address space limit (RLIMIT_AS) {soft} bytes: 1 GiB kept for the node, {ADDRESS_SPACE_PER_POD} bytes per WebAssembly pod"
                ),
            )
        },
    );
    let (pods, why) = by_maps.into_iter().chain(by_space).min_by_key(|c| c.0)?;
    Some((usize::try_from(pods).unwrap_or(usize::MAX), why))
}

impl WasiConfig {
    /// Defaults for a node rooted at `root_dir`.
    pub fn new(root_dir: &Path) -> WasiConfig {
        WasiConfig {
            root_dir: root_dir.to_path_buf(),
            credentials_file: root_dir.join("config.json"),
            image_gc_min_age: Duration::from_secs(120),
            image_gc_period: Duration::from_secs(60),
            threads: std::thread::available_parallelism().map_or(2, |n| n.get()),
            max_map_count: None,
            default_memory_limit: DEFAULT_MEMORY_LIMIT,
        }
    }
}

/// The container's limit on `resource`, parsed by `parse`.
fn limit(
    container: &k8s_openapi::api::core::v1::Container,
    resource: &str,
    parse: fn(&str) -> Result<u128, kubelet_provider::quantity::QuantityError>,
) -> Result<Option<u64>, ProviderError> {
    let quantity = container.resources.as_ref().and_then(|r| r.limits.as_ref()).and_then(|l| l.get(resource));
    let Some(quantity) = quantity else { return Ok(None) };
    let value = parse(&quantity.0)
        .map_err(|e| ProviderError::new(ProviderErrorKind::Config, format!("{resource} limit: {e}")))?;
    Ok(Some(u64::try_from(value).unwrap_or(u64::MAX)))
}

/// A container's memory limit, or `default`.
fn memory_limit_or(container: &Container, default: u64) -> u64 {
    limit(container, "memory", kubelet_provider::quantity::parse_units).ok().flatten().unwrap_or(default)
}

/// The pod's memory budget: its long-running containers' limits (or
/// `default`) summed, or the largest init container's if that is more.
fn pod_memory_budget(pod: &Pod, default: u64) -> u64 {
    let spec = pod.spec.as_ref();
    let init = spec.and_then(|s| s.init_containers.as_deref()).unwrap_or_default();
    let sidecars = init.iter().filter(|c| c.restart_policy.as_deref() == Some("Always"));
    let running: u64 = spec
        .map(|s| s.containers.iter())
        .into_iter()
        .flatten()
        .chain(sidecars)
        .map(|c| memory_limit_or(c, default))
        .fold(0, u64::saturating_add);
    let largest_init = init.iter().map(|c| memory_limit_or(c, default)).max().unwrap_or(0);
    running.max(largest_init)
}

/// How much of an exec's stdout and stderr is kept (each); a module
/// writing more gets a write error.
const EXEC_OUTPUT_LIMIT: usize = 64 * 1024;

/// An exec: a fresh instance with the client's streams.
struct ExecSession {
    runtime: Arc<Runtime>,
    threads: tokio::runtime::Handle,
    compiled: Compiled,
    spec: RunSpec,
}

#[async_trait]
impl StreamSession for ExecSession {
    async fn run(self: Box<Self>, streams: SessionStreams) -> Result<i32, ProviderError> {
        let ExecSession { runtime, threads, compiled, mut spec } = *self;
        spec.output = Output::Session(Arc::new(Mutex::new(Some(streams))));
        // The instance ends with the session: a client that leaves stops it.
        // Not supervised: one exec session's instance, aborted with the session.
        let mut run = AbortOnDrop(threads.spawn(async move { runtime.run(compiled, spec).await }));
        match (&mut run.0).await {
            Ok(exit) => Ok(exit.exit_code),
            Err(e) => Err(ProviderError::new(ProviderErrorKind::Other, format!("exec: {e}"))),
        }
    }
}

/// An attach: the running module's output as it writes it.
struct AttachSession {
    output: tokio::sync::broadcast::Receiver<logs::Attached>,
    exit: watch::Receiver<Option<ContainerExit>>,
    /// A terminal: stderr goes to stdout.
    merge: bool,
}

#[async_trait]
impl StreamSession for AttachSession {
    async fn run(self: Box<Self>, streams: SessionStreams) -> Result<i32, ProviderError> {
        use tokio::io::AsyncWriteExt as _;
        let AttachSession { mut output, mut exit, merge } = *self;
        let (mut stdout, mut stderr) = (streams.stdout, streams.stderr);
        loop {
            let (written, ended) = tokio::select! {
                written = output.recv() => (Some(written), None),
                ended = exit.wait_for(Option::is_some) => {
                    (None, Some(ended.ok().and_then(|e| e.as_ref().map(|e| e.exit_code)).unwrap_or(0)))
                }
            };
            match written {
                Some(Ok((is_stderr, bytes))) => {
                    let target = if is_stderr && !merge { stderr.as_mut() } else { stdout.as_mut() };
                    if let Some(target) = target
                        && target.write_all(&bytes).await.is_err()
                    {
                        // The client went away.
                        return Ok(0);
                    }
                }
                Some(Err(tokio::sync::broadcast::error::RecvError::Lagged(missed))) => {
                    tracing::debug!(missed, "an attached client fell behind; output skipped");
                }
                Some(Err(tokio::sync::broadcast::error::RecvError::Closed)) => return Ok(0),
                None => {}
            }
            if let Some(code) = ended {
                // What was written before the end is sent first.
                while let Ok((is_stderr, bytes)) = output.try_recv() {
                    let target = if is_stderr && !merge { stderr.as_mut() } else { stdout.as_mut() };
                    if let Some(target) = target {
                        let _ = target.write_all(&bytes).await;
                    }
                }
                return Ok(code);
            }
        }
    }
}

/// A task aborted when dropped.
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

struct Instance {
    /// The module and what it runs with: an exec probe runs a fresh
    /// instance of it with the probe's command as its arguments.
    template: (Compiled, RunSpec),
    /// The running instance's log (attach follows what it writes).
    log: CriLog,
    exit: watch::Receiver<Option<ContainerExit>>,
    stop: watch::Sender<bool>,
}

/// Runs WebAssembly containers.
pub struct WasiProvider {
    store: ImageStore,
    puller: Arc<Puller>,
    runtime: Arc<Runtime>,
    threads: Option<tokio::runtime::Runtime>,
    instances: Mutex<HashMap<ContainerId, Instance>>,
    /// Each pod's containers in `instances` (a pod's removal looks up its
    /// own, whatever the number of pods).
    pod_containers: Mutex<HashMap<String, Vec<ContainerId>>>,
    /// Pods removed since the heap was last trimmed.
    removed_since_trim: Arc<AtomicU64>,
    /// Image names each pod uses (they are not garbage-collected).
    pod_images: Arc<Mutex<HashMap<String, HashSet<String>>>>,
    next: AtomicU64,
    ceiling: Option<(usize, String)>,
    /// Each pod's memory budget, shared by its instances.
    budgets: Mutex<HashMap<String, Arc<crate::runtime::MemoryBudget>>>,
    default_memory_limit: u64,
}

impl Drop for WasiProvider {
    fn drop(&mut self) {
        if let Some(threads) = self.threads.take() {
            threads.shutdown_background();
        }
    }
}

impl WasiProvider {
    /// A provider with `config`: opens the image store, starts the wasm
    /// threads and the image garbage collector.
    pub fn new(config: WasiConfig) -> Result<WasiProvider, StartError> {
        let store = ImageStore::open(&config.root_dir)?;
        let puller = Arc::new(Puller::new(store.clone(), config.credentials_file.clone()));
        let runtime = Arc::new(Runtime::new()?);
        let threads = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(config.threads.max(1))
            .thread_name("wasm")
            .enable_all()
            .build()
            .map_err(|source| StartError::Threads { what: "wasm threads", source })?;
        let pod_images: Arc<Mutex<HashMap<String, HashSet<String>>>> = Arc::default();
        let collector = (store.clone(), runtime.clone(), pod_images.clone());
        // Not supervised: the provider's image collector, on its own threads; a panic in one round is caught and logged, and the next round runs.
        threads.spawn(async move {
            let (store, runtime, pod_images) = collector;
            loop {
                tokio::time::sleep(config.image_gc_period).await;
                let round = std::panic::AssertUnwindSafe(|| {
                    collect_garbage(&store, &runtime, &pod_images, config.image_gc_min_age);
                });
                if let Err(panic) = std::panic::catch_unwind(round) {
                    let message = kubelet_support::health::panic_message(&*panic);
                    tracing::error!(panic = %message, "image garbage collection panicked; the next round runs as planned");
                }
            }
        });
        // The heap keeps what removed pods freed unless told to give it
        // back: it is trimmed once a burst of removals has settled (no
        // removal for a whole tick), or after every TRIM_AFTER removals
        // while they go on.
        let removed_since_trim = Arc::new(AtomicU64::new(0));
        let removed = removed_since_trim.clone();
        // Not supervised: the provider's heap trimmer, on its own threads; the trim runs on a blocking thread, whose panic is only a failed trim.
        threads.spawn(async move {
            let mut seen = 0;
            loop {
                tokio::time::sleep(TRIM_TICK).await;
                let now = removed.load(Ordering::Relaxed);
                if (now > 0 && now == seen) || now >= TRIM_AFTER {
                    removed.fetch_sub(now, Ordering::Relaxed);
                    seen = 0;
                    let _ = tokio::task::spawn_blocking(dense::release_free_heap).await;
                } else {
                    seen = now;
                }
            }
        });
        Ok(WasiProvider {
            store,
            puller,
            runtime,
            threads: Some(threads),
            instances: Mutex::new(HashMap::new()),
            pod_containers: Mutex::default(),
            removed_since_trim,
            pod_images,
            next: AtomicU64::new(0),
            ceiling: pod_ceiling(config.max_map_count),
            budgets: Mutex::default(),
            default_memory_limit: config.default_memory_limit,
        })
    }

    /// The image store.
    pub fn images(&self) -> &ImageStore {
        &self.store
    }

    /// How many pulls reached a registry.
    pub fn pull_count(&self) -> u64 {
        self.puller.pull_count()
    }

    /// How many modules were compiled.
    pub fn compilations(&self) -> u64 {
        self.runtime.compilations()
    }

    /// The memory budget of `pod` (made at its first container): the sum
    /// of its containers' memory limits, a container without one counted
    /// at the default; init containers (one at a time, before the others)
    /// count with the largest of them.
    fn budget(&self, pod: &Pod) -> Arc<crate::runtime::MemoryBudget> {
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        let limit = pod_memory_budget(pod, self.default_memory_limit);
        crate::lock(&self.budgets)
            .entry(uid)
            .or_insert_with(|| Arc::new(crate::runtime::MemoryBudget::new(limit)))
            .clone()
    }

    /// What `pod`'s instances hold now against its memory budget, and the
    /// budget (none before its first container).
    pub fn memory_budget(&self, pod_uid: &str) -> Option<(u64, u64)> {
        crate::lock(&self.budgets).get(pod_uid).map(|b| (b.used(), b.limit()))
    }

    fn threads(&self) -> &tokio::runtime::Handle {
        self.threads.as_ref().expect("present until drop").handle()
    }
}

fn collect_garbage(
    store: &ImageStore,
    runtime: &Runtime,
    pod_images: &Mutex<HashMap<String, HashSet<String>>>,
    min_age: Duration,
) {
    let in_use: HashSet<String> = crate::lock(pod_images).values().flatten().cloned().collect();
    let cutoff = Timestamp::now() - jiff::SignedDuration::try_from(min_age).unwrap_or_default();
    match store.collect_garbage(&in_use, cutoff) {
        Ok(removed) => {
            for image in removed {
                tracing::info!(image = %image.name, id = %image.id, "unused image removed");
            }
        }
        Err(error) => tracing::warn!(%error, "image garbage collection failed"),
    }
    if let Ok(images) = store.list() {
        runtime.forget_except(&images.into_iter().map(|i| i.module).collect());
    }
}

/// The node-side name of a container's image.
fn image_of(container: &Container) -> Result<&str, ProviderError> {
    container.image.as_deref().filter(|i| !i.trim().is_empty()).ok_or_else(|| {
        ProviderError::new(ProviderErrorKind::Config, format!("container {:?} names no image", container.name))
    })
}

fn pull_error(error: pull::PullError) -> ProviderError {
    let kind = match error.kind {
        pull::PullErrorKind::NeverPull => ProviderErrorKind::ImageNeverPull,
        _ => ProviderErrorKind::ImagePull,
    };
    ProviderError::new(kind, error.message)
}

/// argv for a container: `command` + `args`; with no `command`, the
/// container's name as argv\[0\], then `args`, else the image's default
/// arguments after its entrypoint.
fn argv(container: &Container, launch: &ContainerLaunch, default_args: &[String]) -> Vec<String> {
    let options = &launch.run_options;
    if !options.command.is_empty() {
        return options.command.iter().chain(options.args.iter()).cloned().collect();
    }
    let program = default_args.first().cloned().unwrap_or_else(|| container.name.clone());
    let rest: Vec<String> =
        if options.args.is_empty() { default_args.iter().skip(1).cloned().collect() } else { options.args.clone() };
    std::iter::once(program).chain(rest).collect()
}

/// The wasmtime release this provider is built with (the workspace pins it).
pub(crate) const WASMTIME_VERSION: &str = "48.0.8";

#[async_trait]
impl Provider for WasiProvider {
    async fn prepare_image(&self, pod: &Pod, container: &Container) -> Result<PreparedImage, ProviderError> {
        self.prepare_image_with_secrets(pod, container, &PullSecrets::default()).await
    }

    async fn prepare_image_with_secrets(
        &self,
        pod: &Pod,
        container: &Container,
        secrets: &PullSecrets,
    ) -> Result<PreparedImage, ProviderError> {
        // The pod's secrets in its order (the first naming a registry wins),
        // then the node's config.json.
        let mut credentials = pull::Credentials::default();
        for (n, config) in secrets.0.iter().enumerate() {
            match pull::Credentials::parse(config) {
                Ok(parsed) => credentials.fill_from(parsed),
                Err(error) => {
                    tracing::warn!(secret = n, %error, "an image pull secret is not a docker config; skipped")
                }
            }
        }
        let image = image_of(container)?;
        let policy = PullPolicy::of(container.image_pull_policy.as_deref(), image);
        let puller = self.puller.clone();
        let owned = image.to_owned();
        // On the provider's threads: a slow registry never holds the node's.
        let record = self
            .threads()
            // Not supervised: one pull, awaited here.
            .spawn(async move { puller.ensure_with(&owned, policy, credentials).await })
            .await
            .map_err(|e| ProviderError::new(ProviderErrorKind::Other, e.to_string()))?
            .map_err(pull_error)?;
        if let Err(error) = self.store.touch(&record) {
            tracing::warn!(%error, "cannot record the image's use");
        }
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        crate::lock(&self.pod_images).entry(uid).or_default().insert(record.name.clone());
        Ok(PreparedImage { image_id: format!("{}@{}", record.name.split('@').next().unwrap_or_default(), record.id) })
    }

    async fn start_container(&self, launch: &ContainerLaunch) -> Result<ContainerId, ProviderError> {
        let container = &launch.container;
        let image = image_of(container)?;
        let name = pull::parse_reference(image).map_err(pull_error)?.whole();
        let cannot_run = |message: String| ProviderError::new(ProviderErrorKind::CannotRun, message);
        let record = self
            .store
            .get(&name)
            .map_err(|e| cannot_run(e.to_string()))?
            .ok_or_else(|| cannot_run(format!("image \"{image}\" is not in the image store")))?;
        let store = self.store.clone();
        let module = record.module.clone();
        let compiled = self
            .runtime
            .compiled(&record.module, record.kind, move || store.read_blob(&module).map_err(|e| e.to_string()))
            .await
            .map_err(|e| cannot_run(format!("image \"{image}\": {e}")))?;

        let options = &launch.run_options;
        let mut preopens = Vec::new();
        for mount in &options.mounts {
            let what = match &mount.volume {
                Some(volume) => format!("volume {volume:?}"),
                None => "device mount".to_owned(),
            };
            match std::fs::metadata(&mount.host_path) {
                Ok(meta) if meta.is_dir() => {
                    preopens.push((mount.host_path.clone(), mount.container_path.clone(), mount.read_only))
                }
                // A device plugin's mount that is not a directory (a
                // device node, a socket, nothing yet): WASI cannot preopen
                // it, and the module still gets the device's env.
                _ if mount.volume.is_none() => {
                    tracing::debug!(path = %mount.host_path.display(), "device mount is not a directory; not preopened");
                }
                Ok(_) => {
                    return Err(cannot_run(format!(
                        "{what} at {}: host path {} is not a directory (WASI preopens directories only)",
                        mount.container_path,
                        mount.host_path.display()
                    )));
                }
                Err(e) => {
                    return Err(cannot_run(format!(
                        "{what} at {}: host path {}: {e}",
                        mount.container_path,
                        mount.host_path.display()
                    )));
                }
            }
        }
        let memory_limit = limit(container, "memory", kubelet_provider::quantity::parse_units)?;
        let cpu_limit_milli = limit(container, "cpu", kubelet_provider::quantity::parse_milli)?;
        let log = CriLog::open(&launch.log_path).map_err(|e| {
            ProviderError::new(ProviderErrorKind::Other, format!("log {}: {e}", launch.log_path.display()))
        })?;
        let spec = RunSpec {
            args: argv(container, launch, &record.default_args),
            env: options.env.iter().map(|v| (v.name.clone(), v.value.clone())).collect(),
            preopens,
            cwd: options.working_dir.clone(),
            memory_limit: Some(crate::runtime::MemoryLimit::new(memory_limit.unwrap_or(self.default_memory_limit))),
            budget: Some(self.budget(&launch.pod)),
            cpu_limit_milli,
            cpu: Arc::default(),
            memory: Arc::default(),
            output: Output::Log(log.clone()),
        };
        // The template keeps no log file open: an exec's output is
        // captured.
        let template = (compiled.clone(), RunSpec { output: Output::capture(0), ..spec.clone() });
        let pod_uid = launch.pod.metadata.uid.clone().unwrap_or_default();
        let id = ContainerId(format!(
            "wasm-{}-{}-{}",
            &pod_uid.get(..8).unwrap_or(&pod_uid),
            container.name,
            self.next.fetch_add(1, Ordering::Relaxed)
        ));
        let (exit_tx, exit) = watch::channel(None);
        let (stop, mut stopped) = watch::channel(false);
        let runtime = self.runtime.clone();
        let task_id = id.clone();
        let attach_log = log.clone();
        // Not supervised: one container's instance, for as long as it runs.
        self.threads().spawn(async move {
            let exit = tokio::select! {
                exit = runtime.run(compiled, spec) => exit,
                _ = stopped.wait_for(|s| *s) => {
                    log.finish();
                    ended(STOPPED_EXIT_CODE, None, Some("stopped by the node".into()))
                }
            };
            tracing::debug!(container = %task_id, exit_code = exit.exit_code, "module ended");
            let _ = exit_tx.send(Some(exit));
        });
        crate::lock(&self.pod_containers).entry(pod_uid).or_default().push(id.clone());
        let instance = Instance { template, log: attach_log, exit, stop };
        crate::lock(&self.instances).insert(id.clone(), instance);
        Ok(id)
    }

    async fn wait_container(&self, id: &ContainerId) -> Result<ContainerExit, ProviderError> {
        let exit = crate::lock(&self.instances).get(id).map(|i| i.exit.clone());
        let Some(mut exit) = exit else {
            return Err(ProviderError::new(ProviderErrorKind::NotFound, format!("no container {id}")));
        };
        let ended = exit
            .wait_for(Option::is_some)
            .await
            .map_err(|_| ProviderError::new(ProviderErrorKind::Other, format!("container {id}: its task is gone")))?;
        Ok(ended.clone().expect("waited for Some"))
    }

    async fn update_container_resources(
        &self,
        _pod: &Pod,
        id: &ContainerId,
        container: &Container,
    ) -> Result<(), ProviderError> {
        // The memory limit is what an instance may grow to: a new one holds
        // from its next growth (what it holds already is kept). The cpu
        // limit is read at start.
        let bytes = limit(container, "memory", kubelet_provider::quantity::parse_units)?;
        let instances = crate::lock(&self.instances);
        let Some(instance) = instances.get(id).filter(|i| i.exit.borrow().is_none()) else {
            return Err(ProviderError::new(ProviderErrorKind::NotFound, format!("container {id} is not running")));
        };
        if let Some(cell) = &instance.template.1.memory_limit {
            cell.set(bytes.unwrap_or(self.default_memory_limit));
        }
        Ok(())
    }

    async fn update_pod_resources(&self, pod: &Pod) -> Result<(), ProviderError> {
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        if let Some(budget) = crate::lock(&self.budgets).get(&uid) {
            budget.set_limit(pod_memory_budget(pod, self.default_memory_limit));
        }
        Ok(())
    }

    async fn stop_container(&self, id: &ContainerId, _grace: Duration) -> Result<(), ProviderError> {
        // A module cannot handle SIGTERM: it is interrupted at its next
        // epoch tick, well within any grace period.
        let exit = {
            let instances = crate::lock(&self.instances);
            let Some(instance) = instances.get(id) else { return Ok(()) };
            let _ = instance.stop.send(true);
            instance.exit.clone()
        };
        let mut exit = exit;
        let _ = exit.wait_for(Option::is_some).await;
        Ok(())
    }

    async fn exec_sync(
        &self,
        id: &ContainerId,
        command: &[String],
        timeout: Duration,
    ) -> Result<ExecOutput, ProviderError> {
        let template = {
            let instances = crate::lock(&self.instances);
            instances.get(id).filter(|i| i.exit.borrow().is_none()).map(|i| i.template.clone())
        };
        let Some((compiled, mut spec)) = template else {
            return Err(ProviderError::new(ProviderErrorKind::NotFound, format!("container {id} is not running")));
        };
        let output = Output::capture(EXEC_OUTPUT_LIMIT);
        spec.args = command.to_vec();
        spec.output = output.clone();
        spec.cpu = Arc::default();
        spec.memory = Arc::default();
        let runtime = self.runtime.clone();
        // The instance yields at every epoch tick: aborting ends it, at the
        // timeout or when the caller (a probe of a container that ended)
        // goes away.
        // Not supervised: one exec's instance, aborted at its timeout or with its caller.
        let mut run = AbortOnDrop(self.threads().spawn(async move { runtime.run(compiled, spec).await }));
        let exit = match tokio::time::timeout(timeout, &mut run.0).await {
            Ok(Ok(exit)) => exit,
            Ok(Err(e)) => return Err(ProviderError::new(ProviderErrorKind::Other, format!("exec in {id}: {e}"))),
            Err(_) => {
                return Err(ProviderError::new(
                    ProviderErrorKind::Timeout,
                    format!("command {:?} timed out after {timeout:?}", command.join(" ")),
                ));
            }
        };
        let Output::Capture { stdout, stderr } = output else { unreachable!("made as a capture above") };
        let mut stderr = stderr.contents().to_vec();
        if let Some(message) = exit.message {
            stderr.extend_from_slice(message.as_bytes());
        }
        Ok(ExecOutput { exit_code: exit.exit_code, stdout: stdout.contents().to_vec(), stderr })
    }

    /// CPU time as measured around every poll of the module (exec probes
    /// not included); memory is the instance's linear memory.
    async fn reopen_container_log(&self, id: &ContainerId) -> Result<(), ProviderError> {
        let log = crate::lock(&self.instances).get(id).map(|i| i.log.clone());
        let Some(log) = log else {
            return Err(ProviderError::new(ProviderErrorKind::NotFound, format!("container {id} is not running")));
        };
        log.reopen()
            .map_err(|e| ProviderError::new(ProviderErrorKind::Other, format!("reopening the log of {id}: {e}")))
    }

    async fn container_stats(&self, id: &ContainerId) -> Result<ContainerStats, ProviderError> {
        let instances = crate::lock(&self.instances);
        let Some(instance) = instances.get(id).filter(|i| i.exit.borrow().is_none()) else {
            return Err(ProviderError::new(ProviderErrorKind::NotFound, format!("container {id} is not running")));
        };
        let spec = &instance.template.1;
        let cpu = u64::try_from(spec.cpu.used().as_nanos()).unwrap_or(u64::MAX);
        let memory = spec.memory.load(Ordering::Acquire);
        Ok(ContainerStats {
            cpu_usage_core_nanoseconds: Some(cpu),
            memory_working_set_bytes: Some(memory),
            memory_usage_bytes: Some(memory),
            // Linear memory is all the instance's own.
            memory_rss_bytes: Some(memory),
            // Instances share the node's process: no faults of their own.
            memory_page_faults: None,
            memory_major_page_faults: None,
            fs_used_bytes: None,
        })
    }

    /// `kubectl exec`: a fresh instance of the container's module with the
    /// command as its arguments, the container's env, volumes and limits,
    /// and the client's stdin, stdout and stderr.
    async fn exec(&self, id: &ContainerId, request: &StreamRequest) -> Result<StreamingEndpoint, ProviderError> {
        let template = {
            let instances = crate::lock(&self.instances);
            instances.get(id).filter(|i| i.exit.borrow().is_none()).map(|i| i.template.clone())
        };
        let Some((compiled, mut spec)) = template else {
            return Err(ProviderError::new(ProviderErrorKind::NotFound, format!("container {id} is not running")));
        };
        spec.args = request.command.clone();
        spec.cpu = Arc::default();
        spec.memory = Arc::default();
        let session = ExecSession { runtime: self.runtime.clone(), threads: self.threads().clone(), compiled, spec };
        Ok(StreamingEndpoint::Session(Box::new(session)))
    }

    /// `kubectl attach`: what the running module writes from now on, until
    /// it ends or the client leaves. Modules have no stdin to attach to.
    async fn attach(&self, id: &ContainerId, request: &StreamRequest) -> Result<StreamingEndpoint, ProviderError> {
        if request.stdin {
            return Err(ProviderError::new(
                ProviderErrorKind::Unsupported,
                "a WebAssembly container has no stdin to attach to (attach without -i)",
            ));
        }
        let instance = {
            let instances = crate::lock(&self.instances);
            instances.get(id).filter(|i| i.exit.borrow().is_none()).map(|i| (i.log.attach(), i.exit.clone()))
        };
        let Some((output, exit)) = instance else {
            return Err(ProviderError::new(ProviderErrorKind::NotFound, format!("container {id} is not running")));
        };
        Ok(StreamingEndpoint::Session(Box::new(AttachSession { output, exit, merge: request.tty })))
    }

    async fn port_forward(&self, _: &str, _: &[u16]) -> Result<StreamingEndpoint, ProviderError> {
        Err(ProviderError::new(
            ProviderErrorKind::Unsupported,
            "port-forward is not supported for WebAssembly pods: they have no network namespace of their own \
             (a module listening on a port listens on the node's)",
        ))
    }

    async fn running_containers(&self) -> Result<Vec<RunningContainer>, ProviderError> {
        // Modules run inside the node's process: none outlives it.
        Ok(Vec::new())
    }

    /// The instances that have not exited, by pod.
    async fn list_running(&self) -> Result<Vec<(String, ContainerId)>, ProviderError> {
        let pods = crate::lock(&self.pod_containers).clone();
        let instances = crate::lock(&self.instances);
        Ok(pods
            .into_iter()
            .flat_map(|(uid, ids)| ids.into_iter().map(move |id| (uid.clone(), id)))
            .filter(|(_, id)| instances.get(id).is_some_and(|i| i.exit.borrow().is_none()))
            .collect())
    }

    async fn remove_pod(&self, pod_uid: &str) -> Result<(), ProviderError> {
        let ids = crate::lock(&self.pod_containers).remove(pod_uid).unwrap_or_default();
        {
            let mut instances = crate::lock(&self.instances);
            for id in ids {
                instances.remove(&id);
            }
        }
        crate::lock(&self.pod_images).remove(pod_uid);
        crate::lock(&self.budgets).remove(pod_uid);
        self.removed_since_trim.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn runtime_type(&self, _: &Pod) -> String {
        "wasmtime".to_owned()
    }

    fn runtime_version(&self) -> String {
        format!("wasmtime://{WASMTIME_VERSION}")
    }

    fn node_labels(&self) -> BTreeMap<String, String> {
        BTreeMap::from([("kubernetes.io/arch".to_owned(), WASM_ARCH.to_owned())])
    }

    fn pod_overhead(&self, pod: &Pod) -> u128 {
        // What each instance costs the node beside its linear memory, as a
        // RuntimeClass's declared overhead: admission counts it on top of
        // the containers' requests, as upstream's does. The memory budget
        // (limits, or the default) is the enforced cap, not a reservation:
        // a pod without requests is admitted as upstream admits BestEffort
        // pods. Init containers run one at a time, before the others.
        let spec = pod.spec.as_ref();
        let long_running = spec.map_or(0, |s| s.containers.len())
            + spec.and_then(|s| s.init_containers.as_ref()).map_or(0, |init| {
                let sidecars = init.iter().filter(|c| c.restart_policy.as_deref() == Some("Always")).count();
                sidecars + usize::from(sidecars < init.len())
            });
        INSTANCE_OVERHEAD * long_running as u128
    }

    fn pod_ceiling(&self) -> Option<(usize, String)> {
        self.ceiling.clone()
    }

    fn node_taints(&self) -> Vec<Taint> {
        ["NoSchedule", "NoExecute"]
            .into_iter()
            .map(|effect| Taint {
                key: "kubernetes.io/arch".into(),
                value: Some(WASM_ARCH.into()),
                effect: effect.into(),
                time_added: None,
            })
            .collect()
    }
}

#[cfg(test)]
mod lock_tests {
    /// A panic while a lock is held (as in one pod's call) leaves the lock
    /// usable by the next caller, where `.lock().expect(..)` panicked for
    /// every later pod.
    #[test]
    fn a_panic_under_a_lock_does_not_fail_every_later_caller() {
        let shared = std::sync::Arc::new(std::sync::Mutex::new(vec![1]));
        let holder = std::sync::Arc::clone(&shared);
        let panicked = std::thread::spawn(move || {
            let mut guard = super::lock(&holder);
            guard.push(2);
            panic!("a bug in one pod's call");
        })
        .join();
        assert!(panicked.is_err());
        assert!(shared.is_poisoned());
        assert_eq!(*super::lock(&shared), vec![1, 2], "the next caller gets the lock and what it holds");
    }
}
