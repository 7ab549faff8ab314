//! `/containerLogs/<namespace>/<pod>/<container>`: a container's log text,
//! as the kubelet serves it to `kubectl logs`.
//!
//! Parameters, every field of `PodLogOptions`: `previous=true` (the run
//! before the current one), `tailLines=N` (only the last N lines),
//! `sinceSeconds=N` or `sinceTime=<RFC 3339>` (only lines written since;
//! tail first, then since, as the kubelet applies them), `timestamps=true`
//! (each line starts with the runtime's RFC 3339 timestamp and a space),
//! `limitBytes=N` (the answer ends after N bytes, maybe mid-line),
//! `follow=true` (keep the answer open and send lines as the container
//! writes them, until that run of the container ends, the pod goes, the
//! byte limit is reached or the client hangs up). Following is
//! event-driven: a watch on the container's log directory and the pod
//! store's change signal wake the sender, nothing polls. The watches are
//! those of one inotify instance for the whole node (`LogWatcher`), one
//! per directory however many follow it: a follower costs a channel, not an
//! inotify instance (whose per-user limit is 128 by default).

use std::path::{Path as FsPath, PathBuf};

use axum::body::Body;
use axum::extract::{Path, RawQuery, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use k8s_openapi::api::core::v1::Pod;
use tokio::io::{AsyncReadExt as _, AsyncSeekExt as _};
use tokio::sync::mpsc;

use crate::log_watcher::LogSubscription;
use crate::pod::PodStore;
use crate::provider::{CriLogDecoder, LogEntry};
use crate::state::{HttpState, text};

/// The query parameters.
#[derive(Debug, PartialEq, Eq)]
struct LogQuery {
    previous: bool,
    follow: bool,
    tail_lines: Option<usize>,
    since: Option<jiff::Timestamp>,
    timestamps: bool,
    limit_bytes: Option<u64>,
}

fn flag(value: &str) -> bool {
    value == "true" || value == "1"
}

impl LogQuery {
    fn parse(query: Option<&str>, now: jiff::Timestamp) -> Result<LogQuery, String> {
        let mut parsed = LogQuery {
            previous: false,
            follow: false,
            tail_lines: None,
            since: None,
            timestamps: false,
            limit_bytes: None,
        };
        let (mut since_seconds, mut since_time) = (None, None);
        for pair in query.unwrap_or_default().split('&').filter(|p| !p.is_empty()) {
            let (key, value) = pair.split_once('=').unwrap_or((pair, "true"));
            let number = |what: &str| -> Result<i64, String> {
                value.parse::<i64>().map_err(|_| format!("{what}={value} is not a number"))
            };
            match key {
                "previous" => parsed.previous = flag(value),
                "follow" => parsed.follow = flag(value),
                "timestamps" => parsed.timestamps = flag(value),
                "tailLines" => {
                    let n = number("tailLines")?;
                    parsed.tail_lines = Some(usize::try_from(n).map_err(|_| "tailLines must be 0 or more".to_owned())?);
                }
                "limitBytes" => {
                    let n = number("limitBytes")?;
                    if n < 1 {
                        return Err("limitBytes must be greater than 0".into());
                    }
                    parsed.limit_bytes = u64::try_from(n).ok();
                }
                "sinceSeconds" => {
                    let n = number("sinceSeconds")?;
                    if n < 1 {
                        return Err("sinceSeconds must be greater than 0".into());
                    }
                    since_seconds = Some(n);
                }
                "sinceTime" => {
                    let decoded = value.replace("%3A", ":").replace("%3a", ":").replace("%2B", "+").replace("%2b", "+");
                    let time: jiff::Timestamp =
                        decoded.parse().map_err(|e| format!("sinceTime={value} is not an RFC 3339 time: {e}"))?;
                    since_time = Some(time);
                }
                _ => {}
            }
        }
        parsed.since = match (since_seconds, since_time) {
            (Some(_), Some(_)) => return Err("at most one of sinceTime or sinceSeconds may be specified".into()),
            // Further back than time goes: everything.
            (Some(seconds), None) => {
                Some(now.checked_sub(jiff::SignedDuration::from_secs(seconds)).unwrap_or(jiff::Timestamp::MIN))
            }
            (None, time) => time,
        };
        Ok(parsed)
    }
}

/// Turns log entries into the answer's text: since, timestamps, the byte
/// limit.
struct Renderer {
    since: Option<jiff::Timestamp>,
    timestamps: bool,
    remaining: Option<u64>,
}

impl Renderer {
    fn new(query: &LogQuery) -> Self {
        Renderer { since: query.since, timestamps: query.timestamps, remaining: query.limit_bytes }
    }

    /// Whether the byte limit is used up.
    fn done(&self) -> bool {
        self.remaining == Some(0)
    }

    fn render(&mut self, entries: Vec<LogEntry>) -> String {
        let mut out = String::new();
        for entry in entries {
            if let Some(since) = self.since
                && entry.time.parse::<jiff::Timestamp>().is_ok_and(|t| t < since)
            {
                continue;
            }
            if self.timestamps && !entry.time.is_empty() {
                out.push_str(&entry.time);
                out.push(' ');
            }
            out.push_str(&entry.text);
        }
        if let Some(remaining) = self.remaining.as_mut() {
            let keep = usize::try_from(*remaining).unwrap_or(usize::MAX).min(out.len());
            // Cut on a character boundary at or before the limit.
            let cut = (0..=keep).rev().find(|&i| out.is_char_boundary(i)).unwrap_or(0);
            out.truncate(cut);
            *remaining -= cut as u64;
            if cut < keep {
                // A character straddles the limit: nothing more fits.
                *remaining = 0;
            }
        }
        out
    }
}

/// Which log file of which container.
struct LogTarget {
    uid: String,
    container: String,
    dir: PathBuf,
    run: u32,
}

impl LogTarget {
    fn file(&self) -> PathBuf {
        self.dir.join(format!("{}.log", self.run))
    }

    /// Whether the run this file belongs to may still write to it: the pod
    /// is there, no later run has a log, and the container's status is for
    /// this run and not terminated.
    fn may_grow(&self, store: &PodStore) -> bool {
        let Some(pod) = store.get(&self.uid) else { return false };
        if self.dir.join(format!("{}.log", self.run + 1)).exists() {
            return false;
        }
        let status = pod.status.as_ref().and_then(|s| {
            s.init_container_statuses
                .iter()
                .flatten()
                .chain(s.container_statuses.iter().flatten())
                .chain(s.ephemeral_container_statuses.iter().flatten())
                .find(|c| c.name == self.container)
        });
        status.is_some_and(|c| {
            u32::try_from(c.restart_count).ok() == Some(self.run)
                && c.state.as_ref().is_none_or(|state| state.terminated.is_none())
        })
    }
}

pub(crate) async fn container_logs(
    State(state): State<HttpState>,
    Path((namespace, name, container)): Path<(String, String, String)>,
    RawQuery(query): RawQuery,
) -> Response {
    let query = match LogQuery::parse(query.as_deref(), jiff::Timestamp::now()) {
        Ok(query) => query,
        Err(error) => return text(StatusCode::BAD_REQUEST, format!("{error}\n")),
    };
    let found = state.views.pods.store().list().into_iter().find(|p| {
        p.metadata.namespace.as_deref() == Some(namespace.as_str()) && p.metadata.name.as_deref() == Some(name.as_str())
    });
    let Some(pod) = found else {
        return text(StatusCode::NOT_FOUND, format!("pod \"{name}\" not found in namespace \"{namespace}\"\n"));
    };
    if !has_container(&pod, &container) {
        return text(StatusCode::BAD_REQUEST, format!("container {container} is not valid for pod {name}\n"));
    }
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    let dir = crate::pod::pod_log_dir(&state.views.root_dir, &namespace, &name, &uid).join(&container);
    let mut runs = log_runs(&dir);
    runs.sort_unstable();
    let pick = if query.previous { runs.len().checked_sub(2) } else { runs.len().checked_sub(1) };
    let Some(run) = pick.map(|i| runs[i]) else {
        let why = if query.previous { "previous terminated container" } else { "container" };
        return text(StatusCode::BAD_REQUEST, format!("{why} \"{container}\" in pod \"{name}\" has no logs yet\n"));
    };
    let target = LogTarget { uid, container, dir, run };
    let renderer = Renderer::new(&query);
    if query.follow && !query.previous {
        let guard = match state.sessions.begin() {
            Ok(guard) => guard,
            Err(refused) => return refused.into_response(),
        };
        return follow(&state, target, query.tail_lines, renderer, guard);
    }
    if query.tail_lines.is_none() {
        // Read as it is sent, stopping at `limitBytes`: a long log costs a
        // chunk of memory, not its size.
        return match tokio::fs::File::open(target.file()).await {
            Ok(file) => stream_log(file, renderer),
            Err(error) => text(StatusCode::INTERNAL_SERVER_ERROR, format!("cannot read the log: {error}\n")),
        };
    }
    // With `tailLines`, what is read is bounded by the lines asked for: it
    // starts where the last of them do (found from the end).
    let read = async {
        let mut file = tokio::fs::File::open(target.file()).await?;
        if let Some(lines) = query.tail_lines {
            let start = tail_offset(&mut file, lines).await?;
            file.seek(std::io::SeekFrom::Start(start)).await?;
        }
        let mut raw = Vec::new();
        file.read_to_end(&mut raw).await?;
        Ok::<Vec<u8>, std::io::Error>(raw)
    };
    let raw = match read.await {
        Ok(raw) => raw,
        Err(error) => return text(StatusCode::INTERNAL_SERVER_ERROR, format!("cannot read the log: {error}\n")),
    };
    let mut decoder = CriLogDecoder::default();
    let mut entries = decoder.feed_entries(&raw);
    entries.extend(decoder.finish_entries());
    let mut renderer = renderer;
    let body = renderer.render(tail(entries, query.tail_lines));
    // Chunked, as the kubelet answers: the API server's WebSocket log
    // copier drops the last read that comes with the end of the body, so a
    // body with a Content-Length (one read, then EOF) reaches a WebSocket
    // client empty.
    let chunk = futures_util::stream::once(async move { Ok::<_, std::io::Error>(body) });
    (StatusCode::OK, [(header::CONTENT_TYPE, "text/plain; charset=utf-8")], Body::from_stream(chunk)).into_response()
}

/// How much of a log is read at a time when it is streamed.
const LOG_CHUNK: usize = 64 * 1024;

/// Streams `file` (chunked) through `renderer` until its end or the
/// renderer's byte limit, reading one chunk at a time.
fn stream_log(mut file: tokio::fs::File, mut renderer: Renderer) -> Response {
    let (tx, rx) = mpsc::channel::<Result<String, std::io::Error>>(4);
    // Not supervised: one request's log stream.
    tokio::spawn(async move {
        let mut decoder = CriLogDecoder::default();
        let mut buffer = vec![0u8; LOG_CHUNK];
        loop {
            let read = match file.read(&mut buffer).await {
                Ok(0) => break,
                Ok(read) => read,
                Err(error) => {
                    let _ = tx.send(Err(error)).await;
                    return;
                }
            };
            let text = renderer.render(decoder.feed_entries(&buffer[..read]));
            if !text.is_empty() && tx.send(Ok(text)).await.is_err() {
                return;
            }
            if renderer.done() {
                return;
            }
        }
        let text = renderer.render(decoder.finish_entries());
        if !text.is_empty() {
            let _ = tx.send(Ok(text)).await;
        }
    });
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx)),
    )
        .into_response()
}

fn has_container(pod: &Pod, container: &str) -> bool {
    pod.spec.iter().any(|s| {
        s.init_containers.iter().flatten().chain(s.containers.iter()).any(|c| c.name == container)
            || s.ephemeral_containers.iter().flatten().any(|c| c.name == container)
    })
}

/// The run numbers that have a log file in `dir`.
fn log_runs(dir: &FsPath) -> Vec<u32> {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.strip_suffix(".log")?.parse().ok())
        .collect()
}

/// Where to start reading a log for its last `lines` lines: a raw line
/// boundary with more than `lines` whole entries after it (the first may
/// be the end of a longer, split line, and is dropped by [`tail`]), found
/// by reading back from the end in doubling windows; 0 for a short log.
async fn tail_offset(file: &mut tokio::fs::File, lines: usize) -> std::io::Result<u64> {
    let size = file.metadata().await?.len();
    let mut window: u64 = 64 * 1024;
    loop {
        let start = size.saturating_sub(window);
        if start == 0 {
            return Ok(0);
        }
        file.seek(std::io::SeekFrom::Start(start)).await?;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes).await?;
        if let Some(first) = bytes.iter().position(|b| *b == b'\n') {
            let mut decoder = CriLogDecoder::default();
            if decoder.feed_entries(&bytes[first + 1..]).len() > lines {
                return Ok(start + first as u64 + 1);
            }
        }
        window = window.saturating_mul(2);
    }
}

fn tail<T>(mut lines: Vec<T>, keep: Option<usize>) -> Vec<T> {
    let skip = keep.map_or(0, |n| lines.len().saturating_sub(n));
    lines.drain(..skip);
    lines
}

/// Streams the log: what is there (tailed), then each line as it is written.
fn follow(
    state: &HttpState,
    target: LogTarget,
    tail_lines: Option<usize>,
    renderer: Renderer,
    guard: crate::state::SessionGuard,
) -> Response {
    // The watch is made before the first read, so nothing written between
    // the read and the wait goes unnoticed.
    let events = match state.log_watcher.subscribe(&target.dir) {
        Ok(events) => events,
        Err(error) => {
            return text(StatusCode::INTERNAL_SERVER_ERROR, format!("cannot follow the log: {error}\n"));
        }
    };
    let store = state.views.pods.store().clone();
    let (tx, rx) = mpsc::channel::<Result<String, std::io::Error>>(64);
    state.sessions.spawn(guard, async move {
        if let Err(error) = send_log(&store, &target, tail_lines, renderer, events, &tx).await {
            tracing::debug!(%error, file = %target.file().display(), "log follow ended");
        }
    });
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx)),
    )
        .into_response()
}

/// Why a follow ended early.
#[derive(Debug, thiserror::Error)]
enum FollowEnd {
    #[error("the client went away")]
    ClientGone,
    #[error("cannot read the log: {0}")]
    Read(#[from] std::io::Error),
}

async fn send_log(
    store: &PodStore,
    target: &LogTarget,
    tail_lines: Option<usize>,
    mut renderer: Renderer,
    mut events: LogSubscription,
    tx: &mpsc::Sender<Result<String, std::io::Error>>,
) -> Result<(), FollowEnd> {
    let mut changes = store.changes();
    let mut file = tokio::fs::File::open(target.file()).await?;
    if let Some(lines) = tail_lines {
        let start = tail_offset(&mut file, lines).await?;
        file.seek(std::io::SeekFrom::Start(start)).await?;
    }
    let mut decoder = CriLogDecoder::default();
    send(tx, &mut renderer, tail(read_more(&mut file, &mut decoder).await?, tail_lines)).await?;
    loop {
        if renderer.done() {
            return Ok(());
        }
        // Checked before reading: a run that ended has written everything,
        // so the read after this check is its last. Changes are marked seen
        // first, so one that comes after the check wakes the wait below.
        changes.borrow_and_update();
        let growing = target.may_grow(store);
        send(tx, &mut renderer, read_more(&mut file, &mut decoder).await?).await?;
        // Rotated (the node renamed the file and the runtime made a new
        // one): the old file is read to its end above, the new one from
        // its start.
        if let Some(new) = replaced(&file, &target.file()).await {
            file = new;
            send(tx, &mut renderer, read_more(&mut file, &mut decoder).await?).await?;
        }
        if !growing {
            return send(tx, &mut renderer, decoder.finish_entries()).await;
        }
        tokio::select! {
            event = events.changes.changed() => {
                if event.is_err() {
                    return Err(FollowEnd::Read(std::io::Error::other("the log watch ended")));
                }
            }
            changed = changes.changed() => {
                if changed.is_err() {
                    // The node is stopping: what was written is sent.
                    send(tx, &mut renderer, read_more(&mut file, &mut decoder).await?).await?;
                    return send(tx, &mut renderer, decoder.finish_entries()).await;
                }
            }
            () = tx.closed() => return Err(FollowEnd::ClientGone),
        }
    }
}

/// The file now at `path`, if it is not `file` (a rotation replaced it).
async fn replaced(file: &tokio::fs::File, path: &std::path::Path) -> Option<tokio::fs::File> {
    use std::os::unix::fs::MetadataExt as _;
    let open = file.metadata().await.ok()?;
    let now = tokio::fs::metadata(path).await.ok()?;
    if (open.dev(), open.ino()) == (now.dev(), now.ino()) {
        return None;
    }
    tokio::fs::File::open(path).await.ok()
}

/// The lines completed by what was appended since the last read.
async fn read_more(file: &mut tokio::fs::File, decoder: &mut CriLogDecoder) -> std::io::Result<Vec<LogEntry>> {
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes).await?;
    Ok(decoder.feed_entries(&bytes))
}

async fn send(
    tx: &mpsc::Sender<Result<String, std::io::Error>>,
    renderer: &mut Renderer,
    lines: Vec<LogEntry>,
) -> Result<(), FollowEnd> {
    if lines.is_empty() || renderer.done() {
        return Ok(());
    }
    let text = renderer.render(lines);
    if text.is_empty() {
        return Ok(());
    }
    tx.send(Ok(text)).await.map_err(|_| FollowEnd::ClientGone)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A follower notices a rotation: the file at the path is another one.
    #[tokio::test]
    async fn a_rotated_log_is_noticed_by_its_inode() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("0.log");
        std::fs::write(&path, "old\n").expect("write");
        let file = tokio::fs::File::open(&path).await.expect("open");
        assert!(replaced(&file, &path).await.is_none(), "the same file");
        std::fs::rename(&path, dir.path().join("0.log.20261126-120000")).expect("rename");
        assert!(replaced(&file, &path).await.is_none(), "no new file yet");
        std::fs::write(&path, "new\n").expect("write");
        let mut new = replaced(&file, &path).await.expect("the new file");
        let mut text = String::new();
        new.read_to_string(&mut text).await.expect("read");
        assert_eq!(text, "new\n");
    }

    #[tokio::test]
    async fn the_tail_is_read_from_the_end_of_a_long_log() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("0.log");
        let mut log = String::new();
        for i in 0..20_000 {
            log.push_str(&format!("2026-11-24T10:00:00Z stdout F line {i}\n"));
        }
        // The last line is split in three partial entries.
        log.push_str("2026-11-24T10:00:01Z stdout P last-");
        log.push_str("\n2026-11-24T10:00:01Z stdout P split-");
        log.push_str("\n2026-11-24T10:00:01Z stdout F line\n");
        std::fs::write(&path, &log).expect("write");
        let mut file = tokio::fs::File::open(&path).await.expect("open");
        let start = tail_offset(&mut file, 3).await.expect("offset");
        assert!(start > 0 && start < log.len() as u64, "read from near the end: {start}");
        assert_eq!(log.as_bytes()[usize::try_from(start).expect("small") - 1], b'\n', "at a line boundary");
        let mut decoder = CriLogDecoder::default();
        let entries = decoder.feed_entries(&log.as_bytes()[usize::try_from(start).expect("small")..]);
        let texts: Vec<String> = tail(entries, Some(3)).into_iter().map(|e| e.text).collect();
        assert_eq!(texts, ["line 19998\n", "line 19999\n", "last-split-line\n"]);
        let mut file = tokio::fs::File::open(&path).await.expect("open");
        assert_eq!(tail_offset(&mut file, 1_000_000).await.expect("offset"), 0, "more than there is: all of it");
    }

    #[test]
    fn log_query_parses_kubectl_parameters() {
        let now: jiff::Timestamp = "2026-11-24T10:00:00Z".parse().expect("time");
        let parse = |q| LogQuery::parse(Some(q), now);
        let query = parse("follow=true&tailLines=3").expect("valid");
        assert!(query.follow && !query.previous && query.tail_lines == Some(3));
        assert!(parse("previous").expect("valid").previous);
        assert_eq!(parse("tailLines=x"), Err("tailLines=x is not a number".to_owned()));
        assert_eq!(parse("tailLines=-1"), Err("tailLines must be 0 or more".to_owned()));
        let query = parse("sinceSeconds=60&timestamps=true&limitBytes=10").expect("valid");
        assert_eq!(query.since, Some("2026-11-24T09:59:00Z".parse().expect("time")));
        assert!(query.timestamps);
        assert_eq!(query.limit_bytes, Some(10));
        let query = parse("sinceTime=2026-11-24T09%3A30%3A00Z").expect("valid");
        assert_eq!(query.since, Some("2026-11-24T09:30:00Z".parse().expect("time")));
        assert!(parse("sinceTime=yesterday").expect_err("bad time").contains("RFC 3339"));
        assert!(parse("sinceSeconds=1&sinceTime=2026-11-24T09:30:00Z").expect_err("both").contains("at most one"));
        assert!(parse("sinceSeconds=0").expect_err("zero").contains("greater than 0"));
        let query = parse("sinceSeconds=400000000000").expect("huge but valid");
        assert_eq!(query.since, Some(jiff::Timestamp::MIN), "further back than time goes");
        assert!(parse("limitBytes=0").expect_err("zero").contains("greater than 0"));
    }

    fn entry(time: &str, text: &str) -> LogEntry {
        LogEntry { time: time.into(), text: text.into() }
    }

    #[test]
    fn rendering_applies_since_timestamps_and_the_byte_limit() {
        let now: jiff::Timestamp = "2026-11-24T10:00:00Z".parse().expect("time");
        let entries = || {
            vec![
                entry("2026-11-24T09:00:00.000000001Z", "old\n"),
                entry("2026-11-24T09:59:30.5Z", "new\n"),
                entry("2026-11-24T09:59:31Z", "newer\n"),
            ]
        };
        let query = LogQuery::parse(Some("sinceSeconds=60"), now).expect("valid");
        assert_eq!(Renderer::new(&query).render(entries()), "new\nnewer\n");
        let query = LogQuery::parse(Some("timestamps=true&sinceSeconds=60"), now).expect("valid");
        assert_eq!(Renderer::new(&query).render(entries()), "2026-11-24T09:59:30.5Z new\n2026-11-24T09:59:31Z newer\n");
        let query = LogQuery::parse(Some("limitBytes=6"), now).expect("valid");
        let mut renderer = Renderer::new(&query);
        assert_eq!(renderer.render(entries()), "old\nne");
        assert!(renderer.done());
        assert_eq!(renderer.render(entries()), "", "nothing after the limit");
        let query = LogQuery::parse(Some("limitBytes=2"), now).expect("valid");
        assert_eq!(Renderer::new(&query).render(vec![entry("", "é!\n")]), "é", "cut on a character boundary");
        let query = LogQuery::parse(Some("limitBytes=1"), now).expect("valid");
        let mut renderer = Renderer::new(&query);
        assert_eq!(renderer.render(vec![entry("", "é\n")]), "");
        assert!(renderer.done(), "a character straddling the limit ends the answer");
    }

    /// Fuzz target: `/containerLogs` query strings: parsed or refused with
    /// a reason, never a panic.
    #[test]
    fn fuzz_log_queries() {
        let now = jiff::Timestamp::now();
        let ran = crate::fuzz::Fuzz::new("kubelet-api-requests").run(|input| {
            let text = String::from_utf8_lossy(input);
            let query = text.split_once('?').map_or(text.as_ref(), |(_, q)| q);
            let _ = LogQuery::parse(Some(query.trim_end()), now);
            let _ = LogQuery::parse(Some(&text), now);
        });
        assert!(ran > 3);
    }
}
