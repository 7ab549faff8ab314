//! `rustlet --standalone` or `rustlet --kubeconfig FILE`: the flags become
//! a [`NodeConfig`] (and [`ClusterSettings`]), the library runs the node
//! until a signal.

use std::net::{IpAddr, SocketAddr};

use anyhow::bail;
use kubelet::cluster::certificates::BootstrapSettings;
use kubelet::cluster::{ApiSource, ClusterSettings};
use kubelet::health::HealthReporter;
use kubelet::node::{Node, NodeBuilder, NodeConfig};
use tokio_util::sync::CancellationToken;

use kubelet::server::{AuthSettings, AuthorizationMode, KubeletApiConfig, ServingCertSource};

use crate::cli::{AuthorizationModeArg, CgroupDriverArg, NodeArgs};
use kubelet::cgroups::{CgroupDriver, CgroupFs, PodCgroups, QosCgroupSettings};
use kubelet::eviction::Signal;
use kubelet::eviction::manager::EvictionSettings;
use kubelet::node::{Reservation, Reserved};
use std::sync::Arc;

/// The node's configuration from the command line.
pub(crate) fn config(args: &NodeArgs) -> NodeConfig {
    let node_name = args.node_name.clone().unwrap_or_else(host_name);
    let mut config = NodeConfig::new(&args.root_dir, node_name);
    config.http_address = Some(SocketAddr::new(args.healthz_bind_address, args.healthz_port));
    config.plugins.dial_timeout = args.plugin_dial_timeout;
    config.plugins.get_info_timeout = args.plugin_get_info_timeout;
    config.plugins.notify_timeout = args.plugin_notify_timeout;
    config.plugins.resync_period = args.plugin_resync_period;
    config.pods.manifest_dir = args.pod_manifest_path.clone();
    config.pods.max_pods = args.max_pods;
    config.pods.cluster_domain = args.cluster_domain.clone();
    config.pods.allowed_unsafe_sysctls = args.allowed_unsafe_sysctls.clone();
    if !args.cdi_spec_dir.is_empty() {
        config.pods.cdi_spec_dirs = args.cdi_spec_dir.clone();
    }
    config.max_streaming_sessions = args.max_streaming_sessions;
    let trust = kubelet::plugin_trust::PluginTrust::new(args.plugin_allowed_uids.iter().copied());
    config.plugins.trust = trust.clone();
    config.devices.trust = trust;
    config.node_ips = args.node_ip.clone();
    if config.node_ips.is_empty() && args.kubeconfig.is_some() {
        config.node_ips = detect_node_ip().into_iter().collect();
    }
    config.kubelet_api = Some(kubelet_api(args));
    config.configz = configz(args);
    config
}

/// What is held back from pods: `--system-reserved`, `--kube-reserved`,
/// and the hard eviction thresholds of memory and nodefs.
pub(crate) fn reservation(args: &NodeArgs) -> anyhow::Result<Reservation> {
    let map = |pairs: &[(String, String)]| pairs.iter().cloned().collect::<std::collections::BTreeMap<_, _>>();
    let system = Reserved::parse(&map(&args.system_reserved)).map_err(|e| anyhow::anyhow!("--system-reserved: {e}"))?;
    let kube = Reserved::parse(&map(&args.kube_reserved)).map_err(|e| anyhow::anyhow!("--kube-reserved: {e}"))?;
    let thresholds = thresholds(args)?;
    let hard = |signal| thresholds.hard(signal).map(|t: &kubelet::eviction::Threshold| t.value);
    Ok(Reservation {
        system,
        kube,
        eviction_memory: hard(Signal::MemoryAvailable),
        eviction_nodefs: hard(Signal::NodefsAvailable),
    })
}

/// The eviction thresholds from `--eviction-hard`, `--eviction-soft`,
/// `--eviction-soft-grace-period` and `--eviction-minimum-reclaim`.
fn thresholds(args: &NodeArgs) -> anyhow::Result<kubelet::eviction::Thresholds> {
    use kubelet::eviction::parse_flag;
    let flag = |name: &str, text: Option<&str>| {
        text.map(parse_flag).transpose().map_err(|e| anyhow::anyhow!("--eviction-{name}: {e}"))
    };
    let hard = flag("hard", args.eviction_hard.as_deref())?;
    let soft = flag("soft", args.eviction_soft.as_deref())?.unwrap_or_default();
    let mut grace = std::collections::BTreeMap::new();
    for (signal, text) in &args.eviction_soft_grace_period {
        let period = crate::cli::parse_duration(text)
            .map_err(|e| anyhow::anyhow!("--eviction-soft-grace-period: {signal}: {e}"))?;
        grace.insert(signal.clone(), period);
    }
    let reclaim: std::collections::BTreeMap<String, String> = args.eviction_minimum_reclaim.iter().cloned().collect();
    // Each flag checked alone first, so that an error names it.
    for (name, map) in [("hard", hard.as_ref()), ("soft", Some(&soft))] {
        if let Some(map) = map {
            kubelet::eviction::parse_map(map).map_err(|e| anyhow::anyhow!("--eviction-{name}: {e}"))?;
        }
    }
    kubelet::eviction::Thresholds::new(hard.as_ref(), &soft, &grace, &reclaim)
        .map_err(|e| anyhow::anyhow!("eviction thresholds: {e}"))
}

/// The eviction manager's settings (upstream's period: 10 s), its
/// allocatable memory signal on `kubepods` when pods have their cgroups.
fn eviction(args: &NodeArgs, pod_cgroups: Option<&PodCgroups>) -> anyhow::Result<EvictionSettings> {
    let mut settings = EvictionSettings::new(&args.root_dir);
    settings.thresholds = thresholds(args)?;
    settings.pressure_transition_period = args.eviction_pressure_transition_period;
    settings.max_pod_grace_period = std::time::Duration::from_secs(u64::from(args.eviction_max_pod_grace_period));
    settings.kubepods =
        pod_cgroups.filter(|c| c.settings().driver == CgroupDriver::Cgroupfs).map(|c| (c.fs().clone(), c.kubepods()));
    Ok(settings)
}

/// The feature gates Rustlet reads.
const READ_GATES: &[&str] = &["NodeLogQuery"];

/// `/logs/`: the handler and the query, the query only with the
/// `NodeLogQuery` gate (upstream's check and words).
fn system_logs(args: &NodeArgs) -> anyhow::Result<kubelet::server::SystemLogSettings> {
    let gate = |name: &str| args.feature_gates.iter().rev().find(|(n, _)| n == name).is_some_and(|(_, on)| *on);
    let others: Vec<&str> =
        args.feature_gates.iter().map(|(n, _)| n.as_str()).filter(|n| !READ_GATES.contains(n)).collect();
    if !others.is_empty() {
        tracing::info!(gates = ?others, "--feature-gates: Rustlet does not read these gates (its behaviour is fixed)");
    }
    if args.enable_system_log_query && !gate("NodeLogQuery") {
        bail!("invalid configuration: NodeLogQuery feature gate is required for enableSystemLogHandler");
    }
    Ok(kubelet::server::SystemLogSettings {
        handler: args.enable_system_log_handler,
        query: args.enable_system_log_query,
        ..Default::default()
    })
}

/// Garbage collection: upstream's periods, the image thresholds and ages
/// of the command line, the pause image pinned.
fn gc_settings(args: &NodeArgs) -> anyhow::Result<kubelet::gc::GcSettings> {
    if args.image_gc_low_threshold >= args.image_gc_high_threshold && args.image_gc_high_threshold < 100 {
        bail!(
            "--image-gc-low-threshold ({}) must be below --image-gc-high-threshold ({})",
            args.image_gc_low_threshold,
            args.image_gc_high_threshold
        );
    }
    Ok(kubelet::gc::GcSettings {
        keep_per_container: args.maximum_dead_containers_per_container,
        images: kubelet::provider::ImageGcPolicy {
            high_threshold_percent: args.image_gc_high_threshold,
            low_threshold_percent: args.image_gc_low_threshold,
            min_age: args.minimum_image_ttl_duration,
            pinned: args.pod_infra_container_image.iter().cloned().collect(),
        },
        ..Default::default()
    })
}

/// The pods' cgroup hierarchy, when container pods get one
/// (`--cgroups-per-qos`), its `kubepods` group limited to node allocatable
/// when `--enforce-node-allocatable` says `pods`.
fn pod_cgroups(args: &NodeArgs, reservation: &Reservation) -> anyhow::Result<Option<Arc<PodCgroups>>> {
    let enforce = &args.enforce_node_allocatable;
    for value in enforce {
        match value.as_str() {
            "pods" | "none" => {}
            "system-reserved" | "kube-reserved" => tracing::warn!(
                value = %value,
                "--enforce-node-allocatable: Rustlet enforces allocatable on pods only; the reserved groups are left as they are"
            ),
            other => bail!(
                "--enforce-node-allocatable: unknown value {other:?} (pods, system-reserved, kube-reserved or none)"
            ),
        }
    }
    if enforce.iter().any(|v| v == "none") && enforce.len() > 1 {
        bail!("--enforce-node-allocatable: none must be the only value");
    }
    if !args.cgroups_per_qos {
        if enforce.iter().any(|v| v != "none") {
            tracing::info!("--cgroups-per-qos=false: node allocatable is not enforced on a kubepods group");
        }
        return Ok(None);
    }
    let Some(fs) = CgroupFs::detect() else {
        bail!(
            "no cgroup file system at /sys/fs/cgroup: container pods cannot get their cgroups (--cgroups-per-qos=false runs them without)"
        );
    };
    let capacity = kubelet::node::measure(args.max_pods);
    let settings = QosCgroupSettings {
        root: if args.cgroup_root.is_empty() { "/".into() } else { args.cgroup_root.clone() },
        driver: match args.cgroup_driver {
            CgroupDriverArg::Cgroupfs => CgroupDriver::Cgroupfs,
            CgroupDriverArg::Systemd => CgroupDriver::Systemd,
        },
        kubepods: if enforce.iter().any(|v| v == "pods") { reservation.kubepods(capacity) } else { Default::default() },
        pod_pids_limit: u64::try_from(args.pod_max_pids).ok().filter(|p| *p > 0),
        cfs_quota: args.cpu_cfs_quota,
    };
    let cgroups = PodCgroups::start(fs, settings).map_err(|e| {
        anyhow::anyhow!(
            "cannot make the pods' cgroups: {e} (the node needs root; --cgroups-per-qos=false runs pods without)"
        )
    })?;
    Ok(Some(Arc::new(cgroups)))
}

/// The kubelet API's settings from the command line. Cluster mode
/// defaults to the token webhook and Webhook authorization (upstream's
/// configuration-file defaults); a standalone node to AlwaysAllow.
fn kubelet_api(args: &NodeArgs) -> KubeletApiConfig {
    let cluster = args.kubeconfig.is_some();
    let mut api = KubeletApiConfig::new(&args.root_dir);
    api.address = SocketAddr::new(args.address, args.port);
    api.cert_dir = cert_dir(args);
    if let (Some(cert), Some(key)) = (&args.tls_cert_file, &args.tls_private_key_file) {
        api.serving = ServingCertSource::Files { cert: cert.clone(), key: key.clone() };
    } else if args.rotate_server_certificates {
        api.serving = ServingCertSource::Requested;
    }
    api.client_ca = args.client_ca_file.clone();
    api.host_names = vec![host_name()];
    api.auth = AuthSettings {
        anonymous: args.anonymous_auth,
        token_webhook: args.authentication_token_webhook.unwrap_or(cluster),
        token_cache_ttl: args.authentication_token_webhook_cache_ttl,
        authorization: match args.authorization_mode {
            Some(AuthorizationModeArg::AlwaysAllow) => AuthorizationMode::AlwaysAllow,
            Some(AuthorizationModeArg::Webhook) => AuthorizationMode::Webhook,
            None if cluster => AuthorizationMode::Webhook,
            None => AuthorizationMode::AlwaysAllow,
        },
        authorized_ttl: args.authorization_webhook_cache_authorized_ttl,
        unauthorized_ttl: args.authorization_webhook_cache_unauthorized_ttl,
    };
    api
}

/// Where the node keeps its keys and certificates (`--cert-dir`, default
/// `<root-dir>/pki` as the kubelet's).
fn cert_dir(args: &NodeArgs) -> std::path::PathBuf {
    args.cert_dir.clone().unwrap_or_else(|| args.root_dir.join("pki"))
}

/// The flags `/configz` shows, in `KubeletConfiguration`'s names.
fn configz(args: &NodeArgs) -> serde_json::Map<String, serde_json::Value> {
    let mut map = serde_json::Map::new();
    map.insert("clusterDNS".into(), args.cluster_dns.iter().map(ToString::to_string).collect());
    map.insert("clusterDomain".into(), args.cluster_domain.clone().into());
    map.insert("resolvConf".into(), args.resolv_conf.clone().into());
    map.insert("kubeAPIQPS".into(), args.kube_api_qps.into());
    map.insert("kubeAPIBurst".into(), args.kube_api_burst.into());
    map.insert("runtimeRequestTimeout".into(), "2m0s".into());
    map.insert("rotateCertificates".into(), args.rotate_certificates.into());
    map.insert("enableSystemLogHandler".into(), args.enable_system_log_handler.into());
    map.insert("enableSystemLogQuery".into(), args.enable_system_log_query.into());
    let gates: serde_json::Map<String, serde_json::Value> =
        args.feature_gates.iter().map(|(name, on)| (name.clone(), (*on).into())).collect();
    if !gates.is_empty() {
        map.insert("featureGates".into(), gates.into());
    }
    if let Some(endpoint) = &args.container_runtime_endpoint {
        map.insert("containerRuntimeEndpoint".into(), endpoint.clone().into());
    }
    map
}

/// Cluster mode's settings from the command line, if it is asked for.
pub(crate) fn cluster(args: &NodeArgs) -> Option<ClusterSettings> {
    let path = args.kubeconfig.clone()?;
    let source = if args.bootstrap_kubeconfig.is_some() || args.rotate_certificates {
        ApiSource::Bootstrap(BootstrapSettings {
            kubeconfig: path,
            bootstrap_kubeconfig: args.bootstrap_kubeconfig.clone(),
            cert_dir: cert_dir(args),
            rotate: args.rotate_certificates,
        })
    } else {
        ApiSource::Kubeconfig(path)
    };
    let mut settings = ClusterSettings::new(source);
    settings.node_labels = args.node_labels.iter().cloned().collect();
    settings.taints = args.register_with_taints.clone();
    // The client counts every request against the limit; the status
    // writer needs no second bucket of its own.
    settings.api_qps = args.kube_api_qps;
    settings.api_burst = args.kube_api_burst;
    settings.pod_sync.api_qps = 0.0;
    Some(settings)
}

/// The node's IP when `--node-ip` is not given, as the kubelet finds it:
/// the host name's address if it is not a loopback one, else the address
/// the default route leaves from (a UDP "connect" sends nothing).
fn detect_node_ip() -> Option<IpAddr> {
    use std::net::ToSocketAddrs as _;
    let by_name = (host_name().as_str(), 0)
        .to_socket_addrs()
        .ok()
        .into_iter()
        .flatten()
        .map(|a| a.ip())
        .find(|ip| !ip.is_loopback() && !ip.is_unspecified());
    by_name.or_else(|| {
        let socket = std::net::UdpSocket::bind("0.0.0.0:0").ok()?;
        socket.connect("192.0.2.1:9").ok()?;
        socket.local_addr().ok().map(|a| a.ip()).filter(|ip| !ip.is_unspecified())
    })
}

/// Starts the node described by `args`.
pub(crate) async fn start(
    args: &NodeArgs,
    signals: &HealthReporter,
    shutdown: CancellationToken,
) -> anyhow::Result<Node> {
    if !args.standalone && args.kubeconfig.is_none() {
        bail!("say how the node runs: --standalone (no API server) or --kubeconfig FILE (join a cluster)");
    }
    // Every setting checked before anything is made (cgroups, sockets).
    let reservation = reservation(args)?;
    let gc = gc_settings(args)?;
    let system_logs = system_logs(args)?;
    if let Some(image) = &args.pod_infra_container_image {
        tracing::info!(
            %image,
            "--pod-infra-container-image: kept from image garbage collection; the container runtime's own \
             setting (containerd's sandbox_image) picks the sandbox image"
        );
    }
    let labels: std::collections::BTreeMap<String, String> = args.node_labels.iter().cloned().collect();
    kubelet::node::labels::check_node_labels(&labels).map_err(|e| anyhow::anyhow!("invalid --node-labels: {e}"))?;
    // Many plugins mean many sockets; the default soft limit (often 1024) is too low.
    if let Err(error) = rlimit::increase_nofile_limit(u64::MAX) {
        tracing::warn!(%error, "cannot raise the open-file limit");
    }
    let wasm: std::sync::Arc<dyn kubelet::provider::Provider> = std::sync::Arc::new(
        rustlet_wasi::WasiProvider::new(rustlet_wasi::WasiConfig {
            default_memory_limit: args.wasm_default_memory_limit,
            ..rustlet_wasi::WasiConfig::new(&args.root_dir)
        })
        .map_err(|e| anyhow::anyhow!("the WebAssembly provider cannot start: {e}"))?,
    );
    let runtime_health = kubelet::health::HealthReporter::new();
    let mut cri_provider = None;
    let mut node_cgroups = None;
    let mut class_handlers = None;
    let provider = match &args.container_runtime_endpoint {
        None => wasm,
        Some(endpoint) => {
            let mut cri_config = rustlet_cri::CriConfig::new(endpoint.clone());
            cri_config.dns = rustlet_cri::dns::DnsSettings {
                cluster_dns: args.cluster_dns.iter().map(ToString::to_string).collect(),
                cluster_domain: args.cluster_domain.clone(),
                resolv_conf: (!args.resolv_conf.is_empty()).then(|| args.resolv_conf.clone().into()),
            };
            // The same registry credentials as the WebAssembly provider's.
            cri_config.docker_config = Some(args.root_dir.join("config.json"));
            cri_config.pod_cgroups = pod_cgroups(args, &reservation)?;
            node_cgroups = cri_config.pod_cgroups.clone();
            let cri = rustlet_cri::CriProvider::new(cri_config);
            cri_provider = Some(cri.clone());
            match cri.version().await {
                Ok((name, version)) => tracing::info!(%endpoint, runtime = %name, %version, "container runtime"),
                Err(error) => tracing::warn!(%endpoint, %error, "the container runtime does not answer yet"),
            }
            let classes =
                kubelet::runtime_class::RuntimeClasses::new(DEFAULT_RUNTIME_HANDLER, std::sync::Arc::new(cri))
                    .with_handler(WASM_RUNTIME_HANDLER, wasm);
            class_handlers = Some(classes.class_handlers());
            std::sync::Arc::new(classes)
        }
    };
    let mut node_config = config(args);
    node_config.pods.reservation = reservation;
    node_config.pods.eviction = Some(eviction(args, node_cgroups.as_deref())?);
    node_config.pods.gc = Some(gc);
    if let Some(api) = node_config.kubelet_api.as_mut() {
        api.system_logs = system_logs;
    }
    node_config.pods.volume_stats_period = args.volume_stats_agg_period;
    if let Some(eviction) = node_config.pods.eviction.as_mut()
        && let Some(gc) = &node_config.pods.gc
    {
        eviction.image_gc = gc.images.clone();
    }
    let rotation = kubelet::log_rotation::LogRotation {
        max_size: args.container_log_max_size,
        max_files: args.container_log_max_files as usize,
        ..Default::default()
    };
    rotation.validate().map_err(|e| anyhow::anyhow!("--container-log-max-files: {e}"))?;
    node_config.pods.log_rotation = Some(rotation);
    let mut builder = NodeBuilder::new(node_config).provider(provider).health_check("signal-handler", signals);
    if let Some(cri) = &cri_provider {
        builder = builder.health_check("container-runtime", &runtime_health);
        cri.watch_health(runtime_health.clone(), args.runtime_status_period, shutdown.clone());
    }
    if let Some(mut settings) = cluster(args) {
        // With two runtimes, pods pick one by their RuntimeClass's handler.
        settings.runtime_classes = class_handlers;
        builder = builder.cluster(settings);
    }
    let node = builder.start(shutdown).await?;
    Ok(node)
}

/// The handler of the container runtime's own default (containerd's runc).
const DEFAULT_RUNTIME_HANDLER: &str = "runc";

/// The RuntimeClass handler of WebAssembly pods beside a container runtime.
const WASM_RUNTIME_HANDLER: &str = "wasmtime";

/// `rustlet --standalone`: runs until a signal.
pub(crate) async fn run(args: NodeArgs, signals: HealthReporter, shutdown: CancellationToken) -> anyhow::Result<()> {
    let node = start(&args, &signals, shutdown.clone()).await?;
    shutdown.cancelled().await;
    node.stopped().await;
    Ok(())
}

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_owned())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "rustlet".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(flags: &[&str]) -> NodeArgs {
        let all = ["rustlet", "--standalone"].iter().chain(flags);
        <crate::cli::Cli as clap::Parser>::try_parse_from(all).expect("flags").node
    }

    /// The log query needs its gate, in upstream's words; the handler is on
    /// by default and can be switched off.
    #[test]
    fn the_log_query_needs_the_node_log_query_gate() {
        let refused = system_logs(&args(&["--enable-system-log-query"])).expect_err("no gate");
        assert_eq!(
            refused.to_string(),
            "invalid configuration: NodeLogQuery feature gate is required for enableSystemLogHandler"
        );
        let off = system_logs(&args(&["--enable-system-log-query", "--feature-gates=NodeLogQuery=false"]));
        assert!(off.is_err());
        let on =
            system_logs(&args(&["--enable-system-log-query", "--feature-gates=NodeLogQuery=true"])).expect("gated");
        assert!(on.handler && on.query);
        assert_eq!(on.dir, std::path::Path::new("/var/log"));
        let defaults = system_logs(&args(&[])).expect("defaults");
        assert!(defaults.handler && !defaults.query);
        assert!(!system_logs(&args(&["--enable-system-log-handler=false"])).expect("off").handler);
    }
}
