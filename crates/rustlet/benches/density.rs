//! Density benchmark: how many idle WebAssembly pods one node holds, and at
//! what cost. Prints figures, asserts nothing about time.
//!
//! Each measurement runs in a child process of its own (this program with
//! `--part`), so that its RSS and mappings are its own and an abort ends
//! only that measurement. For each pod count (1,000 / 10,000 / 50,000;
//! `RUSTLET_BENCH_QUICK=1`: 1,000; `RUSTLET_DENSITY_PODS=a,b` to choose):
//! - **node**: the node as the binary runs it (`NodeBuilder`, static pods
//!   from a manifest directory, the WebAssembly provider) with the `sleep`
//!   example module (prints a line, then sleeps in `poll_oneoff`), pods as
//!   users write them (no resources: each held to the default memory
//!   budget) on the machine's own allocatable (`--max-pods` raised); all
//!   manifests written at once → all Running: time, RSS, CPU, mappings,
//!   address space; the time per pod in each tenth of the pods (does a
//!   pod's start cost grow as the node fills?); all manifests removed →
//!   all gone: time, RSS at once and 10 s later (the provider gives the
//!   heap back once removals settle);
//! - **floor**: the same number of instances of the module created and
//!   started directly on the provider's runtime, no node: the same
//!   figures.
//!
//! First, 1,000 instances under each engine layout (wasmtime's defaults
//! and the dense layout the provider uses), for the mappings and address
//! space each instance costs.
//!
//! Run: `cargo bench -p rustlet --bench density`.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use kubelet::node::{NodeBuilder, NodeConfig};
use rustlet_wasi::runtime::{Layout, Output, RunSpec, Runtime};
use rustlet_wasi::store::ModuleKind;
use tokio_util::sync::CancellationToken;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
const IMAGE: &str = "example.com/bench/sleep:v1";

fn quick() -> bool {
    std::env::var("RUSTLET_BENCH_QUICK").is_ok_and(|v| v == "1")
}

/// Mappings, address space (MiB) and RSS (MiB) of this process.
#[derive(Clone, Copy)]
struct Footprint {
    maps: usize,
    vm_mib: f64,
    rss_mib: f64,
}

fn footprint() -> Footprint {
    let maps = std::fs::read_to_string("/proc/self/maps").map(|m| m.lines().count()).unwrap_or(0);
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| -> f64 {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
            .unwrap_or(0.0)
            / 1024.0
    };
    Footprint { maps, vm_mib: field("VmSize:"), rss_mib: field("VmRSS:") }
}

fn per_instance(before: Footprint, after: Footprint, n: usize) -> String {
    let n = n.max(1) as f64;
    format!(
        "{:.2} mappings, {:.1} MiB of address space, {:.1} KiB resident per instance",
        (after.maps as f64 - before.maps as f64) / n,
        (after.vm_mib - before.vm_mib) / n,
        (after.rss_mib - before.rss_mib) * 1024.0 / n
    )
}

fn describe(f: Footprint) -> String {
    format!("RSS {:.0} MiB, {} mappings, {:.1} GiB of address space", f.rss_mib, f.maps, f.vm_mib / 1024.0)
}

/// Lets this process hold `files` open files (raising the hard limit too
/// where allowed).
fn allow_files(files: u64) {
    let _ = rlimit::increase_nofile_limit(u64::MAX);
    if let Ok((soft, hard)) = rlimit::getrlimit(rlimit::Resource::NOFILE)
        && soft < files
    {
        let _ = rlimit::setrlimit(rlimit::Resource::NOFILE, files.max(soft), files.max(hard));
    }
}

/// Waits, checking every 100 ms, until `done(elapsed)` is true; at most
/// `deadline`.
async fn poll_until(deadline: Duration, mut done: impl FnMut() -> bool) -> Result<Duration, BoxError> {
    let began = Instant::now();
    loop {
        if done() {
            return Ok(began.elapsed());
        }
        if began.elapsed() > deadline {
            return Err(format!("not done within {deadline:?}").into());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The floor: `n` instances of the module started on the runtime alone.
async fn floor(n: usize, layout: Layout) -> Result<(), BoxError> {
    allow_files(n as u64 + 4096);
    let runtime = Arc::new(Runtime::with_layout(layout)?);
    let module = rustlet_wasi::examples::binary("sleep")?;
    let compiled = runtime.compiled("sha256:density", ModuleKind::Module, move || Ok(module)).await?;
    let before = footprint();
    let cpu_before = common::process_cpu();
    let mut outputs = Vec::with_capacity(n);
    let mut tasks = Vec::with_capacity(n);
    for _ in 0..n {
        let output = Output::capture(1024);
        let Output::Capture { stdout, .. } = &output else { unreachable!() };
        outputs.push(stdout.clone());
        let spec = RunSpec::bare(vec!["sleep".into()], output);
        let runtime = runtime.clone();
        let compiled = compiled.clone();
        tasks.push(tokio::spawn(async move { runtime.run(compiled, spec).await }));
    }
    let mut started = 0;
    let waited = poll_until(Duration::from_secs(600), || {
        while started < n && !outputs[started].contents().is_empty() {
            started += 1;
        }
        started == n || tasks[started..].iter().any(|t| t.is_finished())
    })
    .await?;
    if started < n {
        let ended = tasks.into_iter().find(|t| t.is_finished()).ok_or("an instance ended")?;
        return Err(format!("an instance ended early: {:?}", ended.await?).into());
    }
    let cpu = common::process_cpu() - cpu_before;
    let full = footprint();
    let (slabs, stacks) = runtime.stack_counts();
    println!(
        "  floor ({layout:?}, {n} instances): all started in {:.2} s, CPU {:.2} s; {}",
        waited.as_secs_f64(),
        cpu.as_secs_f64(),
        describe(full)
    );
    println!("    {}", per_instance(before, full, n));
    if slabs > 0 {
        println!("    async stacks: {stacks} in use from {slabs} slab mappings");
    }
    let began = Instant::now();
    for task in &tasks {
        task.abort();
    }
    for task in tasks {
        let _ = task.await;
    }
    let gone = began.elapsed();
    let after = footprint();
    println!("    all stopped in {:.2} s; after: {}", gone.as_secs_f64(), describe(after));
    rustlet_wasi::dense::release_free_heap();
    println!("    after the heap is trimmed (as the provider does): {}", describe(footprint()));
    Ok(())
}

/// The node with `n` static pods of the module.
async fn node(n: usize) -> Result<(), BoxError> {
    allow_files(2 * n as u64 + 4096);
    let shutdown = CancellationToken::new();
    let root = rustlet_testkit::node_root::tempdir("rustlet-bench-density-");
    let manifests = root.path().join("manifests");
    std::fs::create_dir_all(&manifests)?;
    let provider = common::sleep_provider(root.path(), IMAGE)?;
    let mut config = NodeConfig::new(root.path(), "density");
    config.http_address = None;
    config.pods.manifest_dir = Some(manifests.clone());
    // The machine's own CPUs and memory (as the binary measures them), and
    // room for the pods: a user's `--max-pods`.
    config.pods.max_pods = n + 10;
    let node = NodeBuilder::new(config).provider(provider.clone()).start(shutdown.clone()).await?;
    let store = node.pods().store().clone();
    // Files first, in a directory the node does not watch, then renamed in
    // one by one: the writing is not the node's time.
    let staging = root.path().join("staging");
    std::fs::create_dir_all(&staging)?;
    for i in 0..n {
        std::fs::write(staging.join(format!("p{i}.yaml")), common::wasm_manifest(&format!("p{i}"), IMAGE, None))?;
    }
    let before = footprint();
    let cpu_before = common::process_cpu();
    let began = Instant::now();
    for i in 0..n {
        std::fs::rename(staging.join(format!("p{i}.yaml")), manifests.join(format!("p{i}.yaml")))?;
    }
    let mut tenths = Vec::new();
    let deadline = Duration::from_secs(if n > 20_000 { 900 } else { 300 });
    let mut failed = None;
    let waited = poll_until(deadline, || {
        let mut running = 0;
        store.read(|pods| {
            for pod in pods.values() {
                if common::is_running(pod) {
                    running += 1;
                } else if failed.is_none()
                    && let Some(status) = &pod.status
                    && status.phase.as_deref() == Some("Failed")
                {
                    failed = Some(format!("{:?}: {:?}", pod.metadata.name, status.message));
                }
            }
        });
        while tenths.len() < 10 && running >= n * (tenths.len() + 1) / 10 {
            tenths.push(began.elapsed());
        }
        running == n || failed.is_some()
    })
    .await?;
    if let Some(failed) = failed {
        return Err(format!("a pod failed: {failed}").into());
    }
    let cpu = common::process_cpu() - cpu_before;
    let full = footprint();
    println!(
        "  node ({n} pods): all Running in {:.2} s, CPU {:.2} s; {}",
        waited.as_secs_f64(),
        cpu.as_secs_f64(),
        describe(full)
    );
    println!("    {}", per_instance(before, full, n).replace("instance", "pod"));
    let mut previous = Duration::ZERO;
    let per_pod: Vec<String> = tenths
        .iter()
        .map(|t| {
            let tenth = (*t - previous).as_secs_f64() * 1e3 / (n as f64 / 10.0);
            previous = *t;
            format!("{tenth:.2}")
        })
        .collect();
    println!("    ms per pod in each tenth (checked every 100 ms): {}", per_pod.join(" "));
    for i in 0..n {
        std::fs::remove_file(manifests.join(format!("p{i}.yaml")))?;
    }
    let gone = poll_until(deadline, || store.read(|pods| pods.is_empty())).await?;
    let after = footprint();
    println!("    all gone in {:.2} s; at once after: {}", gone.as_secs_f64(), describe(after));
    // The provider trims the heap once removals have settled (a quiet tick
    // of 2 s, so 2–4 s after the last); 10 s is well past that.
    tokio::time::sleep(Duration::from_secs(10)).await;
    println!("    10 s later: {}", describe(footprint()));
    shutdown.cancel();
    node.stopped().await;
    Ok(())
}

/// Runs one part in a child process; says how it ended.
fn child(args: &[String]) -> Result<(), BoxError> {
    let status = std::process::Command::new(std::env::current_exe()?).arg("--part").args(args).status()?;
    if !status.success() {
        println!("  ({} ended with {status})", args.join(" "));
    }
    Ok(())
}

fn orchestrate() -> Result<(), BoxError> {
    let counts: Vec<usize> = match std::env::var("RUSTLET_DENSITY_PODS") {
        Ok(list) => list.split(',').filter_map(|c| c.trim().parse().ok()).collect(),
        Err(_) if quick() => vec![1000],
        Err(_) => vec![1000, 10_000, 50_000],
    };
    let map_count = std::fs::read_to_string("/proc/sys/vm/max_map_count").unwrap_or_default();
    let files = rlimit::getrlimit(rlimit::Resource::NOFILE).map(|(s, h)| format!("{s}/{h}")).unwrap_or_default();
    println!(
        "density benchmark: idle `sleep` modules; {} CPUs, vm.max_map_count {}, open files {files} (soft/hard)",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        map_count.trim()
    );
    println!("\nper instance, by engine layout (1,000 instances):");
    child(&["floor".into(), "defaults".into(), "1000".into()])?;
    child(&["floor".into(), "dense".into(), "1000".into()])?;
    for n in counts {
        println!("\n{n} pods:");
        child(&["node".into(), "dense".into(), n.to_string()])?;
        child(&["floor".into(), "dense".into(), n.to_string()])?;
    }
    Ok(())
}

fn main() -> Result<(), BoxError> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) != Some("--part") {
        return orchestrate();
    }
    let layout = match args.get(2).map(String::as_str) {
        Some("defaults") => Layout::WasmtimeDefaults,
        _ => Layout::Dense,
    };
    let n: usize = args.get(3).and_then(|n| n.parse().ok()).ok_or("--part <node|floor> <layout> <count>")?;
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    match args.get(1).map(String::as_str) {
        Some("node") => runtime.block_on(node(n)),
        _ => runtime.block_on(floor(n, layout)),
    }
}
