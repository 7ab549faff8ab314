//! A module's stdout and stderr as CRI log lines in its container's log
//! file (`<time> <stream> F <line>`), written as the module writes: a line
//! is in the file once the module wrote its newline, and a last line with
//! no newline is written when the module ends.
//!
//! Open files are bounded: the first [`open_log_budget`] logs keep their
//! file open; the others open it for each write and close it again, so
//! tens of thousands of idle containers hold no file descriptors (the
//! process's limit is often 20,000 or less, and cannot always be raised).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};

use bytes::Bytes;
use wasmtime_wasi::cli::{IsTerminal, StdoutStream};
use wasmtime_wasi::p2::{OutputStream, Pollable, StreamResult};

/// The longest line kept whole; longer output is split into partial (`P`)
/// entries, as the CRI runtimes do (16 KiB).
const MAX_LINE: usize = 16 * 1024;

/// Log files held open now, across all containers.
static OPEN_LOGS: AtomicUsize = AtomicUsize::new(0);

/// How many log files stay open between writes: a quarter of the
/// process's open-file limit, at most 4,096.
pub(crate) fn open_log_budget() -> usize {
    static BUDGET: OnceLock<usize> = OnceLock::new();
    *BUDGET.get_or_init(|| {
        let soft = rlimit::getrlimit(rlimit::Resource::NOFILE).map_or(1024, |(soft, _)| soft);
        usize::try_from(soft / 4).unwrap_or(usize::MAX).min(4096)
    })
}

struct Inner {
    path: PathBuf,
    /// Kept open while within the budget (counted in `OPEN_LOGS`).
    file: Option<std::fs::File>,
    partial: [Vec<u8>; 2],
    broken: bool,
    /// An open failure was logged already.
    warned: bool,
}

impl Inner {
    fn append(&mut self, bytes: &[u8]) {
        if self.broken {
            return;
        }
        let written = match &mut self.file {
            Some(file) => file.write_all(bytes),
            // Made again if the node rotated it away.
            None => match std::fs::OpenOptions::new().create(true).append(true).open(&self.path) {
                Ok(mut file) => file.write_all(bytes),
                Err(error) => {
                    // Out of descriptors, for one: this output is lost, the
                    // next may go through.
                    if !self.warned {
                        self.warned = true;
                        tracing::warn!(path = %self.path.display(), %error, "a container log file cannot be opened; output is dropped until it can");
                    }
                    return;
                }
            },
        };
        if written.is_err() {
            self.broken = true;
            tracing::warn!("a container log file cannot be written; its output is dropped");
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        if self.file.take().is_some() {
            OPEN_LOGS.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// Output as the module writes it, for attached clients: whether it is
/// stderr, and the bytes.
pub(crate) type Attached = (bool, Bytes);

/// One container's log file.
#[derive(Clone)]
pub struct CriLog {
    inner: Arc<Mutex<Inner>>,
    /// Made at the first attach (256 slots of memory per container
    /// otherwise).
    attached: Arc<OnceLock<tokio::sync::broadcast::Sender<Attached>>>,
}

impl CriLog {
    /// Appends to `path`.
    pub fn open(path: &Path) -> std::io::Result<CriLog> {
        let keep = OPEN_LOGS
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| (n < open_log_budget()).then_some(n + 1))
            .is_ok();
        CriLog::open_kept(path, keep)
    }

    /// Appends to `path`, keeping it open if `keep` (counted in
    /// `OPEN_LOGS` already).
    fn open_kept(path: &Path, keep: bool) -> std::io::Result<CriLog> {
        let file = match std::fs::OpenOptions::new().create(true).append(true).open(path) {
            Ok(file) => file,
            Err(error) => {
                if keep {
                    OPEN_LOGS.fetch_sub(1, Ordering::Relaxed);
                }
                return Err(error);
            }
        };
        let inner = Inner {
            path: path.to_owned(),
            file: keep.then_some(file),
            partial: [Vec::new(), Vec::new()],
            broken: false,
            warned: false,
        };
        Ok(CriLog { inner: Arc::new(Mutex::new(inner)), attached: Arc::default() })
    }

    /// Writes to the log's path again, a new file if it was renamed (the
    /// node rotated it).
    pub(crate) fn reopen(&self) -> std::io::Result<()> {
        let mut inner = crate::lock(&self.inner);
        if inner.file.is_some() {
            let file = std::fs::OpenOptions::new().create(true).append(true).open(&inner.path)?;
            inner.file = Some(file);
        }
        inner.broken = false;
        Ok(())
    }

    /// What the module writes from now on (`kubectl attach`). A client
    /// that falls 256 writes behind misses some (it is told it lagged).
    pub(crate) fn attach(&self) -> tokio::sync::broadcast::Receiver<Attached> {
        self.attached.get_or_init(|| tokio::sync::broadcast::channel(256).0).subscribe()
    }

    /// A WASI output stream for `stream` (`stdout` or `stderr`).
    pub(crate) fn stream(&self, stream: &'static str) -> CriStream {
        CriStream { log: self.clone(), stream }
    }

    fn write(&self, stream: &'static str, mut bytes: &[u8]) {
        let index = usize::from(stream == "stderr");
        if let Some(attached) = self.attached.get()
            && attached.receiver_count() > 0
        {
            let _ = attached.send((index == 1, Bytes::copy_from_slice(bytes)));
        }
        let mut inner = crate::lock(&self.inner);
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
        if !out.is_empty() {
            inner.append(&out);
        }
    }

    /// Writes what is left of unterminated lines, and gives back the open
    /// file's place in the budget (the container ended: later writes, if
    /// any, open the file for themselves).
    pub(crate) fn finish(&self) {
        let mut inner = crate::lock(&self.inner);
        let mut out = String::new();
        for (index, stream) in ["stdout", "stderr"].into_iter().enumerate() {
            let line = std::mem::take(&mut inner.partial[index]);
            if !line.is_empty() {
                out.push_str(&entry(stream, "F", &line));
            }
        }
        if !out.is_empty() {
            inner.append(out.as_bytes());
        }
        if inner.file.take().is_some() {
            OPEN_LOGS.fetch_sub(1, Ordering::Relaxed);
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
pub(crate) struct CriStream {
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
    fn a_finished_log_gives_its_open_file_back() -> std::io::Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("c.log");
        // A place in the budget, taken as `open` takes it.
        OPEN_LOGS.fetch_add(1, Ordering::Relaxed);
        let log = CriLog::open_kept(&path, true)?;
        assert!(crate::lock(&log.inner).file.is_some());
        OutputStream::write(&mut log.stream("stdout"), Bytes::from_static(b"last words")).expect("write");
        log.finish();
        assert!(crate::lock(&log.inner).file.is_none(), "the descriptor is closed when the container ends");
        let text = std::fs::read_to_string(&path)?;
        assert!(text.ends_with(" stdout F last words\n"), "{text:?}");
        Ok(())
    }

    #[test]
    fn a_log_past_the_open_file_budget_opens_its_file_for_each_write() -> std::io::Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("c.log");
        let log = CriLog::open_kept(&path, false)?;
        assert!(crate::lock(&log.inner).file.is_none(), "no descriptor held between writes");
        let mut out = log.stream("stdout");
        let mut err = log.stream("stderr");
        OutputStream::write(&mut out, Bytes::from_static(b"one\ntw")).expect("write");
        OutputStream::write(&mut err, Bytes::from_static(b"oops\n")).expect("write");
        OutputStream::write(&mut out, Bytes::from_static(b"o\n")).expect("write");
        let text = std::fs::read_to_string(&path)?;
        let lines: Vec<&str> = text.lines().map(|l| l.split_once(' ').map_or(l, |(_, rest)| rest)).collect();
        assert_eq!(lines, ["stdout F one", "stderr F oops", "stdout F two"]);
        Ok(())
    }

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
        let decoded = kubelet_provider::decode_cri_log(&raw);
        assert_eq!(decoded, ["oops\n", "hello world\n", "second\n", "unterminated\n"]);
        assert!(raw.lines().next().is_some_and(|l| l.contains(" stderr F oops")), "{raw}");
        Ok(())
    }

    /// The node rotates a log by renaming it: after `reopen` (kept file)
    /// or at the next write (file opened per write) the output goes to a
    /// new file at the path, and the renamed one keeps what came before.
    #[test]
    fn a_rotated_log_is_written_anew_at_its_path() -> std::io::Result<()> {
        let dir = tempfile::tempdir()?;
        for keep in [true, false] {
            let path = dir.path().join(format!("{keep}.log"));
            let rotated = dir.path().join(format!("{keep}.log.20261126-120000"));
            if keep {
                OPEN_LOGS.fetch_add(1, Ordering::Relaxed);
            }
            let log = CriLog::open_kept(&path, keep)?;
            log.write("stdout", b"before\n");
            std::fs::rename(&path, &rotated)?;
            log.reopen()?;
            log.write("stdout", b"after\n");
            log.finish();
            let read = |p: &Path| std::fs::read_to_string(p).map(|raw| kubelet_provider::decode_cri_log(&raw));
            assert_eq!(read(&rotated)?, ["before\n"], "kept: {keep}");
            assert_eq!(read(&path)?, ["after\n"], "kept: {keep}");
        }
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
        assert_eq!(kubelet_provider::decode_cri_log(&raw), [format!("{long}\n")]);
        Ok(())
    }
}
