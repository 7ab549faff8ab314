//! A provider in about a hundred lines: each container is a process on the
//! host (its `command` and `args`, with its env, in its working dir), its
//! output written to the container's log in the CRI format, so `rustlet
//! logs` and `kubectl logs` read it. Run a node with it:
//!
//! ```sh
//! cargo run -p kubelet --example host_process_provider -- /tmp/hp-root /tmp/hp-manifests
//! ```
//!
//! then put a Pod manifest in `/tmp/hp-manifests` (any `image`; the
//! command is what runs). docs/providers.md walks through it.

use std::collections::HashMap;
use std::process::Stdio;
use std::sync::Mutex;
use std::time::Duration;

use async_trait::async_trait;
use k8s_openapi::api::core::v1::{Container, Pod};
use kubelet_provider::{
    ContainerExit, ContainerId, ContainerLaunch, PreparedImage, Provider, ProviderError, ProviderErrorKind,
    RunningContainer, cri_log_line,
};
use tokio::io::{AsyncBufReadExt as _, AsyncWriteExt as _};
use tokio::sync::watch;

/// A started process: its pid, and its exit once known.
type Started = (u32, watch::Receiver<Option<ContainerExit>>);

/// The containers it started, by id.
#[derive(Default)]
pub struct HostProcesses {
    running: Mutex<HashMap<String, Started>>,
}

/// Copies `stream`'s lines into the log as CRI lines of stream `name`.
async fn copy_lines(
    name: &'static str,
    stream: impl tokio::io::AsyncRead + Unpin,
    log: std::sync::Arc<tokio::sync::Mutex<tokio::fs::File>>,
) {
    let mut lines = tokio::io::BufReader::new(stream).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        let _ = log.lock().await.write_all(cri_log_line(name, &line).as_bytes()).await;
    }
}

fn failed(message: String) -> ProviderError {
    ProviderError::new(ProviderErrorKind::Other, message)
}

#[async_trait]
impl Provider for HostProcesses {
    async fn prepare_image(&self, _pod: &Pod, container: &Container) -> Result<PreparedImage, ProviderError> {
        // Nothing to pull: the host has the programs.
        Ok(PreparedImage { image_id: format!("host://{}", container.image.as_deref().unwrap_or_default()) })
    }

    async fn start_container(&self, launch: &ContainerLaunch) -> Result<ContainerId, ProviderError> {
        let options = &launch.run_options;
        let argv: Vec<&String> = options.command.iter().chain(&options.args).collect();
        let Some((program, args)) = argv.split_first() else {
            return Err(failed(format!("container {} has no command to run", launch.container.name)));
        };
        let mut command = tokio::process::Command::new(program);
        command.args(args).envs(options.env.iter().map(|e| (&e.name, &e.value)));
        command.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).kill_on_drop(true);
        if let Some(dir) = &options.working_dir {
            command.current_dir(dir);
        }
        let mut child = command.spawn().map_err(|e| failed(format!("cannot run {program}: {e}")))?;
        let pid = child.id().unwrap_or_default();
        let log = tokio::fs::OpenOptions::new().create(true).append(true).open(&launch.log_path).await;
        let log = std::sync::Arc::new(tokio::sync::Mutex::new(log.map_err(|e| failed(format!("log: {e}")))?));
        // Each stream, line by line, into the CRI log.
        let copies = [
            child.stdout.take().map(|out| tokio::spawn(copy_lines("stdout", out, log.clone()))),
            child.stderr.take().map(|err| tokio::spawn(copy_lines("stderr", err, log.clone()))),
        ];
        let (exit_tx, exit) = watch::channel(None);
        tokio::spawn(async move {
            let status = child.wait().await;
            for copy in copies.into_iter().flatten() {
                let _ = copy.await;
            }
            let code = status.ok().and_then(|s| s.code()).unwrap_or(137);
            let reason = (code != 0).then(|| "Error".to_owned());
            let _ = exit_tx.send(Some(ContainerExit {
                exit_code: code,
                reason,
                message: None,
                finished_at: jiff::Timestamp::now(),
            }));
        });
        let id = format!("host-{pid}");
        self.running.lock().unwrap_or_else(|p| p.into_inner()).insert(id.clone(), (pid, exit));
        Ok(ContainerId(id))
    }

    async fn wait_container(&self, id: &ContainerId) -> Result<ContainerExit, ProviderError> {
        let exit = self.running.lock().unwrap_or_else(|p| p.into_inner()).get(&id.0).map(|(_, exit)| exit.clone());
        let mut exit = exit.ok_or_else(|| failed(format!("no container {}", id.0)))?;
        let ended = exit.wait_for(Option::is_some).await.map_err(|_| failed("the container's watcher went".into()))?;
        Ok(ended.clone().unwrap_or_else(|| unreachable!("waited for Some")))
    }

    async fn stop_container(&self, id: &ContainerId, grace: Duration) -> Result<(), ProviderError> {
        let Some((pid, mut exit)) = self.running.lock().unwrap_or_else(|p| p.into_inner()).get(&id.0).cloned() else {
            return Ok(());
        };
        // Asked first (SIGTERM), killed after the grace period (SIGKILL).
        let signal = |signal| {
            if let Some(pid) = rustix::process::Pid::from_raw(pid as i32) {
                let _ = rustix::process::kill_process(pid, signal);
            }
        };
        signal(rustix::process::Signal::TERM);
        if tokio::time::timeout(grace, exit.wait_for(Option::is_some)).await.is_err() {
            signal(rustix::process::Signal::KILL);
        }
        Ok(())
    }

    async fn running_containers(&self) -> Result<Vec<RunningContainer>, ProviderError> {
        // The processes end with the node (they are its children), so a
        // restarted node has nothing to adopt.
        Ok(Vec::new())
    }
}

#[allow(dead_code)] // The test includes this file and runs the provider itself.
#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let (Some(root), Some(manifests)) = (args.next(), args.next()) else {
        return Err("usage: host_process_provider ROOT_DIR MANIFEST_DIR".into());
    };
    let mut config = kubelet::node::NodeConfig::new(&root, "host-process-node");
    config.pods.manifest_dir = Some(manifests.into());
    let shutdown = tokio_util::sync::CancellationToken::new();
    let provider = std::sync::Arc::new(HostProcesses::default());
    let node = kubelet::node::NodeBuilder::new(config).provider(provider).start(shutdown.clone()).await?;
    println!("node running; pods: rustlet get pods --root-dir {root}; Ctrl-C stops it");
    tokio::signal::ctrl_c().await?;
    shutdown.cancel();
    node.stopped().await;
    Ok(())
}
