//! A real Prometheus server (Debian's `prometheus` package, installed with
//! `apt-get` the first time it is missing) for tests: started on a free
//! loopback port with a scrape configuration of the test's own and a
//! temporary data dir, asked through its HTTP query API, stopped when
//! dropped. Without the package a test skips with the reason, unless
//! `RUSTLET_REQUIRE_PROMETHEUS=1` (CI), where it fails.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A running Prometheus.
pub struct Prometheus {
    child: tokio::process::Child,
    /// `127.0.0.1:<port>` of its web API.
    pub address: String,
    dir: tempfile::TempDir,
}

/// One series of a query's answer: its labels and value.
#[derive(Clone, Debug)]
pub struct Sample {
    /// The series' labels (`__name__` among them when it has a name).
    pub labels: BTreeMap<String, String>,
    /// Its value.
    pub value: f64,
}

/// The binary, installed when missing.
fn binary() -> Result<PathBuf, String> {
    crate::debian::ensure_installed("/usr/bin/prometheus", "prometheus")
}

/// Starts Prometheus with the scrape configuration `config` (YAML: the
/// `global` and `scrape_configs` sections), or says why the test skips
/// (and fails it when `RUSTLET_REQUIRE_PROMETHEUS=1`).
pub async fn prometheus_or_skip(test: &str, config: &str) -> Option<Prometheus> {
    crate::skip::or_skip(test, crate::skip::Need::Prometheus, Prometheus::start(config).await)
}

/// Percent-encodes a query parameter.
fn encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

impl Prometheus {
    /// Starts it; returns once it answers `/-/ready`.
    pub async fn start(config: &str) -> Result<Prometheus, String> {
        let binary = binary()?;
        let mut dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let file = dir.path().join("prometheus.yml");
        std::fs::write(&file, config).map_err(|e| e.to_string())?;
        let check = std::process::Command::new("/usr/bin/promtool").arg("check").arg("config").arg(&file).output();
        if let Ok(out) = check
            && !out.status.success()
        {
            return Err(format!("promtool refuses the configuration: {}", String::from_utf8_lossy(&out.stdout)));
        }
        // A free port (another process could take it before Prometheus
        // binds it: then the start is tried again on another).
        for _ in 0..5 {
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .map_err(|e| e.to_string())?
                .port();
            let address = format!("127.0.0.1:{port}");
            let log = std::fs::File::create(dir.path().join("prometheus.log")).map_err(|e| e.to_string())?;
            let child = tokio::process::Command::new(&binary)
                .arg(format!("--config.file={}", file.display()))
                .arg(format!("--storage.tsdb.path={}", dir.path().join("data").display()))
                .arg(format!("--web.listen-address={address}"))
                .stdin(Stdio::null())
                .stdout(log.try_clone().map_err(|e| e.to_string())?)
                .stderr(log)
                .kill_on_drop(true)
                .spawn()
                .map_err(|e| format!("{}: {e}", binary.display()))?;
            let mut prometheus = Prometheus { child, address, dir };
            let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
            loop {
                if let Ok(Some(status)) = prometheus.child.try_wait() {
                    let log = prometheus.log();
                    if log.contains("address already in use") {
                        break;
                    }
                    return Err(format!("prometheus exited ({status}): {log}"));
                }
                if prometheus.get("/-/ready").await.is_ok_and(|(code, _)| code == 200) {
                    return Ok(prometheus);
                }
                if tokio::time::Instant::now() > deadline {
                    return Err(format!("prometheus not ready within a minute: {}", prometheus.log()));
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            dir = prometheus.dir;
            let _ = prometheus.child.kill().await;
        }
        Err("no free port for prometheus".into())
    }

    /// Its log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("prometheus.log")).unwrap_or_default()
    }

    /// One `GET path` (HTTP/1.0: the whole body, never chunked).
    async fn get(&self, path: &str) -> Result<(u16, String), String> {
        let exchange = async {
            let mut stream = tokio::net::TcpStream::connect(&self.address).await.map_err(|e| e.to_string())?;
            let request = format!("GET {path} HTTP/1.0\r\nHost: {}\r\n\r\n", self.address);
            stream.write_all(request.as_bytes()).await.map_err(|e| e.to_string())?;
            let mut response = Vec::new();
            stream.read_to_end(&mut response).await.map_err(|e| e.to_string())?;
            let response = String::from_utf8_lossy(&response).into_owned();
            let code = response.split_whitespace().nth(1).and_then(|c| c.parse().ok()).ok_or("no status")?;
            let body = response.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default();
            Ok::<_, String>((code, body))
        };
        tokio::time::timeout(Duration::from_secs(30), exchange).await.map_err(|_| "no answer in 30 s".to_owned())?
    }

    /// Evaluates `expr` now (`/api/v1/query`): its vector's samples.
    pub async fn query(&self, expr: &str) -> Result<Vec<Sample>, String> {
        let (code, body) = self.get(&format!("/api/v1/query?query={}", encode(expr))).await?;
        let answer: Value = serde_json::from_str(&body).map_err(|e| format!("{e}: {body}"))?;
        if code != 200 || answer["status"] != "success" {
            return Err(format!("query {expr:?}: {code} {body}"));
        }
        let result = answer["data"]["result"].as_array().cloned().unwrap_or_default();
        Ok(result
            .iter()
            .map(|series| Sample {
                labels: series["metric"]
                    .as_object()
                    .map(|m| m.iter().map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_owned())).collect())
                    .unwrap_or_default(),
                value: series["value"][1].as_str().and_then(|v| v.parse().ok()).unwrap_or(f64::NAN),
            })
            .collect())
    }

    /// Each scrape target's job, `metrics_path` label and health
    /// (`up`, `down`, `unknown`), with its last error.
    pub async fn targets(&self) -> Result<Vec<(String, String, String, String)>, String> {
        let (_, body) = self.get("/api/v1/targets").await?;
        let answer: Value = serde_json::from_str(&body).map_err(|e| format!("{e}: {body}"))?;
        Ok(answer["data"]["activeTargets"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .iter()
            .map(|t| {
                let text = |v: &Value| v.as_str().unwrap_or_default().to_owned();
                (text(&t["scrapePool"]), text(&t["labels"]["metrics_path"]), text(&t["health"]), text(&t["lastError"]))
            })
            .collect())
    }
}
