//! Command-line flags. Names follow the kubelet's where one exists.

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use k8s_openapi::api::core::v1::Taint;

/// Rustlet: a Kubernetes node agent in Rust.
#[derive(Parser)]
#[command(version = kubelet::VERSION, long_version = kubelet::cluster::LONG_VERSION, about, args_conflicts_with_subcommands = true)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Option<Command>,
    #[command(flatten)]
    pub(crate) node: NodeArgs,
    /// Log format on stderr: `text` for people, `json` (one object per line)
    /// for log collectors and tools.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text, env = "RUSTLET_LOG_FORMAT")]
    pub(crate) log_format: LogFormat,
}

/// How log lines are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line (timestamp, level, target, span, fields).
    Json,
}

#[derive(Subcommand)]
pub(crate) enum Command {
    /// Run a standalone node in a temporary root dir with demo plugins.
    Demo(DemoArgs),
    /// Show the running node's pods or the node itself (like kubectl get).
    Get(GetArgs),
    /// Print a container's log from the running node (like kubectl logs).
    Logs(LogsArgs),
    /// Manage the node's WebAssembly image store (like `ctr images`).
    #[command(subcommand)]
    Images(ImagesCommand),
}

/// `rustlet images ...`.
#[derive(Subcommand)]
pub(crate) enum ImagesCommand {
    /// Load an OCI image layout (a directory, or a tar of one) into the
    /// store, for nodes that cannot reach a registry.
    Import {
        /// The layout: a directory with `oci-layout` and `index.json`, or a
        /// tar (gzip or not) of one.
        source: PathBuf,
        /// Names images the layout gives only a tag (`registry/repository`).
        #[arg(long)]
        base_name: Option<String>,
        #[command(flatten)]
        node: NodeLocator,
    },
    /// List the images in the store.
    #[command(alias = "ls")]
    List {
        /// Print only image names.
        #[arg(short, long)]
        quiet: bool,
        #[command(flatten)]
        node: NodeLocator,
    },
    /// Remove images by name or id (prefix of at least 12 characters).
    #[command(alias = "remove")]
    Rm {
        /// Image names or ids.
        #[arg(required = true)]
        images: Vec<String>,
        #[command(flatten)]
        node: NodeLocator,
    },
}

/// How a command finds the running node.
#[derive(Args, Clone)]
pub(crate) struct NodeLocator {
    /// The node's root dir (the node is read through its local socket,
    /// `<root-dir>/rustlet.sock`).
    #[arg(long, env = "RUSTLET_ROOT_DIR", default_value = kubelet_api::constants::DEFAULT_ROOT_DIR)]
    pub(crate) root_dir: PathBuf,
}

/// What `rustlet get` shows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum Resource {
    /// The node's pods.
    #[value(alias = "pod", alias = "po")]
    Pods,
    /// The node.
    #[value(alias = "nodes", alias = "no")]
    Node,
}

/// Output formats of `rustlet get`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum Output {
    /// More columns.
    Wide,
    /// The objects as JSON (a `v1.PodList` or a `v1.Node`).
    Json,
}

/// Flags of `rustlet get`.
#[derive(Args)]
pub(crate) struct GetArgs {
    /// `pods` (`pod`, `po`) or `node` (`nodes`, `no`).
    pub(crate) resource: Resource,
    /// Only this pod.
    pub(crate) name: Option<String>,
    /// Output format: `wide` or `json`.
    #[arg(short, long)]
    pub(crate) output: Option<Output>,
    /// Only pods in this namespace.
    #[arg(short, long, default_value = "default")]
    pub(crate) namespace: String,
    /// Pods of every namespace (adds a NAMESPACE column).
    #[arg(short = 'A', long)]
    pub(crate) all_namespaces: bool,
    #[command(flatten)]
    pub(crate) node: NodeLocator,
}

/// Flags of `rustlet logs`.
#[derive(Args)]
pub(crate) struct LogsArgs {
    /// The pod's name.
    pub(crate) pod: String,
    /// The container (needed when the pod has several).
    #[arg(short, long)]
    pub(crate) container: Option<String>,
    /// The pod's namespace.
    #[arg(short, long, default_value = "default")]
    pub(crate) namespace: String,
    /// The log of the container's previous run.
    #[arg(short, long)]
    pub(crate) previous: bool,
    /// Only the last N lines.
    #[arg(long)]
    pub(crate) tail: Option<usize>,
    /// Keep printing lines as the container writes them, until it ends.
    #[arg(short, long)]
    pub(crate) follow: bool,
    #[command(flatten)]
    pub(crate) node: NodeLocator,
}

/// Flags of the node itself.
#[derive(Args, Clone)]
pub(crate) struct NodeArgs {
    /// Run without an API server.
    #[arg(long, conflicts_with = "kubeconfig")]
    pub(crate) standalone: bool,
    /// Join the cluster of this kubeconfig's current context as a node
    /// (use a node identity: `system:node:<name>` in `system:nodes`). A
    /// missing or unusable file is retried with backoff; the node's
    /// standalone parts run meanwhile.
    #[arg(long)]
    pub(crate) kubeconfig: Option<PathBuf>,
    /// Kubeconfig with a bootstrap identity (a bootstrap token, say): while
    /// `--kubeconfig` has no valid client certificate, the node asks the
    /// cluster for one (a CertificateSigningRequest) with it, and writes
    /// `--kubeconfig` to use the certificate it gets.
    #[arg(long, requires = "kubeconfig")]
    pub(crate) bootstrap_kubeconfig: Option<PathBuf>,
    /// Renew the client certificate at 70–90% of its lifetime with a new
    /// CertificateSigningRequest.
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub(crate) rotate_certificates: bool,
    /// Get the kubelet API's serving certificate from the cluster (signer
    /// kubernetes.io/kubelet-serving; someone must approve it) and renew
    /// it; until one is issued, the kubelet API refuses TLS handshakes.
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub(crate) rotate_server_certificates: bool,
    /// Labels for the Node, `key=value,...` (cluster mode).
    #[arg(long, value_delimiter = ',', value_parser = parse_label)]
    pub(crate) node_labels: Vec<(String, String)>,
    /// Taints the Node registers with, `key[=value]:Effect,...` with Effect
    /// one of NoSchedule, PreferNoSchedule, NoExecute (cluster mode).
    #[arg(long, value_delimiter = ',', value_parser = parse_taint)]
    pub(crate) register_with_taints: Vec<Taint>,
    /// API requests a second at most, on average: every request of the
    /// node's client counts (cluster mode; 0: no limit).
    #[arg(long, default_value_t = kubelet::cluster::rate_limit::DEFAULT_QPS)]
    pub(crate) kube_api_qps: f64,
    /// API requests at once at most before `--kube-api-qps` applies.
    #[arg(long, default_value_t = kubelet::cluster::rate_limit::DEFAULT_BURST)]
    pub(crate) kube_api_burst: u32,
    /// Run Linux containers through this CRI endpoint (e.g.
    /// `unix:///run/containerd/containerd.sock`): it becomes the node's
    /// default runtime, and pods of RuntimeClass handler `wasmtime` run on
    /// WebAssembly beside them. Without it the node runs WebAssembly only.
    #[arg(long, value_name = "ENDPOINT")]
    pub(crate) container_runtime_endpoint: Option<String>,
    /// How often the container runtime's status is read (`/healthz` check
    /// `container-runtime`, and the Node's Ready condition).
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    pub(crate) runtime_status_period: Duration,
    /// The cluster DNS service's IPs, comma-separated: the nameservers of
    /// container pods with dnsPolicy ClusterFirst.
    #[arg(long, value_delimiter = ',', num_args = 1)]
    pub(crate) cluster_dns: Vec<IpAddr>,
    /// The cluster's domain (e.g. `cluster.local`): container pods with
    /// dnsPolicy ClusterFirst search `<namespace>.svc.<domain>`,
    /// `svc.<domain>` and `<domain>`.
    #[arg(long, default_value = "")]
    pub(crate) cluster_domain: String,
    /// Sysctls pods may set beyond the safe ones (comma-separated names, or
    /// prefixes ending in `*`, as `kernel.msg*`); others reject the pod
    /// (`SysctlForbidden`).
    #[arg(long, value_delimiter = ',')]
    pub(crate) allowed_unsafe_sysctls: Vec<String>,
    /// Where CDI specs are read (comma-separated, later ones win), for
    /// runtimes that do not apply CDI devices themselves (containerd 1.6,
    /// WebAssembly): the node adds the env, device nodes and mounts of a
    /// claim's or device plugin's CDI devices. Default: /etc/cdi,/var/run/cdi.
    #[arg(long, value_delimiter = ',')]
    pub(crate) cdi_spec_dir: Vec<std::path::PathBuf>,
    /// User IDs besides root whose processes may serve plugin sockets in
    /// `plugins_registry/` and register device plugins on `kubelet.sock`
    /// (comma-separated). A socket must also be owned by its process's
    /// user and writable by no one else.
    #[arg(long, value_delimiter = ',')]
    pub(crate) plugin_allowed_uids: Vec<u32>,
    /// The memory limit of a WebAssembly container that sets none (its
    /// linear memories and tables together), in bytes or with a unit
    /// (`256Mi`).
    #[arg(long, default_value = "256Mi", value_parser = parse_bytes)]
    pub(crate) wasm_default_memory_limit: u64,
    /// Streaming sessions (log follows, exec, attach, port-forward) served
    /// at once at most; more are answered 429 Too Many Requests.
    #[arg(long, default_value_t = kubelet::node::DEFAULT_MAX_STREAMING_SESSIONS)]
    pub(crate) max_streaming_sessions: usize,
    /// The resolver configuration container pods with dnsPolicy Default
    /// get (and whose searches ClusterFirst adds); empty: none.
    #[arg(long, default_value = "/etc/resolv.conf")]
    pub(crate) resolv_conf: String,
    /// The node's IPs (one, or one per family), comma-separated: the Node's
    /// InternalIP addresses and the pods' hostIP/podIP. Default in cluster
    /// mode: the address of the host name, else of the default route.
    #[arg(long, value_delimiter = ',', num_args = 1)]
    pub(crate) node_ip: Vec<IpAddr>,
    /// Directory for the node's files; plugins register under
    /// `<root-dir>/plugins_registry`.
    #[arg(long, env = "RUSTLET_ROOT_DIR", default_value = kubelet_api::constants::DEFAULT_ROOT_DIR)]
    pub(crate) root_dir: PathBuf,
    /// Node name (default: the host name). `--hostname-override`, as
    /// kubeadm passes it, is the same flag.
    #[arg(long, alias = "hostname-override")]
    pub(crate) node_name: Option<String>,
    /// A `KubeletConfiguration` file (`kubelet.config.k8s.io/v1beta1`, YAML
    /// or JSON, as kubeadm writes `/var/lib/kubelet/config.yaml`): its
    /// fields set the flags of the same settings; flags given on the
    /// command line win. Fields Rustlet does not implement are listed in a
    /// warning at start.
    #[arg(long)]
    pub(crate) config: Option<PathBuf>,
    /// The pause image (kubeadm passes it). Accepted for kubeadm's command
    /// line: the container runtime's own setting (containerd's
    /// `sandbox_image`) picks the sandbox image.
    #[arg(long)]
    pub(crate) pod_infra_container_image: Option<String>,
    /// Address of the HTTP endpoint serving /healthz and /metrics (the
    /// node's other views are on the local socket `<root-dir>/rustlet.sock`).
    #[arg(long, default_value = "127.0.0.1")]
    pub(crate) healthz_bind_address: IpAddr,
    /// Port of the HTTP endpoint; 0 picks a free port (logged at start-up).
    #[arg(long, default_value_t = 10248)]
    pub(crate) healthz_port: u16,
    /// Address of the kubelet API (HTTPS: logs, exec, attach,
    /// port-forward, stats and metrics for the API server and
    /// metrics-server).
    #[arg(long, default_value = "0.0.0.0")]
    pub(crate) address: IpAddr,
    /// Port of the kubelet API, advertised in the Node's daemonEndpoints;
    /// 0 picks a free port.
    #[arg(long, default_value_t = kubelet_api::constants::KUBELET_PORT)]
    pub(crate) port: u16,
    /// The kubelet API's serving certificate (PEM, chain allowed); with
    /// `--tls-private-key-file`. Without them a self-signed one is made in
    /// `--cert-dir`.
    #[arg(long, requires = "tls_private_key_file")]
    pub(crate) tls_cert_file: Option<PathBuf>,
    /// The serving certificate's private key (PEM).
    #[arg(long, requires = "tls_cert_file")]
    pub(crate) tls_private_key_file: Option<PathBuf>,
    /// Where the node keeps the certificates it makes (default
    /// `<root-dir>/pki`).
    #[arg(long)]
    pub(crate) cert_dir: Option<PathBuf>,
    /// CA bundle that client certificates of kubelet API requests must
    /// chain to (their CN is the user, their O the groups).
    #[arg(long)]
    pub(crate) client_ca_file: Option<PathBuf>,
    /// Serve kubelet API requests that carry no credentials, as
    /// `system:anonymous` (then subject to authorization).
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub(crate) anonymous_auth: bool,
    /// Check bearer tokens on the kubelet API with a TokenReview (default:
    /// on in cluster mode).
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub(crate) authentication_token_webhook: Option<bool>,
    /// How long a TokenReview answer is reused.
    #[arg(long, default_value = "2m", value_parser = parse_duration)]
    pub(crate) authentication_token_webhook_cache_ttl: Duration,
    /// How kubelet API requests are authorized: `Webhook`
    /// (SubjectAccessReview; default in cluster mode) or `AlwaysAllow`
    /// (default standalone).
    #[arg(long, value_enum)]
    pub(crate) authorization_mode: Option<AuthorizationModeArg>,
    /// How long an allowed SubjectAccessReview answer is reused.
    #[arg(long, default_value = "5m", value_parser = parse_duration)]
    pub(crate) authorization_webhook_cache_authorized_ttl: Duration,
    /// How long a denied SubjectAccessReview answer is reused.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub(crate) authorization_webhook_cache_unauthorized_ttl: Duration,
    /// Deadline for connecting to a plugin socket.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub(crate) plugin_dial_timeout: Duration,
    /// Deadline for a plugin's GetInfo.
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    pub(crate) plugin_get_info_timeout: Duration,
    /// Deadline for a plugin's NotifyRegistrationStatus.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    pub(crate) plugin_notify_timeout: Duration,
    /// Period of the full rescan of plugins_registry (a safety net; events
    /// drive registration).
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub(crate) plugin_resync_period: Duration,
    /// Directory of static pod manifests (YAML or JSON, one or several
    /// documents per file), followed as its files change.
    #[arg(long)]
    pub(crate) pod_manifest_path: Option<PathBuf>,
    /// Pods this node runs at most.
    #[arg(long, default_value_t = kubelet::node::DEFAULT_MAX_PODS)]
    pub(crate) max_pods: usize,
    /// Put container pods in the kubelet's cgroup hierarchy: `kubepods`
    /// (limited to node allocatable), `burstable` and `besteffort` below
    /// it, a `pod<uid>` group with the pod's limits each.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub(crate) cgroups_per_qos: bool,
    /// The cgroup under which `kubepods` is made (default: the root, `/`).
    #[arg(long, default_value = "")]
    pub(crate) cgroup_root: String,
    /// How the container runtime manages cgroups: `cgroupfs` (paths, made
    /// by the node) or `systemd` (slices, made by systemd; the node sets no
    /// pod-level limits on them). Must match the runtime's setting.
    #[arg(long, value_enum, default_value_t = CgroupDriverArg::Cgroupfs)]
    pub(crate) cgroup_driver: CgroupDriverArg,
    /// Processes a pod may run at most (-1: no pod-level limit).
    #[arg(long, default_value_t = -1, allow_negative_numbers = true)]
    pub(crate) pod_max_pids: i64,
    /// Enforce containers' and pods' cpu limits with CFS quotas.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub(crate) cpu_cfs_quota: bool,
    /// Serve the node's log dir (`/var/log`) at the kubelet API's `/logs/`
    /// (`enableSystemLogHandler`).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub(crate) enable_system_log_handler: bool,
    /// Answer the node log query, `/logs/?query=<service>|/<file>`
    /// (`enableSystemLogQuery`; needs `--feature-gates=NodeLogQuery=true`,
    /// as the kubelet's).
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub(crate) enable_system_log_query: bool,
    /// Feature gates, `Name=true,Name=false`. Rustlet reads `NodeLogQuery`;
    /// the others are accepted and logged once (their behaviour is fixed).
    #[arg(long, value_delimiter = ',', value_parser = parse_gate)]
    pub(crate) feature_gates: Vec<(String, bool)>,
    /// Resources held back for the system, `cpu=200m,memory=500Mi,
    /// ephemeral-storage=1Gi,pid=1000`: allocatable is capacity less these,
    /// `--kube-reserved` and the hard eviction thresholds.
    #[arg(long, value_delimiter = ',', value_parser = parse_pair)]
    pub(crate) system_reserved: Vec<(String, String)>,
    /// Resources held back for Kubernetes' node components (as
    /// `--system-reserved`).
    #[arg(long, value_delimiter = ',', value_parser = parse_pair)]
    pub(crate) kube_reserved: Vec<(String, String)>,
    /// Hard eviction thresholds, `memory.available<100Mi,nodefs.available<10%`
    /// (default: upstream's four, `memory.available<100Mi,
    /// nodefs.available<10%,nodefs.inodesFree<5%,imagefs.available<15%`;
    /// giving any replaces them all). Those of memory and nodefs are held
    /// back from allocatable.
    #[arg(long, env = "RUSTLET_EVICTION_HARD")]
    pub(crate) eviction_hard: Option<String>,
    /// Soft eviction thresholds (as `--eviction-hard`): a pod is evicted
    /// once one has been met for its grace period.
    #[arg(long)]
    pub(crate) eviction_soft: Option<String>,
    /// Each soft threshold's grace period, `memory.available=1m30s,...`.
    #[arg(long, value_delimiter = ',', value_parser = parse_pair)]
    pub(crate) eviction_soft_grace_period: Vec<(String, String)>,
    /// What is reclaimed beyond a threshold once it is met,
    /// `memory.available=0Mi,nodefs.available=500Mi,...`.
    #[arg(long, value_delimiter = ',', value_parser = parse_pair)]
    pub(crate) eviction_minimum_reclaim: Vec<(String, String)>,
    /// How long a pressure condition holds after its thresholds were last
    /// met. `0s` is taken, as the kubelet takes it: a condition then holds
    /// for no time, so none is reported (evictions still happen), as the
    /// kubelet does.
    #[arg(long, default_value = "5m", value_parser = parse_duration_or_zero)]
    pub(crate) eviction_pressure_transition_period: Duration,
    /// The most grace, in seconds, a pod evicted for a soft threshold gets
    /// (0: its own `terminationGracePeriodSeconds`).
    #[arg(long, default_value_t = 0)]
    pub(crate) eviction_max_pod_grace_period: u32,
    /// A container's log is rotated once it reaches this size (`10Mi`).
    #[arg(long, default_value = "10Mi", value_parser = parse_bytes)]
    pub(crate) container_log_max_size: u64,
    /// Log files a container keeps at most, the live one included (at
    /// least 2): older ones are compressed, the oldest removed.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(2..))]
    pub(crate) container_log_max_files: u32,
    /// Unused images are collected once the image file system is this full
    /// (percent; 100 turns image collection off).
    #[arg(long, default_value_t = 85, value_parser = clap::value_parser!(u8).range(0..=100))]
    pub(crate) image_gc_high_threshold: u8,
    /// … down to this (percent, below the high threshold).
    #[arg(long, default_value_t = 80, value_parser = clap::value_parser!(u8).range(0..=100))]
    pub(crate) image_gc_low_threshold: u8,
    /// How often the pods' persistent volume claims are measured
    /// (`kubelet_volume_stats_*`, `/stats/summary`).
    #[arg(long, default_value = "1m", value_parser = parse_duration)]
    pub(crate) volume_stats_agg_period: Duration,
    /// Images the node first saw more recently than this are not collected.
    #[arg(long, default_value = "2m", value_parser = parse_duration)]
    pub(crate) minimum_image_ttl_duration: Duration,
    /// Exited containers kept per container of a pod (the newest ones).
    #[arg(long, default_value_t = 1)]
    pub(crate) maximum_dead_containers_per_container: usize,
    /// Where node allocatable is enforced: `pods` (the `kubepods` group's
    /// limits) or `none`.
    #[arg(long, value_delimiter = ',', default_value = "pods")]
    pub(crate) enforce_node_allocatable: Vec<String>,
}

/// `--cgroup-driver` values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum CgroupDriverArg {
    /// Cgroup paths.
    Cgroupfs,
    /// systemd slices.
    Systemd,
}

/// `--authorization-mode` values, spelled as the kubelet's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum AuthorizationModeArg {
    /// Every authenticated request is allowed.
    #[value(name = "AlwaysAllow")]
    AlwaysAllow,
    /// A SubjectAccessReview decides.
    #[value(name = "Webhook")]
    Webhook,
}

/// Flags of `rustlet demo`.
#[derive(Args)]
pub(crate) struct DemoArgs {
    /// Exit after the demo's scenario instead of running until Ctrl-C.
    #[arg(long)]
    pub(crate) once: bool,
    /// Show the node's log beside the demo's story (by default it goes to
    /// a file the demo names at the start; `RUSTLET_LOG` set does the same
    /// as this flag).
    #[arg(long, short)]
    pub(crate) verbose: bool,
}

/// Parses a duration as kubelet flags take them: `250ms`, `10s`, `1m30s`,
/// `1h` (units `ns`, `us`, `ms`, `s`, `m`, `h`, and longer spellings), from
/// 1 ms to 24 h.
pub(crate) fn parse_duration(s: &str) -> Result<Duration, String> {
    let value = humantime::parse_duration(s.trim())
        .map_err(|e| format!("{s:?} is not a duration such as 500ms, 10s or 1m30s: {e}"))?;
    if !(Duration::from_millis(1)..=Duration::from_secs(86_400)).contains(&value) {
        return Err(format!("{s:?} must be between 1ms and 24h"));
    }
    Ok(value)
}

/// [`parse_duration`], with zero allowed (`0`, `0s`): for the settings the
/// kubelet lets be zero.
pub(crate) fn parse_duration_or_zero(s: &str) -> Result<Duration, String> {
    let trimmed = s.trim();
    if trimmed == "0" || humantime::parse_duration(trimmed).is_ok_and(|d| d.is_zero()) {
        return Ok(Duration::ZERO);
    }
    parse_duration(s).map_err(|e| e.replace("between 1ms and 24h", "0, or between 1ms and 24h"))
}

/// Parses `key=value` as a Node label.
pub(crate) fn parse_label(s: &str) -> Result<(String, String), String> {
    let (key, value) = s.split_once('=').ok_or_else(|| format!("{s:?} is not a label: expected key=value"))?;
    let key = key.trim();
    if key.is_empty() || key.contains(char::is_whitespace) {
        return Err(format!("{s:?} is not a label: the key must be non-empty, without spaces"));
    }
    Ok((key.to_owned(), value.trim().to_owned()))
}

/// Parses `name=value` (a reservation, a threshold's setting).
pub(crate) fn parse_pair(s: &str) -> Result<(String, String), String> {
    let (key, value) = s.split_once('=').ok_or_else(|| format!("{s:?}: expected name=value"))?;
    if key.trim().is_empty() || value.trim().is_empty() {
        return Err(format!("{s:?}: expected name=value, both non-empty"));
    }
    Ok((key.trim().to_owned(), value.trim().to_owned()))
}

/// Parses `Name=true|false` (a feature gate).
pub(crate) fn parse_gate(s: &str) -> Result<(String, bool), String> {
    let (name, value) = parse_pair(s)?;
    match value.to_ascii_lowercase().as_str() {
        "true" => Ok((name, true)),
        "false" => Ok((name, false)),
        _ => {
            Err(format!("invalid value of {name}: {value}, err: strconv.ParseBool: parsing {value:?}: invalid syntax"))
        }
    }
}

/// Parses `key[=value]:Effect` as a taint (the kubelet's
/// `--register-with-taints` syntax).
pub(crate) fn parse_taint(s: &str) -> Result<Taint, String> {
    let (key_value, effect) =
        s.rsplit_once(':').ok_or_else(|| format!("{s:?} is not a taint: expected key[=value]:Effect"))?;
    if !matches!(effect, "NoSchedule" | "PreferNoSchedule" | "NoExecute") {
        return Err(format!("{s:?}: the effect must be NoSchedule, PreferNoSchedule or NoExecute, not {effect:?}"));
    }
    let (key, value) = match key_value.split_once('=') {
        Some((key, value)) => (key, Some(value.to_owned())),
        None => (key_value, None),
    };
    if key.is_empty() {
        return Err(format!("{s:?} is not a taint: the key is empty"));
    }
    Ok(Taint { key: key.to_owned(), value, effect: effect.to_owned(), time_added: None })
}

/// A byte quantity as Kubernetes writes one (`256Mi`, `1G`, `1048576`).
fn parse_bytes(text: &str) -> Result<u64, String> {
    kubelet::pod::parse_units(text)
        .map_err(|e| e.to_string())
        .and_then(|v| u64::try_from(v).map_err(|_| format!("{text} is too large")))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// clap's own consistency checks over every subcommand (duplicate
    /// names or aliases, bad defaults), which otherwise only fire when that
    /// subcommand is run from a debug build.
    #[test]
    fn the_command_line_is_consistent() {
        use clap::CommandFactory as _;
        Cli::command().debug_assert();
    }

    #[test]
    fn labels_and_taints_parse_as_kubelet_flags_do() {
        assert_eq!(parse_label("zone=a"), Ok(("zone".into(), "a".into())));
        assert_eq!(parse_label("empty="), Ok(("empty".into(), String::new())));
        assert!(parse_label("novalue").expect_err("no =").contains("key=value"));
        assert!(parse_label("=x").expect_err("no key").contains("non-empty"));
        let taint = parse_taint("dedicated=gpu:NoSchedule").expect("taint");
        assert_eq!(
            (taint.key.as_str(), taint.value.as_deref(), taint.effect.as_str()),
            ("dedicated", Some("gpu"), "NoSchedule")
        );
        let taint = parse_taint("example.com/special:NoExecute").expect("taint without value");
        assert_eq!(
            (taint.key.as_str(), taint.value, taint.effect.as_str()),
            ("example.com/special", None, "NoExecute")
        );
        assert!(
            parse_taint("k=v:Sometimes").expect_err("effect").contains("NoSchedule, PreferNoSchedule or NoExecute")
        );
        assert!(parse_taint("k=v").expect_err("no effect").contains("key[=value]:Effect"));
        assert!(parse_taint(":NoSchedule").expect_err("no key").contains("key is empty"));
    }

    #[test]
    fn feature_gates_parse_as_the_kubelets() {
        assert_eq!(parse_gate("NodeLogQuery=true"), Ok(("NodeLogQuery".into(), true)));
        assert_eq!(parse_gate("A=False"), Ok(("A".into(), false)));
        assert!(parse_gate("A=yes").expect_err("not a bool").contains("invalid value of A: yes"));
        let cli = <Cli as clap::Parser>::try_parse_from([
            "rustlet",
            "--standalone",
            "--feature-gates=A=true,NodeLogQuery=false",
        ])
        .expect("flags");
        assert_eq!(cli.node.feature_gates, [("A".into(), true), ("NodeLogQuery".into(), false)]);
        assert!(cli.node.enable_system_log_handler && !cli.node.enable_system_log_query);
    }

    #[test]
    fn durations_parse_as_kubelet_flags_do() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("10s"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1m30s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert!(parse_duration("0s").expect_err("zero").contains("between 1ms and 24h"));
        assert!(parse_duration("500us").expect_err("too short").contains("between 1ms and 24h"));
        assert!(parse_duration("25h").expect_err("huge").contains("between 1ms and 24h"));
        assert!(parse_duration("5 parsecs").expect_err("unit").contains("not a duration"));
        assert!(parse_duration("soon").expect_err("garbage").contains("not a duration"));
        // What the kubelet lets be zero.
        assert_eq!(parse_duration_or_zero("0s"), Ok(Duration::ZERO));
        assert_eq!(parse_duration_or_zero("0"), Ok(Duration::ZERO));
        assert_eq!(parse_duration_or_zero("30s"), Ok(Duration::from_secs(30)));
        assert!(parse_duration_or_zero("500us").expect_err("too short").contains("0, or between 1ms and 24h"));
        let cli = <Cli as clap::Parser>::try_parse_from([
            "rustlet",
            "--standalone",
            "--eviction-pressure-transition-period",
            "0s",
        ])
        .expect("0s is taken");
        assert_eq!(cli.node.eviction_pressure_transition_period, Duration::ZERO);
    }
}
