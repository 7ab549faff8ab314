//! The Prometheus text exposition format (version 0.0.4) the kubelet
//! serves on `/metrics`, `/metrics/cadvisor`, `/metrics/probes` and
//! `/metrics/resource`, and the few tools every crate's series share.
//!
//! The series live in [`prometheus_client`] registries, which encode
//! OpenMetrics. OpenMetrics names every counter's sample `<family>_total`,
//! so a kubelet counter without that suffix
//! (`kubelet_certificate_manager_client_expiration_renew_errors`,
//! `kubelet_evictions`) could not keep its name, and the kubelet's alerts
//! would find nothing. [`encode_text`] writes a registry in the format the
//! kubelet serves instead, where **a counter's sample carries its family's
//! name as registered**: register `kubelet_started_pods_total` to expose
//! `kubelet_started_pods_total`, `kubelet_evictions` to expose
//! `kubelet_evictions`.
//!
//! Series computed at scrape time are [`ScrapeFamily`] collectors; pages
//! made of nothing else (`/metrics/cadvisor`) are written with
//! [`TextWriter`].

use std::fmt::Write as _;
use std::sync::Arc;

use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

/// The content type of the text format.
pub const TEXT_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Prometheus' default histogram buckets (`prometheus.DefBuckets`).
pub const DEFAULT_BUCKETS: [f64; 11] = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];

/// `count` buckets from `start`, each `factor` times the one before
/// (`prometheus.ExponentialBuckets`).
pub fn exponential_buckets(start: f64, factor: f64, count: usize) -> Vec<f64> {
    std::iter::successors(Some(start), |b| Some(b * factor)).take(count).collect()
}

/// Writes `registry` in the text format 0.0.4: OpenMetrics' `# UNIT`,
/// `# EOF` and `_created` lines are dropped, and each counter's samples are
/// named as its family (see the module docs).
pub fn encode_text(registry: &Registry) -> Result<String, std::fmt::Error> {
    let mut open = String::new();
    prometheus_client::encoding::text::encode_registry(&mut open, registry)?;
    Ok(openmetrics_to_text(&open))
}

/// The conversion [`encode_text`] makes.
fn openmetrics_to_text(open: &str) -> String {
    let mut out = String::with_capacity(open.len());
    // The family being written, if it is a counter.
    let mut counter: Option<&str> = None;
    for line in open.lines() {
        if let Some(comment) = line.strip_prefix("# ") {
            if comment.starts_with("UNIT ") || comment == "EOF" {
                continue;
            }
            if let Some(rest) = comment.strip_prefix("TYPE ") {
                let (name, kind) = rest.split_once(' ').unwrap_or((rest, "untyped"));
                counter = (kind == "counter").then_some(name);
                let kind = match kind {
                    "unknown" | "info" | "stateset" => "untyped",
                    "gaugehistogram" => "histogram",
                    other => other,
                };
                let _ = writeln!(out, "# TYPE {name} {kind}");
                continue;
            }
            out.push_str(line);
            out.push('\n');
            continue;
        }
        // A family read at scrape time without labels writes `name{} v`.
        let unlabelled;
        let line = match line.find("{} ") {
            Some(at) if !line[..at].contains(['{', ' ']) => {
                unlabelled = format!("{}{}", &line[..at], &line[at + 2..]);
                unlabelled.as_str()
            }
            _ => line,
        };
        // dtoa writes infinities as `inf`; the text format's are `+Inf`.
        let infinite;
        let line = match line.rsplit_once(' ') {
            Some((head, "inf")) => {
                infinite = format!("{head} +Inf");
                infinite.as_str()
            }
            Some((head, "-inf")) => {
                infinite = format!("{head} -Inf");
                infinite.as_str()
            }
            _ => line,
        };
        if let Some(family) = counter {
            // `<family>_total{…} v` becomes `<family>{…} v`; `_created` goes.
            let name_end = line.find(['{', ' ']).unwrap_or(line.len());
            let name = &line[..name_end];
            if name.strip_prefix(family) == Some("_created") {
                continue;
            }
            if name.strip_prefix(family) == Some("_total") {
                out.push_str(family);
                out.push_str(&line[name_end..]);
                out.push('\n');
                continue;
            }
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// A sample value as the text format writes it (`+Inf`, `-Inf`, `NaN`).
pub(crate) fn format_value(value: f64) -> String {
    if value.is_nan() {
        "NaN".to_owned()
    } else if value == f64::INFINITY {
        "+Inf".to_owned()
    } else if value == f64::NEG_INFINITY {
        "-Inf".to_owned()
    } else {
        format!("{value}")
    }
}

/// Escapes a label value (backslash, double quote, newline).
pub fn escape_label(value: &str) -> std::borrow::Cow<'_, str> {
    if value.contains(['\\', '"', '\n']) {
        value.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n").into()
    } else {
        value.into()
    }
}

/// Writes a page of families in the text format by hand.
#[derive(Debug, Default)]
pub struct TextWriter {
    out: String,
}

impl TextWriter {
    /// An empty page.
    pub fn new() -> Self {
        TextWriter::default()
    }

    /// Starts family `name` of type `kind` (`counter`, `gauge`, …) with its
    /// help text.
    pub fn family(&mut self, name: &str, kind: &str, help: &str) {
        let help = help.replace('\\', "\\\\").replace('\n', "\\n");
        let _ = writeln!(self.out, "# HELP {name} {help}");
        let _ = writeln!(self.out, "# TYPE {name} {kind}");
    }

    /// One sample of `name` with `labels` (written in the order given), and
    /// a timestamp in milliseconds if any.
    pub fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: f64, timestamp_ms: Option<i64>) {
        self.out.push_str(name);
        if !labels.is_empty() {
            self.out.push('{');
            for (i, (key, value)) in labels.iter().enumerate() {
                if i > 0 {
                    self.out.push(',');
                }
                let _ = write!(self.out, "{key}=\"{}\"", escape_label(value));
            }
            self.out.push('}');
        }
        let _ = write!(self.out, " {}", format_value(value));
        if let Some(ms) = timestamp_ms {
            let _ = write!(self.out, " {ms}");
        }
        self.out.push('\n');
    }

    /// The page.
    pub fn finish(self) -> String {
        self.out
    }
}

/// Label values of one sample, in the order of its family's label names.
pub(crate) type LabelValues = Vec<String>;

/// What a [`ScrapeFamily`] reads at each scrape: its samples.
pub(crate) type ReadSamples = Arc<dyn Fn() -> Vec<(LabelValues, f64)> + Send + Sync>;

/// A gauge (or counter) family whose samples are read at each scrape (the
/// number of running pods, a node's name), registered with
/// [`Registry::register_collector`].
pub struct ScrapeFamily {
    name: &'static str,
    help: &'static str,
    labels: &'static [&'static str],
    counter: bool,
    read: ReadSamples,
}

impl std::fmt::Debug for ScrapeFamily {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ScrapeFamily").field("name", &self.name).finish_non_exhaustive()
    }
}

impl ScrapeFamily {
    /// Gauge `name` with label names `labels`, valued by `read`.
    pub fn gauge(
        name: &'static str,
        help: &'static str,
        labels: &'static [&'static str],
        read: impl Fn() -> Vec<(LabelValues, f64)> + Send + Sync + 'static,
    ) -> Box<Self> {
        Box::new(ScrapeFamily { name, help, labels, counter: false, read: Arc::new(read) })
    }

    /// Counter `name` (a total kept elsewhere, `process_cpu_seconds_total`),
    /// valued by `read`.
    pub(crate) fn counter(
        name: &'static str,
        help: &'static str,
        labels: &'static [&'static str],
        read: impl Fn() -> Vec<(LabelValues, f64)> + Send + Sync + 'static,
    ) -> Box<Self> {
        Box::new(ScrapeFamily { name, help, labels, counter: true, read: Arc::new(read) })
    }
}

/// Registers the process' own series as client_golang's process collector
/// names them: `process_cpu_seconds_total`, `process_resident_memory_bytes`,
/// `process_virtual_memory_bytes`, `process_open_fds`,
/// `process_start_time_seconds` (all read from `/proc/self` at each scrape).
pub fn register_process_metrics(registry: &mut Registry) {
    registry.register_collector(ScrapeFamily::counter(
        "process_cpu_seconds_total",
        "Total user and system CPU time spent in seconds.",
        &[],
        || process_stat().map(|s| (Vec::new(), s.cpu_seconds)).into_iter().collect(),
    ));
    registry.register_collector(ScrapeFamily::gauge(
        "process_resident_memory_bytes",
        "Resident memory size in bytes.",
        &[],
        || process_stat().map(|s| (Vec::new(), s.rss_bytes)).into_iter().collect(),
    ));
    registry.register_collector(ScrapeFamily::gauge(
        "process_virtual_memory_bytes",
        "Virtual memory size in bytes.",
        &[],
        || process_stat().map(|s| (Vec::new(), s.vsize_bytes)).into_iter().collect(),
    ));
    registry.register_collector(ScrapeFamily::gauge(
        "process_open_fds",
        "Number of open file descriptors.",
        &[],
        || std::fs::read_dir("/proc/self/fd").map(|d| (Vec::new(), d.count() as f64)).into_iter().collect(),
    ));
    register_process_start_time(registry);
}

/// Registers `process_start_time_seconds` alone (`/metrics/probes` has it).
pub fn register_process_start_time(registry: &mut Registry) {
    registry.register_collector(ScrapeFamily::gauge(
        "process_start_time_seconds",
        "Start time of the process since unix epoch in seconds.",
        &[],
        || process_stat().map(|s| (Vec::new(), s.start_time_seconds)).into_iter().collect(),
    ));
}

/// What `/proc/self/stat` says of the process.
struct ProcessStat {
    cpu_seconds: f64,
    rss_bytes: f64,
    vsize_bytes: f64,
    start_time_seconds: f64,
}

/// Clock ticks a second (`USER_HZ`), 100 on Linux.
const TICKS: f64 = 100.0;

fn process_stat() -> Option<ProcessStat> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // The fields after the command (which may hold spaces) in parentheses.
    let after = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    // Field 3 (state) is index 0 here: utime is 14, stime 15, starttime
    // 22, vsize 23, rss 24 (in pages).
    let field = |n: usize| fields.get(n - 3).and_then(|f| f.parse::<f64>().ok());
    let boot = std::fs::read_to_string("/proc/stat")
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("btime ").and_then(|v| v.trim().parse::<f64>().ok())))?;
    let page = rustix::param::page_size() as f64;
    Some(ProcessStat {
        cpu_seconds: (field(14)? + field(15)?) / TICKS,
        rss_bytes: field(24)? * page,
        vsize_bytes: field(23)?,
        start_time_seconds: boot + field(22)? / TICKS,
    })
}

impl prometheus_client::collector::Collector for ScrapeFamily {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let kind = if self.counter { MetricType::Counter } else { MetricType::Gauge };
        let mut family = encoder.encode_descriptor(self.name, self.help, None, kind)?;
        for (values, value) in (self.read)() {
            // prometheus_client writes label values as given.
            let labels: Vec<(&str, std::borrow::Cow<'_, str>)> =
                self.labels.iter().copied().zip(values.iter().map(|v| escape_label(v))).collect();
            let encoder = family.encode_family(&labels)?;
            if self.counter {
                ConstCounter::new(value).encode(encoder)?;
            } else {
                ConstGauge::new(value).encode(encoder)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::metrics::counter::Counter;
    use prometheus_client::metrics::family::Family;
    use prometheus_client::metrics::gauge::Gauge;
    use prometheus_client::metrics::histogram::Histogram;

    #[test]
    fn counters_keep_their_registered_names() {
        let mut registry = Registry::default();
        let plain = Counter::<u64>::default();
        plain.inc();
        registry.register("kubelet_evictions", "Evictions", plain);
        let total: Family<Vec<(String, String)>, Counter> = Family::default();
        total.get_or_create(&vec![("code".to_owned(), "200".to_owned())]).inc_by(3);
        registry.register("rest_client_requests_total", "Requests", total);
        let gauge = Gauge::<i64>::default();
        gauge.set(7);
        registry.register("kubelet_running_pods", "Pods", gauge);
        let histogram = Histogram::new([0.5, 1.0]);
        histogram.observe(0.7);
        registry.register("kubelet_pod_start_duration_seconds", "Starts", histogram);
        let text = encode_text(&registry).expect("encodes");
        assert!(text.contains("# TYPE kubelet_evictions counter\nkubelet_evictions 1\n"), "{text}");
        assert!(
            text.contains("# TYPE rest_client_requests_total counter\nrest_client_requests_total{code=\"200\"} 3\n"),
            "{text}"
        );
        assert!(text.contains("kubelet_running_pods 7\n"), "{text}");
        assert!(text.contains("kubelet_pod_start_duration_seconds_bucket{le=\"0.5\"} 0\n"), "{text}");
        assert!(text.contains("kubelet_pod_start_duration_seconds_bucket{le=\"+Inf\"} 1\n"), "{text}");
        assert!(text.contains("kubelet_pod_start_duration_seconds_count 1\n"), "{text}");
        assert!(!text.contains("EOF") && !text.contains("_total_total"), "{text}");
    }

    #[test]
    fn scrape_families_are_read_at_each_scrape() {
        let mut registry = Registry::default();
        let value = Arc::new(std::sync::atomic::AtomicU64::new(1));
        let read = Arc::clone(&value);
        registry.register_collector(ScrapeFamily::gauge("kubelet_node_name", "Node", &["node"], move || {
            vec![(vec!["n\"1".to_owned()], read.load(std::sync::atomic::Ordering::Relaxed) as f64)]
        }));
        assert!(encode_text(&registry).expect("encodes").contains("kubelet_node_name{node=\"n\\\"1\"} 1.0\n"));
        value.store(2, std::sync::atomic::Ordering::Relaxed);
        assert!(encode_text(&registry).expect("encodes").contains("kubelet_node_name{node=\"n\\\"1\"} 2.0\n"));
    }

    #[test]
    fn the_writer_escapes_and_formats() {
        let mut page = TextWriter::new();
        page.family("machine_cpu_cores", "gauge", "Number of logical CPU cores.");
        page.sample("machine_cpu_cores", &[("id", "a\\b")], 2.0, None);
        page.sample("x", &[], f64::INFINITY, Some(5));
        assert_eq!(
            page.finish(),
            "# HELP machine_cpu_cores Number of logical CPU cores.\n# TYPE machine_cpu_cores gauge\n\
             machine_cpu_cores{id=\"a\\\\b\"} 2\nx +Inf 5\n"
        );
        assert_eq!(exponential_buckets(0.5, 2.0, 3), vec![0.5, 1.0, 2.0]);
    }

    #[test]
    fn the_process_reads_its_own_figures() {
        let mut registry = Registry::default();
        register_process_metrics(&mut registry);
        let text = encode_text(&registry).expect("encodes");
        let value = |name: &str| -> f64 {
            let line =
                text.lines().find(|l| l.starts_with(&format!("{name} "))).unwrap_or_else(|| panic!("{name} in {text}"));
            line.rsplit(' ').next().and_then(|v| v.parse().ok()).expect("a number")
        };
        assert!(text.contains("# TYPE process_cpu_seconds_total counter\n"), "{text}");
        assert!(value("process_resident_memory_bytes") > 1e5);
        assert!(value("process_open_fds") >= 3.0);
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("after 1970").as_secs_f64();
        let started = value("process_start_time_seconds");
        assert!(started <= now + 1.0 && started > now - 86_400.0, "{started} vs {now}");
    }
}
