//! What a test plugin reports about itself, one JSON object per line.

use std::path::PathBuf;

/// One event seen by a test plugin.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Report {
    /// All sockets are bound and served.
    Listening {
        /// How many registration sockets.
        sockets: usize,
    },
    /// The node called `GetInfo`.
    GetInfo {
        /// Socket called.
        socket: PathBuf,
    },
    /// The node called `NotifyRegistrationStatus`.
    Notified {
        /// Socket called.
        socket: PathBuf,
        /// The verdict.
        registered: bool,
        /// The node's reason, empty on success.
        error: String,
    },
    /// The node made a CSI volume call (stage, publish, unpublish, unstage).
    VolumeCall {
        /// The RPC.
        rpc: String,
        /// The volume.
        volume_id: String,
        /// `target_path` (publish, unpublish), empty otherwise.
        #[serde(default)]
        target_path: String,
        /// `staging_target_path`, empty when not sent.
        #[serde(default)]
        staging_target_path: String,
        /// The capability's access mode (wire number), 0 when not sent.
        #[serde(default)]
        access_mode: i32,
        /// `readonly` (publish).
        #[serde(default)]
        read_only: bool,
        /// `capacity_range.required_bytes` (expand), 0 otherwise.
        #[serde(default)]
        required_bytes: i64,
        /// `volume_context`, sorted.
        #[serde(default)]
        volume_context: Vec<(String, String)>,
    },
    /// The node called the CSI `NodeGetInfo`.
    NodeGetInfo {
        /// Driver endpoint called.
        endpoint: PathBuf,
    },
    /// A device plugin's `Register` call on `kubelet.sock` returned.
    DeviceRegistered {
        /// The resource.
        resource: String,
        /// Empty on success, the node's error otherwise.
        error: String,
    },
    /// The node opened a `ListAndWatch` stream.
    ListAndWatchOpened {
        /// The resource.
        resource: String,
    },
    /// The node called `Allocate` (reported before answering, or not).
    Allocate {
        /// The resource.
        resource: String,
        /// Devices named, per container.
        devices: Vec<Vec<String>>,
    },
    /// The node called `PreStartContainer`.
    PreStartContainer {
        /// The resource.
        resource: String,
        /// Devices named.
        devices: Vec<String>,
    },
    /// A DRA driver instance answered `NodePrepareResources`.
    DraPrepare {
        /// The instance (its per-instance name).
        instance: String,
        /// Per claim UID: its devices, or the error.
        claims: Vec<(String, Result<Vec<String>, String>)>,
    },
    /// A DRA driver instance published its ResourceSlice.
    SlicePublished {
        /// The instance.
        instance: String,
        /// The slice's name.
        name: String,
    },
    /// A DRA driver instance answered `NodeUnprepareResources`.
    DraUnprepare {
        /// The instance.
        instance: String,
        /// The claim UIDs released.
        claims: Vec<String>,
    },
    /// A `ListAndWatch` stream closed (the node hung up or was replaced).
    ListAndWatchClosed {
        /// The resource.
        resource: String,
    },
    /// A test node's pod changed (reported by the `test-node` binary).
    PodStatus {
        /// The pod's name.
        name: String,
        /// Its UID.
        uid: String,
        /// Its phase.
        phase: String,
        /// Containers in the running state.
        running: Vec<String>,
        /// Restarts of all its containers.
        restarts: i32,
        /// The pod's status message.
        message: String,
    },
}

/// Where reports go: a channel in-process, or stdout in the plugin binaries.
#[derive(Clone, Debug)]
pub enum Reporter {
    /// Drop every report.
    Discard,
    /// Print each report as a JSON line on stdout.
    Stdout,
    /// Send each report on a channel.
    Channel(tokio::sync::mpsc::UnboundedSender<Report>),
    /// Send each report with the instant it was made (for benchmarks).
    Timed(tokio::sync::mpsc::UnboundedSender<(std::time::Instant, Report)>),
}

impl Reporter {
    /// Emits one report.
    pub fn report(&self, report: Report) {
        match self {
            Reporter::Discard => {}
            Reporter::Stdout => {
                use std::io::Write;
                let line = serde_json::to_string(&report).unwrap_or_default();
                let mut out = std::io::stdout().lock();
                // A closed stdout means nobody listens; the plugin keeps serving.
                let _ = writeln!(out, "{line}").and_then(|()| out.flush());
            }
            Reporter::Channel(tx) => {
                let _ = tx.send(report);
            }
            Reporter::Timed(tx) => {
                let _ = tx.send((std::time::Instant::now(), report));
            }
        }
    }
}
