//! Running modules: one wasmtime engine with an epoch ticker, compiled
//! modules cached by digest, one store per container.
//!
//! - Preview 1 modules run `_start`; preview 2 components run
//!   `wasi:cli/run`.
//! - Every store yields to the executor at each epoch tick (10 ms), so a
//!   module that loops forever shares its threads, and dropping its future
//!   (a stop) ends it within a tick.
//! - A memory limit caps each linear memory; a module that hits it ends
//!   with `OOMKilled`.
//! - Containers run on the provider's own threads, apart from the node's
//!   control loops.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::OnceCell;
use wasmtime::component::{Component, ResourceTable};
use wasmtime::{Config, Engine, Linker, Module, Store, UpdateDeadline};
use wasmtime_wasi::p1::WasiP1Ctx;
use wasmtime_wasi::p2::bindings::CommandPre;
use wasmtime_wasi::p2::pipe::MemoryOutputPipe;
use wasmtime_wasi::{FsPerms, I32Exit, WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView};

use kubelet_provider::ContainerExit;

use crate::cpu::{CpuMeter, Metered, Throttle};
use crate::logs::CriLog;
use crate::store::ModuleKind;

/// How often the epoch advances (each store yields, and a stop lands, at
/// this granularity).
pub(crate) const EPOCH_TICK: Duration = Duration::from_millis(10);

/// The exit code of a module that trapped (as `wasmtime run` reports a
/// trap: 128 + SIGABRT).
pub(crate) const TRAP_EXIT_CODE: i32 = 134;
/// The exit code of a module stopped by the node (128 + SIGTERM: a module
/// cannot handle the signal, so it ends at once).
pub(crate) const STOPPED_EXIT_CODE: i32 = 143;
/// The exit code of a module that went over its memory limit (128 +
/// SIGKILL, as the kernel's OOM killer).
pub(crate) const OOM_EXIT_CODE: i32 = 137;

/// How much of an interactive session's output may wait to be sent.
const SESSION_BUDGET: usize = 64 * 1024;

/// A compiled module, ready to instantiate.
#[derive(Clone)]
pub enum Compiled {
    /// A core module.
    Module(wasmtime::InstancePre<P1State>),
    /// A component.
    Component(CommandPre<P2State>),
}

/// Where a module's stdout and stderr go.
#[derive(Clone)]
pub enum Output {
    /// The container's CRI log file.
    Log(CriLog),
    /// Kept in memory, up to the pipes' capacity (a probe's command).
    Capture {
        /// stdout.
        stdout: MemoryOutputPipe,
        /// stderr.
        stderr: MemoryOutputPipe,
    },
    /// An interactive session's streams (`kubectl exec`), taken by the one
    /// instance that runs with them; a stream the client did not ask for
    /// is empty (stdin) or dropped (output).
    Session(Arc<Mutex<Option<kubelet_provider::SessionStreams>>>),
}

impl Output {
    /// Output kept in memory, up to `capacity` bytes per stream.
    pub fn capture(capacity: usize) -> Output {
        Output::Capture { stdout: MemoryOutputPipe::new(capacity), stderr: MemoryOutputPipe::new(capacity) }
    }
}

/// What a container runs with.
#[derive(Clone)]
pub struct RunSpec {
    /// argv, `argv[0]` first.
    pub args: Vec<String>,
    /// Environment.
    pub env: Vec<(String, String)>,
    /// Preopened directories: host path, guest path, read-only.
    pub preopens: Vec<(PathBuf, String, bool)>,
    /// Initial working directory.
    pub cwd: Option<String>,
    /// The container's memory limit in bytes: all its linear memories and
    /// tables together (shared with the provider, which may change it while
    /// the instance runs: an in-place resize).
    pub memory_limit: Option<MemoryLimit>,
    /// The pod's budget, shared by all its instances (its containers' and
    /// exec's): what they may hold together.
    pub budget: Option<Arc<MemoryBudget>>,
    /// The CPU limit in thousandths of a CPU.
    pub cpu_limit_milli: Option<u64>,
    /// Where the container's CPU time is counted.
    pub cpu: Arc<CpuMeter>,
    /// Where the container's linear memory is counted, in bytes.
    pub memory: Arc<AtomicU64>,
    /// Where stdout and stderr go.
    pub output: Output,
}

impl RunSpec {
    /// A module run with `args` and nothing else: no env, volumes or
    /// limits, its output to `output`.
    pub fn bare(args: Vec<String>, output: Output) -> RunSpec {
        RunSpec {
            args,
            env: Vec::new(),
            preopens: Vec::new(),
            cwd: None,
            memory_limit: None,
            budget: None,
            cpu_limit_milli: None,
            cpu: Arc::default(),
            memory: Arc::default(),
            output,
        }
    }
}

/// Bytes a table element is counted for (a function reference and its
/// type, or an extern reference, with the table's bookkeeping).
pub(crate) const TABLE_ELEMENT_BYTES: usize = 16;

/// A container's memory limit in bytes, which an in-place resize may
/// change while its instances run (growth beyond a lowered limit is
/// refused; what they hold already is kept).
#[derive(Clone, Debug)]
pub struct MemoryLimit(Arc<AtomicU64>);

impl MemoryLimit {
    /// A limit of `bytes`.
    pub fn new(bytes: u64) -> Self {
        MemoryLimit(Arc::new(AtomicU64::new(bytes)))
    }

    /// The limit now.
    pub(crate) fn get(&self) -> u64 {
        self.0.load(Ordering::Acquire)
    }

    /// Changes the limit.
    pub(crate) fn set(&self, bytes: u64) {
        self.0.store(bytes, Ordering::Release);
    }
}

/// What all the instances of one pod may hold at once: linear memories
/// and tables, counted as they grow.
#[derive(Debug)]
pub struct MemoryBudget {
    limit: AtomicU64,
    used: AtomicU64,
}

impl MemoryBudget {
    /// A budget of `limit` bytes.
    pub(crate) fn new(limit: u64) -> Self {
        MemoryBudget { limit: AtomicU64::new(limit), used: AtomicU64::new(0) }
    }

    /// The budget's size.
    pub(crate) fn limit(&self) -> u64 {
        self.limit.load(Ordering::Acquire)
    }

    /// Resizes the budget (an in-place resize of the pod): growth beyond a
    /// lowered budget is refused; what is held already is kept.
    pub(crate) fn set_limit(&self, limit: u64) {
        self.limit.store(limit, Ordering::Release);
    }

    /// What is counted against it now.
    pub(crate) fn used(&self) -> u64 {
        self.used.load(Ordering::Acquire)
    }

    /// Counts `bytes` if they fit.
    fn try_charge(&self, bytes: u64) -> bool {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(bytes).filter(|total| *total <= self.limit())
            })
            .is_ok()
    }

    fn release(&self, bytes: u64) {
        let _ = self.used.fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| Some(used.saturating_sub(bytes)));
    }
}

/// Counts an instance's growth (linear memories and tables, all of them
/// together) against its container's limit and its pod's budget, and in
/// its container's meter; all given back when the store goes.
pub(crate) struct MemLimiter {
    max: Option<MemoryLimit>,
    budget: Option<Arc<MemoryBudget>>,
    hit: bool,
    /// The first size refused: (asked for, limit, whether at creation,
    /// what refused it).
    refused: Option<(usize, usize, bool, &'static str)>,
    /// The memory was created (the limiter's first call is its creation).
    created: bool,
    meter: Arc<AtomicU64>,
    /// Linear memory counted (in the meter).
    counted: u64,
    /// Tables counted.
    tables: u64,
    /// The last growth allowed, until the next: given back if the growth
    /// then fails (`memory_grow_failed`, `table_grow_failed`).
    pending: (u64, bool),
}

impl MemLimiter {
    /// A limiter for one instance.
    pub(crate) fn new(max: Option<MemoryLimit>, budget: Option<Arc<MemoryBudget>>, meter: Arc<AtomicU64>) -> Self {
        MemLimiter {
            max,
            budget,
            hit: false,
            refused: None,
            created: false,
            meter,
            counted: 0,
            tables: 0,
            pending: (0, false),
        }
    }

    /// Allows growing by `grown` bytes (`desired` asked for in all) if the
    /// container's limit and the pod's budget both have room.
    fn grow(&mut self, grown: u64, desired: usize, current: usize, table: bool) -> bool {
        let at_creation = !std::mem::replace(&mut self.created, true) && current == 0;
        self.pending = (0, table);
        let total = self.counted.saturating_add(self.tables).saturating_add(grown);
        if let Some(max) = self.max.as_ref().map(MemoryLimit::get)
            && total > max
        {
            self.hit = true;
            let max = usize::try_from(max).unwrap_or(usize::MAX);
            self.refused.get_or_insert((desired, max, at_creation, "its memory limit"));
            return false;
        }
        if let Some(budget) = &self.budget
            && !budget.try_charge(grown)
        {
            self.hit = true;
            let limit = usize::try_from(budget.limit()).unwrap_or(usize::MAX);
            self.refused.get_or_insert((desired, limit, at_creation, "its pod's memory budget"));
            return false;
        }
        if table {
            self.tables = self.tables.saturating_add(grown);
        } else {
            self.meter.fetch_add(grown, Ordering::AcqRel);
            self.counted = self.counted.saturating_add(grown);
        }
        self.pending = (grown, table);
        true
    }

    /// A growth allowed by [`MemLimiter::grow`] did not happen: it is not
    /// counted.
    fn ungrow(&mut self) {
        let (grown, table) = std::mem::take(&mut self.pending);
        if table {
            self.tables = self.tables.saturating_sub(grown);
        } else {
            self.meter.fetch_sub(grown, Ordering::AcqRel);
            self.counted = self.counted.saturating_sub(grown);
        }
        if let Some(budget) = &self.budget {
            budget.release(grown);
        }
    }
}

impl Drop for MemLimiter {
    fn drop(&mut self) {
        self.meter.fetch_sub(self.counted, Ordering::AcqRel);
        if let Some(budget) = &self.budget {
            budget.release(self.counted.saturating_add(self.tables));
        }
    }
}

impl wasmtime::ResourceLimiter for MemLimiter {
    fn memory_growing(&mut self, current: usize, desired: usize, _maximum: Option<usize>) -> wasmtime::Result<bool> {
        // Called for a memory's creation too (from 0).
        let grown = u64::try_from(desired.saturating_sub(current)).unwrap_or(u64::MAX);
        Ok(self.grow(grown, desired, current, false))
    }

    fn memory_grow_failed(&mut self, error: wasmtime::Error) -> wasmtime::Result<()> {
        tracing::debug!(%error, "a linear memory could not grow; not counted");
        self.ungrow();
        Ok(())
    }

    fn table_growing(&mut self, current: usize, desired: usize, _maximum: Option<usize>) -> wasmtime::Result<bool> {
        let grown =
            u64::try_from(desired.saturating_sub(current).saturating_mul(TABLE_ELEMENT_BYTES)).unwrap_or(u64::MAX);
        Ok(self.grow(grown, desired.saturating_mul(TABLE_ELEMENT_BYTES), current, true))
    }

    fn table_grow_failed(&mut self, error: wasmtime::Error) -> wasmtime::Result<()> {
        tracing::debug!(%error, "a table could not grow; not counted");
        self.ungrow();
        Ok(())
    }
}

/// A preview 1 store's data.
pub struct P1State {
    wasi: WasiP1Ctx,
    limiter: MemLimiter,
}

/// A preview 2 store's data.
pub struct P2State {
    ctx: WasiCtx,
    table: ResourceTable,
    limiter: MemLimiter,
}

impl WasiView for P2State {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView { ctx: &mut self.ctx, table: &mut self.table }
    }
}

/// How the engine lays out each instance's linear memory and async stack.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// wasmtime's defaults, for a few large instances: 4 GiB of address
    /// space and guard regions per linear memory (no bounds checks), a
    /// copy-on-write image of the module's data, one mapping with a guard
    /// page per async stack. About 6 mappings per idle instance.
    WasmtimeDefaults,
    /// For many small instances ([`crate::dense`]): one mapping per linear
    /// memory, sized to it, with bounds checks in compiled code; async
    /// stacks cut from shared slabs. About 1 mapping per idle instance.
    Dense,
}

/// Stack depth compiled wasm code may use (wasmtime's default).
pub(crate) const MAX_WASM_STACK: usize = 512 << 10;
/// Each async stack: wasm's share plus room for host calls (WASI) made
/// from it (wasmtime's default size). Only the pages a module touches
/// cost memory.
pub(crate) const ASYNC_STACK: usize = 2 << 20;

/// The engine, the linkers and the compiled-module cache.
pub struct Runtime {
    engine: Engine,
    p1: Linker<P1State>,
    p2: wasmtime::component::Linker<P2State>,
    compiled: Mutex<HashMap<String, Arc<OnceCell<Compiled>>>>,
    compilations: std::sync::atomic::AtomicU64,
    ticker_stop: Arc<AtomicBool>,
    stacks: Option<Arc<crate::dense::SlabStacks>>,
}

impl Drop for Runtime {
    fn drop(&mut self) {
        self.ticker_stop.store(true, Ordering::Relaxed);
    }
}

/// Why a module could not be compiled.
#[derive(Debug, thiserror::Error)]
pub enum CompileError {
    /// Its bytes could not be had (the store's message).
    #[error("{0}")]
    Read(String),
    /// wasmtime refused it: what it was taken for, and why.
    #[error("{what}: {reason}")]
    Invalid {
        /// `invalid module`, `cannot link`, ...
        what: &'static str,
        /// wasmtime's reason.
        reason: String,
    },
    /// The compilation task died.
    #[error("compilation task: {0}")]
    Task(String),
}

fn invalid(what: &'static str, error: &wasmtime::Error) -> CompileError {
    CompileError::Invalid { what, reason: error.to_string() }
}

/// Why the WebAssembly runtime or provider could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// wasmtime refused the engine's configuration.
    #[error("wasmtime engine: {0}")]
    Engine(String),
    /// WASI preview 1 could not be linked.
    #[error("WASI preview 1: {0}")]
    Preview1(String),
    /// WASI preview 2 could not be linked.
    #[error("WASI preview 2: {0}")]
    Preview2(String),
    /// A thread could not be started.
    #[error("{what}: {source}")]
    Threads {
        /// Which threads (the epoch ticker, the wasm threads).
        what: &'static str,
        /// The system's error.
        source: std::io::Error,
    },
    /// The image store could not be opened.
    #[error(transparent)]
    Store(#[from] crate::store::StoreError),
}

impl Runtime {
    /// A runtime with its epoch ticker running, laid out for many small
    /// instances ([`Layout::Dense`]).
    pub fn new() -> Result<Runtime, StartError> {
        Runtime::with_layout(Layout::Dense)
    }

    /// A runtime with its epoch ticker running, laid out as `layout` says.
    pub fn with_layout(layout: Layout) -> Result<Runtime, StartError> {
        let mut config = Config::new();
        config.epoch_interruption(true);
        config.max_wasm_stack(MAX_WASM_STACK);
        config.async_stack_size(ASYNC_STACK);
        let stacks = match layout {
            Layout::WasmtimeDefaults => None,
            Layout::Dense => {
                let stacks = Arc::new(crate::dense::SlabStacks::default());
                config
                    .memory_reservation(0)
                    .memory_reservation_for_growth(0)
                    .memory_guard_size(0)
                    .guard_before_linear_memory(false)
                    .memory_init_cow(false)
                    .with_host_memory(Arc::new(crate::dense::DenseMemories))
                    .with_host_stack(stacks.clone());
                Some(stacks)
            }
        };
        let engine = Engine::new(&config).map_err(|e| StartError::Engine(e.to_string()))?;
        let mut p1 = Linker::new(&engine);
        wasmtime_wasi::p1::add_to_linker_async(&mut p1, |s: &mut P1State| &mut s.wasi)
            .map_err(|e| StartError::Preview1(e.to_string()))?;
        let mut p2 = wasmtime::component::Linker::new(&engine);
        wasmtime_wasi::p2::add_to_linker_async(&mut p2).map_err(|e| StartError::Preview2(e.to_string()))?;
        let ticker_stop = Arc::new(AtomicBool::new(false));
        let weak = engine.weak();
        let stop = ticker_stop.clone();
        std::thread::Builder::new()
            .name("wasm-epoch".into())
            .spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    std::thread::sleep(EPOCH_TICK);
                    match weak.upgrade() {
                        Some(engine) => engine.increment_epoch(),
                        None => break,
                    }
                }
            })
            .map_err(|source| StartError::Threads { what: "epoch ticker", source })?;
        Ok(Runtime {
            engine,
            p1,
            p2,
            compiled: Mutex::new(HashMap::new()),
            compilations: std::sync::atomic::AtomicU64::new(0),
            ticker_stop,
            stacks,
        })
    }

    /// Slabs of async stacks mapped so far, and stacks in use now (zeroes
    /// with [`Layout::WasmtimeDefaults`]).
    pub fn stack_counts(&self) -> (usize, usize) {
        self.stacks.as_ref().map_or((0, 0), |s| s.counts())
    }

    /// How many modules were compiled so far (a second pod of one image
    /// compiles nothing).
    pub(crate) fn compilations(&self) -> u64 {
        self.compilations.load(Ordering::Relaxed)
    }

    /// The compiled module with digest `digest`, compiling `bytes()` once
    /// (concurrent callers share the compilation).
    pub async fn compiled(
        &self,
        digest: &str,
        kind: ModuleKind,
        bytes: impl FnOnce() -> Result<Vec<u8>, String> + Send + 'static,
    ) -> Result<Compiled, CompileError> {
        let cell = crate::lock(&self.compiled).entry(digest.to_owned()).or_default().clone();
        let compiled = cell
            .get_or_try_init(|| async {
                let engine = self.engine.clone();
                let p1 = self.p1.clone();
                let p2 = self.p2.clone();
                self.compilations.fetch_add(1, Ordering::Relaxed);
                let digest = digest.to_owned();
                tokio::task::spawn_blocking(move || {
                    let bytes = bytes().map_err(CompileError::Read)?;
                    let started = std::time::Instant::now();
                    let compiled = match kind {
                        ModuleKind::Module => {
                            let module = Module::new(&engine, &bytes).map_err(|e| invalid("invalid module", &e))?;
                            let pre = p1.instantiate_pre(&module).map_err(|e| invalid("cannot link", &e))?;
                            Compiled::Module(pre)
                        }
                        ModuleKind::Component => {
                            let component =
                                Component::new(&engine, &bytes).map_err(|e| invalid("invalid component", &e))?;
                            let pre = p2.instantiate_pre(&component).map_err(|e| invalid("cannot link", &e))?;
                            Compiled::Component(
                                CommandPre::new(pre).map_err(|e| invalid("not a wasi:cli command component", &e))?,
                            )
                        }
                    };
                    tracing::info!(%digest, elapsed = ?started.elapsed(), "module compiled");
                    Ok::<_, CompileError>(compiled)
                })
                .await
                .map_err(|e| CompileError::Task(e.to_string()))?
            })
            .await?;
        Ok(compiled.clone())
    }

    /// Drops compiled modules whose digest is not in `keep`.
    pub(crate) fn forget_except(&self, keep: &std::collections::HashSet<String>) {
        crate::lock(&self.compiled).retain(|digest, _| keep.contains(digest));
    }

    /// Runs `compiled` with `spec` until it ends.
    pub async fn run(&self, compiled: Compiled, spec: RunSpec) -> ContainerExit {
        let mut builder = WasiCtxBuilder::new();
        builder.args(&spec.args);
        for (name, value) in &spec.env {
            builder.env(name, value);
        }
        match &spec.output {
            Output::Log(log) => builder.stdout(log.stream("stdout")).stderr(log.stream("stderr")),
            Output::Capture { stdout, stderr } => builder.stdout(stdout.clone()).stderr(stderr.clone()),
            Output::Session(streams) => {
                let streams = streams.lock().unwrap_or_else(|p| p.into_inner()).take().unwrap_or_default();
                if let Some(stdin) = streams.stdin {
                    builder.stdin(wasmtime_wasi::cli::AsyncStdinStream::new(stdin));
                }
                if let Some(stdout) = streams.stdout {
                    builder.stdout(wasmtime_wasi::cli::AsyncStdoutStream::new(SESSION_BUDGET, stdout));
                }
                if let Some(stderr) = streams.stderr {
                    builder.stderr(wasmtime_wasi::cli::AsyncStdoutStream::new(SESSION_BUDGET, stderr));
                }
                &mut builder
            }
        };
        for (host, guest, read_only) in &spec.preopens {
            let perms = if *read_only { FsPerms::ReadOnly } else { FsPerms::ReadWrite };
            if let Err(e) = builder.preopened_dir(host, guest, perms) {
                return ended(
                    128,
                    Some("StartError"),
                    Some(format!("cannot open {} for {guest}: {e}", host.display())),
                );
            }
        }
        if let Some(cwd) = &spec.cwd {
            builder.initial_cwd(cwd);
        }
        let limiter = MemLimiter::new(spec.memory_limit, spec.budget.clone(), spec.memory.clone());
        let throttle = spec.cpu_limit_milli.map(|milli| Throttle::new(spec.cpu.clone(), milli));
        let ended = match compiled {
            Compiled::Module(pre) => {
                let mut store = Store::new(&self.engine, P1State { wasi: builder.build_p1(), limiter });
                prepare(&mut store, |s| &mut s.limiter, throttle);
                let result = Metered::new(
                    async {
                        let instance = pre.instantiate_async(&mut store).await?;
                        let start = instance.get_typed_func::<(), ()>(&mut store, "_start")?;
                        start.call_async(&mut store, ()).await
                    },
                    spec.cpu.clone(),
                )
                .await;
                outcome(result.map(|()| 0), &store.data().limiter)
            }
            Compiled::Component(pre) => {
                let state = P2State { ctx: builder.build(), table: ResourceTable::new(), limiter };
                let mut store = Store::new(&self.engine, state);
                prepare(&mut store, |s| &mut s.limiter, throttle);
                let result = Metered::new(
                    async {
                        let command = pre.instantiate_async(&mut store).await?;
                        command.wasi_cli_run().call_run(&mut store).await
                    },
                    spec.cpu.clone(),
                )
                .await;
                outcome(result.map(|r| if r.is_ok() { 0 } else { 1 }), &store.data().limiter)
            }
        };
        if let Output::Log(log) = &spec.output {
            log.finish();
        }
        ended
    }
}

/// Memory limit, and a yield at every epoch tick: a pause there instead
/// when the module is over its CPU limit.
fn prepare<T: 'static>(store: &mut Store<T>, limiter: fn(&mut T) -> &mut MemLimiter, mut throttle: Option<Throttle>) {
    store.limiter(move |s| limiter(s) as &mut dyn wasmtime::ResourceLimiter);
    // Host code (WASI) is the code that could overflow an async stack:
    // the stack's guard zone is checked each time it returns.
    store.call_hook(|_, hook| match hook {
        wasmtime::CallHook::ReturningFromHost => crate::dense::check_current_stack().map_err(wasmtime::Error::msg),
        _ => Ok(()),
    });
    store.set_epoch_deadline(1);
    store.epoch_deadline_callback(move |_| {
        Ok(match throttle.as_mut().and_then(Throttle::settle) {
            Some(pause) => UpdateDeadline::YieldCustom(1, Box::pin(tokio::time::sleep(pause))),
            None => UpdateDeadline::Yield(1),
        })
    });
}

/// A container exit now.
pub(crate) fn ended(exit_code: i32, reason: Option<&str>, message: Option<String>) -> ContainerExit {
    ContainerExit { exit_code, reason: reason.map(str::to_owned), message, finished_at: jiff::Timestamp::now() }
}

fn outcome(result: wasmtime::Result<i32>, limiter: &MemLimiter) -> ContainerExit {
    let memory_limit_hit = limiter.hit;
    let oom = || {
        let message = match limiter.refused {
            Some((asked, limit, true, what)) => format!(
                "the module cannot start: it declares {asked} bytes of linear memory, over {what} of {limit} bytes"
            ),
            Some((asked, limit, false, what)) => {
                format!("the module went over {what}: it asked for {asked} bytes, the limit is {limit}")
            }
            None => "the module went over its memory limit".into(),
        };
        ended(OOM_EXIT_CODE, Some("OOMKilled"), Some(message))
    };
    match result {
        Ok(code) if memory_limit_hit && code != 0 => oom(),
        Ok(code) => ended(code, None, None),
        Err(e) => {
            if let Some(exit) = e.downcast_ref::<I32Exit>() {
                if memory_limit_hit && exit.0 != 0 {
                    return oom();
                }
                return ended(exit.0, None, None);
            }
            if memory_limit_hit {
                return oom();
            }
            let message = match e.downcast_ref::<wasmtime::Trap>() {
                Some(trap) => format!("wasm trap: {trap}"),
                None => {
                    // The first line, and the cause where it is another
                    // (wasmtime's first line can be only "error while
                    // executing at wasm backtrace:").
                    let first = format!("{e:?}").lines().next().unwrap_or_default().to_owned();
                    let cause = e.root_cause().to_string();
                    if first.contains(&cause) { first } else { format!("{} {cause}", first.trim_end_matches(':')) }
                }
            };
            ended(TRAP_EXIT_CODE, None, Some(message))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn run_module(runtime: &Runtime, digest: &str, text: &str) -> ContainerExit {
        let module = wat::parse_str(text).expect("assembles");
        let compiled = runtime.compiled(digest, ModuleKind::Module, move || Ok(module)).await.expect("compiles");
        let spec = RunSpec::bare(vec!["test".into()], Output::capture(1024));
        runtime.run(compiled, spec).await
    }

    #[tokio::test]
    async fn dense_memories_are_bounds_checked_and_keep_their_bytes_when_moved() {
        let runtime = Runtime::with_layout(Layout::Dense).expect("runtime");
        // The mapping behind a memory may be larger than the memory (2 → 3
        // pages doubles it to 4): an access just past the memory's end,
        // inside the mapping, must still trap.
        let past_the_end = r#"(module (memory (export "memory") 2)
            (func (export "_start")
              (drop (memory.grow (i32.const 1)))
              (drop (i32.load (i32.mul (memory.size) (i32.const 65536))))))"#;
        let exit = run_module(&runtime, "sha256:oob", past_the_end).await;
        assert_eq!(exit.exit_code, TRAP_EXIT_CODE, "{exit:?}");
        assert!(exit.message.as_deref().is_some_and(|m| m.contains("out of bounds")), "{exit:?}");
        // Growing 1 → 41 pages moves the mapping (mremap): what was
        // written before is still there, and the new end is writable.
        let grow = r#"(module (memory (export "memory") 1)
            (func (export "_start")
              (i32.store (i32.const 100) (i32.const 42))
              (if (i32.eq (memory.grow (i32.const 40)) (i32.const -1)) (then unreachable))
              (if (i32.ne (i32.load (i32.const 100)) (i32.const 42)) (then unreachable))
              (i32.store (i32.const 2686972) (i32.const 7))
              (if (i32.ne (i32.load (i32.const 2686972)) (i32.const 7)) (then unreachable))))"#;
        let exit = run_module(&runtime, "sha256:grow", grow).await;
        assert_eq!((exit.exit_code, exit.message), (0, None));
    }
}

#[cfg(test)]
mod stack_tests {
    use super::*;

    /// An overflow into a stack's guard zone (done here by hand, as host
    /// code overflowing its stack would) ends that instance at its next
    /// return from a host call, with the reason; the runtime goes on.
    #[tokio::test]
    async fn a_damaged_guard_zone_ends_the_instance_not_the_node() {
        let runtime = Arc::new(Runtime::with_layout(Layout::Dense).expect("runtime"));
        let module = wat::parse_str(
            r#"(module
             (import "wasi_snapshot_preview1" "sched_yield" (func $yield (result i32)))
             (memory (export "memory") 1)
             (func (export "_start")
               (loop $more (drop (call $yield)) (br $more))))"#,
        )
        .expect("assembles");
        let compiled = runtime.compiled("sha256:spin", ModuleKind::Module, move || Ok(module)).await.expect("compiles");
        let spec = RunSpec::bare(vec!["spin".into()], Output::capture(1024));
        let running = tokio::spawn({
            let runtime = runtime.clone();
            async move { runtime.run(compiled, spec).await }
        });
        let stacks = runtime.stacks.clone().expect("dense stacks");
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(60);
        while stacks.counts().1 == 0 {
            assert!(tokio::time::Instant::now() < deadline, "the instance never got a stack");
            tokio::task::yield_now().await;
        }
        assert!(stacks.damage_live_zones() >= 1);
        let exit = tokio::time::timeout(std::time::Duration::from_secs(60), running)
            .await
            .expect("the instance ends")
            .expect("joined");
        assert_eq!(exit.exit_code, TRAP_EXIT_CODE, "{exit:?}");
        assert!(exit.message.as_deref().is_some_and(|m| m.contains("guard zone")), "{exit:?}");
        // The damaged stack is not handed out again; the runtime runs on.
        let again =
            run_module_on(&runtime, "sha256:ok", r#"(module (memory (export "memory") 1) (func (export "_start")))"#)
                .await;
        assert_eq!((again.exit_code, again.message), (0, None));
    }

    async fn run_module_on(runtime: &Runtime, digest: &str, text: &str) -> ContainerExit {
        let module = wat::parse_str(text).expect("assembles");
        let compiled = runtime.compiled(digest, ModuleKind::Module, move || Ok(module)).await.expect("compiles");
        runtime.run(compiled, RunSpec::bare(vec!["test".into()], Output::capture(1024))).await
    }
}

#[cfg(test)]
mod error_tests {
    use super::*;

    /// A module a WASI call fails for says why, not only "error while
    /// executing".
    #[tokio::test]
    async fn an_error_names_its_cause() {
        let runtime = Runtime::new().expect("runtime");
        let module = wat::parse_str(
            r#"(module
             (import "wasi_snapshot_preview1" "sched_yield" (func $yield (result i32)))
             (memory 1)
             (func (export "_start")
               (loop $more
                 (if (i32.eq (memory.grow (i32.const 16)) (i32.const -1)) (then unreachable))
                 (drop (call $yield))
                 (br $more))))"#,
        )
        .expect("assembles");
        let compiled =
            runtime.compiled("sha256:probe", ModuleKind::Module, move || Ok(module)).await.expect("compiles");
        let spec = RunSpec::bare(vec!["test".into()], Output::capture(1024));
        let exit = runtime.run(compiled, spec).await;
        assert_eq!(exit.exit_code, TRAP_EXIT_CODE);
        let message = exit.message.unwrap_or_default();
        assert!(message.contains("missing required memory export"), "{message}");
    }
}
