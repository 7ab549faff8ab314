//! Debian packages the real-component tests need (`docker-registry`,
//! `etcd-server`), installed with `apt-get` the first time they are missing
//! (as root, once per machine: a file lock keeps parallel tests from
//! installing twice).

use std::path::PathBuf;
use std::process::Stdio;

/// Makes sure `bin` exists, installing `package` when it does not; the
/// reason when it cannot be had.
pub fn ensure_installed(bin: &str, package: &str) -> Result<PathBuf, String> {
    let path = PathBuf::from(bin);
    if path.is_file() {
        return Ok(path);
    }
    let lock_path = std::env::temp_dir().join(format!("rustlet-apt-{package}.lock"));
    let lock = std::fs::File::create(&lock_path).map_err(|e| format!("{}: {e}", lock_path.display()))?;
    lock.lock().map_err(|e| format!("{}: {e}", lock_path.display()))?;
    if path.is_file() {
        return Ok(path);
    }
    let apt = |args: &[&str]| {
        std::process::Command::new("apt-get")
            .args(args)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .stdin(Stdio::null())
            .output()
    };
    eprintln!("{bin} is missing: installing {package} with apt-get (once per machine)");
    let mut installed = apt(&["install", "-y", "-q", "--no-install-recommends", package]);
    if !matches!(&installed, Ok(out) if out.status.success()) {
        let _ = apt(&["update", "-q"]);
        installed = apt(&["install", "-y", "-q", "--no-install-recommends", package]);
    }
    match installed {
        Ok(out) if out.status.success() && path.is_file() => Ok(path),
        Ok(out) => Err(format!(
            "apt-get install {package} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).lines().last().unwrap_or_default()
        )),
        Err(e) => Err(format!("cannot run apt-get: {e}")),
    }
}
