//! A DRA driver test plugin: one instance of the sample DRA driver
//! (`rustlet_sample_plugins::dra_driver`), reporting on stdout as JSON lines.
//! It serves until killed (a `kill -9` leaves its sockets behind, as a
//! crashed driver does).
//!
//!   fake-dra-driver --root-dir /r --driver gpu.example.com --instance a \
//!     --pool node-1 --count 2 [--version v1beta1.DRAPlugin]... [--kubeconfig node.kubeconfig]

use std::path::PathBuf;

use clap::Parser;
use rustlet_testkit::dra_driver::{DraDriver, DraDriverConfig};
use rustlet_testkit::report::{Report, Reporter};
use tokio_util::sync::CancellationToken;

#[derive(Parser)]
struct Args {
    /// The node's root dir (`plugins_registry/` and `plugins/` are in it).
    #[arg(long)]
    root_dir: PathBuf,
    /// The driver's name.
    #[arg(long)]
    driver: String,
    /// This instance's name.
    #[arg(long)]
    instance: String,
    /// The pool (the node's name).
    #[arg(long)]
    pool: String,
    /// Devices `dev-0` … `dev-<count-1>`.
    #[arg(long, default_value_t = 1)]
    count: usize,
    /// A version to announce, in order (default: v1.DRAPlugin, v1beta1.DRAPlugin).
    #[arg(long)]
    version: Vec<String>,
    /// Where the CDI spec goes (default: `<root-dir>/cdi`).
    #[arg(long)]
    cdi_dir: Option<PathBuf>,
    /// The node's kubeconfig: publish a ResourceSlice, prepare what the
    /// claims' allocations say.
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let devices = (0..args.count).map(|i| format!("dev-{i}")).collect();
    let mut config = DraDriverConfig::new(&args.driver, &args.instance, &args.root_dir, &args.pool, devices);
    if !args.version.is_empty() {
        config.versions = args.version;
    }
    if let Some(dir) = args.cdi_dir {
        config.cdi_dir = dir;
    }
    let mut driver = DraDriver::new(config, Reporter::Stdout);
    if let Some(path) = args.kubeconfig {
        let kubeconfig = kube::config::Kubeconfig::read_from(&path)?;
        let options = kube::config::KubeConfigOptions::default();
        let config = kube::Config::from_custom_kubeconfig(kubeconfig, &options).await?;
        driver = driver.with_client(kube::Client::try_from(config)?);
    }
    let server = driver.spawn(CancellationToken::new())?;
    Reporter::Stdout.report(Report::Listening { sockets: 2 });
    server.await?;
    Ok(())
}
