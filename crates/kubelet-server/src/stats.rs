//! `/stats/summary` and `/metrics/resource`: the node's CPU, memory and
//! file system, and each running container's CPU and memory as its
//! provider measures them (CRI `ContainerStats`; the WebAssembly provider's
//! metered CPU time and linear memory).
//!
//! Node figures come from `/proc`: CPU time is `/proc/stat`'s busy time
//! (everything but idle and iowait); memory usage is `MemTotal - MemFree`
//! and the working set that minus `Inactive(file)`, the page cache the
//! kernel can drop, as cAdvisor counts the root cgroup. Rates
//! (`usageNanoCores`) come from the previous reading of the same thing,
//! so the first answer has none.

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
    }
    usage
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

fn memory_json(now: &str, usage: Option<u64>, working_set: Option<u64>, available: Option<u64>) -> Value {
    let mut memory = json!({"time": now});
    if let Some(bytes) = usage {
        memory["usageBytes"] = json!(bytes);
    }
    if let Some(bytes) = working_set {
        memory["workingSetBytes"] = json!(bytes);
    }
    if let Some(bytes) = available {
        memory["availableBytes"] = json!(bytes);
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
    let (pods, _) = pod_usage(state.http.views.pods.store().list(), state.provider.as_ref()).await;
    let mut fs = json!({"time": now});
    if let Ok(stats) = rustix::fs::statvfs(&state.http.views.root_dir) {
        let size = stats.f_frsize;
        fs["capacityBytes"] = json!(stats.f_blocks.saturating_mul(size));
        fs["availableBytes"] = json!(stats.f_bavail.saturating_mul(size));
        fs["usedBytes"] = json!(stats.f_blocks.saturating_sub(stats.f_bfree).saturating_mul(size));
        fs["inodes"] = json!(stats.f_files);
        fs["inodesFree"] = json!(stats.f_ffree);
        fs["inodesUsed"] = json!(stats.f_files.saturating_sub(stats.f_ffree));
    }
    let node_json = json!({
        "nodeName": state.http.views.node_name,
        "startTime": time(node.boot_time.unwrap_or(now_ts)),
        "cpu": cpu_json(&state.rates, "node", &now, node.cpu_ns),
        "memory": memory_json(&now, node.memory_usage, node.memory_working_set, node.memory_available),
        "fs": fs,
        "runtime": {"imageFs": fs},
    });
    let pods_json: Vec<Value> = pods
        .iter()
        .map(|pod| {
            let containers: Vec<Value> = pod
                .containers
                .iter()
                .map(|c| {
                    json!({
                        "name": c.name,
                        "startTime": c.started.map(time),
                        "cpu": cpu_json(&state.rates, &format!("container/{}", c.id), &now, c.stats.cpu_usage_core_nanoseconds),
                        "memory": memory_json(&now, c.stats.memory_usage_bytes, c.stats.memory_working_set_bytes, None),
                    })
                })
                .collect();
            let cpu = sum(pod.containers.iter().map(|c| c.stats.cpu_usage_core_nanoseconds));
            let working_set = sum(pod.containers.iter().map(|c| c.stats.memory_working_set_bytes));
            let used = sum(pod.containers.iter().map(|c| c.stats.memory_usage_bytes));
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
                "memory": memory_json(&now, used, working_set, None),
            });
            if !volumes.is_empty() {
                pod_json["volume"] = json!(volumes);
            }
            pod_json
        })
        .collect();
    Json(json!({"node": node_json, "pods": pods_json})).into_response()
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
    fn label_values_are_escaped() {
        assert_eq!(escape_label("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
