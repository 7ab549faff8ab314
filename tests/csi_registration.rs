//! The `CSIPlugin` handler against the fake CSI driver binary: version rules,
//! one driver per name, NodeGetInfo with a deadline, node info publishing.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use kubelet::plugin_manager::{PluginEvent, PluginState};
use kubelet_api::constants::CSI_NODE_ID_ANNOTATION;
use rustlet_testkit::process::PluginProcess;
use rustlet_testkit::report::Report;

struct Driver {
    process: PluginProcess,
    registration: PathBuf,
    endpoint: PathBuf,
}

async fn start_driver(node: &TestNode, name: &str, socket: &str, extra: &[&str]) -> Driver {
    let registration = node.socket(socket);
    let endpoint = node.root.path().join("plugins").join(socket).join("csi.sock");
    let mut args = vec![
        "--registration-socket".to_owned(),
        registration.display().to_string(),
        "--endpoint".to_owned(),
        endpoint.display().to_string(),
        "--name".to_owned(),
        name.to_owned(),
    ];
    args.extend(extra.iter().map(|s| (*s).to_owned()));
    let process = PluginProcess::spawn(csi_driver_bin(), &args).await.expect("start fake-csi-driver");
    Driver { process, registration, endpoint }
}

fn notified(socket: &Path) -> impl FnMut(&Report) -> bool + '_ {
    move |r| matches!(r, Report::Notified { socket: s, .. } if s == socket)
}

async fn verdict(node: &TestNode, driver: &mut Driver) -> (bool, String) {
    let report = driver.process.wait_for(SOON, notified(&driver.registration)).await;
    let report = report.unwrap_or_else(|e| {
        panic!(
            "{}: {e}\nnode: {:?}\n{:#?}",
            driver.registration.display(),
            *node.handle.counts().borrow(),
            node.handle.status()
        )
    });
    match report {
        Report::Notified { registered, error, .. } => (registered, error),
        other => panic!("unexpected {other:?}"),
    }
}

#[tokio::test]
async fn csi_driver_registration_publishes_node_info() {
    let node = TestNode::start().await;
    let mut events = node.events();
    let mut driver = start_driver(
        &node,
        "hostpath.csi.example.com",
        "hostpath.sock",
        &["--node-id", "node-7", "--max-volumes", "12", "--topology", "zone=z1", "--topology", "rack=r2"],
    )
    .await;
    driver.process.wait_for(SOON, |r| matches!(r, Report::NodeGetInfo { .. })).await.expect("NodeGetInfo called");
    assert_eq!(verdict(&node, &mut driver).await, (true, String::new()));
    next_event(&mut events, "registered", registered_at(&driver.registration)).await;

    let registered = node.csi_drivers.get("hostpath.csi.example.com").expect("in the registry");
    assert_eq!(registered.endpoint, driver.endpoint.display().to_string());
    assert_eq!(registered.version.to_string(), "1.0.0");
    let info = node.node_info.snapshot();
    assert_eq!(info.annotations[CSI_NODE_ID_ANNOTATION], r#"{"hostpath.csi.example.com":"node-7"}"#);
    assert_eq!(info.labels.get("zone").map(String::as_str), Some("z1"));
    assert_eq!(info.drivers.len(), 1);
    assert_eq!(info.drivers[0].topology_keys, vec!["rack".to_owned(), "zone".to_owned()]);
    assert_eq!(info.drivers[0].allocatable_count, Some(12));
}

/// The kubelet's CSI version rules, over the wire: rejected lists reach the plugin
/// with the reason; accepted ones register with the highest 1.x version.
#[tokio::test]
async fn csi_version_lists_are_checked() {
    let node = TestNode::start().await;
    for (i, (versions, reason)) in [
        ("", "CSI driver reported an empty list of supported versions"),
        ("0.3.0", "highest supported version reported by driver is 0.3.0, must be v1.x"),
        ("4.9.12,2.0.1", r#"none of the versions ["4.9.12", "2.0.1"] reported by the driver is supported"#),
        ("var,boo", r#"none of the versions ["var", "boo"] reported by the driver is supported"#),
    ]
    .into_iter()
    .enumerate()
    {
        let name = format!("bad{i}.csi.example.com");
        let mut driver = start_driver(&node, &name, &format!("bad{i}.sock"), &["--versions", versions]).await;
        let (registered, error) = verdict(&node, &mut driver).await;
        assert!(!registered, "{versions:?}");
        let want = format!(
            "RegisterPlugin error -- plugin validation failed with err: validation failed for CSI driver {name} at endpoint {}: {reason}",
            driver.endpoint.display()
        );
        assert_eq!(error, want, "{versions:?}");
    }
    for (i, (versions, want)) in
        [("1.0.0", "1.0.0"), ("v1.0.0", "1.0.0"), ("0.2.0,v1.2.3", "1.2.3")].into_iter().enumerate()
    {
        let name = format!("good{i}.csi.example.com");
        let mut driver = start_driver(&node, &name, &format!("good{i}.sock"), &["--versions", versions]).await;
        assert_eq!(verdict(&node, &mut driver).await, (true, String::new()), "{versions:?}");
        assert_eq!(node.csi_drivers.get(&name).expect("registered").version.to_string(), want);
    }
    assert!(node.csi_drivers.list().iter().all(|d| d.name.starts_with("good")));
}

/// Bad input: the same CSI driver name on two sockets. The second is turned
/// down; when the first goes away, the second registers without waiting out
/// its backoff.
#[tokio::test]
async fn same_csi_driver_name_on_two_sockets() {
    let (root, registry) = root_dir();
    let node = TestNode::start_in(root, registry, |c| {
        // A long backoff proves the second socket is retried because the
        // first went away, not because its backoff ran out.
        c.plugins.initial_backoff = std::time::Duration::from_secs(600);
        c.plugins.max_backoff = std::time::Duration::from_secs(600);
    })
    .await;
    let mut events = node.events();
    let mut first = start_driver(&node, "twin.csi.example.com", "first.sock", &["--node-id", "first"]).await;
    assert_eq!(verdict(&node, &mut first).await, (true, String::new()));
    let mut second = start_driver(&node, "twin.csi.example.com", "second.sock", &["--node-id", "second"]).await;
    let (registered, error) = verdict(&node, &mut second).await;
    assert!(!registered);
    assert!(
        error.contains(&format!(
            "CSI driver twin.csi.example.com is already registered with version 1.0.0 from socket {}",
            first.registration.display()
        )),
        "{error}"
    );
    next_event(&mut events, "second rejected", failed_at(&second.registration)).await;
    assert_eq!(node.status_of(&second.registration).await.expect("listed").state, PluginState::BackingOff);

    first.process.kill().await;
    std::fs::remove_file(&first.registration).expect("remove the first socket");
    next_event(&mut events, "second registered", registered_at(&second.registration)).await;
    let driver = node.csi_drivers.get("twin.csi.example.com").expect("registered");
    assert_eq!(driver.socket_path, second.registration);
    assert_eq!(node.node_info.snapshot().drivers[0].node_id, "second");
}

/// A second socket offering a higher version replaces the registered driver;
/// deregistering the older socket afterwards leaves the newer one alone.
#[tokio::test]
async fn higher_version_replaces_the_registered_driver() {
    let node = TestNode::start().await;
    let mut old = start_driver(&node, "up.csi.example.com", "old.sock", &["--versions", "1.0.0"]).await;
    assert_eq!(verdict(&node, &mut old).await, (true, String::new()));
    let mut new =
        start_driver(&node, "up.csi.example.com", "new.sock", &["--versions", "1.5.0", "--node-id", "n2"]).await;
    assert_eq!(verdict(&node, &mut new).await, (true, String::new()));
    assert_eq!(node.csi_drivers.get("up.csi.example.com").expect("present").version.to_string(), "1.5.0");
    std::fs::remove_file(&old.registration).expect("rm old");
    node.wait_counts("old deregistered", |c| c.registered == 1 && c.deregistrations == 1).await;
    let driver = node.csi_drivers.get("up.csi.example.com").expect("still present");
    assert_eq!(driver.socket_path, new.registration);
    assert_eq!(node.node_info.snapshot().drivers[0].node_id, "n2");
}

/// Bad input: a plugin told `plugin_registered=false` exits and leaves its
/// socket behind, as the node-driver-registrar does. The node backs off on
/// the stale socket; other drivers are unaffected.
#[tokio::test]
async fn rejected_registrar_that_exits_leaves_a_stale_socket_that_backs_off() {
    let node = TestNode::start().await;
    let mut events = node.events();
    let mut rejected =
        start_driver(&node, "old.csi.example.com", "old.sock", &["--versions", "0.3.0", "--exit-on-rejection"]).await;
    let (registered, _) = verdict(&node, &mut rejected).await;
    assert!(!registered);
    rejected.process.wait_exit(SOON).await.expect("the registrar exits");
    assert!(rejected.registration.exists(), "its socket stays behind");
    let event = next_event(&mut events, "a dial failure on the stale socket", |e| {
        matches!(e, PluginEvent::RegistrationFailed { socket_path, error, .. }
            if socket_path == &rejected.registration && error.contains("Connection refused"))
    })
    .await;
    let PluginEvent::RegistrationFailed { failures, .. } = event else { unreachable!() };
    assert!(failures >= 2);
    let mut fine = start_driver(&node, "fine.csi.example.com", "fine.sock", &[]).await;
    assert_eq!(verdict(&node, &mut fine).await, (true, String::new()));
    let status = node.status_of(&rejected.registration).await.expect("listed");
    assert!(matches!(status.state, PluginState::BackingOff | PluginState::Registering), "{status:?}");
    assert!(status.plugin.is_none());
}

/// Bad input: NodeGetInfo never answers. The registration fails at its
/// deadline, is undone, and the plugin is told why.
#[tokio::test]
async fn node_get_info_that_hangs_fails_the_registration() {
    let (root, registry) = root_dir();
    let node = TestNode::start_in(root, registry, |c| c.csi.node_get_info_timeout = HANG_DEADLINE).await;
    let mut driver = start_driver(&node, "slow.csi.example.com", "slow.sock", &["--node-get-info", "hang"]).await;
    let (registered, error) = verdict(&node, &mut driver).await;
    assert!(!registered);
    assert_eq!(
        error,
        format!(
            "RegisterPlugin error -- plugin registration failed with err: CSI driver slow.csi.example.com: NodeGetInfo failed: NodeGetInfo at {} did not answer within 500ms",
            driver.endpoint.display()
        )
    );
    assert!(node.csi_drivers.get("slow.csi.example.com").is_none(), "undone");
    assert!(node.node_info.snapshot().drivers.is_empty());
}

#[tokio::test]
async fn node_get_info_error_fails_the_registration() {
    let node = TestNode::start().await;
    let mut driver = start_driver(&node, "err.csi.example.com", "err.sock", &["--node-get-info", "fail"]).await;
    let (registered, error) = verdict(&node, &mut driver).await;
    assert!(!registered);
    assert!(error.contains("fake CSI driver told to fail NodeGetInfo"), "{error}");
    assert!(node.csi_drivers.list().is_empty());
}

/// A driver whose endpoint does not exist (the plugin lies) is turned down.
#[tokio::test]
async fn csi_endpoint_that_does_not_exist_fails_the_registration() {
    let node = TestNode::start().await;
    let socket = node.socket("liar.sock");
    let mut plugin = registration_plugin(&[
        "--socket",
        &node.socket_str("liar.sock"),
        "--type",
        "CSIPlugin",
        "--name",
        "liar.csi.example.com",
        "--endpoint",
        "/nonexistent/csi.sock",
    ])
    .await;
    let Report::Notified { registered, error, .. } = plugin.wait_for(SOON, notified(&socket)).await.expect("notified")
    else {
        unreachable!()
    };
    assert!(!registered);
    assert!(error.contains("NodeGetInfo failed: dial /nonexistent/csi.sock"), "{error}");
}

#[tokio::test]
async fn removed_csi_driver_is_dropped_from_registry_and_node_info() {
    let node = TestNode::start().await;
    let mut keep = start_driver(&node, "keep.csi.example.com", "keep.sock", &["--topology", "zone=z9"]).await;
    let mut gone = start_driver(&node, "gone.csi.example.com", "gone.sock", &[]).await;
    assert!(verdict(&node, &mut keep).await.0 && verdict(&node, &mut gone).await.0);
    std::fs::remove_file(&gone.registration).expect("rm");
    node.wait_counts("one deregistered", |c| c.deregistrations == 1 && c.registered == 1).await;
    assert_eq!(node.csi_drivers.list().len(), 1);
    let info = node.node_info.snapshot();
    assert_eq!(info.annotations[CSI_NODE_ID_ANNOTATION], r#"{"keep.csi.example.com":"node-1"}"#);
    assert_eq!(info.drivers.iter().map(|d| d.name.as_str()).collect::<Vec<_>>(), ["keep.csi.example.com"]);
}

/// A newer registration of a driver name that fails (here NodeGetInfo) or
/// goes away hands the name back to the older registration, which is still
/// registered with the plugin manager (upstream would lose both).
#[tokio::test]
async fn failed_or_removed_newer_driver_falls_back_to_the_older_one() {
    let node = TestNode::start().await;
    let mut old =
        start_driver(&node, "fb.csi.example.com", "old.sock", &["--versions", "1.0.0", "--node-id", "old"]).await;
    assert_eq!(verdict(&node, &mut old).await, (true, String::new()));
    let mut broken = start_driver(
        &node,
        "fb.csi.example.com",
        "broken.sock",
        &["--versions", "1.5.0", "--node-id", "broken", "--node-get-info", "fail"],
    )
    .await;
    assert!(!verdict(&node, &mut broken).await.0);
    assert_eq!(node.csi_drivers.get("fb.csi.example.com").expect("present").socket_path, old.registration);
    assert_eq!(node.node_info.snapshot().drivers[0].node_id, "old");
    broken.process.kill().await;
    std::fs::remove_file(&broken.registration).expect("rm broken");

    let mut newer =
        start_driver(&node, "fb.csi.example.com", "new.sock", &["--versions", "1.5.0", "--node-id", "new"]).await;
    assert_eq!(verdict(&node, &mut newer).await, (true, String::new()));
    assert_eq!(node.node_info.snapshot().drivers[0].node_id, "new");
    std::fs::remove_file(&newer.registration).expect("rm newer");
    node.wait_counts("newer deregistered", |c| c.deregistrations == 1).await;
    let active = node.csi_drivers.get("fb.csi.example.com").expect("the older one is active again");
    assert_eq!(active.socket_path, old.registration);
    let info = node.node_info.snapshot();
    assert_eq!(info.drivers[0].node_id, "old");
    assert_eq!(info.annotations[CSI_NODE_ID_ANNOTATION], r#"{"fb.csi.example.com":"old"}"#);
}
