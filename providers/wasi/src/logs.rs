//! A module's stdout and stderr as CRI log lines in its container's log
//! file (`<time> <stream> F <line>`), written as the module writes: a line
//! is in the file once the module wrote its newline, and a last line with
//! no newline is written when the module ends.

use std::io::Write;
use std::path::Path;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use wasmtime_wasi::cli::{IsTerminal, StdoutStream};
use wasmtime_wasi::p2::{OutputStream, Pollable, StreamResult};

/// The longest line kept whole; longer output is split into partial (`P`)
/// entries, as the CRI runtimes do (16 KiB).
const MAX_LINE: usize = 16 * 1024;

struct Inner {
    file: std::fs::File,
    partial: [Vec<u8>; 2],
    broken: bool,
}

/// Output as the module writes it, for attached clients: whether it is
/// stderr, and the bytes.
pub type Attached = (bool, Bytes);

/// One container's log file.
#[derive(Clone)]
pub struct CriLog {
    inner: Arc<Mutex<Inner>>,
    attached: tokio::sync::broadcast::Sender<Attached>,
}

impl CriLog {
    /// Appends to `path`.
    pub fn open(path: &Path) -> std::io::Result<CriLog> {
        let file = std::fs::OpenOptions::new().create(true).append(true).open(path)?;
        let inner = Arc::new(Mutex::new(Inner { file, partial: [Vec::new(), Vec::new()], broken: false }));
        Ok(CriLog { inner, attached: tokio::sync::broadcast::channel(256).0 })
    }

    /// What the module writes from now on (`kubectl attach`). A client
    /// that falls 256 writes behind misses some (it is told it lagged).
    pub fn attach(&self) -> tokio::sync::broadcast::Receiver<Attached> {
        self.attached.subscribe()
    }

    /// A WASI output stream for `stream` (`stdout` or `stderr`).
    pub fn stream(&self, stream: &'static str) -> CriStream {
        CriStream { log: self.clone(), stream }
    }

    fn write(&self, stream: &'static str, mut bytes: &[u8]) {
        let index = usize::from(stream == "stderr");
        if self.attached.receiver_count() > 0 {
            let _ = self.attached.send((index == 1, Bytes::copy_from_slice(bytes)));
        }
        let mut inner = self.inner.lock().expect("lock");
        let mut out = Vec::new();
        while !bytes.is_empty() {
            let (chunk, rest, line_end) = match bytes.iter().position(|b| *b == b'\n') {
                Some(n) => (&bytes[..n], &bytes[n + 1..], true),
                None => (bytes, &[][..], false),
            };
            bytes = rest;
            let partial = &mut inner.partial[index];
            partial.extend_from_slice(chunk);
            while partial.len() > MAX_LINE {
                let head: Vec<u8> = partial.drain(..MAX_LINE).collect();
                out.extend_from_slice(entry(stream, "P", &head).as_bytes());
            }
            if line_end {
                let line = std::mem::take(partial);
                out.extend_from_slice(entry(stream, "F", &line).as_bytes());
            }
        }
        if !out.is_empty() && !inner.broken && inner.file.write_all(&out).is_err() {
            inner.broken = true;
            tracing::warn!("a container log file cannot be written; its output is dropped");
        }
    }

    /// Writes what is left of unterminated lines.
    pub fn finish(&self) {
        let mut inner = self.inner.lock().expect("lock");
        let mut out = String::new();
        for (index, stream) in ["stdout", "stderr"].into_iter().enumerate() {
            let line = std::mem::take(&mut inner.partial[index]);
            if !line.is_empty() {
                out.push_str(&entry(stream, "F", &line));
            }
        }
        if !out.is_empty() && !inner.broken {
            let _ = inner.file.write_all(out.as_bytes());
        }
    }
}

fn entry(stream: &str, tag: &str, line: &[u8]) -> String {
    let line = String::from_utf8_lossy(line);
    let line = line.strip_suffix('\r').unwrap_or(&line);
    format!("{} {stream} {tag} {line}\n", jiff::Timestamp::now())
}

/// A module's stdout or stderr.
#[derive(Clone)]
pub struct CriStream {
    log: CriLog,
    stream: &'static str,
}

impl IsTerminal for CriStream {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl StdoutStream for CriStream {
    fn async_stream(&self) -> Box<dyn tokio::io::AsyncWrite + Send + Sync> {
        Box::new(self.clone())
    }

    fn p2_stream(&self) -> Box<dyn OutputStream> {
        Box::new(self.clone())
    }
}

#[async_trait::async_trait]
impl Pollable for CriStream {
    async fn ready(&mut self) {}
}

impl OutputStream for CriStream {
    fn write(&mut self, bytes: Bytes) -> StreamResult<()> {
        self.log.write(self.stream, &bytes);
        Ok(())
    }

    fn flush(&mut self) -> StreamResult<()> {
        Ok(())
    }

    fn check_write(&mut self) -> StreamResult<usize> {
        Ok(64 * 1024)
    }
}

impl tokio::io::AsyncWrite for CriStream {
    fn poll_write(self: Pin<&mut Self>, _: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        self.log.write(self.stream, buf);
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_become_cri_entries() -> std::io::Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("0.log");
        let log = CriLog::open(&path)?;
        log.write("stdout", b"hello ");
        log.write("stderr", b"oops\n");
        log.write("stdout", b"world\nsecond\r\nunterminated");
        log.finish();
        let raw = std::fs::read_to_string(&path)?;
        let decoded = kubelet::provider::decode_cri_log(&raw);
        assert_eq!(decoded, ["oops\n", "hello world\n", "second\n", "unterminated\n"]);
        assert!(raw.lines().next().is_some_and(|l| l.contains(" stderr F oops")), "{raw}");
        Ok(())
    }

    #[test]
    fn long_lines_are_split_into_partial_entries() -> std::io::Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("0.log");
        let log = CriLog::open(&path)?;
        let long = "x".repeat(MAX_LINE * 2 + 5);
        log.write("stdout", format!("{long}\n").as_bytes());
        let raw = std::fs::read_to_string(&path)?;
        assert_eq!(raw.lines().filter(|l| l.contains(" P ")).count(), 2);
        assert_eq!(kubelet::provider::decode_cri_log(&raw), [format!("{long}\n")]);
        Ok(())
    }
}
