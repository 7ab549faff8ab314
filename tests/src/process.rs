//! Runs a test plugin binary as a child process and turns its report lines
//! into events a test can wait for, each with a deadline.

use std::ffi::OsStr;
use std::path::Path;
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::mpsc;

use crate::report::Report;

/// A running plugin process; killed when dropped.
pub struct PluginProcess {
    child: Child,
    reports: mpsc::UnboundedReceiver<Report>,
    /// Reports that arrived before `Listening`: a plugin binds its sockets
    /// before it says so, and the node may call it in between.
    early: std::collections::VecDeque<Report>,
    /// The copy another user runs, kept while it runs.
    _reachable: Option<crate::other_user::ReachableBinary>,
}

impl PluginProcess {
    /// Starts `program` with `args` and waits (up to 30 s) until it reports
    /// that its sockets are listening.
    pub async fn spawn<I, S>(program: impl AsRef<Path>, args: I) -> Result<Self, String>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        Self::spawn_as(program, args, None, None).await
    }

    /// [`PluginProcess::spawn`], as user and group `uid` (where given, which
    /// takes root) and with file mode mask `umask` (where given). Another
    /// user runs a [copy it can reach](crate::other_user::ReachableBinary).
    pub async fn spawn_as<I, S>(
        program: impl AsRef<Path>,
        args: I,
        uid: Option<u32>,
        umask: Option<u32>,
    ) -> Result<Self, String>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let reachable = match uid {
            Some(uid) if uid != 0 => Some(crate::other_user::ReachableBinary::new(program.as_ref())?),
            _ => None,
        };
        let program = reachable.as_ref().map_or(program.as_ref(), |copy| copy.path());
        let mut command = match umask {
            // The shell sets the mask and becomes the program.
            Some(mask) => {
                let mut shell = Command::new("sh");
                shell.arg("-c").arg(format!("umask {mask:03o} && exec \"$0\" \"$@\"")).arg(program);
                shell
            }
            None => Command::new(program),
        };
        if let Some(uid) = uid {
            command.uid(uid).gid(uid);
        }
        let mut child = command
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("spawn {}: {e}", program.display()))?;
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let (tx, reports) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            let mut lines = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                match serde_json::from_str::<Report>(&line) {
                    Ok(report) => {
                        if tx.send(report).is_err() {
                            break;
                        }
                    }
                    Err(_) => eprintln!("plugin stdout: {line}"),
                }
            }
        });
        let mut process = PluginProcess { child, reports, early: Default::default(), _reachable: None };
        let listening = async {
            while let Some(report) = process.reports.recv().await {
                if matches!(report, Report::Listening { .. }) {
                    return Ok(());
                }
                process.early.push_back(report);
            }
            Err(format!("{} exited before listening", program.display()))
        };
        tokio::time::timeout(Duration::from_secs(30), listening)
            .await
            .map_err(|_| format!("{} did not listen within 30s", program.display()))??;
        process._reachable = reachable;
        Ok(process)
    }

    /// Waits up to `deadline` for a report matching `pred`, skipping others.
    pub async fn wait_for(
        &mut self,
        deadline: Duration,
        mut pred: impl FnMut(&Report) -> bool,
    ) -> Result<Report, String> {
        let mut skipped = Vec::new();
        while let Some(report) = self.early.pop_front() {
            if pred(&report) {
                return Ok(report);
            }
            skipped.push(report);
        }
        let wait = async {
            while let Some(report) = self.reports.recv().await {
                if pred(&report) {
                    return Ok(report);
                }
                skipped.push(report);
            }
            Err(())
        };
        match tokio::time::timeout(deadline, wait).await {
            Ok(Ok(report)) => Ok(report),
            Ok(Err(())) => {
                // Say how it ended, so that a failure explains itself.
                let status = tokio::time::timeout(Duration::from_secs(5), self.child.wait()).await;
                Err(format!("the plugin's output ended (exit: {status:?}); reports before the end: {skipped:?}"))
            }
            Err(_) => Err(format!("no matching plugin report within {deadline:?}; reports seen: {skipped:?}")),
        }
    }

    /// Waits up to `deadline` for the process to exit.
    pub async fn wait_exit(&mut self, deadline: Duration) -> Result<ExitStatus, String> {
        tokio::time::timeout(deadline, self.child.wait())
            .await
            .map_err(|_| format!("plugin still running after {deadline:?}"))?
            .map_err(|e| e.to_string())
    }

    /// Writes one command line to the plugin's stdin.
    pub async fn send(&mut self, line: &str) -> Result<(), String> {
        use tokio::io::AsyncWriteExt;
        let stdin = self.child.stdin.as_mut().ok_or("stdin closed")?;
        stdin.write_all(format!("{line}\n").as_bytes()).await.map_err(|e| e.to_string())?;
        stdin.flush().await.map_err(|e| e.to_string())
    }

    /// Kills the process (SIGKILL) and reaps it. Its sockets stay on disk.
    pub async fn kill(&mut self) {
        let _ = self.child.kill().await;
    }

    /// The process id.
    pub fn id(&self) -> Option<u32> {
        self.child.id()
    }
}

/// Runs `script` (with `sh -c script args…`) once this test binary exits,
/// however it exits: the shell first reads its stdin, which is a pipe whose
/// other end only this process holds, so the read returns when the process
/// is gone. Keep the returned pair alive as long as the process runs.
pub fn when_this_process_exits(
    script: &str,
    args: &[String],
) -> (Option<std::process::ChildStdin>, Option<std::process::Child>) {
    let watcher = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("cat >/dev/null; {script}"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn();
    match watcher {
        Ok(mut watcher) => (watcher.stdin.take(), Some(watcher)),
        Err(_) => (None, None),
    }
}
