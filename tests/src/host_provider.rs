//! A provider for tests that runs each container's command as a real host
//! process: its env is the container's run options, its working dir the
//! spec's, and every mount is exposed as an env var naming the host path
//! (`MOUNT_<VOLUME>` for a pod volume, upper-cased with `-` as `_`;
//! `DEVICE_MOUNT_<n>` for a device plugin's mount). Output goes to the
//! container's log file in the CRI format. Tests see real exits, device env
//! and files written into volumes.
//!
//! Not done yet: adopting processes after a restart of the node (the
//! processes are the node's children and die with it).

use std::collections::HashMap;
use std::process::Stdio;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use k8s_openapi::api::core::v1::{Container, Pod};
use k8s_openapi::jiff::Timestamp;
use kubelet::provider::{
    ContainerExit, ContainerId, ContainerLaunch, PreparedImage, Provider, ProviderError, ProviderErrorKind,
    RunningContainer,
};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::sync::watch;

/// One process.
struct Instance {
    pid: Option<u32>,
    exit: watch::Receiver<Option<ContainerExit>>,
    kill: tokio::sync::mpsc::UnboundedSender<()>,
}

/// Runs containers as host processes.
#[derive(Default)]
pub struct HostProcessProvider {
    instances: Mutex<HashMap<ContainerId, Instance>>,
    next: AtomicU64,
    /// Images whose preparation fails (`image` → message).
    pub failing_images: Mutex<HashMap<String, String>>,
}

impl HostProcessProvider {
    /// A provider with no failing images.
    pub fn new() -> Self {
        Self::default()
    }

    fn instance(&self, id: &ContainerId) -> Option<(Option<u32>, watch::Receiver<Option<ContainerExit>>)> {
        let instances = self.instances.lock().expect("lock");
        instances.get(id).map(|i| (i.pid, i.exit.clone()))
    }
}

fn env_name(text: &str) -> String {
    text.chars().map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_uppercase() } else { '_' }).collect()
}

#[async_trait]
impl Provider for HostProcessProvider {
    async fn prepare_image(&self, _pod: &Pod, container: &Container) -> Result<PreparedImage, ProviderError> {
        let image = container.image.clone().unwrap_or_default();
        if let Some(message) = self.failing_images.lock().expect("lock").get(&image) {
            return Err(ProviderError::new(ProviderErrorKind::ImagePull, message.clone()));
        }
        Ok(PreparedImage { image_id: format!("host://{image}") })
    }

    async fn start_container(&self, launch: &ContainerLaunch) -> Result<ContainerId, ProviderError> {
        let options = &launch.run_options;
        let mut argv: Vec<String> = options.command.iter().chain(options.args.iter()).cloned().collect();
        if argv.is_empty() {
            return Err(ProviderError::new(ProviderErrorKind::Config, "the host provider needs a command"));
        }
        let program = argv.remove(0);
        let mut command = tokio::process::Command::new(&program);
        command.args(&argv).env_clear().env("PATH", std::env::var("PATH").unwrap_or_default());
        for var in &options.env {
            command.env(&var.name, &var.value);
        }
        let mut device_mounts = 0;
        for mount in &options.mounts {
            let name = match &mount.volume {
                Some(volume) => format!("MOUNT_{}", env_name(volume)),
                None => {
                    device_mounts += 1;
                    format!("DEVICE_MOUNT_{device_mounts}")
                }
            };
            command.env(name, &mount.host_path);
        }
        if let Some(dir) = &options.working_dir {
            command.current_dir(dir);
        }
        command.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).kill_on_drop(true);
        let mut child = command
            .spawn()
            .map_err(|e| ProviderError::new(ProviderErrorKind::CannotRun, format!("run {program:?}: {e}")))?;
        let log =
            tokio::fs::OpenOptions::new().create(true).append(true).open(&launch.log_path).await.map_err(|e| {
                ProviderError::new(ProviderErrorKind::Other, format!("log {}: {e}", launch.log_path.display()))
            })?;
        let log = std::sync::Arc::new(tokio::sync::Mutex::new(log));
        let mut copies = Vec::new();
        if let Some(out) = child.stdout.take() {
            copies.push(tokio::spawn(copy_lines(out, "stdout", log.clone())));
        }
        if let Some(err) = child.stderr.take() {
            copies.push(tokio::spawn(copy_lines(err, "stderr", log.clone())));
        }
        let id = ContainerId(format!("host-{}-{}", launch.container.name, self.next.fetch_add(1, Ordering::Relaxed)));
        let pid = child.id();
        let (exit_tx, exit) = watch::channel(None);
        let (kill, mut kills) = tokio::sync::mpsc::unbounded_channel::<()>();
        tokio::spawn(async move {
            let status = tokio::select! {
                status = child.wait() => status,
                _ = kills.recv() => { let _ = child.start_kill(); child.wait().await }
            };
            for copy in copies {
                let _ = copy.await;
            }
            use std::os::unix::process::ExitStatusExt;
            let exit_code = match &status {
                Ok(s) => s.code().unwrap_or_else(|| 128 + s.signal().unwrap_or(9)),
                Err(_) => 255,
            };
            let _ = exit_tx.send(Some(ContainerExit {
                exit_code,
                reason: None,
                message: None,
                finished_at: Timestamp::now(),
            }));
        });
        self.instances.lock().expect("lock").insert(id.clone(), Instance { pid, exit, kill });
        Ok(id)
    }

    async fn wait_container(&self, id: &ContainerId) -> Result<ContainerExit, ProviderError> {
        let Some((_, mut exit)) = self.instance(id) else {
            return Err(ProviderError::new(ProviderErrorKind::NotFound, format!("no container {id}")));
        };
        let ended = exit.wait_for(Option::is_some).await.map_err(|_| {
            ProviderError::new(ProviderErrorKind::Other, format!("container {id}: its watcher is gone"))
        })?;
        Ok(ended.clone().expect("waited for Some"))
    }

    async fn stop_container(&self, id: &ContainerId, grace: Duration) -> Result<(), ProviderError> {
        let Some((pid, mut exit)) = self.instance(id) else { return Ok(()) };
        if exit.borrow().is_some() {
            return Ok(());
        }
        if let Some(pid) = pid {
            // SIGTERM first, through kill(1): the test support stays free of
            // unsafe code.
            let _ = tokio::process::Command::new("kill").args(["-TERM", &pid.to_string()]).status().await;
        }
        if tokio::time::timeout(grace, exit.wait_for(Option::is_some)).await.is_err() {
            if let Some(instance) = self.instances.lock().expect("lock").get(id) {
                let _ = instance.kill.send(());
            }
            let _ = exit.wait_for(Option::is_some).await;
        }
        Ok(())
    }

    async fn running_containers(&self) -> Result<Vec<RunningContainer>, ProviderError> {
        Ok(Vec::new())
    }

    async fn remove_pod(&self, _pod_uid: &str) -> Result<(), ProviderError> {
        Ok(())
    }
}

async fn copy_lines(
    stream: impl tokio::io::AsyncRead + Unpin,
    name: &'static str,
    log: std::sync::Arc<tokio::sync::Mutex<tokio::fs::File>>,
) {
    let mut lines = BufReader::new(stream).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        let entry = kubelet::provider::cri_log_line(name, &line);
        let _ = log.lock().await.write_all(entry.as_bytes()).await;
    }
}
