//! `/containerLogs/<namespace>/<pod>/<container>`: a container's log text,
//! as the kubelet serves it to `kubectl logs`.
//!
//! Parameters: `previous=true` (the run before the current one),
//! `tailLines=N` (only the last N lines), `follow=true` (keep the answer
//! open and send lines as the container writes them, until that run of the
//! container ends, the pod goes, or the client hangs up). Following is
//! event-driven: an inotify watch on the container's log directory and the
//! pod store's change signal wake the sender, nothing polls.

use std::path::{Path as FsPath, PathBuf};

use axum::body::Body;
use axum::extract::{Path, RawQuery, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use inotify::{Inotify, WatchMask};
use k8s_openapi::api::core::v1::Pod;
use tokio::io::AsyncReadExt as _;
use tokio::sync::mpsc;
use tokio_stream::StreamExt as _;

use super::http::{HttpState, text};
use crate::pod::PodStore;
use crate::provider::CriLogDecoder;

/// The query parameters.
#[derive(Debug, PartialEq, Eq)]
struct LogQuery {
    previous: bool,
    follow: bool,
    tail_lines: Option<usize>,
}

fn flag(value: &str) -> bool {
    value == "true" || value == "1"
}

impl LogQuery {
    fn parse(query: Option<&str>) -> Result<LogQuery, String> {
        let mut parsed = LogQuery { previous: false, follow: false, tail_lines: None };
        for pair in query.unwrap_or_default().split('&').filter(|p| !p.is_empty()) {
            let (key, value) = pair.split_once('=').unwrap_or((pair, "true"));
            match key {
                "previous" => parsed.previous = flag(value),
                "follow" => parsed.follow = flag(value),
                "tailLines" => {
                    parsed.tail_lines = Some(value.parse().map_err(|_| format!("tailLines={value} is not a number"))?)
                }
                _ => {}
            }
        }
        Ok(parsed)
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
                .find(|c| c.name == self.container)
        });
        status.is_some_and(|c| {
            u32::try_from(c.restart_count).ok() == Some(self.run)
                && c.state.as_ref().is_none_or(|state| state.terminated.is_none())
        })
    }
}

pub(super) async fn container_logs(
    State(state): State<HttpState>,
    Path((namespace, name, container)): Path<(String, String, String)>,
    RawQuery(query): RawQuery,
) -> Response {
    let query = match LogQuery::parse(query.as_deref()) {
        Ok(query) => query,
        Err(error) => return text(StatusCode::BAD_REQUEST, format!("{error}\n")),
    };
    let found = state.pods.store().list().into_iter().find(|p| {
        p.metadata.namespace.as_deref() == Some(namespace.as_str()) && p.metadata.name.as_deref() == Some(name.as_str())
    });
    let Some(pod) = found else {
        return text(StatusCode::NOT_FOUND, format!("pod \"{name}\" not found in namespace \"{namespace}\"\n"));
    };
    if !has_container(&pod, &container) {
        return text(StatusCode::BAD_REQUEST, format!("container {container} is not valid for pod {name}\n"));
    }
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    let dir = crate::pod::pod_log_dir(&state.root_dir, &namespace, &name, &uid).join(&container);
    let mut runs = log_runs(&dir);
    runs.sort_unstable();
    let pick = if query.previous { runs.len().checked_sub(2) } else { runs.len().checked_sub(1) };
    let Some(run) = pick.map(|i| runs[i]) else {
        let why = if query.previous { "previous terminated container" } else { "container" };
        return text(StatusCode::BAD_REQUEST, format!("{why} \"{container}\" in pod \"{name}\" has no logs yet\n"));
    };
    let target = LogTarget { uid, container, dir, run };
    if query.follow && !query.previous {
        return follow(state.pods.store().clone(), target, query.tail_lines);
    }
    let raw = match tokio::fs::read_to_string(target.file()).await {
        Ok(raw) => raw,
        Err(error) => return text(StatusCode::INTERNAL_SERVER_ERROR, format!("cannot read the log: {error}\n")),
    };
    let lines = crate::provider::decode_cri_log(&raw);
    text(StatusCode::OK, tail(lines, query.tail_lines).concat())
}

fn has_container(pod: &Pod, container: &str) -> bool {
    pod.spec
        .iter()
        .flat_map(|s| s.init_containers.iter().flatten().chain(s.containers.iter()))
        .any(|c| c.name == container)
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

fn tail(mut lines: Vec<String>, keep: Option<usize>) -> Vec<String> {
    let skip = keep.map_or(0, |n| lines.len().saturating_sub(n));
    lines.drain(..skip);
    lines
}

/// Streams the log: what is there (tailed), then each line as it is written.
fn follow(store: PodStore, target: LogTarget, tail_lines: Option<usize>) -> Response {
    // The watch is made before the first read, so nothing written between
    // the read and the wait goes unnoticed.
    let events = Inotify::init().and_then(|inotify| {
        inotify.watches().add(&target.dir, WatchMask::MODIFY | WatchMask::CREATE | WatchMask::MOVED_TO)?;
        inotify.into_event_stream(vec![0u8; 4096])
    });
    let events = match events {
        Ok(events) => events,
        Err(error) => {
            return text(StatusCode::INTERNAL_SERVER_ERROR, format!("cannot follow the log: {error}\n"));
        }
    };
    let (tx, rx) = mpsc::channel::<Result<String, std::io::Error>>(64);
    tokio::spawn(async move {
        if let Err(error) = send_log(&store, &target, tail_lines, events, &tx).await {
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
    mut events: inotify::EventStream<Vec<u8>>,
    tx: &mpsc::Sender<Result<String, std::io::Error>>,
) -> Result<(), FollowEnd> {
    let mut changes = store.changes();
    let mut file = tokio::fs::File::open(target.file()).await?;
    let mut decoder = CriLogDecoder::default();
    send(tx, tail(read_more(&mut file, &mut decoder).await?, tail_lines)).await?;
    loop {
        // Checked before reading: a run that ended has written everything,
        // so the read after this check is its last. Changes are marked seen
        // first, so one that comes after the check wakes the wait below.
        changes.borrow_and_update();
        let growing = target.may_grow(store);
        send(tx, read_more(&mut file, &mut decoder).await?).await?;
        if !growing {
            return send(tx, decoder.finish()).await;
        }
        tokio::select! {
            event = events.next() => {
                if event.is_none() {
                    return Err(FollowEnd::Read(std::io::Error::other("the log watch ended")));
                }
            }
            changed = changes.changed() => {
                if changed.is_err() {
                    // The node is stopping: what was written is sent.
                    send(tx, read_more(&mut file, &mut decoder).await?).await?;
                    return send(tx, decoder.finish()).await;
                }
            }
            () = tx.closed() => return Err(FollowEnd::ClientGone),
        }
    }
}

/// The lines completed by what was appended since the last read.
async fn read_more(file: &mut tokio::fs::File, decoder: &mut CriLogDecoder) -> std::io::Result<Vec<String>> {
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes).await?;
    Ok(decoder.feed(&bytes))
}

async fn send(tx: &mpsc::Sender<Result<String, std::io::Error>>, lines: Vec<String>) -> Result<(), FollowEnd> {
    if lines.is_empty() {
        return Ok(());
    }
    tx.send(Ok(lines.concat())).await.map_err(|_| FollowEnd::ClientGone)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_query_parses_kubectl_parameters() {
        assert_eq!(
            LogQuery::parse(Some("follow=true&tailLines=3")),
            Ok(LogQuery { previous: false, follow: true, tail_lines: Some(3) })
        );
        assert_eq!(LogQuery::parse(Some("previous")), Ok(LogQuery { previous: true, follow: false, tail_lines: None }));
        assert_eq!(LogQuery::parse(Some("tailLines=x")), Err("tailLines=x is not a number".to_owned()));
    }
}
