//! The suite's one skip policy.
//!
//! A test that needs something of the machine beyond the repository (root,
//! a writable cgroup file system, mounts, containerd, an OCI registry,
//! Prometheus, a real kube-apiserver, a user's cluster) and cannot have it
//! here calls [`skip`] and returns. That prints one line naming the test,
//! what it lacks and why, and the `RUSTLET_REQUIRE_*` variable that turns
//! the skip into a failure; with that variable set to `1`, [`skip`] panics
//! instead, so a test can never pass without having run where its
//! dependency is promised (`.ci/run` sets every variable CI can satisfy).
//!
//! The line is written to the process's standard error directly, not
//! through `eprintln!`, which the test harness captures and hides for a
//! test that passes. Each skip is also appended, one line per skip, to the
//! file named by `RUSTLET_SKIP_LOG` (kind, variable, what is missing,
//! test, reason; split by tabs): `cargo xtask test` sets it and ends the
//! suite with the skips counted by reason.

use std::fmt::Display;
use std::io::Write as _;

/// The variable naming the file each skip is appended to.
pub const SKIP_LOG: &str = "RUSTLET_SKIP_LOG";

/// What a test needs of the machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Need {
    /// Root: running a process as another user, `chown`, containerd.
    Root,
    /// A cgroup file system this process may write (its own root group).
    Cgroups,
    /// Mounting (a tmpfs, bind mounts, a private mount namespace).
    Mounts,
    /// A containerd the suite starts itself (installed with `apt-get`).
    Containerd,
    /// An OCI registry the suite starts itself (`docker-registry`).
    Registry,
    /// Prometheus, which the suite starts itself.
    Prometheus,
    /// A real kube-apiserver (binaries in `RUSTLET_KUBE_BIN_DIR`).
    Kube,
    /// A real control plane that serves structured DRA (1.32+) and
    /// upstream's DRA test driver beside its binaries
    /// (`RUSTLET_KUBE_BIN_DIR/dra-test-driver`).
    KubeDra,
    /// A user's own cluster (`RUSTLET_E2E_KUBECONFIG`).
    Cluster,
    /// An address of this host besides loopback.
    HostAddress,
}

impl Need {
    /// Every need, in the order the summary lists them.
    pub const ALL: [Need; 10] = [
        Need::Root,
        Need::Cgroups,
        Need::Mounts,
        Need::Containerd,
        Need::Registry,
        Need::Prometheus,
        Need::Kube,
        Need::KubeDra,
        Need::Cluster,
        Need::HostAddress,
    ];

    /// The variable that makes a skip for want of this a failure.
    pub fn variable(self) -> &'static str {
        match self {
            Need::Root => "RUSTLET_REQUIRE_ROOT",
            Need::Cgroups => "RUSTLET_REQUIRE_CGROUPS",
            Need::Mounts => "RUSTLET_REQUIRE_MOUNTS",
            Need::Containerd => "RUSTLET_REQUIRE_CONTAINERD",
            Need::Registry => "RUSTLET_REQUIRE_REGISTRY",
            Need::Prometheus => "RUSTLET_REQUIRE_PROMETHEUS",
            Need::Kube => "RUSTLET_REQUIRE_KUBE",
            Need::KubeDra => "RUSTLET_REQUIRE_KUBE_DRA",
            Need::Cluster => "RUSTLET_REQUIRE_E2E",
            Need::HostAddress => "RUSTLET_REQUIRE_HOST_ADDRESS",
        }
    }

    /// What is missing, in words.
    pub fn lack(self) -> &'static str {
        match self {
            Need::Root => "not root",
            Need::Cgroups => "no writable cgroup file system",
            Need::Mounts => "cannot mount",
            Need::Containerd => "no containerd",
            Need::Registry => "no OCI registry",
            Need::Prometheus => "no Prometheus",
            Need::Kube => "no real kube-apiserver",
            Need::KubeDra => "no real control plane with structured DRA and upstream's DRA test driver",
            Need::Cluster => "no cluster of the user's",
            Need::HostAddress => "no host address but loopback",
        }
    }

    /// Whether this need is promised here (its variable is `1`).
    pub fn required(self) -> bool {
        std::env::var(self.variable()).is_ok_and(|v| v == "1")
    }
}

/// Skips `test` for want of `need`, saying why (`reason`): one line on
/// standard error and one in the skip log. Panics, failing the test, where
/// the need is [required](Need::required). The caller returns after it.
pub fn skip(test: &str, need: Need, reason: impl Display) {
    record(Kind::Test, test, need, &reason.to_string());
}

/// Skips one check of `test` (named in `check`) for want of `need`, the
/// test going on with the rest: said and recorded as [`skip`] does, and
/// a failure where the need is required.
pub fn skip_check(test: &str, check: &str, need: Need, reason: impl Display) {
    record(Kind::Check, &format!("{test} ({check})"), need, &reason.to_string());
}

/// What a skip leaves out.
#[derive(Clone, Copy)]
enum Kind {
    /// A whole test.
    Test,
    /// One check of a test.
    Check,
}

fn record(kind: Kind, test: &str, need: Need, reason: &str) {
    let variable = need.variable();
    if need.required() {
        panic!("{test}: {variable}=1 but {}: {reason}", need.lack());
    }
    let line = format!("SKIP {test}: {}: {reason} (set {variable}=1 to make this a failure)\n", need.lack());
    // Straight to the file descriptor: the harness captures `eprintln!`.
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
    if let Some(path) = std::env::var_os(SKIP_LOG) {
        let kind = match kind {
            Kind::Test => "test",
            Kind::Check => "check",
        };
        let record = format!("{kind}\t{variable}\t{}\t{}\t{}\n", need.lack(), one_line(test), one_line(reason));
        // One `write` per record, in append mode: the test binaries run
        // beside one another and their records do not interleave.
        let appended = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .and_then(|mut file| file.write_all(record.as_bytes()));
        if let Err(error) = appended {
            panic!("{test}: cannot record its skip in {}: {error}", std::path::Path::new(&path).display());
        }
    }
}

/// `Some(value)`, or `None` after [`skip`]ping `test` for want of `need`
/// (the error is the reason).
pub fn or_skip<T, E: Display>(test: &str, need: Need, result: Result<T, E>) -> Option<T> {
    match result {
        Ok(value) => Some(value),
        Err(reason) => {
            skip(test, need, reason);
            None
        }
    }
}

/// Whether this process runs as root; [`skip`]s `test` (`why` it needs
/// root) where it does not.
pub fn root(test: &str, why: &str) -> bool {
    if is_root() {
        return true;
    }
    skip(test, Need::Root, why);
    false
}

/// Whether this process runs as root (its effective user id is 0).
pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("Uid:").map(|u| u.split_whitespace().nth(1) == Some("0"))))
        .unwrap_or(false)
}

/// The reason on one line, tabs and newlines turned into spaces (the skip
/// log is one record per line, fields split by tabs).
fn one_line(reason: &str) -> String {
    reason.split(['\n', '\t', '\r']).map(str::trim).filter(|s| !s.is_empty()).collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reason_is_kept_on_one_line() {
        assert_eq!(one_line("a\n  b\tc\r\n"), "a b c");
    }

    #[test]
    fn every_need_has_its_own_variable() {
        let mut variables: Vec<_> = Need::ALL.iter().map(|n| n.variable()).collect();
        variables.sort_unstable();
        variables.dedup();
        assert_eq!(variables.len(), Need::ALL.len());
        assert!(variables.iter().all(|v| v.starts_with("RUSTLET_REQUIRE_")));
    }
}
