//! Plugin registration benchmark: prints figures, asserts nothing about time.
//!
//! The node is the release `rustlet --standalone` binary in its own process.
//! This program is the load generator: it plays the plugins (a CSI driver and
//! its registration socket each, the same test plugins the tests use) and
//! measures from "registration socket listening" (right after `bind`) to "the
//! plugin received NotifyRegistrationStatus(true)". Every registration does
//! the full work: GetInfo, NodeGetInfo on the driver's endpoint, Notify.
//!
//! The floor: in the same run, the generator registers identical plugins
//! itself (dial, GetInfo, NodeGetInfo, Notify right after bind, no watcher,
//! no reconciler), interleaved with the node's runs. Ratios are node / floor.
//!
//! Run: `cargo bench -p rustlet --bench registration` (or `just bench`).
//! Set `RUSTLET_BENCH_QUICK=1` for fewer rounds.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use kubelet_api::pluginregistration::registration_client::RegistrationClient;
use kubelet_api::pluginregistration::{InfoRequest, RegistrationStatus};
use rustlet_testkit::csi_driver::{CsiDriverConfig, RegisteredCsiDriver};
use rustlet_testkit::report::{Report, Reporter};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use common::{Figures, figures, ms};

const WAIT: Duration = Duration::from_secs(15);

type BoxError = Box<dyn std::error::Error + Send + Sync>;

struct Plugin {
    name: String,
    registration: PathBuf,
    endpoint: PathBuf,
    stop: CancellationToken,
    listening_at: Instant,
}

struct Generator {
    registry: PathBuf,
    floor_dir: PathBuf,
    endpoints: PathBuf,
    seq: usize,
    tx: mpsc::UnboundedSender<(Instant, Report)>,
    rx: mpsc::UnboundedReceiver<(Instant, Report)>,
    /// Last `Notify(true)` per registration socket.
    notified: HashMap<PathBuf, Instant>,
    rejected: usize,
}

impl Generator {
    /// A generator for a node whose root dir is `root`.
    fn new(root: &Path) -> Generator {
        let (tx, rx) = mpsc::unbounded_channel();
        Generator {
            registry: root.join("plugins_registry"),
            floor_dir: root.join("floor"),
            endpoints: root.join("endpoints"),
            seq: 0,
            tx,
            rx,
            notified: HashMap::new(),
            rejected: 0,
        }
    }

    fn spawn_plugin(&mut self, in_registry: bool) -> Result<Plugin, BoxError> {
        self.seq += 1;
        let name = format!("bench-{}.csi.example.com", self.seq);
        self.spawn_plugin_at(in_registry, &name)
    }

    fn spawn_plugin_at(&mut self, in_registry: bool, name: &str) -> Result<Plugin, BoxError> {
        let endpoint = self.endpoints.join(format!("{name}.sock"));
        let dir = if in_registry { &self.registry } else { &self.floor_dir };
        let registration = dir.join(format!("{name}-reg.sock"));
        let stop = CancellationToken::new();
        let config = CsiDriverConfig { name: name.into(), node_id: "bench-node".into(), ..Default::default() };
        // Taken just before `bind`: a node can register the plugin before
        // this thread runs again, so a later timestamp could miss it.
        let listening_at = Instant::now();
        RegisteredCsiDriver::new(&registration, &endpoint, config)
            .spawn(Reporter::Timed(self.tx.clone()), stop.clone())?;
        Ok(Plugin { name: name.to_owned(), registration, endpoint, stop, listening_at })
    }

    /// Stops each plugin, removes its sockets and starts it again at the
    /// same paths (a plugin restart).
    fn recreate(&mut self, in_registry: bool, plugins: Vec<Plugin>) -> Result<Vec<Plugin>, BoxError> {
        let mut again = Vec::with_capacity(plugins.len());
        for p in plugins {
            p.stop.cancel();
            std::fs::remove_file(&p.registration)?;
            let _ = std::fs::remove_file(&p.endpoint);
            again.push(self.spawn_plugin_at(in_registry, &p.name)?);
        }
        Ok(again)
    }

    /// Waits until every plugin got `Notify(true)` after it started listening;
    /// returns the latencies and how many never did.
    async fn wait_notified(&mut self, plugins: &[Plugin]) -> (Vec<Duration>, usize) {
        let deadline = tokio::time::Instant::now() + WAIT;
        let done = |g: &Generator| {
            plugins.iter().all(|p| g.notified.get(&p.registration).is_some_and(|t| *t >= p.listening_at))
        };
        while !done(self) {
            match tokio::time::timeout_at(deadline, self.rx.recv()).await {
                Ok(Some((at, Report::Notified { socket, registered: true, .. }))) => {
                    self.notified.insert(socket, at);
                }
                Ok(Some((_, Report::Notified { registered: false, .. }))) => self.rejected += 1,
                Ok(Some(_)) => {}
                Ok(None) | Err(_) => break,
            }
        }
        let mut latencies = Vec::new();
        let mut missing = 0;
        for p in plugins {
            match self.notified.get(&p.registration) {
                Some(t) if *t >= p.listening_at => latencies.push(*t - p.listening_at),
                _ => missing += 1,
            }
        }
        (latencies, missing)
    }
}

/// The floor: the generator registers a plugin itself, as a node with no
/// watcher and no reconciler would.
async fn floor_register(registration: PathBuf, endpoint: PathBuf) -> Result<(), BoxError> {
    floor_register_steps(registration, endpoint).await.map(|_| ())
}

/// The floor's registration, timing its steps: dial, GetInfo, NodeGetInfo
/// (its own dial included), Notify.
async fn floor_register_steps(registration: PathBuf, endpoint: PathBuf) -> Result<[Duration; 4], BoxError> {
    let t0 = Instant::now();
    let channel = kubelet_api::uds::dial(&registration, Duration::from_secs(10)).await?;
    let mut client = RegistrationClient::new(channel);
    let t1 = Instant::now();
    let info = client.get_info(InfoRequest {}).await?.into_inner();
    assert_eq!(info.endpoint, endpoint.display().to_string());
    let t2 = Instant::now();
    kubelet::csi::node_get_info(&info.endpoint, Duration::from_secs(10)).await?;
    let t3 = Instant::now();
    client.notify_registration_status(RegistrationStatus { plugin_registered: true, error: String::new() }).await?;
    let t4 = Instant::now();
    Ok([t1 - t0, t2 - t1, t3 - t2, t4 - t3])
}

/// The node process and its log.
struct Node {
    child: tokio::process::Child,
    deregistered: mpsc::UnboundedReceiver<(Instant, PathBuf)>,
    /// The debug events of each registration's steps, when the node logs them.
    steps: mpsc::UnboundedReceiver<common::NodeLog>,
}

impl Node {
    async fn start(root: &Path, level: &str) -> Result<Node, BoxError> {
        let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_rustlet"))
            .args(["--standalone", "--log-format", "json", "--healthz-port", "0", "--port", "0", "--root-dir"])
            .arg(root)
            .env("RUSTLET_LOG", level)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()?;
        let stderr = child.stderr.take().ok_or("no stderr")?;
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
        let (tx, deregistered) = mpsc::unbounded_channel();
        let (steps_tx, steps) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            let mut ready = Some(ready_tx);
            let mut lines = BufReader::new(stderr).lines();
            let mut log = std::env::var_os("RUSTLET_BENCH_NODE_LOG").and_then(|p| std::fs::File::create(p).ok());
            while let Ok(Some(line)) = lines.next_line().await {
                if let Some(log) = log.as_mut() {
                    use std::io::Write;
                    let _ = writeln!(log, "{line}");
                }
                let Some(event) = common::NodeLog::parse(&line) else { continue };
                match event.message() {
                    "node started" => {
                        if let Some(ready) = ready.take() {
                            let _ = ready.send(());
                        }
                    }
                    "plugin deregistered" => {
                        if let Some(socket) = event.field("socket") {
                            let _ = tx.send((Instant::now(), PathBuf::from(socket)));
                        }
                    }
                    _ => {}
                }
                if event.level() == "ERROR" {
                    eprintln!("node: {line}");
                }
                if matches!(event.message(), "plugin socket seen" | "registration started" | "registration steps") {
                    let _ = steps_tx.send(event);
                }
            }
        });
        tokio::time::timeout(WAIT, ready_rx).await??;
        Ok(Node { child, deregistered, steps })
    }

    fn pid(&self) -> u32 {
        self.child.id().unwrap_or_default()
    }

    /// CPU time (user + system) so far.
    fn cpu(&self) -> Duration {
        common::cpu_of(&self.pid().to_string())
    }

    fn rss_mb(&self) -> f64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap_or_default();
        status
            .lines()
            .find(|l| l.starts_with("VmRSS:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kb| kb.parse::<f64>().ok())
            .map_or(0.0, |kb| kb / 1024.0)
    }

    /// Waits until every socket in `sockets` was deregistered after `since`.
    async fn wait_deregistered(&mut self, sockets: &[(PathBuf, Instant)]) -> (Vec<Duration>, usize) {
        let mut seen: HashMap<PathBuf, Instant> = HashMap::new();
        let deadline = tokio::time::Instant::now() + WAIT;
        while sockets.iter().any(|(s, since)| seen.get(s).is_none_or(|t| t < since)) {
            match tokio::time::timeout_at(deadline, self.deregistered.recv()).await {
                Ok(Some((at, socket))) => {
                    seen.insert(socket, at);
                }
                _ => break,
            }
        }
        let mut latencies = Vec::new();
        let mut missing = 0;
        for (socket, since) in sockets {
            match seen.get(socket) {
                Some(t) if t >= since => latencies.push(*t - *since),
                _ => {
                    eprintln!("not deregistered: {}", socket.display());
                    missing += 1;
                }
            }
        }
        (latencies, missing)
    }
}

fn line(label: &str, f: &Figures) -> String {
    format!("{label:<8} p50 {:>11}  p90 {:>11}  p99 {:>11}  max {:>11}", ms(f.p50), ms(f.p90), ms(f.p99), ms(f.max))
}

async fn teardown(node: &mut Node, plugins: Vec<Plugin>) -> (Vec<Duration>, usize, Duration) {
    let started = Instant::now();
    let mut removed = Vec::new();
    for p in plugins {
        p.stop.cancel();
        // The clock starts before the unlink: the node may log the
        // deregistration before this task runs again.
        let since = Instant::now();
        let _ = std::fs::remove_file(&p.registration);
        let _ = std::fs::remove_file(&p.endpoint);
        removed.push((p.registration, since));
    }
    let (lat, missing) = node.wait_deregistered(&removed).await;
    (lat, missing, started.elapsed())
}

async fn run() -> Result<(), BoxError> {
    let quick = std::env::var_os("RUSTLET_BENCH_QUICK").is_some();
    let _ = rlimit::increase_nofile_limit(u64::MAX);
    let root = tempfile::Builder::new().prefix("rustlet-bench-").tempdir()?;
    let mut g = Generator::new(root.path());
    std::fs::create_dir_all(&g.floor_dir)?;
    std::fs::create_dir_all(&g.endpoints)?;
    let level = std::env::var("RUSTLET_BENCH_NODE_LEVEL").unwrap_or_else(|_| "info".into());
    let mut node = Node::start(root.path(), &level).await?;
    println!("Rustlet plugin registration benchmark");
    println!(
        "machine: {} cores; node: release rustlet --standalone (pid {}); each registration = GetInfo + NodeGetInfo + Notify",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        node.pid()
    );
    println!("latency = registration socket listening -> plugin received NotifyRegistrationStatus(true)\n");

    // 1. One plugin at a time.
    let rounds = if quick { 50 } else { 200 };
    let (mut node_lat, mut floor_lat) = (Vec::new(), Vec::new());
    let cpu0 = node.cpu();
    let mut singles = Vec::new();
    for _ in 0..rounds {
        let p = g.spawn_plugin(true)?;
        let (lat, missing) = g.wait_notified(std::slice::from_ref(&p)).await;
        assert_eq!(missing, 0, "a single plugin was not registered");
        node_lat.extend(lat);
        singles.push(p);
        let f = g.spawn_plugin(false)?;
        floor_register(f.registration.clone(), f.endpoint.clone()).await?;
        let (lat, _) = g.wait_notified(std::slice::from_ref(&f)).await;
        floor_lat.extend(lat);
        f.stop.cancel();
    }
    let node_cpu = node.cpu() - cpu0;
    let (fn_, ff) = (figures(node_lat), figures(floor_lat));
    println!("[single] {rounds} plugins one at a time (node CPU {})", ms(node_cpu));
    println!("  {}", line("rustlet", &fn_));
    println!("  {}", line("floor", &ff));
    println!("  ratio p50 {:.2}x; targets: p50 <= 1 ms, p99 <= 5 ms", fn_.p50.as_secs_f64() / ff.p50.as_secs_f64());
    println!("  reference: Go kubelet 1.28.7 p50 377-490 ms; Krustlet p50 1.7 ms\n");

    // 2. Re-registration: socket removed and recreated, one at a time.
    let mut rereg = Vec::new();
    let mut recreated = Vec::new();
    for p in singles.drain(..) {
        let again = g.recreate(true, vec![p])?;
        let (lat, missing) = g.wait_notified(&again).await;
        assert_eq!(missing, 0, "a recreated plugin was not re-registered");
        rereg.extend(lat);
        recreated.extend(again);
    }
    let f = figures(rereg);
    println!("[re-registration] {} sockets removed and recreated, one at a time", recreated.len());
    println!("  {}", line("rustlet", &f));
    println!("  target p99 <= 20 ms; reference: Go kubelet p50 1.2-1.7 s\n");

    // 3. Deregistration after removal, one at a time.
    let mut dereg = Vec::new();
    for p in recreated.drain(..) {
        let (lat, missing, _) = teardown(&mut node, vec![p]).await;
        assert_eq!(missing, 0, "a removed plugin was not deregistered");
        dereg.extend(lat);
    }
    let f = figures(dereg);
    println!("[deregistration] {rounds} sockets removed one at a time -> node logged the deregistration");
    println!("  {}", line("rustlet", &f));
    println!("  target p99 <= 10 ms\n");

    // 4. Bursts.
    let mut kept = Vec::new();
    for (n, runs) in [(100usize, if quick { 2 } else { 5 }), (1000, if quick { 1 } else { 3 })] {
        let (mut node_all, mut floor_all, mut walls, mut floor_walls) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut failed = 0;
        let mut cpu = Duration::ZERO;
        let mut bind_spans = Vec::new();
        for run in 0..runs {
            // Node run.
            let cpu0 = node.cpu();
            let mut plugins = Vec::with_capacity(n);
            for _ in 0..n {
                plugins.push(g.spawn_plugin(true)?);
            }
            let first = plugins[0].listening_at;
            bind_spans.push(plugins[n - 1].listening_at - first);
            let (lat, missing) = g.wait_notified(&plugins).await;
            failed += missing;
            walls.push(lat.iter().zip(&plugins).map(|(l, p)| p.listening_at + *l).max().map_or(WAIT, |t| t - first));
            node_all.extend(lat);
            cpu += node.cpu() - cpu0;
            if n == 1000 && run + 1 == runs {
                kept = plugins;
            } else {
                let (_, missing, wall) = teardown(&mut node, plugins).await;
                if n == 1000 {
                    println!("  (deregistration of {n} removed at once: {} wall, {missing} missed)", ms(wall));
                }
            }
            // Floor run: bind and register right away, all concurrently.
            let mut plugins = Vec::with_capacity(n);
            let mut tasks = tokio::task::JoinSet::new();
            for _ in 0..n {
                let p = g.spawn_plugin(false)?;
                tasks.spawn(floor_register(p.registration.clone(), p.endpoint.clone()));
                plugins.push(p);
            }
            let first = plugins[0].listening_at;
            let (lat, _) = g.wait_notified(&plugins).await;
            floor_walls
                .push(lat.iter().zip(&plugins).map(|(l, p)| p.listening_at + *l).max().map_or(WAIT, |t| t - first));
            floor_all.extend(lat);
            while tasks.join_next().await.is_some() {}
            for p in plugins {
                p.stop.cancel();
            }
        }
        let (fn_, ff) = (figures(node_all), figures(floor_all));
        let (wn, wf, wb) = (figures(walls), figures(floor_walls), figures(bind_spans));
        println!("[burst {n}] {runs} runs of {n} plugins created at once (node CPU {} per run)", ms(cpu / runs as u32));
        println!("  {}", line("rustlet", &fn_));
        println!("  {}", line("floor", &ff));
        println!(
            "  ratio p50 {:.2}x, p99 {:.2}x",
            fn_.p50.as_secs_f64() / ff.p50.as_secs_f64(),
            fn_.p99.as_secs_f64() / ff.p99.as_secs_f64()
        );
        println!("  slowest plugin (socket listening -> notified): rustlet {}, floor {}", ms(fn_.max), ms(ff.max));
        println!(
            "  first socket listening -> last plugin notified: rustlet max {}, floor max {} \
             (the generator alone needs up to {} to bind all {n})",
            ms(wn.max),
            ms(wf.max),
            ms(wb.max)
        );
        println!(
            "  not registered within {WAIT:?}: {failed}; node CPU per registration {:.0} µs",
            cpu.as_secs_f64() * 1e6 / (n * runs) as f64
        );
        if n == 100 {
            println!(
                "  targets: p50 within 1.5x the floor, all within 100 ms; reference: Go kubelet p50 2.1-3.3 s, Krustlet p50 36-58 ms\n"
            );
        } else {
            println!("  targets: all registered within 2 s, none failed\n");
        }
    }

    // 5. 50 sockets recreated at once (Krustlet lost 1-5 of 50).
    let batch: Vec<Plugin> = kept.drain(..50).collect();
    let recreated = g.recreate(true, batch)?;
    let bind_span = recreated[recreated.len() - 1].listening_at - recreated[0].listening_at;
    let (lat, missing) = g.wait_notified(&recreated).await;
    let f = figures(lat);
    println!(
        "[recreate 50 at once] lost: {missing} of 50 (the generator needs {} to stop, unlink and rebind all 50)",
        ms(bind_span)
    );
    println!("  {}", line("rustlet", &f));
    // Floor: the same restart of 50 plugins, registered by the generator itself.
    let mut floor = Vec::new();
    for _ in 0..50 {
        floor.push(g.spawn_plugin(false)?);
    }
    let mut tasks = tokio::task::JoinSet::new();
    let mut restarted = Vec::new();
    for p in floor {
        // Registered right after its restart, as a watcher would see it.
        let again = g.recreate(false, vec![p])?;
        tasks.spawn(floor_register(again[0].registration.clone(), again[0].endpoint.clone()));
        restarted.extend(again);
    }
    let floor = restarted;
    let (lat, _) = g.wait_notified(&floor).await;
    while tasks.join_next().await.is_some() {}
    println!("  {}\n", line("floor", &figures(lat)));
    for p in floor {
        p.stop.cancel();
    }
    kept.extend(recreated);

    // 6. Idle with 1,000 registered plugins.
    let idle = if quick { Duration::from_secs(3) } else { Duration::from_secs(10) };
    let cpu0 = node.cpu();
    let t0 = Instant::now();
    tokio::time::sleep(idle).await; // measuring an idle period, not synchronizing
    let used = node.cpu() - cpu0;
    println!(
        "[idle] {} plugins registered: CPU {:.2}% of one core over {:?}, RSS {:.1} MB",
        kept.len(),
        used.as_secs_f64() / t0.elapsed().as_secs_f64() * 100.0,
        idle,
        node.rss_mb()
    );
    println!("  targets: < 1% of one core, RSS < 50 MB; reference: Go kubelet RSS 75-82 MB, Krustlet 27 MB");
    println!("rejections seen: {}", g.rejected);
    for p in kept {
        p.stop.cancel();
    }
    drop(node);

    steps(if quick { 50 } else { 200 }).await
}

/// Where one registration's time goes (phase 7): a second node that logs
/// each step at debug level (which costs time itself, so its totals are a
/// little above the `[single]` figures), one plugin at a time.
async fn steps(rounds: usize) -> Result<(), BoxError> {
    let root = tempfile::Builder::new().prefix("rustlet-bench-steps-").tempdir()?;
    let mut node = Node::start(root.path(), "info,kubelet_plugins::plugin_manager=debug").await?;
    let mut g = Generator::new(root.path());
    std::fs::create_dir_all(&g.endpoints)?;
    // Instants of this process and the node's wall-clock timestamps meet here.
    let (anchor, wall) = (Instant::now(), std::time::SystemTime::now());
    let at = |i: Instant| wall + (i - anchor);
    std::fs::create_dir_all(&g.floor_dir)?;
    let mut plugins = Vec::new();
    let mut totals = Vec::new();
    let mut floor_steps: [Vec<Duration>; 4] = Default::default();
    for _ in 0..rounds {
        let p = g.spawn_plugin(true)?;
        let (lat, missing) = g.wait_notified(std::slice::from_ref(&p)).await;
        assert_eq!(missing, 0, "a plugin was not registered");
        totals.extend(lat);
        plugins.push(p);
        let f = g.spawn_plugin(false)?;
        let steps = floor_register_steps(f.registration.clone(), f.endpoint.clone()).await?;
        for (samples, step) in floor_steps.iter_mut().zip(steps) {
            samples.push(step);
        }
        f.stop.cancel();
    }
    let mut seen: HashMap<String, std::time::SystemTime> = HashMap::new();
    let mut started: HashMap<String, std::time::SystemTime> = HashMap::new();
    let mut parts: HashMap<String, [Duration; 5]> = HashMap::new();
    let deadline = tokio::time::Instant::now() + WAIT;
    while parts.len() < rounds {
        let Ok(Some(event)) = tokio::time::timeout_at(deadline, node.steps.recv()).await else { break };
        let (Some(socket), Some(ts)) = (event.field("socket"), event.timestamp()) else { continue };
        let us = |name: &str| Duration::from_micros(event.field(name).and_then(|v| v.parse().ok()).unwrap_or(0));
        match event.message() {
            "plugin socket seen" => {
                seen.entry(socket).or_insert(ts);
            }
            "registration started" => {
                started.entry(socket).or_insert(ts);
            }
            _ => {
                parts.insert(
                    socket,
                    [us("dial_us"), us("get_info_us"), us("validate_us"), us("register_us"), us("notify_us")],
                );
            }
        }
    }
    let mut columns: Vec<(&str, Vec<Duration>)> = [
        "bind -> node sees the socket (inotify, watcher, reconciler wake-up)",
        "seen -> registration task running (reconcile, spawn, permit)",
        "dial (connect + HTTP/2 handshake)",
        "GetInfo",
        "handler validate (CSI version check)",
        "handler register (CSI: dial the driver, NodeGetInfo, publish)",
        "NotifyRegistrationStatus",
    ]
    .into_iter()
    .map(|label| (label, Vec::new()))
    .collect();
    for p in &plugins {
        let key = p.registration.display().to_string();
        let (Some(seen), Some(started), Some(steps)) = (seen.get(&key), started.get(&key), parts.get(&key)) else {
            continue;
        };
        let bind = at(p.listening_at);
        columns[0].1.push(seen.duration_since(bind).unwrap_or_default());
        columns[1].1.push(started.duration_since(*seen).unwrap_or_default());
        for (i, step) in steps.iter().enumerate() {
            columns[i + 2].1.push(*step);
        }
    }
    println!("\n[steps] where one registration's time goes ({rounds} plugins one at a time; node logging at debug)");
    println!("  {}", line("total", &figures(totals)));
    for (label, samples) in columns {
        let f = figures(samples);
        println!("  p50 {:>11}  p99 {:>11}  {label} (n={})", ms(f.p50), ms(f.p99), f.n);
    }
    println!("  the floor's own steps, same run (in-process, no watcher):");
    for (label, samples) in
        ["dial", "GetInfo", "NodeGetInfo (with its dial)", "NotifyRegistrationStatus"].into_iter().zip(floor_steps)
    {
        let f = figures(samples);
        println!("  p50 {:>11}  p99 {:>11}  {label} (n={})", ms(f.p50), ms(f.p99), f.n);
    }
    for p in plugins {
        p.stop.cancel();
    }
    Ok(())
}

fn main() -> Result<(), BoxError> {
    // `cargo bench` passes `--bench`; nothing to parse.
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?.block_on(run())
}
