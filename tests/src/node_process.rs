//! A running `rustlet` binary as a test drives it: its log lines (stderr)
//! arrive on a channel and can be waited for, each with a deadline; plus a
//! one-shot HTTP GET for its endpoint.

use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::mpsc;

/// How long a test waits for a log line.
pub const SOON: Duration = Duration::from_secs(30);

/// A running node process; killed when dropped.
pub struct NodeProcess {
    /// The process.
    pub child: Child,
    /// Its stderr, line by line (each line is also echoed to the test's
    /// stderr with a `rustlet:` prefix).
    pub lines: mpsc::UnboundedReceiver<String>,
    /// Every line so far, waited for or not.
    all: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

/// The hard eviction thresholds of the nodes tests start: upstream's
/// memory threshold and no disk threshold. A test machine's disk is shared
/// and may be nearly full (a CI machine once had under 1% free after the
/// build), and a node under DiskPressure refuses every pod; a test about
/// disk pressure sets its own thresholds.
pub const TEST_EVICTION_HARD: &str = "memory.available<100Mi";

impl NodeProcess {
    /// Starts `command` (stdout discarded, stderr captured).
    pub fn start(mut command: Command) -> NodeProcess {
        // Test machines share their disk: the node watches memory only, not
        // upstream's 10-15% of the disk (a test that wants other thresholds
        // passes `--eviction-hard`, which wins, or sets or removes the
        // variable).
        let given = command.as_std().get_envs().any(|(key, _)| key == "RUSTLET_EVICTION_HARD");
        if !given && std::env::var_os("RUSTLET_EVICTION_HARD").is_none() {
            command.env("RUSTLET_EVICTION_HARD", TEST_EVICTION_HARD);
        }
        let mut child =
            command.stderr(Stdio::piped()).stdout(Stdio::null()).kill_on_drop(true).spawn().expect("spawn rustlet");
        let stderr = child.stderr.take().expect("stderr");
        let (tx, lines) = mpsc::unbounded_channel();
        let all = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let record = all.clone();
        tokio::spawn(async move {
            let mut reader = BufReader::new(stderr).lines();
            while let Ok(Some(line)) = reader.next_line().await {
                eprintln!("rustlet: {line}");
                record.lock().unwrap_or_else(|p| p.into_inner()).push(line.clone());
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        NodeProcess { child, lines, all }
    }

    /// Every log line the process wrote so far (waited for or not).
    pub fn all_lines(&self) -> Vec<String> {
        self.all.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Waits for a log line containing `needle`.
    pub async fn line_with(&mut self, needle: &str) -> String {
        let wait = async {
            while let Some(line) = self.lines.recv().await {
                if line.contains(needle) {
                    return line;
                }
            }
            panic!("rustlet's log ended before {needle:?}");
        };
        tokio::time::timeout(SOON, wait).await.unwrap_or_else(|_| panic!("no log line with {needle:?}"))
    }

    /// Waits for log lines containing each of `needles`, in any order.
    pub async fn lines_with_all(&mut self, needles: &[&str]) {
        let mut missing: Vec<&str> = needles.to_vec();
        let wait = async {
            while let Some(line) = self.lines.recv().await {
                missing.retain(|n| !line.contains(n));
                if missing.is_empty() {
                    return;
                }
            }
            panic!("rustlet's log ended before {missing:?}");
        };
        tokio::time::timeout(SOON, wait).await.unwrap_or_else(|_| panic!("no log lines with {needles:?}"));
    }

    /// The HTTP endpoint's address, from the start-up log line.
    pub async fn http_address(&mut self) -> String {
        let line = self.line_with("http endpoint listening").await;
        let start = line.find("address=").expect("address field") + "address=".len();
        line[start..].split_whitespace().next().expect("address").to_owned()
    }
}

/// `GET path` on `address`: the status code and body. An address that
/// starts with `/` is a Unix socket (the node's local socket, see
/// [`local_socket`]); any other is `host:port`.
pub async fn http_get(address: &str, path: &str) -> (u16, String) {
    let response = String::from_utf8_lossy(&http_get_raw(address, path).await).into_owned();
    let code = response.split_whitespace().nth(1).and_then(|c| c.parse().ok()).expect("status code");
    let body = response.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default();
    (code, body)
}

/// One HTTP/1.1 `GET path` on `address` (a Unix socket path when it starts
/// with `/`, else `host:port`): the whole answer, raw, read within
/// [`SOON`] times two.
pub async fn http_get_raw(address: &str, path: &str) -> Vec<u8> {
    let request = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
    let mut response = Vec::new();
    let exchange = async {
        if address.starts_with('/') {
            let mut stream = tokio::net::UnixStream::connect(address).await.expect("connect to the local socket");
            stream.write_all(request.as_bytes()).await.expect("write");
            stream.read_to_end(&mut response).await.expect("read");
        } else {
            let mut stream = tokio::net::TcpStream::connect(address).await.expect("connect");
            stream.write_all(request.as_bytes()).await.expect("write");
            stream.read_to_end(&mut response).await.expect("read");
        }
    };
    tokio::time::timeout(SOON * 2, exchange).await.expect("an answer in time");
    response
}

/// The local socket of the node whose root dir is `root`, as the address
/// [`http_get`] takes.
pub fn local_socket(root: &std::path::Path) -> String {
    root.join(kubelet::node::LOCAL_SOCKET).to_str().expect("utf-8 root dir").to_owned()
}

/// Loads the built-in example module `name` into the image store of the
/// node at `root` as `<repository>/<name>:v1`, with `rustlet images import`
/// (`rustlet` is the binary's path).
pub async fn import_example(rustlet: &std::path::Path, root: &std::path::Path, repository: &str, name: &str) {
    let layout = root.join(format!("layout-{name}"));
    let module = rustlet_wasi::examples::binary(name).expect("module");
    let image = format!("{repository}/{name}:v1");
    rustlet_wasi::import::write_layout(&layout, &[(image.as_str(), &module)]).expect("layout");
    let output = Command::new(rustlet)
        .args(["images", "import"])
        .arg(&layout)
        .arg("--root-dir")
        .arg(root)
        .output()
        .await
        .expect("run");
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
}
