//! A provider for tests that runs each container's command as a real host
//! process: its env is the container's run options, its working dir the
//! spec's, and every mount is exposed as an env var naming the host path
//! (`MOUNT_<VOLUME>` for a pod volume, upper-cased with `-` as `_`;
//! `DEVICE_MOUNT_<n>` for a device plugin's mount; the CDI devices, from
//! device plugins and resource claims, as `CDI_DEVICES`, comma-separated).
//! Output goes to the container's log file in the CRI format. Tests see real
//! exits, device env and files written into volumes.
//!
//! Two ways to run a process:
//! - [`HostProcessProvider::new`]: the node's own children (they die with
//!   it); fast, for most tests and the benchmark.
//! - [`HostProcessProvider::detached`]: each container runs under the
//!   `container-shim` binary in its own process group, with its state in a
//!   directory (`lock` held while it runs, `exit` once it ended). It
//!   outlives the node, and a node started again adopts it
//!   ([`Provider::running_containers`]): the kubelet-restart tests use it.

use std::collections::HashMap;
use std::path::PathBuf;
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
    /// The process (in-process mode) or the shim's process group (detached).
    pid: Option<u32>,
    /// Signals go to the process group (detached mode).
    group: bool,
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
    /// In-place updates asked for (a host process has no limits to change:
    /// they are recorded), in order: container id, its new resources.
    pub updates: Mutex<Vec<(ContainerId, k8s_openapi::api::core::v1::ResourceRequirements)>>,
    /// Updates fail with this message while it is set.
    pub failing_updates: Mutex<Option<String>>,
    detached: Option<Detached>,
}

/// Where detached containers keep their state, and the shim that runs them.
struct Detached {
    shim: PathBuf,
    state_dir: PathBuf,
}

/// What a detached container's directory says about it.
#[derive(serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct Meta {
    pod_uid: String,
    container_name: String,
    restart_count: u32,
    started_at: Timestamp,
    group: u32,
}

/// Kills every detached container under `state_dir` (their process groups);
/// for test cleanup.
pub fn kill_detached(state_dir: &std::path::Path) {
    for pod in std::fs::read_dir(state_dir).into_iter().flatten().flatten() {
        for container in std::fs::read_dir(pod.path()).into_iter().flatten().flatten() {
            let Ok(meta) = std::fs::read(container.path().join("meta.json")) else { continue };
            let Ok(meta) = serde_json::from_slice::<Meta>(&meta) else { continue };
            let _ = std::process::Command::new("kill").args(["-KILL", "--", &format!("-{}", meta.group)]).status();
        }
    }
}

impl HostProcessProvider {
    /// A provider whose processes are the node's children.
    pub fn new() -> Self {
        Self::default()
    }

    /// A provider whose processes run under `shim` (the `container-shim`
    /// binary) with their state in `state_dir`: they outlive the node and
    /// are adopted by the next one.
    pub fn detached(shim: impl Into<PathBuf>, state_dir: impl Into<PathBuf>) -> Self {
        HostProcessProvider {
            detached: Some(Detached { shim: shim.into(), state_dir: state_dir.into() }),
            ..Self::default()
        }
    }

    /// Follows the detached container in `dir`: its exit is reported once
    /// the shim's lock is free (a blocking lock in a worker thread, no poll).
    fn watch_detached(&self, id: ContainerId, dir: PathBuf, group: u32) {
        let (exit_tx, exit) = watch::channel(None);
        let (kill, mut kills) = tokio::sync::mpsc::unbounded_channel::<()>();
        tokio::spawn(async move {
            let lock_path = dir.join("lock");
            let waited = tokio::task::spawn_blocking(move || {
                std::fs::OpenOptions::new().write(true).open(&lock_path).and_then(|f| f.lock())
            });
            tokio::pin!(waited);
            loop {
                tokio::select! {
                    _ = &mut waited => break,
                    Some(()) = kills.recv() => {
                        let _ = tokio::process::Command::new("kill").args(["-KILL", "--", &format!("-{group}")]).status().await;
                    }
                }
            }
            let exit_code = std::fs::read_to_string(dir.join("exit"))
                .ok()
                .and_then(|code| code.trim().parse().ok())
                // The shim itself was killed: the container is gone too.
                .unwrap_or(137);
            let _ = exit_tx.send(Some(ContainerExit {
                exit_code,
                reason: None,
                message: None,
                finished_at: Timestamp::now(),
            }));
        });
        self.instances.lock().expect("lock").insert(id, Instance { pid: Some(group), group: true, exit, kill });
    }

    async fn start_detached(
        &self,
        detached: &Detached,
        launch: &ContainerLaunch,
        argv: Vec<String>,
        env: Vec<(String, String)>,
    ) -> Result<ContainerId, ProviderError> {
        let uid = launch.pod.metadata.uid.clone().unwrap_or_default();
        let nonce = self.next.fetch_add(1, Ordering::Relaxed);
        let dir = detached.state_dir.join(&uid).join(format!(
            "{}-{}-{}-{nonce}",
            launch.container.name,
            launch.restart_count,
            std::process::id()
        ));
        let other = |e: std::io::Error| ProviderError::new(ProviderErrorKind::Other, format!("{}: {e}", dir.display()));
        std::fs::create_dir_all(&dir).map_err(other)?;
        let mut command = tokio::process::Command::new(&detached.shim);
        command
            .arg("--dir")
            .arg(&dir)
            .arg("--log")
            .arg(&launch.log_path)
            .arg("--")
            .args(&argv)
            .env_clear()
            .envs(env)
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            // Not the node's stderr: the shim outlives the node, and would
            // hold whatever reads the node's output open.
            .stderr(Stdio::null())
            .kill_on_drop(false);
        if let Some(working_dir) = &launch.run_options.working_dir {
            command.current_dir(working_dir);
        }
        let mut shim = command.spawn().map_err(|e| {
            ProviderError::new(ProviderErrorKind::CannotRun, format!("run {}: {e}", detached.shim.display()))
        })?;
        let group = shim.id().unwrap_or_default();
        let stdout = shim.stdout.take().expect("piped");
        let mut ready = String::new();
        let said = tokio::time::timeout(Duration::from_secs(30), BufReader::new(stdout).read_line(&mut ready)).await;
        if !matches!(said, Ok(Ok(n)) if n > 0) {
            let _ = shim.start_kill();
            return Err(ProviderError::new(ProviderErrorKind::CannotRun, "the container shim did not start"));
        }
        let meta = Meta {
            pod_uid: uid,
            container_name: launch.container.name.clone(),
            restart_count: launch.restart_count,
            started_at: Timestamp::now(),
            group,
        };
        std::fs::write(dir.join("meta.json"), serde_json::to_vec(&meta).unwrap_or_default()).map_err(other)?;
        // The shim is reaped by the runtime once it exits; it is followed
        // through its lock from here on.
        drop(shim);
        let id = ContainerId(format!("shim:{}", dir.display()));
        self.watch_detached(id.clone(), dir, group);
        Ok(id)
    }

    fn instance(&self, id: &ContainerId) -> Option<(Option<String>, watch::Receiver<Option<ContainerExit>>)> {
        let instances = self.instances.lock().expect("lock");
        instances
            .get(id)
            .map(|i| (i.pid.map(|p| if i.group { format!("-{p}") } else { p.to_string() }), i.exit.clone()))
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
        let mut env = vec![("PATH".to_owned(), std::env::var("PATH").unwrap_or_default())];
        env.extend(options.env.iter().map(|var| (var.name.clone(), var.value.clone())));
        let mut device_mounts = 0;
        for mount in &options.mounts {
            let name = match &mount.volume {
                Some(volume) => format!("MOUNT_{}", env_name(volume)),
                None => {
                    device_mounts += 1;
                    format!("DEVICE_MOUNT_{device_mounts}")
                }
            };
            env.push((name, mount.host_path.display().to_string()));
        }
        if !options.cdi_devices.is_empty() {
            env.push(("CDI_DEVICES".to_owned(), options.cdi_devices.join(",")));
        }
        if let Some(detached) = &self.detached {
            return self.start_detached(detached, launch, argv, env).await;
        }
        let program = argv.remove(0);
        let mut command = tokio::process::Command::new(&program);
        command.args(&argv).env_clear().envs(env);
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
        self.instances.lock().expect("lock").insert(id.clone(), Instance { pid, group: false, exit, kill });
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

    async fn update_container_resources(
        &self,
        _pod: &Pod,
        id: &ContainerId,
        container: &Container,
    ) -> Result<(), ProviderError> {
        let running = self.instance(id).is_some_and(|(_, exit)| exit.borrow().is_none());
        if !running {
            return Err(ProviderError::new(ProviderErrorKind::NotFound, format!("container {id} is not running")));
        }
        if let Some(message) = self.failing_updates.lock().expect("lock").clone() {
            return Err(ProviderError::new(ProviderErrorKind::Other, message));
        }
        let resources = container.resources.clone().unwrap_or_default();
        self.updates.lock().expect("lock").push((id.clone(), resources));
        Ok(())
    }

    async fn stop_container(&self, id: &ContainerId, grace: Duration) -> Result<(), ProviderError> {
        let Some((pid, mut exit)) = self.instance(id) else { return Ok(()) };
        if exit.borrow().is_some() {
            return Ok(());
        }
        if let Some(pid) = pid {
            // SIGTERM first, through kill(1): the test support stays free of
            // unsafe code.
            let _ = tokio::process::Command::new("kill").args(["-TERM", "--", &pid]).status().await;
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
        let Some(detached) = &self.detached else { return Ok(Vec::new()) };
        let mut running = Vec::new();
        for pod in std::fs::read_dir(&detached.state_dir).into_iter().flatten().flatten() {
            for container in std::fs::read_dir(pod.path()).into_iter().flatten().flatten() {
                let dir = container.path();
                let Ok(meta) = std::fs::read(dir.join("meta.json")) else { continue };
                let Ok(meta) = serde_json::from_slice::<Meta>(&meta) else { continue };
                // Running while its shim holds the lock.
                let held = std::fs::OpenOptions::new()
                    .write(true)
                    .open(dir.join("lock"))
                    .is_ok_and(|f| matches!(f.try_lock(), Err(std::fs::TryLockError::WouldBlock)));
                if !held {
                    continue;
                }
                let id = ContainerId(format!("shim:{}", dir.display()));
                self.watch_detached(id.clone(), dir, meta.group);
                running.push(RunningContainer {
                    id,
                    pod_uid: meta.pod_uid,
                    container_name: meta.container_name,
                    restart_count: meta.restart_count,
                    started_at: meta.started_at,
                });
            }
        }
        Ok(running)
    }

    async fn remove_pod(&self, pod_uid: &str) -> Result<(), ProviderError> {
        if let Some(detached) = &self.detached {
            match std::fs::remove_dir_all(detached.state_dir.join(pod_uid)) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(ProviderError::new(ProviderErrorKind::Other, e.to_string()));
                }
                _ => {}
            }
        }
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
