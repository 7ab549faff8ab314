//! Percentiles and their printing, shared by the benchmark programs.
#![allow(dead_code)]

use std::time::Duration;

/// p50/p90/p99/max of a set of samples.
#[derive(Clone, Copy, Debug)]
pub struct Figures {
    pub p50: Duration,
    pub p90: Duration,
    pub p99: Duration,
    pub max: Duration,
    pub n: usize,
}

/// The value at quantile `q` of sorted samples (zero when there are none).
pub fn pct(sorted: &[Duration], q: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

pub fn figures(mut samples: Vec<Duration>) -> Figures {
    samples.sort();
    Figures {
        p50: pct(&samples, 0.5),
        p90: pct(&samples, 0.9),
        p99: pct(&samples, 0.99),
        max: samples.last().copied().unwrap_or_default(),
        n: samples.len(),
    }
}

/// User + system CPU time of process `pid` ("self" for this one), from
/// `/proc` (clock ticks of 10 ms).
pub fn cpu_of(pid: &str) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat.rsplit(')').next().unwrap_or_default().split_whitespace().collect();
    let ticks: u64 = fields.get(11..13).map_or(0, |f| f.iter().filter_map(|v| v.parse::<u64>().ok()).sum());
    Duration::from_millis(ticks * 10)
}

/// This process's CPU time.
pub fn process_cpu() -> Duration {
    cpu_of("self")
}

pub fn ms(d: Duration) -> String {
    format!("{:.3} ms", d.as_secs_f64() * 1000.0)
}

pub fn us(d: Duration) -> String {
    format!("{:.0} µs", d.as_secs_f64() * 1e6)
}

impl Figures {
    /// One line in milliseconds.
    pub fn in_ms(&self) -> String {
        format!(
            "p50 {:>10}  p90 {:>10}  p99 {:>10}  max {:>10}  (n={})",
            ms(self.p50),
            ms(self.p90),
            ms(self.p99),
            ms(self.max),
            self.n
        )
    }

    /// One line in microseconds.
    pub fn in_us(&self) -> String {
        format!(
            "p50 {:>8}  p90 {:>8}  p99 {:>8}  max {:>8}  (n={})",
            us(self.p50),
            us(self.p90),
            us(self.p99),
            us(self.max),
            self.n
        )
    }
}

/// One line of the node's `--log-format json` output.
pub struct NodeLog(serde_json::Value);

impl NodeLog {
    /// Parses a log line; `None` for anything that is not a JSON object.
    pub fn parse(line: &str) -> Option<NodeLog> {
        serde_json::from_str::<serde_json::Value>(line).ok().filter(|v| v.is_object()).map(NodeLog)
    }

    /// The event's message.
    pub fn message(&self) -> &str {
        self.0["fields"]["message"].as_str().unwrap_or_default()
    }

    /// `ERROR`, `WARN`, `INFO`, …
    pub fn level(&self) -> &str {
        self.0["level"].as_str().unwrap_or_default()
    }

    /// A field of the event, or else of its current span, as text.
    pub fn field(&self, name: &str) -> Option<String> {
        let value = self.0["fields"].get(name).or_else(|| self.0["span"].get(name))?;
        Some(value.as_str().map_or_else(|| value.to_string(), str::to_owned))
    }
}

impl NodeLog {
    /// When the node wrote the event (its `timestamp`, RFC 3339 in UTC).
    pub fn timestamp(&self) -> Option<std::time::SystemTime> {
        parse_utc(self.0["timestamp"].as_str()?)
    }
}

/// Parses `YYYY-MM-DDTHH:MM:SS[.fraction]Z`.
fn parse_utc(s: &str) -> Option<std::time::SystemTime> {
    let s = s.strip_suffix('Z')?;
    let (date, time) = s.split_once('T')?;
    let mut d = date.split('-').map(|p| p.parse::<i64>());
    let (y, m, day) = (d.next()?.ok()?, d.next()?.ok()?, d.next()?.ok()?);
    let (hms, fraction) = time.split_once('.').unwrap_or((time, "0"));
    let mut t = hms.split(':').map(|p| p.parse::<i64>());
    let (hh, mm, ss) = (t.next()?.ok()?, t.next()?.ok()?, t.next()?.ok()?);
    let nanos: u32 = format!("{fraction:0<9}").get(..9)?.parse().ok()?;
    // Days since 1970-01-01 of a proleptic Gregorian date.
    let (y, m) = if m <= 2 { (y - 1, m + 9) } else { (y, m - 3) };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * m + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let secs = days * 86_400 + hh * 3600 + mm * 60 + ss;
    Some(std::time::UNIX_EPOCH + Duration::new(u64::try_from(secs).ok()?, nanos))
}

#[cfg(test)]
#[test]
fn timestamps_parse() {
    let t = parse_utc("2026-11-23T00:44:08.318895Z").expect("parses");
    assert_eq!(t.duration_since(std::time::UNIX_EPOCH).expect("after").as_micros(), 1_795_394_648_318_895);
}

/// A WebAssembly provider in `root` with the `sleep` example module
/// imported as `image`.
pub fn sleep_provider(
    root: &std::path::Path,
    image: &str,
) -> Result<std::sync::Arc<rustlet_wasi::WasiProvider>, Box<dyn std::error::Error + Send + Sync>> {
    let provider = std::sync::Arc::new(rustlet_wasi::WasiProvider::new(rustlet_wasi::WasiConfig::new(root))?);
    let layout = root.join("layout");
    let sleep = rustlet_wasi::examples::binary("sleep")?;
    rustlet_wasi::import::write_layout(&layout, &[(image, &sleep)])?;
    rustlet_wasi::import::import(provider.images(), &layout, None)?;
    Ok(provider)
}

/// A static pod manifest: one container running `image` (imported, never
/// pulled), with `limits` (YAML flow mapping) when given.
pub fn wasm_manifest(name: &str, image: &str, limits: Option<&str>) -> String {
    let resources = limits.map(|l| format!("    resources: {{limits: {l}}}\n")).unwrap_or_default();
    format!(
        "apiVersion: v1
kind: Pod
metadata: {{name: {name}}}
spec:
  terminationGracePeriodSeconds: 5
  containers:
  - name: main
    image: {image}
    imagePullPolicy: Never
{resources}"
    )
}

/// Whether every container of `pod` runs.
pub fn is_running(pod: &k8s_openapi::api::core::v1::Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .is_some_and(|c| !c.is_empty() && c.iter().all(|c| c.state.as_ref().is_some_and(|s| s.running.is_some())))
}

/// Waits until `count` pods named with `prefix` satisfy `pred` (or, for
/// `count` 0, none is left), at most `deadline`.
pub async fn wait_pods(
    store: &kubelet::pod::PodStore,
    prefix: &str,
    count: usize,
    pred: impl Fn(&k8s_openapi::api::core::v1::Pod) -> bool,
    deadline: Duration,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let done = store
        .wait_for(deadline, |pods| {
            let named = pods.values().filter(|p| p.metadata.name.as_deref().is_some_and(|n| n.starts_with(prefix)));
            if count == 0 { named.count() == 0 } else { named.filter(|p| pred(p)).count() == count }
        })
        .await;
    done.map(|_| ()).ok_or_else(|| format!("pods {prefix}* not there within {deadline:?}").into())
}

/// This process's resident set, in MiB.
pub fn rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0.0);
    kib / 1024.0
}
