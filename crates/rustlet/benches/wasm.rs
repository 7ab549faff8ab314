//! WebAssembly provider benchmark: prints figures, asserts nothing about time.
//!
//! In one process: the node as the binary runs it (`NodeBuilder`, static
//! pods from a manifest directory, the WebAssembly provider), with the
//! `sleep` example module imported into its image store. Measures:
//! - the first pod of the image (the module compiled), then warm starts:
//!   manifest written → container Running, one pod at a time, and its
//!   removal; beside the floor, the provider's runtime instantiating and
//!   running a module that returns at once, with no lifecycle around it;
//! - 100 manifests written at once → all Running; the RSS each idle
//!   module adds; how many compilations all of that took (one is the goal:
//!   Krustlet compiled at every start);
//! - a cold pull of a 1 MiB module from a loopback registry
//!   (`docker-registry`) into an empty store, beside `curl` fetching the
//!   same blob (the floor).
//!
//! Run: `cargo bench -p rustlet --bench wasm` (`RUSTLET_BENCH_QUICK=1` for
//! fewer rounds).

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use kubelet::node::{NodeBuilder, NodeConfig};
use kubelet::pod::Allocatable;
use rustlet_wasi::pull::{PullPolicy, Puller};
use rustlet_wasi::runtime::{RunSpec, Runtime};
use rustlet_wasi::store::{ImageStore, ModuleKind};
use tokio_util::sync::CancellationToken;

use common::figures;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
const IMAGE: &str = "example.com/bench/sleep:v1";
const DEADLINE: Duration = Duration::from_secs(120);

fn quick() -> bool {
    std::env::var("RUSTLET_BENCH_QUICK").is_ok_and(|v| v == "1")
}

/// Writes a manifest as editors do: a temp file renamed in place.
fn write_manifest(dir: &Path, name: &str) -> std::io::Result<()> {
    let temp = dir.join(format!(".{name}.tmp"));
    std::fs::write(&temp, common::wasm_manifest(name, IMAGE, Some("{memory: 16Mi}")))?;
    std::fs::rename(temp, dir.join(format!("{name}.yaml")))
}

/// The floor of a warm start: the provider's runtime alone, instantiating
/// and running a compiled module that returns at once.
async fn floor(rounds: usize, scratch: &Path) -> Result<Vec<Duration>, BoxError> {
    let runtime = Runtime::new()?;
    let module = wat::parse_str(r#"(module (memory (export "memory") 3) (func (export "_start")))"#)?;
    let compiled = runtime.compiled("sha256:floor", ModuleKind::Module, move || Ok(module)).await?;
    let mut samples = Vec::new();
    for i in 0..rounds {
        let log = rustlet_wasi::logs::CriLog::open(&scratch.join(format!("floor-{i}.log")))?;
        let spec = RunSpec {
            memory_limit: Some(rustlet_wasi::runtime::MemoryLimit::new(16 << 20)),
            ..RunSpec::bare(vec!["floor".into()], rustlet_wasi::runtime::Output::Log(log))
        };
        let began = Instant::now();
        let exit = runtime.run(compiled.clone(), spec).await;
        samples.push(began.elapsed());
        if exit.exit_code != 0 {
            return Err(format!("the floor module exited with {}", exit.exit_code).into());
        }
    }
    Ok(samples)
}

/// A valid module of about `size` bytes: its bulk is a custom section.
fn big_module(size: usize) -> Vec<u8> {
    let mut payload = vec![1u8, b'x'];
    payload.extend((0..size).map(|i| (i * 7 % 251) as u8));
    let mut module = b"\0asm\x01\0\0\0".to_vec();
    module.push(0);
    let mut len = payload.len();
    loop {
        let byte = (len & 0x7f) as u8;
        len >>= 7;
        if len == 0 {
            module.push(byte);
            break;
        }
        module.push(byte | 0x80);
    }
    module.extend(payload);
    module
}

/// A cold pull of a 1 MiB module into an empty store, beside curl.
async fn cold_pull(rounds: usize) -> Result<(), BoxError> {
    let mut registry = match rustlet_testkit::registry::Registry::start().await {
        Ok(registry) => registry,
        Err(reason) => {
            println!("\ncold pull: skipped, no OCI registry on this machine: {reason}");
            return Ok(());
        }
    };
    let module = big_module(1 << 20);
    let (_, layer) = registry.push_wasm("bench/big", "v1", &module).await?;
    let reference = registry.reference("bench/big", "v1");
    let url = format!("http://{}/v2/bench/big/blobs/{layer}", registry.host());
    let (mut pulls, mut curls) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        let root = rustlet_testkit::node_root::tempdir("rustlet-bench-");
        let puller = Puller::new(ImageStore::open(root.path())?, root.path().join("config.json"));
        let began = Instant::now();
        puller.ensure(&reference, PullPolicy::Always).await?;
        pulls.push(began.elapsed());
        let began = Instant::now();
        let status = tokio::process::Command::new("curl").args(["-sf", "-o", "/dev/null", &url]).status().await?;
        curls.push(began.elapsed());
        if !status.success() {
            return Err(format!("curl {url}: {status}").into());
        }
    }
    println!(
        "\ncold pull of a {:.2} MiB module from a loopback registry, {rounds} rounds:",
        module.len() as f64 / 1048576.0
    );
    println!(
        "  into an empty store   {}   (manifest, config and layer; digest checked; written and renamed)",
        figures(pulls).in_ms()
    );
    println!("  floor: curl the blob  {}   (a process started; the blob only)", figures(curls).in_ms());
    registry.stop().await;
    Ok(())
}

async fn run() -> Result<(), BoxError> {
    let _ = rlimit::increase_nofile_limit(u64::MAX);
    let (sequential, at_once, pull_rounds) = if quick() { (10, 20, 3) } else { (50, 100, 10) };
    let shutdown = CancellationToken::new();
    let root = rustlet_testkit::node_root::tempdir("rustlet-bench-wasm-");
    let manifests = root.path().join("manifests");
    std::fs::create_dir_all(&manifests)?;
    let provider = common::sleep_provider(root.path(), IMAGE)?;

    let mut config = NodeConfig::new(root.path(), "bench");
    config.http_address = None;
    config.pods.manifest_dir = Some(manifests.clone());
    config.pods.allocatable = Some(Allocatable { cpu_milli: 64_000, memory: 64 << 30, pods: 1000 });
    let node = NodeBuilder::new(config).provider(provider.clone()).start(shutdown.clone()).await?;
    let store = node.pods().store().clone();
    println!("wasm benchmark: NodeBuilder + static pods + the WebAssembly provider; the `sleep` module, imported");

    let began = Instant::now();
    write_manifest(&manifests, "first")?;
    common::wait_pods(&store, "first-", 1, common::is_running, DEADLINE).await?;
    let first = began.elapsed();
    std::fs::remove_file(manifests.join("first.yaml"))?;
    common::wait_pods(&store, "first-", 0, |_| true, DEADLINE).await?;

    let (mut up, mut down) = (Vec::new(), Vec::new());
    for i in 0..sequential {
        let name = format!("seq{i}");
        let began = Instant::now();
        write_manifest(&manifests, &name)?;
        common::wait_pods(&store, &format!("{name}-"), 1, common::is_running, DEADLINE).await?;
        up.push(began.elapsed());
        let began = Instant::now();
        std::fs::remove_file(manifests.join(format!("{name}.yaml")))?;
        common::wait_pods(&store, &format!("{name}-"), 0, |_| true, DEADLINE).await?;
        down.push(began.elapsed());
    }
    let floor = floor(sequential, root.path()).await?;
    println!("\nthe first pod of the image (module compiled): {:.1} ms", first.as_secs_f64() * 1e3);
    println!("one pod at a time ({sequential} pods, the module compiled already):");
    println!("  manifest → Running     {}   (target p50 ≤ 10 ms)", figures(up).in_ms());
    println!("  removed → gone         {}", figures(down).in_ms());
    println!("  floor: instantiate and run a module that returns at once {}", figures(floor).in_ms());

    let rss_before = common::rss_mib();
    let began = Instant::now();
    for i in 0..at_once {
        write_manifest(&manifests, &format!("many{i}"))?;
    }
    common::wait_pods(&store, "many", at_once, common::is_running, DEADLINE).await?;
    let all_up = began.elapsed();
    let rss = common::rss_mib();
    println!("\n{at_once} pods at once:");
    println!("  all Running after {:.0} ms   (target ≤ 2 s)", all_up.as_secs_f64() * 1e3);
    println!(
        "  RSS {rss:.1} MiB with them, {rss_before:.1} MiB before: {:.0} KiB per idle module",
        (rss - rss_before) * 1024.0 / at_once as f64
    );
    let began = Instant::now();
    for i in 0..at_once {
        std::fs::remove_file(manifests.join(format!("many{i}.yaml")))?;
    }
    common::wait_pods(&store, "many", 0, |_| true, DEADLINE).await?;
    println!("  all removed → gone after {:.0} ms", began.elapsed().as_secs_f64() * 1e3);
    println!(
        "  compilations for all {} pods: {}   (Krustlet compiled at every start)",
        1 + sequential + at_once,
        provider.compilations()
    );
    shutdown.cancel();
    node.stopped().await;

    cold_pull(pull_rounds).await
}

fn main() -> Result<(), BoxError> {
    tokio::runtime::Builder::new_multi_thread().enable_all().build()?.block_on(run())
}
