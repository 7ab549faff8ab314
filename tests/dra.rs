//! DRA drivers (`DRAPlugin`) on a whole node, as real processes on real
//! Unix sockets: version negotiation, refusal of drivers the node cannot
//! serve, and seamless upgrade (two instances of one driver, calls to the
//! newest connected one, connections watched without calls).

mod common;

use std::path::Path;
use std::time::Duration;

use common::*;
use kubelet::dra::{ClaimRef, DraInstance, DraVersion};
use kubelet::node::{Node, NodeBuilder, NodeConfig};
use rustlet_testkit::process::PluginProcess;
use rustlet_testkit::report::Report;
use tokio_util::sync::CancellationToken;

const DRIVER: &str = "gpu.dra.example.com";

fn dra_driver_bin() -> &'static str {
    env!("CARGO_BIN_EXE_fake-dra-driver")
}

async fn start_node(root: &Path) -> (Node, CancellationToken) {
    let mut config = NodeConfig::new(root, "dra-node");
    config.http_address = None;
    config.plugins = test_config(&root.join("plugins_registry"));
    let shutdown = CancellationToken::new();
    let node = NodeBuilder::new(config).start(shutdown.clone()).await.expect("node");
    (node, shutdown)
}

async fn driver(root: &Path, instance: &str, versions: &[&str]) -> PluginProcess {
    let mut args: Vec<String> = ["--root-dir", &root.display().to_string(), "--driver", DRIVER, "--instance", instance]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
    args.extend(["--pool".into(), "dra-node".into(), "--count".into(), "4".into()]);
    for version in versions {
        args.extend(["--version".to_owned(), (*version).to_owned()]);
    }
    PluginProcess::spawn(dra_driver_bin(), &args).await.expect("start fake-dra-driver")
}

async fn verdict(driver: &mut PluginProcess) -> (bool, String) {
    match driver.wait_for(SOON, |r| matches!(r, Report::Notified { .. })).await.expect("told its registration") {
        Report::Notified { registered, error, .. } => (registered, error),
        other => panic!("unexpected {other:?}"),
    }
}

fn claim(n: u32) -> ClaimRef {
    ClaimRef { namespace: "default".into(), uid: format!("claim-uid-{n}"), name: format!("claim-{n}") }
}

/// Prepares `claim` and returns which instance answered (from the drivers'
/// reports) and the CDI IDs.
async fn prepare_on(
    node: &Node,
    claim: &ClaimRef,
    instances: &mut [(&str, &mut PluginProcess)],
) -> (String, Vec<String>) {
    let answer = node.dra_drivers().prepare(DRIVER, std::slice::from_ref(claim)).await.expect("NodePrepareResources");
    let devices = answer[&claim.uid].clone().expect("the claim prepared");
    assert_eq!(devices.len(), 1, "{devices:?}");
    assert_eq!(devices[0].pool, "dra-node");
    // The instance that answered reports it (its report line may trail the
    // answer): each is asked in turn until one has, within the deadline.
    let uid = claim.uid.clone();
    let deadline = tokio::time::Instant::now() + SOON;
    while tokio::time::Instant::now() < deadline {
        for (name, process) in instances.iter_mut() {
            let seen = process
                .wait_for(
                    Duration::from_millis(50),
                    |r| matches!(r, Report::DraPrepare { claims, .. } if claims.iter().any(|(u, _)| *u == uid)),
                )
                .await;
            if seen.is_ok() {
                return ((*name).to_owned(), devices[0].cdi_device_ids.clone());
            }
        }
    }
    panic!("no instance reported preparing {uid}");
}

fn connected(instances: &[DraInstance], endpoint_suffix: &str) -> bool {
    instances.iter().any(|i| i.endpoint.ends_with(endpoint_suffix) && i.connected)
}

/// The plugin's order of preference decides among the versions the node
/// serves; a driver of an older API (the `v1alpha3.NodeService` of the
/// Kubernetes 1.28–1.33 drivers) is refused with both lists named, and a
/// list without any version is refused too.
#[tokio::test]
async fn a_driver_gets_its_preferred_served_version_and_older_apis_are_refused() {
    let (root, _) = root_dir();
    let (node, _shutdown) = start_node(root.path()).await;

    let mut beta =
        driver(root.path(), "beta", &["v1alpha1.DRAResourceHealth", "v1beta1.DRAPlugin", "v1.DRAPlugin"]).await;
    assert_eq!(verdict(&mut beta).await, (true, String::new()));
    let registered = node.dra_drivers().list();
    assert_eq!(registered.len(), 1, "{registered:?}");
    assert_eq!(registered[0].version, DraVersion::V1beta1);
    assert!(
        node.dra_drivers().wait_until(SOON, |i| connected(i, "dra-beta.sock")).await,
        "{:?}",
        node.dra_drivers().list()
    );
    // Calls go over v1beta1 and come back whole.
    let (instance, cdi) = prepare_on(&node, &claim(1), &mut [("beta", &mut beta)]).await;
    assert_eq!(instance, "beta");
    assert_eq!(cdi, vec![format!("{DRIVER}/device=dev-0")]);
    let cdi_spec = std::fs::read_to_string(root.path().join("cdi").join(format!("{DRIVER}.json"))).expect("CDI spec");
    assert!(cdi_spec.contains("DRA_DEVICE_DEV_0=dev-0"), "{cdi_spec}");
    let released = node.dra_drivers().unprepare(DRIVER, &[claim(1)]).await.expect("NodeUnprepareResources");
    assert_eq!(released[&claim(1).uid], Ok(()));

    let mut old = driver(root.path(), "old", &["v1alpha3.NodeService"]).await;
    let (registered, error) = verdict(&mut old).await;
    assert!(!registered);
    assert!(error.contains("none of services supported by the plugin ([\"v1alpha3.NodeService\"])"), "{error}");
    assert!(error.contains("[\"v1.DRAPlugin\", \"v1beta1.DRAPlugin\"]"), "{error}");
    assert!(error.contains(DRIVER), "{error}");
    assert_eq!(node.dra_drivers().list().len(), 1, "the refused driver is not registered");

    let unknown = node.dra_drivers().prepare("absent.example.com", &[claim(2)]).await.expect_err("no such driver");
    assert_eq!(unknown.to_string(), "DRA driver absent.example.com is not registered");
}

/// Seamless upgrade: calls go to the newest connected instance; an
/// instance killed is seen disconnected without any call (its connection
/// is watched) and calls fall back to the other; the older one killed
/// mid-flow does not take the driver away; with every instance gone the
/// driver is unusable and a call says why; its sockets removed, it is
/// deregistered.
#[tokio::test]
async fn seamless_upgrade_sends_calls_to_the_newest_connected_instance() {
    let (root, _) = root_dir();
    let (node, _shutdown) = start_node(root.path()).await;
    let drivers = node.dra_drivers();

    let mut a = driver(root.path(), "a", &[]).await;
    assert_eq!(verdict(&mut a).await, (true, String::new()));
    assert!(drivers.wait_until(SOON, |i| connected(i, "dra-a.sock")).await, "{:?}", drivers.list());
    assert_eq!(prepare_on(&node, &claim(1), &mut [("a", &mut a)]).await.0, "a");

    // The new instance comes up beside the old one and takes the calls.
    let mut b = driver(root.path(), "b", &[]).await;
    assert_eq!(verdict(&mut b).await, (true, String::new()));
    assert!(drivers.wait_until(SOON, |i| connected(i, "dra-b.sock") && connected(i, "dra-a.sock")).await);
    assert_eq!(drivers.list().iter().filter(|i| i.driver == DRIVER).count(), 2);
    let (answered, cdi) = prepare_on(&node, &claim(2), &mut [("a", &mut a), ("b", &mut b)]).await;
    assert_eq!(answered, "b");
    assert_eq!(cdi, vec![format!("{DRIVER}/device=dev-1")], "the new instance knows what the old one prepared");

    // The new one dies: noticed without a call; the old one takes over.
    b.kill().await;
    assert!(drivers.wait_until(SOON, |i| !connected(i, "dra-b.sock")).await, "{:?}", drivers.list());
    assert!(drivers.usable(DRIVER));
    assert_eq!(prepare_on(&node, &claim(3), &mut [("a", &mut a), ("b", &mut b)]).await.0, "a");

    // A third instance, then the old one killed mid-flow: preparation
    // keeps working on the newest.
    let mut c = driver(root.path(), "c", &[]).await;
    assert_eq!(verdict(&mut c).await, (true, String::new()));
    assert!(drivers.wait_until(SOON, |i| connected(i, "dra-c.sock")).await);
    a.kill().await;
    assert_eq!(prepare_on(&node, &claim(4), &mut [("c", &mut c)]).await.0, "c");
    // Claim 1 was prepared by `a`: `c` gives the same device again.
    let again = drivers.prepare(DRIVER, &[claim(1)]).await.expect("prepare again");
    assert_eq!(again[&claim(1).uid].as_ref().expect("prepared")[0].device, "dev-0");

    // Every instance gone: unusable, and a call names the endpoint and why.
    c.kill().await;
    assert!(drivers.wait_until(SOON, |i| i.iter().all(|i| !i.connected)).await, "{:?}", drivers.list());
    assert!(!drivers.usable(DRIVER));
    let error = drivers.prepare(DRIVER, &[claim(5)]).await.expect_err("no instance runs");
    assert!(error.to_string().contains("dra-c.sock"), "the newest is tried: {error}");

    // A registration socket removed: that instance is deregistered.
    for instance in ["a", "b", "c"] {
        std::fs::remove_file(root.path().join("plugins_registry").join(format!("{DRIVER}-{instance}-reg.sock")))
            .expect("rm");
    }
    assert!(drivers.wait_until(SOON, <[DraInstance]>::is_empty).await, "{:?}", drivers.list());
}
