//! Test support for Rustlet: the sample plugins as processes, test-only
//! clients, and the cross-crate integration tests.
//!
//! - The sample plugins (`registration`, `csi_driver`, `device_plugin`,
//!   `report`) are product code in `rustlet-sample-plugins`, re-exported
//!   here; this package builds them into binaries with misbehaviours the
//!   tests need (`fake-registration-plugin`, `fake-csi-driver`,
//!   `fake-device-plugin`, `device-allocator`).
//! - [`raw_h2`]: a bare HTTP/2 gRPC client that sends any `:authority`, to
//!   play an old grpc-go client.
//! - [`host_provider`]: a pod provider running containers as host
//!   processes.
//! - [`process`]: spawning the plugin binaries and reading their reports.
//! - [`control_plane`]: a real etcd + kube-apiserver (and, on demand,
//!   kube-scheduler and kube-controller-manager) for cluster tests.
//! - [`test_api`]: one cluster test body run against both API servers.
//! - [`https`]: one request to a node's kubelet API (HTTPS), with a bearer
//!   token, a client certificate, or nothing.
//! - [`registry`]: a real OCI registry (`docker-registry`) on loopback,
//!   installed on first use, and pushes of wasm images to it.
//! - [`skip`]: the one skip policy: a test that cannot have what it needs
//!   says so in one line, and fails where its `RUSTLET_REQUIRE_*` is `1`.
//! - [`other_user`]: running a binary as another user from any checkout.
//! - [`node_root`]: temp root dirs for nodes, under a shared mount that
//!   goes when the test binary exits.

pub use rustlet_sample_plugins::{csi_driver, device_plugin, dra_driver, registration, report};

pub mod apiserver;
pub mod cgroups;
pub mod containerd;
pub mod control_plane;
pub mod debian;
pub mod dra_test_driver;
pub mod host_provider;
pub mod https;
pub mod node_process;
pub mod node_root;
pub mod other_user;
pub mod pod_deletion;
pub mod pod_state;
pub mod process;
pub mod prometheus;
pub mod raw_h2;
pub mod registry;
pub mod skip;
pub mod test_api;

/// Waits until the file at `path` exists and its content satisfies `pred`
/// (checked on every inotify event of its directory), within `within`.
pub async fn wait_file(
    path: &std::path::Path,
    mut pred: impl FnMut(&str) -> bool,
    within: std::time::Duration,
) -> String {
    use tokio_stream::StreamExt;
    let dir = path.parent().expect("a file in a directory");
    std::fs::create_dir_all(dir).expect("the file's directory");
    let inotify = inotify::Inotify::init().expect("inotify");
    // MODIFY too: a writer that keeps the file open (a container runtime
    // appending to a log) closes nothing.
    let mask = inotify::WatchMask::CLOSE_WRITE
        | inotify::WatchMask::MOVED_TO
        | inotify::WatchMask::CREATE
        | inotify::WatchMask::MODIFY;
    inotify.watches().add(dir, mask).expect("watch");
    let mut events = inotify.into_event_stream(vec![0u8; 4096]).expect("stream");
    let wait = async {
        loop {
            if let Ok(text) = std::fs::read_to_string(path)
                && pred(&text)
            {
                return text;
            }
            events.next().await.expect("inotify alive").expect("inotify event");
        }
    };
    match tokio::time::timeout(within, wait).await {
        Ok(text) => text,
        Err(_) => panic!("{} not as expected within {within:?}: {:?}", path.display(), std::fs::read_to_string(path)),
    }
}
