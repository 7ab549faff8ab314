//! The repository's own commands, run as `cargo xtask <command>`.
//!
//! - `test [ARGS]`: the whole test suite, `cargo test --workspace
//!   --no-fail-fast [ARGS]`, ended by the skips counted by reason and one
//!   closing line: `suite: N passed, N failed, N skipped`. It builds first
//!   (`--no-run`) and says how much disk was free before and after, so that
//!   a build that died of a full disk says so.
//! - `deb [--binary PATH] [--out DIR]`: a Debian package that installs
//!   Rustlet as the node's kubelet for kubeadm (see `deb.rs`); it builds the
//!   release binary unless one is named.
//!
//! A test that cannot have what it needs here (root, containerd, a real
//! kube-apiserver, ...) skips through the test kit's skip policy, which
//! appends a record to the file named by `RUSTLET_SKIP_LOG`; this command
//! sets that variable, reads the records back when the suite is done, and
//! counts a skipped test as skipped, not passed (the harness saw it pass).

mod deb;
#[cfg(test)]
mod source_rules;

use std::collections::BTreeMap;
use std::io::{BufRead as _, BufReader, Write as _};
use std::path::PathBuf;
use std::process::{Command, ExitCode, Stdio};

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    match args.next().as_deref() {
        Some("test") => test(args.collect()),
        Some("deb") => match deb::run(&args.collect::<Vec<_>>()) {
            Ok(path) => {
                println!("{}", path.display());
                ExitCode::SUCCESS
            }
            Err(error) => {
                eprintln!("error: {error}");
                ExitCode::FAILURE
            }
        },
        other => {
            if let Some(other) = other {
                eprintln!("error: unknown command {other:?}");
            }
            eprintln!("usage: cargo xtask test [ARGS for cargo test] | cargo xtask deb [--binary PATH] [--out DIR]");
            ExitCode::from(2)
        }
    }
}

/// What the test harness said of one test binary (`test result:` lines,
/// added up).
#[derive(Default)]
struct Results {
    passed: u64,
    failed: u64,
    ignored: u64,
    binaries: u64,
}

impl Results {
    /// Adds `line` when it is a harness's closing line.
    fn read(&mut self, line: &str) {
        let Some(rest) = line.trim().strip_prefix("test result: ") else { return };
        self.binaries += 1;
        for part in rest.split(';') {
            let mut words = part.split_whitespace().rev();
            let (Some(what), Some(count)) = (words.next(), words.next()) else { continue };
            let Ok(count) = count.parse::<u64>() else { continue };
            match what {
                "passed" => self.passed += count,
                "failed" => self.failed += count,
                "ignored" => self.ignored += count,
                _ => {}
            }
        }
    }
}

/// One skip record: kind (`test` or `check`), variable, what was missing,
/// the test, the reason.
struct Skip {
    whole_test: bool,
    variable: String,
    lack: String,
    test: String,
    reason: String,
}

impl Skip {
    fn parse(line: &str) -> Option<Skip> {
        let mut fields = line.splitn(5, '\t');
        let kind = fields.next()?;
        Some(Skip {
            whole_test: kind == "test",
            variable: fields.next()?.to_owned(),
            lack: fields.next()?.to_owned(),
            test: fields.next()?.to_owned(),
            reason: fields.next()?.to_owned(),
        })
    }
}

fn test(args: Vec<String>) -> ExitCode {
    let workspace = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let workspace = workspace.canonicalize().unwrap_or(workspace);
    let target = std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| workspace.join("target"), PathBuf::from);
    if let Err(error) = std::fs::create_dir_all(&target) {
        eprintln!("error: cannot make {}: {error}", target.display());
        return ExitCode::FAILURE;
    }
    let skip_log = target.join("rustlet-test-skips.tsv");
    if let Err(error) = std::fs::write(&skip_log, "") {
        eprintln!("error: cannot start the skip log {}: {error}", skip_log.display());
        return ExitCode::FAILURE;
    }
    let free_before = disk_free(&target);
    println!("disk: {} free where the build goes ({})", show_bytes(free_before), target.display());
    let mut build = cargo_command(&workspace);
    let built = build.args(["test", "--workspace", "--no-run"]).args(&args).status();
    let free_after = disk_free(&target);
    match built {
        Ok(status) if status.success() => println!("disk: {} free after the build", show_bytes(free_after)),
        Ok(status) => {
            println!("cargo test --no-run failed ({status}): the build failed (above)");
            if free_after.is_some_and(|free| free < LOW_DISK) {
                println!(
                    "disk: only {} free: a linker killed by a bus error (signal 7) or a write that failed \
                     with ENOSPC is what a full disk looks like; the build needs about 4 GiB",
                    show_bytes(free_after)
                );
            }
            report(&Results::default(), 1, &[]);
            return ExitCode::FAILURE;
        }
        Err(error) => {
            eprintln!("error: cannot run cargo test: {error}");
            return ExitCode::FAILURE;
        }
    }
    let mut command = cargo_command(&workspace);
    let child = command
        .args(["test", "--workspace", "--no-fail-fast"])
        .args(&args)
        .env("RUSTLET_SKIP_LOG", &skip_log)
        .stdout(Stdio::piped())
        .spawn();
    let mut child = match child {
        Ok(child) => child,
        Err(error) => {
            eprintln!("error: cannot run cargo test: {error}");
            return ExitCode::FAILURE;
        }
    };
    let mut results = Results::default();
    if let Some(stdout) = child.stdout.take() {
        let mut out = std::io::stdout().lock();
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            results.read(&line);
            let _ = writeln!(out, "{line}");
        }
    }
    let status = match child.wait() {
        Ok(status) => status,
        Err(error) => {
            eprintln!("error: cargo test: {error}");
            return ExitCode::FAILURE;
        }
    };
    let skips: Vec<Skip> =
        std::fs::read_to_string(&skip_log).unwrap_or_default().lines().filter_map(Skip::parse).collect();
    let mut failed = results.failed;
    if !status.success() && failed == 0 {
        // A build error, or a test binary that died without its closing
        // line: cargo said which above.
        println!("cargo test failed ({status}) with no failed test counted: a build or a test binary failed (above)");
        failed = 1;
    }
    report(&results, failed, &skips);
    if status.success() { ExitCode::SUCCESS } else { ExitCode::FAILURE }
}

/// Below this much free disk, a failed build is most likely the disk's.
const LOW_DISK: u64 = 1 << 30;

/// `cargo`, run in the workspace, without what `cargo run` told this
/// program of itself: that is not the suite's, and build scripts that watch
/// `CARGO_MANIFEST_DIR` (ring's) would rebuild, and all above them, at
/// every switch between this and `cargo test`.
fn cargo_command(workspace: &std::path::Path) -> Command {
    let mut command = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    command.current_dir(workspace);
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy();
        if name.starts_with("CARGO_PKG_")
            || [
                "CARGO_MANIFEST_DIR",
                "CARGO_MANIFEST_PATH",
                "CARGO_CRATE_NAME",
                "CARGO_BIN_NAME",
                "CARGO_PRIMARY_PACKAGE",
            ]
            .contains(&name.as_ref())
        {
            command.env_remove(name.as_ref());
        }
    }
    command
}

/// Bytes free to an unprivileged writer on the file system holding `path`,
/// as `df` tells it; `None` when `df` cannot say.
fn disk_free(path: &std::path::Path) -> Option<u64> {
    let output = Command::new("df").args(["-P", "-k"]).arg(path).stderr(Stdio::null()).output().ok()?;
    parse_df(&String::from_utf8_lossy(&output.stdout))
}

/// The "Available" column (KiB) of `df -P -k`'s one data line, in bytes.
fn parse_df(text: &str) -> Option<u64> {
    let line = text.lines().nth(1)?;
    let available: u64 = line.split_whitespace().nth(3)?.parse().ok()?;
    Some(available * 1024)
}

fn show_bytes(bytes: Option<u64>) -> String {
    match bytes {
        Some(bytes) => format!("{:.1} GiB", bytes as f64 / f64::from(1u32 << 30)),
        None => "(df could not say how much)".to_owned(),
    }
}

/// Prints each skip, the skips counted by reason, and the closing line.
fn report(results: &Results, failed: u64, skips: &[Skip]) {
    let skipped_tests = skips.iter().filter(|s| s.whole_test).count() as u64;
    let skipped_checks = skips.len() as u64 - skipped_tests;
    println!();
    if !skips.is_empty() {
        println!("skipped (each, with the variable that makes it a failure):");
        for skip in skips {
            let what = if skip.whole_test { "test " } else { "check" };
            println!("  {what} {}: {}: {} [{}]", skip.test, skip.lack, skip.reason, skip.variable);
        }
    }
    let mut by_reason: BTreeMap<(String, String), u64> = BTreeMap::new();
    for skip in skips {
        *by_reason.entry((skip.lack.clone(), skip.variable.clone())).or_default() += 1;
    }
    let mut reasons: Vec<String> =
        by_reason.iter().map(|((lack, variable), count)| format!("{count} {lack} ({variable})")).collect();
    if results.ignored > 0 {
        reasons.push(format!("{} ignored by the harness", results.ignored));
    }
    if reasons.is_empty() {
        println!("skips by reason: none ({} test binaries)", results.binaries);
    } else {
        println!(
            "skips by reason: {} ({skipped_tests} tests, {skipped_checks} checks, {} test binaries)",
            reasons.join(", "),
            results.binaries
        );
    }
    let passed = results.passed.saturating_sub(skipped_tests);
    println!("suite: {passed} passed, {failed} failed, {} skipped", skipped_tests + results.ignored);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn closing_lines_of_the_harness_are_added_up() {
        let mut results = Results::default();
        results.read("test result: ok. 12 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out; finished in 0.20s");
        results.read("test result: FAILED. 3 passed; 2 failed; 0 ignored; 0 measured; 0 filtered out; finished in 1s");
        results.read("running 5 tests");
        assert_eq!((results.passed, results.failed, results.ignored, results.binaries), (15, 2, 1, 2));
    }

    #[test]
    fn the_free_space_is_read_from_df() {
        let text = "Filesystem     1024-blocks      Used Available Capacity Mounted on\n\
                    /dev/vda        263174212  12582912  83886080      13% /\n";
        assert_eq!(parse_df(text), Some(83_886_080 * 1024));
        assert_eq!(parse_df("Filesystem 1024-blocks Used Available Capacity Mounted on\n"), None);
        assert_eq!(show_bytes(Some(3 << 29)), "1.5 GiB");
    }

    #[test]
    fn a_skip_record_is_read_back() {
        let skip = Skip::parse("check\tRUSTLET_REQUIRE_ROOT\tnot root\tt (part)\tneeds root").expect("a record");
        assert!(!skip.whole_test);
        assert_eq!(
            (skip.variable.as_str(), skip.test.as_str(), skip.reason.as_str()),
            ("RUSTLET_REQUIRE_ROOT", "t (part)", "needs root")
        );
        assert!(Skip::parse("garbage").is_none());
    }
}
