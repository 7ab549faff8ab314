//! Talking to a running node: a plain HTTP/1.0 GET on its local socket,
//! `<root-dir>/rustlet.sock` (which only root and the node's own user may
//! open).

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, bail};
use kubelet::node::LOCAL_SOCKET;

/// The node's answer to one request.
pub(crate) struct Answer {
    pub(crate) status: u16,
    pub(crate) body: String,
}

/// Opens a connection to the node whose root dir is `root_dir` and sends
/// `GET path`.
fn request(root_dir: &Path, path: &str, read_timeout: Option<Duration>) -> anyhow::Result<UnixStream> {
    let socket = root_dir.join(LOCAL_SOCKET);
    let mut stream = UnixStream::connect(&socket).with_context(|| {
        format!(
            "cannot reach a node through {} (is one running with root dir {}? start one with \
             `rustlet --standalone --root-dir {}`, or pass --root-dir; only root and the node's own user may open \
             the socket)",
            socket.display(),
            root_dir.display(),
            root_dir.display()
        )
    })?;
    stream.set_read_timeout(read_timeout)?;
    stream.set_write_timeout(Some(Duration::from_secs(30)))?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: localhost\r\nAccept: */*\r\n\r\n")?;
    Ok(stream)
}

/// The status code in an HTTP answer's head.
fn status_of(head: &str, path: &str) -> anyhow::Result<u16> {
    head.split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .with_context(|| format!("the node's answer to GET {path} has no status"))
}

/// `GET path` on the node whose root dir is `root_dir`.
pub(crate) fn get(root_dir: &Path, path: &str) -> anyhow::Result<Answer> {
    let mut stream = request(root_dir, path, Some(Duration::from_secs(30)))?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).with_context(|| format!("reading the node's answer to GET {path}"))?;
    let raw = String::from_utf8_lossy(&raw);
    let Some((head, body)) = raw.split_once("\r\n\r\n") else { bail!("the node's answer to GET {path} is not HTTP") };
    Ok(Answer { status: status_of(head, path)?, body: body.to_owned() })
}

/// `GET path`, copying the body to `out` as it arrives (for answers that
/// stay open, like a followed log); fails with the node's message unless it
/// answers 200.
pub(crate) fn stream_to(root_dir: &Path, path: &str, out: &mut impl Write) -> anyhow::Result<()> {
    let stream = request(root_dir, path, None)?;
    let mut reader = BufReader::new(stream);
    let mut head = String::new();
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).with_context(|| format!("reading the node's answer to GET {path}"))? == 0 {
            bail!("the node's answer to GET {path} is not HTTP");
        }
        if line == "\r\n" {
            break;
        }
        head.push_str(&line);
    }
    let status = status_of(&head, path)?;
    if status != 200 {
        let mut body = String::new();
        reader.read_to_string(&mut body)?;
        bail!("{}", body.trim());
    }
    let mut chunk = [0u8; 16 * 1024];
    loop {
        let n = reader.read(&mut chunk).with_context(|| format!("reading the node's answer to GET {path}"))?;
        if n == 0 {
            return Ok(());
        }
        out.write_all(&chunk[..n])?;
        out.flush()?;
    }
}

/// `GET path`, failing with the node's message unless it answers 200.
pub(crate) fn get_ok(root_dir: &Path, path: &str) -> anyhow::Result<String> {
    let answer = get(root_dir, path)?;
    if answer.status != 200 {
        bail!("{}", answer.body.trim());
    }
    Ok(answer.body)
}
