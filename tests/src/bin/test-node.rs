//! A standalone node with the detached host-process provider, for the tests
//! that kill the node (`kill -9`) and start it again: its containers run
//! under `container-shim` and outlive it.
//!
//!   test-node --root DIR [--kubeconfig FILE --node-name NAME]
//!
//! With a kubeconfig the node joins that cluster (cluster mode) as NAME.
//! Static pods come from `DIR/manifests`. Prints `listening` (a JSON report)
//! once the node serves and the device checkpoint is on disk, then a
//! `pod_status` report whenever a pod's status changes.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kubelet::cluster::{ApiSource, ClusterSettings};
use kubelet::node::{NodeBuilder, NodeConfig};
use kubelet::pod::{Allocatable, BackoffConfig};
use rustlet_testkit::host_provider::HostProcessProvider;
use rustlet_testkit::report::{Report, Reporter};
use tokio_util::sync::CancellationToken;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let usage = "usage: test-node --root DIR [--kubeconfig FILE --node-name NAME]";
    let (mut root, mut kubeconfig, mut node_name) = (None, None, "Node-1".to_owned());
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().ok_or(usage)?;
        match flag.as_str() {
            "--root" => root = Some(PathBuf::from(value)),
            "--kubeconfig" => kubeconfig = Some(PathBuf::from(value)),
            "--node-name" => node_name = value,
            _ => return Err(usage.into()),
        }
    }
    let root = root.ok_or(usage)?;
    let shim = std::env::current_exe()?.with_file_name("container-shim");
    let mut config = NodeConfig::new(&root, node_name);
    config.http_address = Some(([127, 0, 0, 1], 0).into());
    config.plugins.initial_backoff = Duration::from_millis(100);
    config.plugins.max_backoff = Duration::from_millis(1600);
    config.plugins.get_info_timeout = Duration::from_secs(10);
    config.plugins.notify_timeout = Duration::from_secs(10);
    config.csi.node_get_info_timeout = Duration::from_secs(10);
    config.devices.call_timeout = Duration::from_secs(10);
    config.pods.manifest_dir = Some(root.join("manifests"));
    config.pods.allocatable = Some(Allocatable { cpu_milli: 4000, memory: 8 << 30, pods: 110 });
    config.pods.restart_backoff = BackoffConfig {
        initial: Duration::from_millis(50),
        max: Duration::from_millis(400),
        reset_after: Duration::from_secs(600),
    };
    let provider = HostProcessProvider::detached(shim, root.join("host-provider"));
    let shutdown = CancellationToken::new();
    let mut builder = NodeBuilder::new(config).provider(Arc::new(provider));
    if let Some(kubeconfig) = kubeconfig {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let mut settings = ClusterSettings::new(ApiSource::Kubeconfig(kubeconfig));
        settings.pod_sync.retry_initial = Duration::from_millis(50);
        settings.pod_sync.retry_max = Duration::from_millis(500);
        builder = builder.cluster(settings);
    }
    let node = builder.start(shutdown.clone()).await?;
    node.devices().persisted().await?;
    let reporter = Reporter::Stdout;
    reporter.report(Report::Listening { sockets: 0 });
    let store = node.pods().store().clone();
    let mut changes = store.changes();
    let mut last = std::collections::BTreeMap::new();
    loop {
        for pod in store.list() {
            let status = pod.status.clone().unwrap_or_default();
            let statuses = status.container_statuses.clone().unwrap_or_default();
            let report = Report::PodStatus {
                name: pod.metadata.name.clone().unwrap_or_default(),
                uid: pod.metadata.uid.clone().unwrap_or_default(),
                phase: status.phase.clone().unwrap_or_default(),
                running: statuses
                    .iter()
                    .filter(|c| c.state.as_ref().is_some_and(|s| s.running.is_some()))
                    .map(|c| c.name.clone())
                    .collect(),
                restarts: statuses.iter().map(|c| c.restart_count).sum(),
                message: status.message.clone().unwrap_or_default(),
            };
            let uid = pod.metadata.uid.clone().unwrap_or_default();
            if last.get(&uid) != Some(&report) {
                reporter.report(report.clone());
                last.insert(uid, report);
            }
        }
        tokio::select! {
            changed = changes.changed() => if changed.is_err() { break },
            _ = tokio::signal::ctrl_c() => break,
        }
    }
    shutdown.cancel();
    node.stopped().await;
    Ok(())
}
