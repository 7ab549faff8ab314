//! What Rustlet's node runs with, below the crates that do its jobs: the
//! node's crates use it, and so may a provider, but a provider author need
//! not read it (the contract is `kubelet-provider`).
//!
//! - [`health`]: how a long-running component reports its health to the
//!   node's `/healthz`.
//! - [`supervisor`]: the one supervisor of long-running tasks (a health
//!   check each, ends caught and counted, restarts with backoff).
//! - [`retry`]: the one jittered backoff every retry uses.
//! - [`durable`]: the one durable file write (temporary file, fsync,
//!   rename, directory fsync) every checkpoint, key and store uses.
//! - [`cgroups`]: cgroup v1 and v2 files, pod cgroup limits, the kubepods
//!   hierarchy.
//! - [`metrics`]: the Prometheus text format the node serves its series in.
//! - `fuzz` (with the `testing` feature, for the workspace's own tests):
//!   the mutation fuzzer the fuzz targets run in `cargo test`.

pub mod cgroups;
pub mod durable;
#[cfg(any(test, feature = "testing"))]
pub mod fuzz;
pub mod health;
pub mod metrics;
pub mod retry;
pub mod supervisor;
