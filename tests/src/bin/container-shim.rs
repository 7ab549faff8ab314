//! The host provider's container shim: runs one container's command so that
//! it outlives the node (like containerd's shims).
//!
//!   container-shim --dir STATE --log LOG -- COMMAND ARGS...
//!
//! It holds an exclusive lock on `STATE/lock` for as long as it runs (a
//! waiter blocks on that lock: no polling), starts the command with the env
//! it was given, prints `ready` on stdout once the lock is held and the
//! command runs, copies the command's output to LOG in the CRI log format,
//! and writes the exit code to `STATE/exit` (atomically) when the command
//! ends. SIGTERM is not the shim's: it is passed to the command (the node
//! signals the process group) and the shim keeps waiting to record the exit.

use std::io::Write;
use std::path::PathBuf;
use std::process::Stdio;

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

fn usage() -> ! {
    eprintln!("usage: container-shim --dir STATE --log LOG -- COMMAND [ARGS...]");
    std::process::exit(2);
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let mut args = std::env::args().skip(1);
    let (mut dir, mut log) = (None, None);
    let mut argv = Vec::new();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--dir" => dir = args.next().map(PathBuf::from),
            "--log" => log = args.next().map(PathBuf::from),
            "--" => argv.extend(args.by_ref()),
            _ => usage(),
        }
    }
    let (Some(dir), Some(log), false) = (dir, log, argv.is_empty()) else { usage() };
    if let Err(error) = run(dir, log, argv).await {
        eprintln!("container-shim: {error}");
        std::process::exit(1);
    }
}

async fn run(dir: PathBuf, log: PathBuf, argv: Vec<String>) -> std::io::Result<()> {
    let lock = std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(dir.join("lock"))?;
    lock.lock()?;
    // Ignore SIGTERM/SIGINT: the command gets them (same process group).
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut int = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())?;
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
        }
    });
    let mut child = tokio::process::Command::new(&argv[0])
        .args(&argv[1..])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let log_file = std::sync::Arc::new(tokio::sync::Mutex::new(
        tokio::fs::OpenOptions::new().create(true).append(true).open(&log).await?,
    ));
    let mut copies = Vec::new();
    let code = match child.as_mut() {
        Ok(child) => {
            std::fs::write(dir.join("pid"), child.id().unwrap_or_default().to_string())?;
            for (stream, name) in [
                (child.stdout.take().map(|s| Box::new(s) as Box<dyn tokio::io::AsyncRead + Unpin + Send>), "stdout"),
                (child.stderr.take().map(|s| Box::new(s) as Box<dyn tokio::io::AsyncRead + Unpin + Send>), "stderr"),
            ] {
                if let Some(stream) = stream {
                    copies.push(tokio::spawn(copy_lines(stream, name, log_file.clone())));
                }
            }
            say_ready();
            None
        }
        Err(error) => {
            let line = kubelet::provider::cri_log_line("stderr", &format!("cannot run {:?}: {error}", argv[0]));
            log_file.lock().await.write_all(line.as_bytes()).await?;
            say_ready();
            Some(127)
        }
    };
    let code = match (code, child) {
        (Some(code), _) => code,
        (None, Ok(mut child)) => {
            let status = child.wait().await?;
            use std::os::unix::process::ExitStatusExt;
            status.code().unwrap_or_else(|| 128 + status.signal().unwrap_or(9))
        }
        (None, Err(_)) => 127,
    };
    for copy in copies {
        let _ = copy.await;
    }
    let temp = dir.join(".exit.tmp");
    std::fs::write(&temp, code.to_string())?;
    std::fs::rename(&temp, dir.join("exit"))?;
    Ok(())
}

fn say_ready() {
    let mut out = std::io::stdout();
    let _ = writeln!(out, "ready");
    let _ = out.flush();
}

async fn copy_lines(
    stream: impl tokio::io::AsyncRead + Unpin,
    name: &'static str,
    log: std::sync::Arc<tokio::sync::Mutex<tokio::fs::File>>,
) {
    let mut lines = BufReader::new(stream).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        let entry = kubelet::provider::cri_log_line(name, &line);
        let _ = log.lock().await.write_all(entry.as_bytes()).await;
    }
}
