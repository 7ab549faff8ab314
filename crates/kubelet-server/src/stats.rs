//! `/stats/summary` and `/metrics/resource`: the node's CPU, memory and
//! file system, and each running container's CPU and memory as its
//! provider measures them (CRI `ContainerStats`; the WebAssembly provider's
//! metered CPU time and linear memory).
//!
//! Node figures come from `/proc`: CPU time is `/proc/stat`'s busy time
//! (everything but idle and iowait); memory usage is `MemTotal - MemFree`
//! and the working set that minus `Inactive(file)`, the page cache the
//! kernel can drop, as cAdvisor counts the root cgroup; its RSS is the
//! anonymous memory (`AnonPages`), its page faults `/proc/vmstat`'s. Rates
//! (`usageNanoCores`) come from the previous reading of the same thing,
//! so the first answer has none.
//!
//! The summary has the fields upstream's readers dereference (the e2e
//! framework's resource monitor reads the node's `rssBytes` and those of
//! the `kubelet` system container): the node's memory with `rssBytes`,
//! `pageFaults`, `majorPageFaults` and `availableBytes`, its network (every
//! interface but loopback and the pods' veths, `eth0` as the headline),
//! `rlimit`, `runtime.imageFs` and `containerFs`, and `systemContainers`:
//! `kubelet` (this process) and `pods` (every pod together).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::Json;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use kubelet_support::metrics::{TEXT_CONTENT_TYPE, TextWriter};

use super::ApiState;
use crate::pod::usage::{ContainerUsage, PodUsage, pod_usage};
use kubelet_provider::InterfaceStats;

/// Previous cumulative CPU readings, for rates.
#[derive(Default)]
pub(super) struct Rates {
    last: Mutex<HashMap<String, (Instant, u64)>>,
}

impl Rates {
    /// The rate in nanocores since the last reading of `key`, recording
    /// this one.
    fn rate(&self, key: &str, cpu_ns: u64) -> Option<u64> {
        self.rate_at(key, cpu_ns, Instant::now())
    }

    fn rate_at(&self, key: &str, cpu_ns: u64, now: Instant) -> Option<u64> {
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        if last.len() > 10_000 {
            last.retain(|_, (at, _)| now.duration_since(*at) < Duration::from_secs(600));
        }
        let previous = last.insert(key.to_owned(), (now, cpu_ns));
        let (at, before) = previous?;
        let elapsed = now.saturating_duration_since(at).as_nanos();
        if elapsed == 0 || cpu_ns < before {
            return None;
        }
        u64::try_from(u128::from(cpu_ns - before) * 1_000_000_000 / elapsed).ok()
    }
}

/// The node's own figures.
#[derive(Debug, Default, Clone)]
pub(super) struct NodeUsage {
    pub(super) cpu_ns: Option<u64>,
    pub(super) memory_usage: Option<u64>,
    pub(super) memory_working_set: Option<u64>,
    pub(super) memory_available: Option<u64>,
    pub(super) memory_rss: Option<u64>,
    pub(super) page_faults: Option<u64>,
    pub(super) major_page_faults: Option<u64>,
    pub(super) boot_time: Option<jiff::Timestamp>,
}

pub(super) fn node_usage() -> NodeUsage {
    let mut usage = NodeUsage::default();
    if let Ok(stat) = std::fs::read_to_string("/proc/stat") {
        for line in stat.lines() {
            let mut fields = line.split_whitespace();
            match fields.next() {
                Some("cpu") => {
                    let ticks: Vec<u64> = fields.filter_map(|f| f.parse().ok()).collect();
                    // user nice system idle iowait irq softirq steal (guest is in user).
                    let busy: u64 =
                        ticks.iter().take(8).enumerate().filter(|(i, _)| *i != 3 && *i != 4).map(|(_, t)| t).sum();
                    // USER_HZ is 100 on Linux.
                    usage.cpu_ns = Some(busy.saturating_mul(10_000_000));
                }
                Some("btime") => {
                    usage.boot_time = fields
                        .next()
                        .and_then(|s| s.parse::<i64>().ok())
                        .and_then(|s| jiff::Timestamp::from_second(s).ok());
                }
                _ => {}
            }
        }
    }
    if let Ok(meminfo) = std::fs::read_to_string("/proc/meminfo") {
        let field = |name: &str| {
            meminfo
                .lines()
                .find(|l| l.starts_with(name) && l[name.len()..].starts_with(':'))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kib| kib.parse::<u64>().ok())
                .map(|kib| kib * 1024)
        };
        if let (Some(total), Some(free)) = (field("MemTotal"), field("MemFree")) {
            let used = total.saturating_sub(free);
            usage.memory_usage = Some(used);
            usage.memory_working_set = Some(used.saturating_sub(field("Inactive(file)").unwrap_or(0)));
        }
        usage.memory_available = field("MemAvailable");
        usage.memory_rss = field("AnonPages");
    }
    if let Ok(vmstat) = std::fs::read_to_string("/proc/vmstat") {
        let counter = |name: &str| {
            vmstat.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse::<u64>().ok())
        };
        usage.page_faults = counter("pgfault");
        usage.major_page_faults = counter("pgmajfault");
    }
    usage
}

/// What one process uses, from `/proc/<pid>/stat` and `status` (the
/// `kubelet` system container: this process).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(super) struct ProcessUsage {
    pub(super) cpu_ns: Option<u64>,
    pub(super) resident: Option<u64>,
    pub(super) anonymous: Option<u64>,
    pub(super) page_faults: Option<u64>,
    pub(super) major_page_faults: Option<u64>,
    pub(super) started: Option<jiff::Timestamp>,
}

/// Reads `/proc/self`; `boot_time` places its start.
pub(super) fn own_usage(boot_time: Option<jiff::Timestamp>) -> ProcessUsage {
    process_usage("self", boot_time).unwrap_or_default()
}

/// What process `pid` (`self` for this one) uses, from its `/proc` files;
/// `None` if it is gone.
fn process_usage(pid: &str, boot_time: Option<jiff::Timestamp>) -> Option<ProcessUsage> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    Some(parse_process(&stat, &status, boot_time))
}

/// A process as a system container of the summary (`kubelet`, `runtime`).
fn system_container(
    rates: &Rates,
    name: &str,
    usage: &ProcessUsage,
    fallback_start: jiff::Timestamp,
    now: &str,
) -> serde_json::Value {
    json!({
        "name": name,
        "startTime": time(usage.started.unwrap_or(fallback_start)),
        "cpu": cpu_json(rates, &format!("system/{name}"), now, usage.cpu_ns),
        "memory": memory_json(now, Memory {
            usage: usage.resident,
            working_set: usage.resident,
            rss: usage.anonymous,
            page_faults: usage.page_faults,
            major_page_faults: usage.major_page_faults,
            ..Memory::default()
        }),
    })
}

fn parse_process(stat: &str, status: &str, boot_time: Option<jiff::Timestamp>) -> ProcessUsage {
    // The command name may hold spaces and parentheses: fields count from
    // the last `)`; after it come field 3 (state) onwards.
    let fields: Vec<&str> =
        stat.rsplit_once(')').map(|(_, rest)| rest.split_whitespace().collect()).unwrap_or_default();
    let field = |n: usize| fields.get(n - 3).and_then(|v| v.parse::<u64>().ok());
    // USER_HZ is 100 on Linux.
    let ticks = |t: u64| t.saturating_mul(10_000_000);
    let kib = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
            .map(|k| k * 1024)
    };
    let (minor, major) = (field(10), field(12));
    ProcessUsage {
        cpu_ns: field(14).zip(field(15)).map(|(user, system)| ticks(user + system)),
        resident: kib("VmRSS"),
        anonymous: kib("RssAnon"),
        page_faults: minor.zip(major).map(|(minor, major)| minor + major),
        major_page_faults: major,
        started: field(22).zip(boot_time).and_then(|(start, boot)| {
            boot.checked_add(jiff::SignedDuration::from_millis(i64::try_from(start).ok()?.saturating_mul(10))).ok()
        }),
    }
}

/// The node's interfaces as cAdvisor counts the root container's: loopback
/// and the pods' host-side veths left out.
fn node_interfaces(table: &str) -> Vec<InterfaceStats> {
    InterfaceStats::parse_net_dev(table)
        .into_iter()
        .filter(|i| !["veth", "docker", "nerdctl"].iter().any(|prefix| i.name.starts_with(prefix)))
        .collect()
}

/// Upstream's `NetworkStats`: the default interface (`eth0`) inline, and
/// every interface in `interfaces`.
fn network_json(now: &str, interfaces: &[InterfaceStats]) -> Value {
    let one = |i: &InterfaceStats| json!({"name": i.name, "rxBytes": i.rx_bytes, "rxErrors": i.rx_errors, "txBytes": i.tx_bytes, "txErrors": i.tx_errors});
    let mut network = json!({"time": now, "interfaces": interfaces.iter().map(one).collect::<Vec<_>>()});
    if let Some(default) = interfaces.iter().find(|i| i.name == "eth0")
        && let (Value::Object(network), Value::Object(default)) = (&mut network, one(default))
    {
        network.extend(default);
    }
    network
}

/// `rlimit`: the kernel's `pid_max` and the tasks now running (as the
/// kubelet's `sysinfo` count).
fn rlimit_json(now: &str) -> Value {
    let mut rlimit = json!({"time": now});
    if let Some(max) =
        std::fs::read_to_string("/proc/sys/kernel/pid_max").ok().and_then(|s| s.trim().parse::<u64>().ok())
    {
        rlimit["maxpid"] = json!(max);
    }
    // `/proc/loadavg`'s fourth field: running/total scheduling entities.
    let total = std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().nth(3)?.split_once('/')?.1.parse::<u64>().ok());
    if let Some(total) = total {
        rlimit["curproc"] = json!(total);
    }
    rlimit
}

fn time(t: jiff::Timestamp) -> String {
    t.strftime("%Y-%m-%dT%H:%M:%SZ").to_string()
}

fn cpu_json(rates: &Rates, key: &str, now: &str, cpu_ns: Option<u64>) -> Value {
    let mut cpu = json!({"time": now});
    if let Some(ns) = cpu_ns {
        cpu["usageCoreNanoSeconds"] = json!(ns);
        if let Some(rate) = rates.rate(key, ns) {
            cpu["usageNanoCores"] = json!(rate);
        }
    }
    cpu
}

/// Upstream's `MemoryStats`; absent figures are left out.
#[derive(Debug, Default, Clone, Copy)]
struct Memory {
    usage: Option<u64>,
    working_set: Option<u64>,
    available: Option<u64>,
    rss: Option<u64>,
    page_faults: Option<u64>,
    major_page_faults: Option<u64>,
}

fn memory_json(now: &str, m: Memory) -> Value {
    let mut memory = json!({"time": now});
    for (key, value) in [
        ("availableBytes", m.available),
        ("usageBytes", m.usage),
        ("workingSetBytes", m.working_set),
        ("rssBytes", m.rss),
        ("pageFaults", m.page_faults),
        ("majorPageFaults", m.major_page_faults),
    ] {
        if let Some(value) = value {
            memory[key] = json!(value);
        }
    }
    memory
}

pub(super) fn sum(values: impl Iterator<Item = Option<u64>>) -> Option<u64> {
    values.fold(None, |total, v| match (total, v) {
        (None, v) => v,
        (Some(t), Some(v)) => Some(t.saturating_add(v)),
        (t, None) => t,
    })
}

/// `GET /stats/summary`.
pub(super) async fn summary(State(state): State<ApiState>) -> Response {
    let now_ts = jiff::Timestamp::now();
    let now = time(now_ts);
    let node = node_usage();
    let listed = state.http.views.pods.store().list();
    let (pods, _) = pod_usage(listed.clone(), state.provider.as_ref()).await;
    let pod_stats = match &state.provider {
        Some(provider) => pods_stats(&listed, provider).await,
        None => vec![None; listed.len()],
    };
    let fs = fs_json(&now, &state.http.views.root_dir);
    let image_fs = match &state.provider {
        Some(provider) => provider.image_fs_path().await,
        None => None,
    };
    let image_fs = image_fs.map_or_else(|| fs.clone(), |path| fs_json(&now, &path));
    let interfaces = std::fs::read_to_string("/proc/net/dev").map(|t| node_interfaces(&t)).unwrap_or_default();
    let mut pods_json = Vec::new();
    let (mut all_cpu, mut all_memory) = (Vec::new(), Vec::new());
    for (pod, stats) in pods.iter().zip(pod_stats) {
        let stats = stats.unwrap_or_default();
        let containers: Vec<Value> = pod
            .containers
            .iter()
            .map(|c| {
                let mut container = json!({
                    "name": c.name,
                    "startTime": c.started.map(time),
                    "cpu": cpu_json(&state.rates, &format!("container/{}", c.id), &now, c.stats.cpu_usage_core_nanoseconds),
                    "memory": memory_json(&now, Memory {
                        usage: c.stats.memory_usage_bytes,
                        working_set: c.stats.memory_working_set_bytes,
                        rss: c.stats.memory_rss_bytes,
                        page_faults: c.stats.memory_page_faults,
                        major_page_faults: c.stats.memory_major_page_faults,
                        ..Memory::default()
                    }),
                });
                if let Some(used) = c.stats.fs_used_bytes {
                    container["rootfs"] = json!({"time": now, "usedBytes": used});
                }
                container
            })
            .collect();
        // The pod's own cgroup where it has one, else its containers summed.
        let of_containers =
            |f: fn(&kubelet_provider::ContainerStats) -> Option<u64>| sum(pod.containers.iter().map(|c| f(&c.stats)));
        let cpu = stats.cpu_usage_core_nanoseconds.or_else(|| of_containers(|c| c.cpu_usage_core_nanoseconds));
        let memory = Memory {
            usage: stats.memory_usage_bytes.or_else(|| of_containers(|c| c.memory_usage_bytes)),
            working_set: stats.memory_working_set_bytes.or_else(|| of_containers(|c| c.memory_working_set_bytes)),
            rss: stats.memory_rss_bytes.or_else(|| of_containers(|c| c.memory_rss_bytes)),
            page_faults: of_containers(|c| c.memory_page_faults),
            major_page_faults: of_containers(|c| c.memory_major_page_faults),
            ..Memory::default()
        };
        all_cpu.push(cpu);
        all_memory.push(memory);
        let volumes: Vec<Value> = state
            .http
            .views
            .pods
            .volume_stats()
            .pod_usage(&pod.uid)
            .into_iter()
            .map(|u| {
                json!({
                    "time": time(u.time),
                    "availableBytes": u.available,
                    "capacityBytes": u.capacity,
                    "usedBytes": u.used,
                    "inodesFree": u.inodes_free,
                    "inodes": u.inodes,
                    "inodesUsed": u.inodes_used,
                    "name": u.volume.volume,
                    "pvcRef": {"name": u.volume.claim, "namespace": u.volume.namespace},
                })
            })
            .collect();
        let mut pod_json = json!({
            "podRef": {"name": pod.name, "namespace": pod.namespace, "uid": pod.uid},
            "startTime": pod.started.map(time),
            "containers": containers,
            "cpu": cpu_json(&state.rates, &format!("pod/{}", pod.uid), &now, cpu),
            "memory": memory_json(&now, memory),
        });
        if !stats.network.is_empty() {
            pod_json["network"] = network_json(&now, &stats.network);
        }
        if !volumes.is_empty() {
            pod_json["volume"] = json!(volumes);
        }
        pods_json.push(pod_json);
    }
    let me = own_usage(node.boot_time);
    let booted = node.boot_time.unwrap_or(now_ts);
    let mut system_containers = vec![system_container(&state.rates, "kubelet", &me, booted, &now)];
    let runtime = match &state.provider {
        Some(provider) => provider.runtime_process().await,
        None => None,
    };
    if let Some(usage) = runtime.and_then(|pid| process_usage(&pid.to_string(), node.boot_time)) {
        system_containers.push(system_container(&state.rates, "runtime", &usage, booted, &now));
    }
    system_containers.push(json!({
        "name": "pods",
        "startTime": time(me.started.or(node.boot_time).unwrap_or(now_ts)),
        "cpu": cpu_json(&state.rates, "system/pods", &now, sum(all_cpu.into_iter())),
        "memory": memory_json(&now, Memory {
            usage: sum(all_memory.iter().map(|m| m.usage)),
            working_set: sum(all_memory.iter().map(|m| m.working_set)),
            rss: sum(all_memory.iter().map(|m| m.rss)),
            page_faults: sum(all_memory.iter().map(|m| m.page_faults)),
            major_page_faults: sum(all_memory.iter().map(|m| m.major_page_faults)),
            // What pods may still take before the node's memory runs out.
            available: node.memory_available,
        }),
    }));
    let node_json = json!({
        "nodeName": state.http.views.node_name,
        "systemContainers": system_containers,
        "startTime": time(node.boot_time.unwrap_or(now_ts)),
        "cpu": cpu_json(&state.rates, "node", &now, node.cpu_ns),
        "memory": memory_json(&now, Memory {
            usage: node.memory_usage,
            working_set: node.memory_working_set,
            available: node.memory_available,
            rss: node.memory_rss,
            page_faults: node.page_faults,
            major_page_faults: node.major_page_faults,
        }),
        "network": network_json(&now, &interfaces),
        "fs": fs,
        "runtime": {"imageFs": image_fs, "containerFs": image_fs},
        "rlimit": rlimit_json(&now),
    });
    Json(json!({"node": node_json, "pods": pods_json})).into_response()
}

/// How long one pod's own stats may take before they are left out.
const POD_STATS_DEADLINE: Duration = Duration::from_secs(2);

/// Each pod's own stats, read at once, each within a deadline (`None`:
/// unsupported, failed or late).
pub(super) async fn pods_stats(
    pods: &[k8s_openapi::api::core::v1::Pod],
    provider: &std::sync::Arc<dyn kubelet_provider::Provider>,
) -> Vec<Option<kubelet_provider::PodStats>> {
    let reads = pods.iter().map(|pod| async move {
        match tokio::time::timeout(POD_STATS_DEADLINE, provider.pod_stats(pod)).await {
            Ok(Ok(stats)) => Some(stats),
            Ok(Err(error)) if error.kind == kubelet_provider::ProviderErrorKind::Unsupported => None,
            Ok(Err(error)) => {
                tracing::debug!(%error, pod = ?pod.metadata.name, "no pod stats");
                None
            }
            Err(_) => None,
        }
    });
    futures_util::future::join_all(reads).await
}

/// Upstream's `FsStats` of the file system holding `path`.
fn fs_json(now: &str, path: &std::path::Path) -> Value {
    let mut fs = json!({"time": now});
    if let Ok(stats) = rustix::fs::statvfs(path) {
        let size = stats.f_frsize;
        fs["capacityBytes"] = json!(stats.f_blocks.saturating_mul(size));
        fs["availableBytes"] = json!(stats.f_bavail.saturating_mul(size));
        fs["usedBytes"] = json!(stats.f_blocks.saturating_sub(stats.f_bfree).saturating_mul(size));
        fs["inodes"] = json!(stats.f_files);
        fs["inodesFree"] = json!(stats.f_ffree);
        fs["inodesUsed"] = json!(stats.f_files.saturating_sub(stats.f_ffree));
    }
    fs
}

/// `GET /metrics/resource`: the series metrics-server reads, in the
/// Prometheus text format, with the kubelet's names, help and labels.
pub(super) async fn resource_metrics(State(state): State<ApiState>) -> Response {
    let node = node_usage();
    let (pods, failed) = pod_usage(state.http.views.pods.store().list(), state.provider.as_ref()).await;
    let ms = Some(jiff::Timestamp::now().as_millisecond());
    let mut out = TextWriter::new();
    let mut family = |name: &str, kind: &str, help: &str, samples: Vec<(Vec<(&str, &str)>, f64)>| {
        out.family(name, kind, &format!("[STABLE] {help}"));
        for (labels, value) in samples {
            out.sample(name, &labels, value, ms);
        }
    };
    let seconds = |ns: u64| ns as f64 / 1e9;
    let each = |f: &dyn Fn(&ContainerUsage) -> Option<f64>| -> Vec<(Vec<(&str, &str)>, f64)> {
        pods.iter()
            .flat_map(|p| {
                p.containers.iter().filter_map(move |c| {
                    let labels = vec![("container", c.name.as_str()), ("namespace", &p.namespace), ("pod", &p.name)];
                    f(c).map(|v| (labels, v))
                })
            })
            .collect()
    };
    let per_pod = |f: &dyn Fn(&PodUsage) -> Option<f64>| -> Vec<(Vec<(&str, &str)>, f64)> {
        pods.iter()
            .filter_map(|p| f(p).map(|v| (vec![("namespace", p.namespace.as_str()), ("pod", &p.name)], v)))
            .collect()
    };
    family(
        "container_cpu_usage_seconds_total",
        "counter",
        "Cumulative cpu time consumed by the container in core-seconds",
        each(&|c| c.stats.cpu_usage_core_nanoseconds.map(seconds)),
    );
    family(
        "container_memory_working_set_bytes",
        "gauge",
        "Current working set of the container in bytes",
        each(&|c| c.stats.memory_working_set_bytes.map(|b| b as f64)),
    );
    family(
        "container_start_time_seconds",
        "gauge",
        "Start time of the container since unix epoch in seconds",
        each(&|c| c.started.map(|t| t.as_millisecond() as f64 / 1e3)),
    );
    family(
        "node_cpu_usage_seconds_total",
        "counter",
        "Cumulative cpu time consumed by the node in core-seconds",
        node.cpu_ns.map(|ns| (Vec::new(), seconds(ns))).into_iter().collect(),
    );
    family(
        "node_memory_working_set_bytes",
        "gauge",
        "Current working set of the node in bytes",
        node.memory_working_set.map(|b| (Vec::new(), b as f64)).into_iter().collect(),
    );
    family(
        "pod_cpu_usage_seconds_total",
        "counter",
        "Cumulative cpu time consumed by the pod in core-seconds",
        per_pod(&|p| sum(p.containers.iter().map(|c| c.stats.cpu_usage_core_nanoseconds)).map(seconds)),
    );
    family(
        "pod_memory_working_set_bytes",
        "gauge",
        "Current working set of the pod in bytes",
        per_pod(&|p| sum(p.containers.iter().map(|c| c.stats.memory_working_set_bytes)).map(|b| b as f64)),
    );
    out.family("scrape_error", "gauge", "[ALPHA] 1 if there was an error while getting container metrics, 0 otherwise");
    out.sample("scrape_error", &[], f64::from(u8::from(failed)), None);
    (StatusCode::OK, [(header::CONTENT_TYPE, TEXT_CONTENT_TYPE)], out.finish()).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use kubelet_support::metrics::escape_label;

    #[test]
    fn rates_come_from_the_previous_reading() {
        let rates = Rates::default();
        let start = Instant::now();
        assert_eq!(rates.rate_at("a", 100, start), None, "no earlier reading");
        let later = start + Duration::from_millis(10);
        assert_eq!(rates.rate_at("a", 100 + 5_000_000, later), Some(500_000_000), "5 ms of CPU in 10 ms: half a core");
        let later = later + Duration::from_millis(10);
        assert_eq!(rates.rate_at("a", 10, later), None, "a counter that went back (a new container) gives no rate");
    }

    #[test]
    fn node_usage_reads_proc() {
        let usage = node_usage();
        assert!(usage.cpu_ns.is_some_and(|ns| ns > 0));
        assert!(usage.memory_working_set.is_some_and(|b| b > 0));
        assert!(usage.memory_usage >= usage.memory_working_set);
        assert!(usage.boot_time.is_some());
    }

    #[test]
    fn a_process_is_read_from_its_stat_and_status() {
        // A command name with a space and a parenthesis; utime 150, stime
        // 50 ticks; 700 minor and 3 major faults; started 1,000 ticks after
        // boot.
        let stat = "42 (tokio (rt) x) S 1 42 42 0 -1 4194560 700 0 3 0 150 50 0 0 20 0 8 0 1000 1000 200";
        let status = "Name:\tx\nVmRSS:\t   2048 kB\nRssAnon:\t    1024 kB\n";
        let boot = jiff::Timestamp::from_second(1_700_000_000).expect("a time");
        let usage = parse_process(stat, status, Some(boot));
        assert_eq!(usage.cpu_ns, Some(2_000_000_000), "200 ticks of 10 ms");
        assert_eq!((usage.resident, usage.anonymous), (Some(2 << 20), Some(1 << 20)));
        assert_eq!((usage.page_faults, usage.major_page_faults), (Some(703), Some(3)));
        assert_eq!(usage.started, Some(jiff::Timestamp::from_second(1_700_000_010).expect("a time")));
        assert_eq!(parse_process("", "", None), ProcessUsage::default(), "nothing to read, nothing made up");
    }

    #[test]
    fn the_nodes_network_has_eth0_inline_and_no_pod_veths() {
        let table = "Inter-|   Receive |  Transmit
 face |bytes packets errs drop fifo frame compressed multicast|bytes packets errs drop fifo colls carrier compressed
    lo: 100 1 0 0 0 0 0 0 100 1 0 0 0 0 0 0
  eth0: 5000 10 1 0 0 0 0 0 7000 12 2 0 0 0 0 0
vethab12: 300 3 0 0 0 0 0 0 400 4 0 0 0 0 0 0
  cni0: 10 1 0 0 0 0 0 0 20 2 0 0 0 0 0 0
";
        let interfaces = node_interfaces(table);
        let names: Vec<&str> = interfaces.iter().map(|i| i.name.as_str()).collect();
        assert_eq!(names, ["eth0", "cni0"]);
        let network = network_json("now", &interfaces);
        assert_eq!((network["name"].as_str(), network["rxBytes"].as_u64()), (Some("eth0"), Some(5000)));
        assert_eq!((network["txBytes"].as_u64(), network["txErrors"].as_u64()), (Some(7000), Some(2)));
        assert_eq!(network["interfaces"].as_array().map(Vec::len), Some(2));
        let without = network_json("now", &interfaces[1..]);
        assert!(without.get("name").is_none(), "no eth0, no headline: {without}");
    }

    #[test]
    fn the_node_reads_rss_and_page_faults() {
        let usage = node_usage();
        assert!(usage.memory_rss.is_some_and(|b| b > 0));
        assert!(usage.page_faults.is_some_and(|n| n > 0));
        assert!(usage.major_page_faults.is_some());
        let me = own_usage(usage.boot_time);
        assert!(me.resident.is_some_and(|b| b > 0) && me.page_faults.is_some_and(|n| n > 0), "{me:?}");
        assert!(me.started.is_some_and(|t| t <= jiff::Timestamp::now()), "{me:?}");
    }

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(escape_label("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
