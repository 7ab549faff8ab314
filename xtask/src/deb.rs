//! `cargo xtask deb`: a Debian package that installs Rustlet as a node's
//! kubelet, the way the kubelet's own package does, so that `kubeadm init`
//! and `kubeadm join` start it with no flag mapped by hand.
//!
//! What it installs:
//! - `/usr/bin/rustlet`, and `/usr/bin/kubelet` pointing at it through
//!   `update-alternatives` (kubeadm's preflight runs `kubelet --version`;
//!   installed under that name Rustlet answers `Kubernetes v<semver>`);
//! - `kubelet.service` (kubeadm starts and restarts the unit of that name)
//!   and its drop-in `kubelet.service.d/10-kubeadm.conf`, which passes what
//!   kubeadm writes: `--bootstrap-kubeconfig=/etc/kubernetes/bootstrap-kubelet.conf
//!   --kubeconfig=/etc/kubernetes/kubelet.conf`, `--config=/var/lib/kubelet/config.yaml`,
//!   `$KUBELET_KUBEADM_ARGS` from `/var/lib/kubelet/kubeadm-flags.env`, and
//!   `$KUBELET_EXTRA_ARGS` from `/etc/default/kubelet`.
//!
//! The package `Provides`, `Conflicts` with and `Replaces` `kubelet`: one
//! node runs one kubelet.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The unit kubeadm starts.
const SERVICE: &str = "\
[Unit]
Description=Rustlet: the node agent, as the node's kubelet
Wants=network-online.target
After=network-online.target

[Service]
ExecStart=/usr/bin/kubelet
Restart=always
StartLimitInterval=0
RestartSec=10

[Install]
WantedBy=multi-user.target
";

/// The drop-in that gives the unit kubeadm's files.
const KUBEADM_DROP_IN: &str = "\
# What kubeadm writes for the node's kubelet, passed to Rustlet as is.
[Service]
Environment=\"KUBELET_KUBECONFIG_ARGS=--bootstrap-kubeconfig=/etc/kubernetes/bootstrap-kubelet.conf --kubeconfig=/etc/kubernetes/kubelet.conf\"
Environment=\"KUBELET_CONFIG_ARGS=--config=/var/lib/kubelet/config.yaml\"
# kubeadm init and join write KUBELET_KUBEADM_ARGS here.
EnvironmentFile=-/var/lib/kubelet/kubeadm-flags.env
# The administrator's own flags: KUBELET_EXTRA_ARGS.
EnvironmentFile=-/etc/default/kubelet
ExecStart=
ExecStart=/usr/bin/kubelet $KUBELET_KUBECONFIG_ARGS $KUBELET_CONFIG_ARGS $KUBELET_KUBEADM_ARGS $KUBELET_EXTRA_ARGS
";

const POSTINST: &str = "\
#!/bin/sh
set -e
if [ \"$1\" = configure ]; then
    update-alternatives --install /usr/bin/kubelet kubelet /usr/bin/rustlet 50
    if [ -d /run/systemd/system ]; then
        systemctl daemon-reload || true
        systemctl enable kubelet.service || true
    fi
fi
";

const PRERM: &str = "\
#!/bin/sh
set -e
if [ \"$1\" = remove ] || [ \"$1\" = deconfigure ]; then
    update-alternatives --remove kubelet /usr/bin/rustlet
fi
";

/// What a package is made of.
pub(crate) struct Package<'a> {
    /// The `rustlet` binary to ship.
    pub(crate) binary: &'a Path,
    /// The package's version (the workspace's).
    pub(crate) version: &'a str,
    /// Debian's name of the architecture (`amd64`).
    pub(crate) architecture: &'a str,
}

impl Package<'_> {
    fn control(&self, installed_kib: u64) -> String {
        format!(
            "Package: rustlet
Version: {version}
Architecture: {arch}
Maintainer: Rustlet developers <rustlet@localhost>
Installed-Size: {installed_kib}
Section: admin
Priority: optional
Provides: kubelet
Conflicts: kubelet
Replaces: kubelet
Description: Kubernetes node agent in Rust, installed as the node's kubelet
 Rustlet registers the machine as a Kubernetes node and runs its pods on a
 CRI runtime (containerd) or WebAssembly. This package installs it as
 /usr/bin/kubelet (update-alternatives) with the kubelet.service unit and
 the drop-in kubeadm expects, so kubeadm init and kubeadm join start it.
",
            version = self.version,
            arch = self.architecture,
        )
    }

    /// Lays the package's tree out under `stage` (made afresh) and builds
    /// `<out>/rustlet_<version>_<arch>.deb` with `dpkg-deb`; its path.
    pub(crate) fn build(&self, stage: &Path, out: &Path) -> Result<PathBuf, String> {
        let io = |what: &str, path: &Path| {
            let what = what.to_owned();
            let path = path.display().to_string();
            move |e: std::io::Error| format!("{what} {path}: {e}")
        };
        if stage.exists() {
            std::fs::remove_dir_all(stage).map_err(io("cannot clear", stage))?;
        }
        let write = |relative: &str, contents: &[u8], mode: u32| -> Result<(), String> {
            use std::os::unix::fs::PermissionsExt as _;
            let path = stage.join(relative);
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent).map_err(io("cannot make", parent))?;
            }
            std::fs::write(&path, contents).map_err(io("cannot write", &path))?;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).map_err(io("cannot chmod", &path))
        };
        let binary = std::fs::read(self.binary).map_err(io("cannot read", self.binary))?;
        write("usr/bin/rustlet", &binary, 0o755)?;
        write("usr/lib/systemd/system/kubelet.service", SERVICE.as_bytes(), 0o644)?;
        write("usr/lib/systemd/system/kubelet.service.d/10-kubeadm.conf", KUBEADM_DROP_IN.as_bytes(), 0o644)?;
        let kib = (binary.len() + SERVICE.len() + KUBEADM_DROP_IN.len()).div_ceil(1024) as u64;
        write("DEBIAN/control", self.control(kib).as_bytes(), 0o644)?;
        write("DEBIAN/postinst", POSTINST.as_bytes(), 0o755)?;
        write("DEBIAN/prerm", PRERM.as_bytes(), 0o755)?;
        std::fs::create_dir_all(out).map_err(io("cannot make", out))?;
        let deb = out.join(format!("rustlet_{}_{}.deb", self.version, self.architecture));
        let built = Command::new("dpkg-deb")
            .args(["--root-owner-group", "--build"])
            .arg(stage)
            .arg(&deb)
            .output()
            .map_err(|e| format!("cannot run dpkg-deb (Debian's dpkg package has it): {e}"))?;
        if !built.status.success() {
            return Err(format!("dpkg-deb failed: {}", String::from_utf8_lossy(&built.stderr).trim()));
        }
        Ok(deb)
    }
}

/// `cargo xtask deb [--binary PATH] [--out DIR]`: builds the release binary
/// unless one is named, then the package; prints its path.
pub(crate) fn run(args: &[String]) -> Result<PathBuf, String> {
    let mut binary = None;
    let mut out = PathBuf::from("target/deb");
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--binary" => binary = Some(PathBuf::from(args.next().ok_or("--binary needs a path")?)),
            "--out" => out = PathBuf::from(args.next().ok_or("--out needs a directory")?),
            other => {
                return Err(format!("unknown argument {other:?} (usage: cargo xtask deb [--binary PATH] [--out DIR])"));
            }
        }
    }
    let binary = match binary {
        Some(binary) => binary,
        None => {
            let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
            let status = Command::new(cargo)
                .args(["build", "--release", "-p", "rustlet"])
                .status()
                .map_err(|e| format!("cannot run cargo: {e}"))?;
            if !status.success() {
                return Err("the release build failed".to_owned());
            }
            PathBuf::from("target/release/rustlet")
        }
    };
    let architecture = Command::new("dpkg")
        .arg("--print-architecture")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_else(|| debian_arch(std::env::consts::ARCH).to_owned());
    let package = Package { binary: &binary, version: env!("CARGO_PKG_VERSION"), architecture: &architecture };
    package.build(&out.join("stage"), &out)
}

/// Debian's name for a Rust target architecture.
fn debian_arch(arch: &str) -> &str {
    match arch {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dpkg_deb(args: &[&str], deb: &Path) -> String {
        let output = Command::new("dpkg-deb").args(args).arg(deb).output().expect("dpkg-deb runs");
        assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    #[test]
    fn the_package_installs_rustlet_as_the_kubelet_kubeadm_starts() {
        if Command::new("dpkg-deb").arg("--version").output().is_err() {
            assert!(
                std::env::var_os("RUSTLET_REQUIRE_DPKG").is_none(),
                "dpkg-deb is not installed (Debian's dpkg package)"
            );
            eprintln!("skipped: dpkg-deb is not installed");
            return;
        }
        let dir = std::env::temp_dir().join(format!("rustlet-deb-test-{}", std::process::id()));
        let binary = dir.join("rustlet");
        std::fs::create_dir_all(&dir).expect("mkdir");
        std::fs::write(&binary, b"#!/bin/sh\necho Kubernetes v1.33.3+rustlet.0.1.0\n").expect("write");
        let package = Package { binary: &binary, version: "0.1.0", architecture: "amd64" };
        let deb = package.build(&dir.join("stage"), &dir.join("out")).expect("a package");
        assert_eq!(deb.file_name().and_then(|n| n.to_str()), Some("rustlet_0.1.0_amd64.deb"));

        let field = |name: &str| {
            dpkg_deb(&["--field"], &deb)
                .lines()
                .find_map(|l| l.strip_prefix(name).and_then(|rest| rest.strip_prefix(": ")).map(str::to_owned))
        };
        assert_eq!(field("Package").as_deref(), Some("rustlet"));
        assert_eq!(field("Version").as_deref(), Some("0.1.0"));
        for relation in ["Provides", "Conflicts", "Replaces"] {
            assert_eq!(field(relation).as_deref(), Some("kubelet"), "{relation}");
        }
        let contents = dpkg_deb(&["--contents"], &deb);
        let entry = |path: &str| contents.lines().find(|l| l.ends_with(path)).map(str::to_owned);
        let bin = entry("./usr/bin/rustlet").unwrap_or_else(|| panic!("the binary in {contents}"));
        assert!(bin.starts_with("-rwxr-xr-x root/root"), "executable, owned by root: {bin}");
        assert!(entry("./usr/lib/systemd/system/kubelet.service").is_some(), "{contents}");
        assert!(entry("./usr/lib/systemd/system/kubelet.service.d/10-kubeadm.conf").is_some(), "{contents}");

        // The drop-in passes every file kubeadm writes, and the unit runs
        // the kubelet name the alternatives point at Rustlet.
        let extract = dir.join("extract");
        let output = Command::new("dpkg-deb").arg("--raw-extract").arg(&deb).arg(&extract).output().expect("extract");
        assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
        let drop_in = std::fs::read_to_string(extract.join("usr/lib/systemd/system/kubelet.service.d/10-kubeadm.conf"))
            .expect("the drop-in");
        for wanted in [
            "--bootstrap-kubeconfig=/etc/kubernetes/bootstrap-kubelet.conf",
            "--kubeconfig=/etc/kubernetes/kubelet.conf",
            "--config=/var/lib/kubelet/config.yaml",
            "EnvironmentFile=-/var/lib/kubelet/kubeadm-flags.env",
            "ExecStart=/usr/bin/kubelet $KUBELET_KUBECONFIG_ARGS $KUBELET_CONFIG_ARGS $KUBELET_KUBEADM_ARGS $KUBELET_EXTRA_ARGS",
        ] {
            assert!(drop_in.contains(wanted), "{wanted} in {drop_in}");
        }
        let postinst = std::fs::read_to_string(extract.join("DEBIAN/postinst")).expect("postinst");
        assert!(
            postinst.contains("update-alternatives --install /usr/bin/kubelet kubelet /usr/bin/rustlet"),
            "{postinst}"
        );
        let shipped = std::fs::read(extract.join("usr/bin/rustlet")).expect("the binary");
        assert_eq!(shipped, std::fs::read(&binary).expect("read"), "the binary as given");
        std::fs::remove_dir_all(&dir).expect("clean up");
    }

    #[test]
    fn debian_names_the_architectures() {
        assert_eq!(debian_arch("x86_64"), "amd64");
        assert_eq!(debian_arch("aarch64"), "arm64");
    }
}
