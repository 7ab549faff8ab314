//! `/metrics/cadvisor`: the container series the kubelet's embedded
//! cAdvisor serves and dashboards read, for the pods' containers, with
//! cAdvisor's names, help and labels (`container`, `id`, `image`, `name`,
//! `namespace`, `pod`).
//!
//! Rustlet has no cAdvisor: the figures come from the pods' provider.
//! - Each running container: CRI `ContainerStats` (cpu, memory working
//!   set, usage, RSS, writable layer) for containers; the WebAssembly
//!   provider's metered CPU time and linear memory for modules. `name` is
//!   the runtime's container ID, as cAdvisor names containerd's
//!   containers; `id` is its cgroup under the pod's.
//! - Each pod (`container=""`, as cAdvisor's pod cgroup): the provider's
//!   pod stats (the CRI provider reads the pod's cgroup and its sandbox's
//!   network namespace), else the sum of its containers and no network.
//! - The node (`id="/"`): `/proc` (cpu, memory, the host's interfaces).
//! - `machine_cpu_cores`, `machine_memory_bytes`.
//!
//! Samples of measured figures carry the time of the scrape, as cAdvisor's
//! carry the time of their stats.

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use kubelet_provider::{InterfaceStats, PodStats};
use kubelet_support::metrics::{TEXT_CONTENT_TYPE, TextWriter};

use super::ApiState;
use super::stats::{pods_stats, sum};
use crate::pod::usage::{PodUsage, pod_usage};

/// One cgroup's series.
#[derive(Default)]
struct Row {
    container: String,
    id: String,
    image: String,
    name: String,
    namespace: String,
    pod: String,
    cpu_seconds: Option<f64>,
    working_set: Option<u64>,
    usage: Option<u64>,
    rss: Option<u64>,
    fs_usage: Option<u64>,
    start_time: Option<f64>,
    network: Vec<InterfaceStats>,
}

impl Row {
    fn labels(&self) -> [(&'static str, &str); 6] {
        [
            ("container", &self.container),
            ("id", &self.id),
            ("image", &self.image),
            ("name", &self.name),
            ("namespace", &self.namespace),
            ("pod", &self.pod),
        ]
    }
}

/// The rows of one pod and its containers.
fn pod_rows(pod: &PodUsage, stats: Option<PodStats>, rows: &mut Vec<Row>) {
    let stats = stats.unwrap_or_default();
    let pod_id = stats.cgroup.clone().unwrap_or_else(|| format!("/rustlet/pod{}", pod.uid));
    let seconds = |ns: u64| ns as f64 / 1e9;
    rows.push(Row {
        id: pod_id.clone(),
        namespace: pod.namespace.clone(),
        pod: pod.name.clone(),
        cpu_seconds: stats
            .cpu_usage_core_nanoseconds
            .or_else(|| sum(pod.containers.iter().map(|c| c.stats.cpu_usage_core_nanoseconds)))
            .map(seconds),
        working_set: stats
            .memory_working_set_bytes
            .or_else(|| sum(pod.containers.iter().map(|c| c.stats.memory_working_set_bytes))),
        usage: stats.memory_usage_bytes.or_else(|| sum(pod.containers.iter().map(|c| c.stats.memory_usage_bytes))),
        rss: stats.memory_rss_bytes.or_else(|| sum(pod.containers.iter().map(|c| c.stats.memory_rss_bytes))),
        start_time: pod.started.map(|t| t.as_millisecond() as f64 / 1e3),
        network: stats.network,
        ..Row::default()
    });
    for container in &pod.containers {
        rows.push(Row {
            container: container.name.clone(),
            id: format!("{pod_id}/{}", container.id),
            image: container.image.clone(),
            name: container.id.clone(),
            namespace: pod.namespace.clone(),
            pod: pod.name.clone(),
            cpu_seconds: container.stats.cpu_usage_core_nanoseconds.map(seconds),
            working_set: container.stats.memory_working_set_bytes,
            usage: container.stats.memory_usage_bytes,
            rss: container.stats.memory_rss_bytes,
            fs_usage: container.stats.fs_used_bytes,
            start_time: container.started.map(|t| t.as_millisecond() as f64 / 1e3),
            ..Row::default()
        });
    }
}

/// The node's own row (`id="/"`).
fn root_row() -> Row {
    let node = super::stats::node_usage();
    Row {
        id: "/".into(),
        cpu_seconds: node.cpu_ns.map(|ns| ns as f64 / 1e9),
        working_set: node.memory_working_set,
        usage: node.memory_usage,
        start_time: node.boot_time.map(|t| t.as_second() as f64),
        network: std::fs::read_to_string("/proc/net/dev")
            .map(|t| InterfaceStats::parse_net_dev(&t))
            .unwrap_or_default(),
        ..Row::default()
    }
}

/// What names the machine: `boot_id`, `machine_id`, `system_uuid` (empty
/// when unreadable, as cAdvisor leaves them).
fn machine_labels() -> [(&'static str, String); 3] {
    let read = |path: &str| std::fs::read_to_string(path).map(|s| s.trim().to_owned()).unwrap_or_default();
    [
        ("boot_id", read("/proc/sys/kernel/random/boot_id")),
        ("machine_id", read("/etc/machine-id")),
        ("system_uuid", read("/sys/class/dmi/id/product_uuid")),
    ]
}

/// The page.
fn page(rows: &[Row], device: &str, now_ms: i64) -> String {
    let mut out = TextWriter::new();
    let machine = machine_labels();
    let machine: Vec<(&str, &str)> = machine.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let capacity = crate::cluster::capacity::measure(0);
    out.family("machine_cpu_cores", "gauge", "Number of logical CPU cores.");
    out.sample("machine_cpu_cores", &machine, (capacity.cpu_milli / 1000) as f64, None);
    if capacity.memory > 0 {
        out.family("machine_memory_bytes", "gauge", "Amount of memory installed on the machine.");
        out.sample("machine_memory_bytes", &machine, capacity.memory as f64, None);
    }
    let ts = Some(now_ms);
    let mut gauge =
        |name: &str, help: &str, kind: &str, value: &dyn Fn(&Row) -> Option<f64>, extra: Option<(&str, &str)>| {
            let values: Vec<(&Row, f64)> = rows.iter().filter_map(|r| value(r).map(|v| (r, v))).collect();
            if values.is_empty() {
                return;
            }
            out.family(name, kind, help);
            for (row, v) in values {
                let mut labels: Vec<(&str, &str)> = row.labels().to_vec();
                if let Some(pair) = extra {
                    // cpu/device sort before/after id as cAdvisor's sorted names do.
                    labels.push(pair);
                    labels.sort_by_key(|(k, _)| *k);
                }
                out.sample(name, &labels, v, ts);
            }
        };
    gauge(
        "container_cpu_usage_seconds_total",
        "Cumulative cpu time consumed in seconds.",
        "counter",
        &|r| r.cpu_seconds,
        Some(("cpu", "total")),
    );
    gauge(
        "container_fs_usage_bytes",
        "Number of bytes that are consumed by the container on this filesystem.",
        "gauge",
        &|r| r.fs_usage.map(|b| b as f64),
        Some(("device", device)),
    );
    gauge("container_memory_rss", "Size of RSS in bytes.", "gauge", &|r| r.rss.map(|b| b as f64), None);
    gauge(
        "container_memory_usage_bytes",
        "Current memory usage in bytes, including all memory regardless of when it was accessed",
        "gauge",
        &|r| r.usage.map(|b| b as f64),
        None,
    );
    gauge(
        "container_memory_working_set_bytes",
        "Current working set in bytes.",
        "gauge",
        &|r| r.working_set.map(|b| b as f64),
        None,
    );
    type Counter = fn(&InterfaceStats) -> u64;
    let network: [(&str, &str, Counter); 8] = [
        ("container_network_receive_bytes_total", "Cumulative count of bytes received", |i| i.rx_bytes),
        ("container_network_receive_errors_total", "Cumulative count of errors encountered while receiving", |i| {
            i.rx_errors
        }),
        (
            "container_network_receive_packets_dropped_total",
            "Cumulative count of packets dropped while receiving",
            |i| i.rx_dropped,
        ),
        ("container_network_receive_packets_total", "Cumulative count of packets received", |i| i.rx_packets),
        ("container_network_transmit_bytes_total", "Cumulative count of bytes transmitted", |i| i.tx_bytes),
        ("container_network_transmit_errors_total", "Cumulative count of errors encountered while transmitting", |i| {
            i.tx_errors
        }),
        (
            "container_network_transmit_packets_dropped_total",
            "Cumulative count of packets dropped while transmitting",
            |i| i.tx_dropped,
        ),
        ("container_network_transmit_packets_total", "Cumulative count of packets transmitted", |i| i.tx_packets),
    ];
    for (name, help, value) in network {
        if rows.iter().all(|r| r.network.is_empty()) {
            break;
        }
        out.family(name, "counter", help);
        for row in rows {
            for interface in &row.network {
                let mut labels: Vec<(&str, &str)> = row.labels().to_vec();
                labels.push(("interface", &interface.name));
                labels.sort_by_key(|(k, _)| *k);
                out.sample(name, &labels, value(interface) as f64, ts);
            }
        }
    }
    gauge_start(&mut out, rows);
    out.finish()
}

/// `container_start_time_seconds`, without a sample time (as cAdvisor).
fn gauge_start(out: &mut TextWriter, rows: &[Row]) {
    let name = "container_start_time_seconds";
    if rows.iter().all(|r| r.start_time.is_none()) {
        return;
    }
    out.family(name, "gauge", "Start time of the container since unix epoch in seconds.");
    for row in rows {
        if let Some(start) = row.start_time {
            out.sample(name, &row.labels(), start, None);
        }
    }
}

/// The device of the file system holding `path` (the longest mount point
/// over it in `/proc/self/mountinfo`), for `container_fs_usage_bytes`.
fn device_of(path: &std::path::Path) -> String {
    let Ok(mountinfo) = std::fs::read_to_string("/proc/self/mountinfo") else { return String::new() };
    let mut best: (usize, String) = (0, String::new());
    for line in mountinfo.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let Some(mount_point) = fields.get(4) else { continue };
        let Some(dash) = fields.iter().position(|f| *f == "-") else { continue };
        let Some(source) = fields.get(dash + 2) else { continue };
        if path.starts_with(mount_point) && mount_point.len() >= best.0 {
            best = (mount_point.len(), (*source).to_owned());
        }
    }
    best.1
}

/// `GET /metrics/cadvisor`.
pub(super) async fn metrics(State(state): State<ApiState>) -> Response {
    let pods = state.http.views.pods.store().list();
    let (usage, _) = pod_usage(pods.clone(), state.provider.as_ref()).await;
    let stats = match &state.provider {
        Some(provider) => pods_stats(&pods, provider).await,
        None => vec![None; pods.len()],
    };
    let image_fs = match &state.provider {
        Some(provider) => provider.image_fs_path().await,
        None => None,
    };
    let device = device_of(image_fs.as_deref().unwrap_or(&state.http.views.root_dir));
    let mut rows = vec![root_row()];
    for (pod, stats) in usage.iter().zip(stats) {
        pod_rows(pod, stats, &mut rows);
    }
    let body = page(&rows, &device, jiff::Timestamp::now().as_millisecond());
    (StatusCode::OK, [(header::CONTENT_TYPE, TEXT_CONTENT_TYPE)], body).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pod::usage::ContainerUsage;
    use kubelet_provider::ContainerStats;

    fn pod() -> PodUsage {
        PodUsage {
            name: "web".into(),
            namespace: "default".into(),
            uid: "u1".into(),
            started: None,
            containers: vec![ContainerUsage {
                name: "app".into(),
                id: "abc".into(),
                image: "registry/app:1".into(),
                started: Some(jiff::Timestamp::from_second(1_700_000_000).expect("a time")),
                stats: ContainerStats {
                    cpu_usage_core_nanoseconds: Some(2_500_000_000),
                    memory_working_set_bytes: Some(1000),
                    memory_usage_bytes: Some(1500),
                    memory_rss_bytes: Some(800),
                    fs_used_bytes: Some(4096),
                    ..ContainerStats::default()
                },
            }],
        }
    }

    #[test]
    fn containers_and_their_pod_have_cadvisors_labels() {
        let mut rows = Vec::new();
        let stats = PodStats {
            cgroup: Some("/kubepods/burstable/podu1".into()),
            memory_working_set_bytes: Some(3000),
            network: vec![InterfaceStats { name: "eth0".into(), rx_bytes: 42, ..InterfaceStats::default() }],
            ..PodStats::default()
        };
        pod_rows(&pod(), Some(stats), &mut rows);
        let text = page(&rows, "/dev/vda1", 5);
        assert!(text.contains(
            "container_cpu_usage_seconds_total{container=\"app\",cpu=\"total\",id=\"/kubepods/burstable/podu1/abc\",image=\"registry/app:1\",name=\"abc\",namespace=\"default\",pod=\"web\"} 2.5 5\n"
        ), "{text}");
        assert!(text.contains(
            "container_memory_working_set_bytes{container=\"\",id=\"/kubepods/burstable/podu1\",image=\"\",name=\"\",namespace=\"default\",pod=\"web\"} 3000 5\n"
        ), "{text}");
        // The pod's cpu, unmeasured at its level, is its containers' sum.
        assert!(text.contains("cpu=\"total\",id=\"/kubepods/burstable/podu1\",image=\"\",name=\"\",namespace=\"default\",pod=\"web\"} 2.5 5\n"), "{text}");
        assert!(text.contains(
            "container_network_receive_bytes_total{container=\"\",id=\"/kubepods/burstable/podu1\",image=\"\",interface=\"eth0\",name=\"\",namespace=\"default\",pod=\"web\"} 42 5\n"
        ), "{text}");
        assert!(text.contains("container_fs_usage_bytes{container=\"app\",device=\"/dev/vda1\",id="), "{text}");
        assert!(text.contains("container_start_time_seconds{container=\"app\",id=\"/kubepods/burstable/podu1/abc\",image=\"registry/app:1\",name=\"abc\",namespace=\"default\",pod=\"web\"} 1700000000\n"), "{text}");
        assert!(text.contains("# TYPE machine_cpu_cores gauge\nmachine_cpu_cores{boot_id=\""), "{text}");
    }

    #[test]
    fn a_pod_without_its_own_stats_is_named_by_its_uid() {
        let mut rows = Vec::new();
        let mut wasm = pod();
        // A WebAssembly container measures no file system use.
        wasm.containers[0].stats.fs_used_bytes = None;
        pod_rows(&wasm, None, &mut rows);
        assert_eq!(rows[0].id, "/rustlet/podu1");
        assert_eq!(rows[1].id, "/rustlet/podu1/abc");
        assert_eq!(rows[0].working_set, Some(1000));
        assert!(rows[1].fs_usage.is_none());
    }
}
