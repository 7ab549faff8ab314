//! The example provider (`examples/host_process_provider.rs`, a provider in
//! about a hundred lines) embedded in a node, as docs/providers.md walks
//! through it: a static pod's container runs as a host process with its
//! env, writes its output to its log, reaches Running, and stops when its
//! manifest goes.

#[allow(dead_code)]
#[path = "../examples/host_process_provider.rs"]
mod example;

use std::sync::Arc;
use std::time::Duration;

use kubelet::node::{NodeBuilder, NodeConfig};
use tokio_util::sync::CancellationToken;

const SOON: Duration = Duration::from_secs(60);

/// The node makes its root dir a shared mount (a bind on itself, as root)
/// and leaves it, as the kubelet does; the test's goes with the test.
struct UnmountAtEnd(std::path::PathBuf);

impl Drop for UnmountAtEnd {
    fn drop(&mut self) {
        if kubelet::volume::mounts::is_mount_point(&self.0) {
            let _ = rustix::mount::unmount(&self.0, rustix::mount::UnmountFlags::DETACH);
        }
    }
}

#[tokio::test]
async fn the_example_provider_runs_a_pod_as_a_host_process() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (root, manifests) = (dir.path().join("root"), dir.path().join("manifests"));
    let _unmount = UnmountAtEnd(root.clone());
    std::fs::create_dir_all(&manifests).expect("mkdir");
    let out = dir.path().join("out");
    // The container's process (the shell execs `sleep`, which keeps its pid;
    // `$$$$` is `$$` once Kubernetes has expanded the args).
    let pid_file = dir.path().join("pid");
    std::fs::write(
        manifests.join("hello.yaml"),
        format!(
            "apiVersion: v1\nkind: Pod\nmetadata: {{name: hello}}\nspec:\n  terminationGracePeriodSeconds: 5\n  \
             containers:\n  - name: main\n    image: host\n    command: [sh, -c]\n    \
             args: ['echo hello $GREETING; echo $$$$ > {}; echo $GREETING > {}; exec sleep 600']\n    \
             env: [{{name: GREETING, value: world}}]\n",
            pid_file.display(),
            out.display()
        ),
    )
    .expect("manifest");
    let mut config = NodeConfig::new(&root, "example-node");
    config.http_address = None;
    config.pods.manifest_dir = Some(manifests.clone());
    let shutdown = CancellationToken::new();
    let _stop = shutdown.clone().drop_guard();
    let node = NodeBuilder::new(config)
        .provider(Arc::new(example::HostProcesses::default()))
        .start(shutdown.clone())
        .await
        .expect("node");
    let store = node.pods().store().clone();
    let running = store
        .wait_for(SOON, |pods| {
            pods.values().any(|p| {
                p.status
                    .as_ref()
                    .and_then(|s| s.container_statuses.as_ref())
                    .and_then(|s| s.first())
                    .is_some_and(|c| c.state.as_ref().is_some_and(|s| s.running.is_some()))
            })
        })
        .await;
    assert!(running.is_some(), "the pod did not reach Running: {:?}", store.list());
    // What the container wrote: its file, and its log in the CRI format.
    let deadline = tokio::time::Instant::now() + SOON;
    while std::fs::read_to_string(&out).unwrap_or_default() != "world\n" {
        assert!(tokio::time::Instant::now() < deadline, "the container wrote nothing");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let pod = store.list().into_iter().next().expect("the pod");
    let uid = pod.metadata.uid.clone().expect("uid");
    let log = root.join(format!("logs/pods/default_hello-example-node_{uid}/main/0.log"));
    let deadline = tokio::time::Instant::now() + SOON;
    loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if kubelet::provider::decode_cri_log(&text) == ["hello world\n"] {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "log {}: {text:?}", log.display());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let pid: u32 = std::fs::read_to_string(&pid_file).expect("pid file").trim().parse().expect("a pid");
    let proc_dir = std::path::PathBuf::from(format!("/proc/{pid}"));
    assert!(proc_dir.exists(), "the container's process {pid} runs");
    // The manifest goes: the process is stopped (SIGTERM ends `sleep`) and
    // the pod is gone.
    std::fs::remove_file(manifests.join("hello.yaml")).expect("rm");
    let gone = store.wait_for(SOON, |pods| pods.is_empty()).await;
    assert!(gone.is_some(), "the pod is still there: {:?}", store.list());
    // The provider returned from stop_container, so the process has ended
    // and been reaped by now; the deadline only bounds a slow reaper.
    let deadline = tokio::time::Instant::now() + SOON;
    while proc_dir.exists() {
        assert!(tokio::time::Instant::now() < deadline, "the container's process {pid} outlived its pod");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
