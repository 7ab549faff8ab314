//! The plugin registration service against real plugin processes over real
//! Unix sockets: watcher, desired/actual state, reconciler and executor.
//! Upstream test names are given where a test mirrors one.

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::*;
use kubelet::plugin_manager::{PluginEvent, PluginState};
use rustlet_testkit::registration::{Behaviour, Identity, RegistrationPlugin};
use rustlet_testkit::report::{Report, Reporter};
use tokio_util::sync::CancellationToken;

fn notified(socket: &std::path::Path) -> impl FnMut(&Report) -> bool + '_ {
    move |r| matches!(r, Report::Notified { socket: s, .. } if s == socket)
}

/// Upstream: TestPluginRegistration.
#[tokio::test]
async fn socket_created_after_start_is_registered_and_told_so() {
    let node = TestNode::start().await;
    let socket = node.socket("example.sock");
    let mut events = node.events();
    let mut plugin =
        registration_plugin(&["--socket", &node.socket_str("example.sock"), "--type", EXAMPLE_TYPE, "--name", "ex-1"])
            .await;
    let report = plugin.wait_for(SOON, notified(&socket)).await.expect("notified");
    assert_eq!(report, Report::Notified { socket: socket.clone(), registered: true, error: String::new() });
    next_event(&mut events, "registered", registered_at(&socket)).await;
    let calls = node.example.calls();
    assert_eq!(calls, vec![Call::Validate("ex-1".into()), Call::Register("ex-1".into(), socket.clone())]);
    let status = node.status_of(&socket).await.expect("listed");
    assert_eq!(status.state, PluginState::Registered);
    let info = status.plugin.expect("plugin info");
    assert_eq!(info.endpoint, socket.display().to_string(), "an empty endpoint defaults to the socket path");
}

/// Upstream: TestPluginRegistrationAtKubeletStart.
#[tokio::test]
async fn sockets_present_at_start_are_registered() {
    let (root, registry) = root_dir();
    let nested = registry.join("vendor/deep");
    let mut plugin = registration_plugin(&[
        "--dir",
        registry.to_str().expect("utf8"),
        "--count",
        "5",
        "--socket",
        nested.join("nested.sock").to_str().expect("utf8"),
        "--type",
        EXAMPLE_TYPE,
    ])
    .await;
    let node = TestNode::start_in(root, registry.clone(), |_| {}).await;
    node.wait_counts("6 plugins registered", |c| c.registered == 6).await;
    plugin.wait_for(SOON, notified(&nested.join("nested.sock"))).await.expect("nested one notified");
}

/// Upstream: TestPluginRegistrationSameName — plugins are keyed by socket
/// path, not by name.
#[tokio::test]
async fn same_name_on_many_sockets_registers_each_socket() {
    let node = TestNode::start().await;
    let _plugin = registration_plugin(&[
        "--dir",
        node.registry_dir.to_str().expect("utf8"),
        "--count",
        "10",
        "--type",
        EXAMPLE_TYPE,
        "--name",
        "same-name",
    ])
    .await;
    node.wait_counts("10 registered", |c| c.registered == 10).await;
    let calls = node.example.calls();
    let sockets: BTreeSet<_> = calls
        .iter()
        .filter_map(|c| match c {
            Call::Register(name, socket) if name == "same-name" => Some(socket.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(sockets.len(), 10);
}

/// Upstream: TestPluginReRegistration — each recreation is a new instance:
/// deregistered, then registered again.
#[tokio::test]
async fn recreated_socket_is_reregistered_with_new_uuid() {
    let node = TestNode::start().await;
    let socket = node.socket("again.sock");
    let identity = || Identity { plugin_type: EXAMPLE_TYPE.into(), name: "again".into(), ..Default::default() };
    let mut events = node.events();
    for round in 0..10 {
        let stop = CancellationToken::new();
        let server = RegistrationPlugin::new(&socket, identity(), Behaviour::Normal, Reporter::Discard)
            .spawn(stop.clone())
            .expect("serve");
        next_event(&mut events, "registered", registered_at(&socket)).await;
        stop.cancel();
        server.await.expect("server stopped");
        std::fs::remove_file(&socket).expect("remove socket");
        next_event(&mut events, "deregistered", deregistered_at(&socket)).await;
        let registers = node.example.calls().iter().filter(|c| matches!(c, Call::Register(..))).count();
        assert_eq!(registers, round + 1);
    }
    let calls = node.example.calls();
    let kinds: Vec<_> =
        calls.iter().filter(|c| !matches!(c, Call::Validate(_))).map(|c| matches!(c, Call::Register(..))).collect();
    assert_eq!(kinds, [true, false].repeat(10), "register/deregister alternate: {calls:?}");
}

/// A socket replaced in place (bind over a stale file, no removal event in
/// between that we wait for) is still a new instance.
#[tokio::test]
async fn socket_replaced_in_place_is_deregistered_then_registered() {
    let node = TestNode::start().await;
    let socket = node.socket("swap.sock");
    let identity = || Identity { plugin_type: EXAMPLE_TYPE.into(), name: "swap".into(), ..Default::default() };
    let mut events = node.events();
    let first = CancellationToken::new();
    let server = RegistrationPlugin::new(&socket, identity(), Behaviour::Normal, Reporter::Discard)
        .spawn(first.clone())
        .expect("serve");
    next_event(&mut events, "first registration", registered_at(&socket)).await;
    first.cancel();
    server.await.expect("stopped");
    // `bind` removes the stale socket and binds a new one at once.
    let _second = RegistrationPlugin::new(&socket, identity(), Behaviour::Normal, Reporter::Discard)
        .spawn(CancellationToken::new())
        .expect("serve again");
    next_event(&mut events, "deregistration of the old instance", deregistered_at(&socket)).await;
    next_event(&mut events, "registration of the new instance", registered_at(&socket)).await;
    assert_eq!(node.wait_counts("one registered", |c| c.registered == 1).await.registered, 1);
}

/// Upstream: TestPluginRegistrationSubDirs, plus the inotify race: a socket
/// bound right after `mkdir -p a/b` is not always reported, so new
/// directories are walked.
#[tokio::test]
async fn socket_bound_right_after_mkdir_p_is_registered() {
    let node = TestNode::start().await;
    for i in 0..100 {
        let dir = node.registry_dir.join(format!("a{i}/b{i}"));
        std::fs::create_dir_all(&dir).expect("mkdir -p");
        let _listener = RegistrationPlugin::new(
            dir.join("p.sock"),
            Identity { plugin_type: EXAMPLE_TYPE.into(), name: format!("nested-{i}"), ..Default::default() },
            Behaviour::Normal,
            Reporter::Discard,
        )
        .spawn(CancellationToken::new())
        .expect("serve");
    }
    node.wait_counts("100 nested plugins registered", |c| c.registered == 100).await;
}

#[tokio::test]
async fn removed_socket_is_deregistered_and_its_directory_removal_too() {
    let node = TestNode::start().await;
    let dir = node.registry_dir.join("vendor");
    let _plugin = registration_plugin(&[
        "--dir",
        dir.to_str().expect("utf8"),
        "--count",
        "3",
        "--socket",
        &node.socket_str("top.sock"),
        "--type",
        EXAMPLE_TYPE,
    ])
    .await;
    node.wait_counts("4 registered", |c| c.registered == 4).await;
    std::fs::remove_file(node.socket("top.sock")).expect("rm socket");
    node.wait_counts("3 left", |c| c.registered == 3).await;
    std::fs::remove_dir_all(&dir).expect("rm -r dir");
    node.wait_counts("none left", |c| c.registered == 0 && c.desired == 0).await;
    let deregistered = node.example.calls().iter().filter(|c| matches!(c, Call::Deregister(..))).count();
    assert_eq!(deregistered, 4);
}

/// Upstream ignores renames; a rename away is a removal here and a rename in
/// a creation, for sockets and for whole directories.
#[tokio::test]
async fn rename_away_deregisters_and_rename_in_registers() {
    let node = TestNode::start().await;
    let outside = node.root.path().join("outside");
    std::fs::create_dir_all(outside.join("dir")).expect("mkdir");
    let _plugin = registration_plugin(&[
        "--socket",
        &node.socket_str("moving.sock"),
        "--socket",
        outside.join("dir/inner.sock").to_str().expect("utf8"),
        "--type",
        EXAMPLE_TYPE,
    ])
    .await;
    node.wait_counts("moving.sock registered", |c| c.registered == 1).await;
    std::fs::rename(node.socket("moving.sock"), outside.join("moving.sock")).expect("rename away");
    node.wait_counts("moved away", |c| c.registered == 0 && c.desired == 0).await;
    std::fs::rename(outside.join("dir"), node.socket("dir")).expect("rename dir in");
    node.wait_counts("directory renamed in", |c| c.registered == 1).await;
    assert!(node.status_of(&node.socket("dir/inner.sock")).await.is_some());
    std::fs::rename(outside.join("moving.sock"), node.socket("back.sock")).expect("rename in");
    node.wait_counts("renamed back in", |c| c.registered == 2).await;
    std::fs::rename(node.socket("dir"), outside.join("dir-again")).expect("rename dir away");
    node.wait_counts("directory renamed away", |c| c.registered == 1 && c.desired == 1).await;
}

/// Bad input: a GetInfo that never answers. Deadline, and other plugins keep
/// registering meanwhile (upstream: concurrent operations on different sockets).
#[tokio::test]
async fn hanging_get_info_times_out_without_delaying_others() {
    let (root, registry) = root_dir();
    let node = TestNode::start_in(root, registry, |c| c.plugins.get_info_timeout = HANG_DEADLINE).await;
    let hung = node.socket("hung.sock");
    let mut events = node.events();
    let _hung = registration_plugin(&["--socket", &node.socket_str("hung.sock"), "--behaviour", "hang-get-info"]).await;
    let _fine = registration_plugin(&[
        "--dir",
        node.registry_dir.join("fine").to_str().expect("utf8"),
        "--count",
        "5",
        "--type",
        EXAMPLE_TYPE,
    ])
    .await;
    node.wait_counts("the healthy plugins registered", |c| c.registered == 5).await;
    let event = next_event(&mut events, "the hung plugin's failure", failed_at(&hung)).await;
    let PluginEvent::RegistrationFailed { error, .. } = event else { unreachable!() };
    assert_eq!(error, format!("GetInfo at socket {} did not answer within 500ms", hung.display()));
}

/// Bad input: a stale socket nobody listens on backs off (doubling delays)
/// and is logged loudly once, then only at debug level.
#[tokio::test(flavor = "current_thread")]
async fn stale_socket_backs_off_quietly() {
    let logs = LogCapture::start();
    let node = TestNode::start().await;
    let stale = node.socket("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).expect("bind"));
    let mut events = node.events();
    let mut times = Vec::new();
    for n in 1..=4 {
        let event = next_event(&mut events, "a failed attempt", failed_at(&stale)).await;
        let PluginEvent::RegistrationFailed { error, failures, .. } = event else { unreachable!() };
        assert_eq!(failures, n);
        assert!(error.contains("Connection refused"), "{error}");
        times.push(tokio::time::Instant::now());
    }
    // Backoff 100, 200, 400 ms between attempts: at least 700 ms for 3 gaps.
    assert!(times[3] - times[0] >= Duration::from_millis(700), "{:?}", times[3] - times[0]);
    let status = node.status_of(&stale).await.expect("listed");
    assert!(matches!(status.state, PluginState::BackingOff | PluginState::Registering), "{status:?}");
    assert!(status.last_error.expect("error").contains("Connection refused"));
    let warnings = logs.lines().into_iter().filter(|l| l.contains("WARN") && l.contains("stale.sock")).count();
    assert_eq!(warnings, 1, "one warning, then quiet: {:#?}", logs.lines());
}

/// Bad input: unknown type — the plugin is told why, upstream's text.
#[tokio::test]
async fn unknown_plugin_type_is_told_why() {
    let node = TestNode::start().await;
    let socket = node.socket("bogus.sock");
    let mut events = node.events();
    let mut plugin = registration_plugin(&["--socket", &node.socket_str("bogus.sock"), "--type", "BogusPlugin"]).await;
    let report = plugin.wait_for(SOON, notified(&socket)).await.expect("notified");
    let want = format!(
        "RegisterPlugin error -- no handler registered for plugin type: BogusPlugin at socket {}",
        socket.display()
    );
    assert_eq!(report, Report::Notified { socket: socket.clone(), registered: false, error: want });
    next_event(&mut events, "failure", failed_at(&socket)).await;
    assert_eq!(node.status_of(&socket).await.expect("listed").failures, 1);
}

/// Bad input: empty name.
#[tokio::test]
async fn empty_plugin_name_is_rejected() {
    let node = TestNode::start().await;
    let socket = node.socket("noname.sock");
    let mut events = node.events();
    let mut plugin =
        registration_plugin(&["--socket", &node.socket_str("noname.sock"), "--type", EXAMPLE_TYPE, "--name", ""]).await;
    let report = plugin.wait_for(SOON, notified(&socket)).await.expect("notified");
    assert_eq!(
        report,
        Report::Notified {
            socket: socket.clone(),
            registered: false,
            error: "RegisterPlugin error -- plugin validation failed with err: plugin name is empty".into()
        }
    );
    let PluginEvent::RegistrationFailed { error, .. } = next_event(&mut events, "failure", failed_at(&socket)).await
    else {
        unreachable!()
    };
    assert_eq!(error, format!("plugin of type Example at socket {} reported an empty name", socket.display()));
    assert!(node.example.calls().is_empty(), "the handler never sees a nameless plugin");
}

/// A handler's validation error reaches the plugin, upstream's prefix.
#[tokio::test]
async fn validation_error_is_sent_to_the_plugin() {
    let node = TestNode::start().await;
    let socket = node.socket("invalid.sock");
    let mut plugin = registration_plugin(&[
        "--socket",
        &node.socket_str("invalid.sock"),
        "--type",
        EXAMPLE_TYPE,
        "--name",
        "invalid-x",
    ])
    .await;
    let Report::Notified { registered, error, .. } = plugin.wait_for(SOON, notified(&socket)).await.expect("notified")
    else {
        unreachable!()
    };
    assert!(!registered);
    assert_eq!(
        error,
        "RegisterPlugin error -- plugin validation failed with err: names starting with 'invalid' are refused (got \"invalid-x\")"
    );
}

/// Bad input: the plugin dies between GetInfo and notify. The handler's
/// registration is rolled back (deregister), nothing stays registered.
#[tokio::test]
async fn plugin_exiting_before_notify_is_rolled_back() {
    let node = TestNode::start().await;
    let socket = node.socket("dies.sock");
    let mut events = node.events();
    let mut plugin = registration_plugin(&[
        "--socket",
        &node.socket_str("dies.sock"),
        "--type",
        EXAMPLE_TYPE,
        "--name",
        "dies",
        "--behaviour",
        "exit-before-notify",
    ])
    .await;
    let event = next_event(&mut events, "the failure", failed_at(&socket)).await;
    let PluginEvent::RegistrationFailed { error, .. } = event else { unreachable!() };
    assert!(
        error.starts_with(&format!("failed to send registration status at socket {}", socket.display())),
        "{error}"
    );
    plugin.wait_exit(SOON).await.expect("plugin exited");
    let calls = node.example.calls();
    assert_eq!(
        calls,
        vec![
            Call::Validate("dies".into()),
            Call::Register("dies".into(), socket.clone()),
            Call::Deregister("dies".into(), socket.clone())
        ]
    );
    let counts = node.wait_counts("settled", |c| c.registering == 0).await;
    assert_eq!(counts.registered, 0);
}

/// Bad input: `register` fails and the handler's `deregister`, which undoes
/// it, hangs. The undo is given up at `deregister_timeout`: the plugin is
/// told why, and the socket is retried instead of staying stuck in its
/// first attempt.
#[tokio::test]
async fn a_rollback_that_hangs_is_given_up_at_its_deadline() {
    let (root, registry) = root_dir();
    let node = TestNode::start_in(root, registry, |c| c.plugins.deregister_timeout = Duration::from_millis(200)).await;
    node.example.hang_deregistrations();
    let socket = node.socket("stuck.sock");
    let mut events = node.events();
    let mut plugin = registration_plugin(&[
        "--socket",
        &node.socket_str("stuck.sock"),
        "--type",
        EXAMPLE_TYPE,
        "--name",
        "unregisterable-x",
    ])
    .await;
    let report = plugin.wait_for(SOON, notified(&socket)).await.expect("told");
    let want = "RegisterPlugin error -- plugin registration failed with err: names starting with 'unregisterable' cannot register (got \"unregisterable-x\")";
    assert_eq!(report, Report::Notified { socket: socket.clone(), registered: false, error: want.into() });
    // A second attempt proves the first one ended.
    for n in 1..=2 {
        let event = next_event(&mut events, "a failed attempt", failed_at(&socket)).await;
        let PluginEvent::RegistrationFailed { failures, .. } = event else { unreachable!() };
        assert_eq!(failures, n);
    }
    let deregistrations = node.example.calls().iter().filter(|c| matches!(c, Call::Deregister(..))).count();
    assert!(deregistrations >= 2, "each attempt tried to undo: {:?}", node.example.calls());
}

/// Bad input: the socket is deleted while the handler is registering. The
/// registration finishes, then the plugin is deregistered (upstream adds to
/// the actual state before `register` for this). Meanwhile no second
/// operation runs on that socket (upstream: executor serializes one socket).
#[tokio::test]
async fn socket_deleted_during_registration_ends_deregistered() {
    let node = TestNode::start().await;
    let gate = node.example.hold_registrations();
    let socket = node.socket("deleted.sock");
    let stop = CancellationToken::new();
    let identity = Identity { plugin_type: EXAMPLE_TYPE.into(), name: "deleted".into(), ..Default::default() };
    let server = RegistrationPlugin::new(&socket, identity.clone(), Behaviour::Normal, Reporter::Discard)
        .spawn(stop.clone())
        .expect("serve");
    node.example.wait_calls("register entered", |c| c.iter().any(|c| matches!(c, Call::Register(..)))).await;
    // Recreate the socket (new instance) and then delete it, all during register.
    stop.cancel();
    server.await.expect("stopped");
    let again = CancellationToken::new();
    let _server = RegistrationPlugin::new(&socket, identity, Behaviour::Normal, Reporter::Discard)
        .spawn(again.clone())
        .expect("serve again");
    node.wait_counts("the new instance is seen", |c| c.desired == 1).await;
    std::fs::remove_file(&socket).expect("delete during register");
    node.wait_counts("the socket is gone from the desired state", |c| c.desired == 0).await;
    let registers = node.example.calls().iter().filter(|c| matches!(c, Call::Register(..))).count();
    assert_eq!(registers, 1, "one operation per socket at a time");
    gate.add_permits(1);
    node.example.wait_calls("deregistered", |c| c.iter().any(|c| matches!(c, Call::Deregister(..)))).await;
    let counts = node.wait_counts("settled", |c| c.registering == 0 && c.registered == 0).await;
    assert_eq!(counts.desired, 0);
}

/// Bad input: a symlink, a FIFO and a regular file named `*.sock` are
/// ignored; a real socket next to them registers.
#[tokio::test]
async fn symlink_fifo_and_regular_file_named_sock_are_ignored() {
    let node = TestNode::start().await;
    std::fs::write(node.socket("file.sock"), b"not a socket").expect("file");
    let status = std::process::Command::new("mkfifo").arg(node.socket("fifo.sock")).status().expect("mkfifo");
    assert!(status.success());
    let outside = node.root.path().join("elsewhere.sock");
    let _target = registration_plugin(&["--socket", outside.to_str().expect("utf8"), "--type", EXAMPLE_TYPE]).await;
    std::os::unix::fs::symlink(&outside, node.socket("link.sock")).expect("symlink");
    let _real = registration_plugin(&["--socket", &node.socket_str("real.sock"), "--type", EXAMPLE_TYPE]).await;
    node.wait_counts("the real socket registered", |c| c.registered == 1).await;
    let listed: Vec<_> = node.status().into_iter().map(|s| s.socket_path).collect();
    assert_eq!(listed, vec![node.socket("real.sock")]);
    // Replacing the real socket by a regular file deregisters it.
    std::fs::remove_file(node.socket("real.sock")).expect("rm");
    std::fs::write(node.socket("real.sock"), b"now a file").expect("write");
    node.wait_counts("the file is not a plugin", |c| c.registered == 0 && c.desired == 0).await;
}

/// Names starting with `.` are ignored.
#[tokio::test]
async fn hidden_sockets_are_ignored() {
    let node = TestNode::start().await;
    let _hidden = registration_plugin(&[
        "--socket",
        &node.socket_str(".hidden.sock"),
        "--socket",
        node.registry_dir.join(".dir/inside.sock").to_str().expect("utf8"),
        "--type",
        EXAMPLE_TYPE,
    ])
    .await;
    let _visible = registration_plugin(&["--socket", &node.socket_str("visible.sock"), "--type", EXAMPLE_TYPE]).await;
    node.wait_counts("the visible socket registered", |c| c.registered == 1).await;
    let listed: Vec<_> = node.status().into_iter().map(|s| s.socket_path).collect();
    assert_eq!(listed, vec![node.socket("visible.sock")]);
}

/// Bad input: 10,000 sockets created at once. Every one is registered
/// exactly once (none lost, none left registered twice with its handler),
/// and retries stay bounded. Under load some `GetInfo` calls may pass their
/// deadline and be retried after a backoff: how many is a speed figure
/// (printed here, measured by the registration benchmark), not behaviour.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_sockets_created_at_once_are_all_registered() {
    const N: usize = 10_000;
    // Upstream's deadlines: under this load some calls miss them, which
    // the node must survive.
    let (root, registry) = root_dir();
    let node = TestNode::start_in(root, registry, |c| {
        let defaults = kubelet::plugin_manager::PluginManagerConfig::new(&c.plugins.registration_dir);
        c.plugins.dial_timeout = defaults.dial_timeout;
        c.plugins.get_info_timeout = defaults.get_info_timeout;
        c.plugins.notify_timeout = defaults.notify_timeout;
    })
    .await;
    let mut plugin = registration_plugin(&[
        "--dir",
        node.registry_dir.to_str().expect("utf8"),
        "--count",
        "10000",
        "--type",
        EXAMPLE_TYPE,
    ])
    .await;
    let counts = node.wait_counts("10,000 registered", |c| c.registered == N).await;
    assert_eq!(counts.desired, N);
    // Net registrations per socket, as the handler saw them: a failed
    // attempt that got as far as `register` was undone with `deregister`.
    let mut net: std::collections::HashMap<std::path::PathBuf, i64> = std::collections::HashMap::new();
    for call in node.example.calls() {
        match call {
            Call::Register(_, socket) => *net.entry(socket).or_default() += 1,
            Call::Deregister(_, socket) => *net.entry(socket).or_default() -= 1,
            Call::Validate(_) => {}
        }
    }
    assert_eq!(net.len(), N, "every socket reached its handler");
    let wrong: Vec<_> = net.iter().filter(|(_, n)| **n != 1).take(5).collect();
    assert!(wrong.is_empty(), "each socket registered exactly once with its handler: {wrong:?}");
    let status = node.status();
    assert_eq!(status.len(), N);
    assert!(status.iter().all(|s| s.state == PluginState::Registered), "all listed as registered");
    println!("10,000 sockets: {} attempts failed and were retried", counts.failed_attempts);
    assert!(
        counts.failed_attempts <= 3 * N as u64,
        "retries are bounded by the backoff, not a storm: {} failed attempts",
        counts.failed_attempts
    );
    plugin.kill().await;
}

/// The manager refuses two handlers for one type.
#[tokio::test]
async fn duplicate_handler_is_refused() {
    let mut manager = kubelet::plugin_manager::PluginManager::new(test_config(std::path::Path::new("/nonexistent")));
    let handler = std::sync::Arc::new(RecordingHandler::default());
    manager.add_handler(kubelet::plugin_manager::PluginType::Dra, handler.clone()).expect("first");
    let err = manager.add_handler(kubelet::plugin_manager::PluginType::Dra, handler).map(|_| ()).expect_err("second");
    assert_eq!(err.to_string(), "a handler for plugin type DRAPlugin is already registered");
}

/// A registration dir that is a regular file is a clear start-up error.
#[tokio::test]
async fn registration_dir_that_is_a_file_fails_to_start() {
    let (root, _) = root_dir();
    let path = root.path().join("file");
    std::fs::write(&path, b"").expect("write");
    let manager = kubelet::plugin_manager::PluginManager::new(test_config(&path));
    let err = manager.start(CancellationToken::new()).map(|_| ()).expect_err("must fail");
    assert_eq!(err.to_string(), format!("plugin registration path {} exists but is not a directory", path.display()));
}

/// A registration dir that cannot be created (or written) is a clear error.
#[tokio::test]
async fn registration_dir_that_cannot_be_created_fails_to_start() {
    let path = std::path::Path::new("/proc/self/rustlet-cannot-exist/plugins_registry");
    let manager = kubelet::plugin_manager::PluginManager::new(test_config(path));
    let err = manager.start(CancellationToken::new()).map(|_| ()).expect_err("must fail");
    assert!(
        err.to_string().starts_with(&format!("cannot create plugin registration directory {}", path.display())),
        "{err}"
    );
}

/// Shutdown stops the manager promptly even with a registration in flight.
#[tokio::test]
async fn shutdown_with_a_registration_in_flight_is_prompt() {
    let node = TestNode::start().await;
    let _gate = node.example.hold_registrations();
    let _plugin = registration_plugin(&["--socket", &node.socket_str("held.sock"), "--type", EXAMPLE_TYPE]).await;
    node.example.wait_calls("register entered", |c| c.iter().any(|c| matches!(c, Call::Register(..)))).await;
    node.stop().await;
}

/// The registration directory deleted under a running node: every plugin is
/// deregistered, the directory is recreated and watched again, and a plugin
/// that comes back registers.
#[tokio::test]
async fn deleted_registration_dir_is_recreated_and_watched_again() {
    let node = TestNode::start().await;
    let _plugins = registration_plugin(&[
        "--dir",
        node.registry_dir.join("sub").to_str().expect("utf8"),
        "--count",
        "3",
        "--type",
        EXAMPLE_TYPE,
    ])
    .await;
    node.wait_counts("3 registered", |c| c.registered == 3).await;
    std::fs::remove_dir_all(&node.registry_dir).expect("rm -r plugins_registry");
    node.wait_counts("all deregistered", |c| c.registered == 0 && c.desired == 0).await;
    let _again = registration_plugin(&["--socket", &node.socket_str("back.sock"), "--type", EXAMPLE_TYPE]).await;
    node.wait_counts("the returning plugin registered", |c| c.registered == 1).await;
}

/// A registration still running at shutdown may finish within the grace
/// period: the plugin ends registered and told so, not half-registered.
#[tokio::test]
async fn shutdown_lets_a_running_registration_finish_within_the_grace() {
    let (root, registry) = root_dir();
    let node = TestNode::start_in(root, registry, |c| c.plugins.shutdown_grace = SOON).await;
    let gate = node.example.hold_registrations();
    let socket = node.socket("late.sock");
    let mut plugin = registration_plugin(&["--socket", &node.socket_str("late.sock"), "--type", EXAMPLE_TYPE]).await;
    node.example.wait_calls("register entered", |c| c.iter().any(|c| matches!(c, Call::Register(..)))).await;
    node.begin_shutdown().await;
    gate.add_permits(1);
    let report = plugin.wait_for(SOON, |r| matches!(r, Report::Notified { .. })).await.expect("notified");
    assert_eq!(report, Report::Notified { socket, registered: true, error: String::new() });
    let example = node.example.clone();
    node.stop().await;
    assert!(
        !example.calls().iter().any(|c| matches!(c, Call::Deregister(..))),
        "the finished registration is not undone: {:?}",
        example.calls()
    );
}

/// `chmod` (or `chown`, a relabel) changes a socket's ctime, not the socket:
/// the plugin stays registered.
#[tokio::test]
async fn chmod_of_a_registered_socket_does_not_reregister_it() {
    let node = TestNode::start().await;
    let socket = node.socket("perm.sock");
    let _plugin = registration_plugin(&["--socket", &node.socket_str("perm.sock"), "--type", EXAMPLE_TYPE]).await;
    node.wait_counts("registered", |c| c.registered == 1).await;
    std::fs::set_permissions(&socket, std::os::unix::fs::PermissionsExt::from_mode(0o600)).expect("chmod");
    // Events are handled in order: once a later socket is registered, the
    // chmod's event has been handled too.
    let _marker = registration_plugin(&["--socket", &node.socket_str("marker.sock"), "--type", EXAMPLE_TYPE]).await;
    let counts = node.wait_counts("marker registered", |c| c.registered == 2).await;
    assert_eq!(counts.deregistrations, 0);
    let registers = node.example.calls().iter().filter(|c| matches!(c, Call::Register(..))).count();
    assert_eq!(registers, 2);
}

/// Invalid settings are refused at start with the setting's name.
#[tokio::test]
async fn out_of_range_settings_are_refused_at_start() {
    let (root, registry) = root_dir();
    let mut config = test_config(&registry);
    config.resync_period = Duration::ZERO;
    let err = kubelet::plugin_manager::PluginManager::new(config)
        .start(CancellationToken::new())
        .map(|_| ())
        .expect_err("must fail");
    assert_eq!(err.to_string(), "invalid plugin manager setting resync_period: 0ns is outside 1ms..=24h");
    drop(root);
}

/// Beyond upstream: a plugin socket is trusted only when the process that
/// serves it runs as root or as a user in `--plugin-allowed-uids`, owns
/// the socket file, and no one else may write to it. A plugin run as uid
/// 65534 (in a directory of its own under `plugins_registry/`, as the
/// real node-driver-registrar could be) is refused with the reason in its
/// status; a root plugin whose socket is world-writable (umask 0) is
/// refused too; the same uid-65534 plugin registers on a node that allows
/// its user.
#[tokio::test]
async fn a_plugin_served_by_another_user_is_refused_with_the_reason() {
    use rustlet_testkit::process::PluginProcess;
    use std::os::unix::fs::PermissionsExt as _;
    if !rustlet_testkit::skip::root(
        "a_plugin_served_by_another_user_is_refused_with_the_reason",
        "running a plugin as another user needs root",
    ) {
        return;
    }
    let nobody = 65534;
    let prepare = |root: &std::path::Path, registry: &std::path::Path| {
        std::fs::set_permissions(root, std::fs::Permissions::from_mode(0o755)).expect("chmod root");
        let own = registry.join("nobody");
        std::fs::create_dir_all(&own).expect("mkdir");
        std::os::unix::fs::chown(&own, Some(nobody), Some(nobody)).expect("chown");
        own.join("p.sock")
    };
    let (root, registry) = root_dir();
    let socket = prepare(root.path(), &registry);
    let node = TestNode::start_in(root, registry.clone(), |_| {}).await;
    let mut events = node.events();
    let args = ["--socket", socket.to_str().expect("utf8"), "--type", EXAMPLE_TYPE, "--name", "nobody-1"];
    let _plugin =
        PluginProcess::spawn_as(registration_plugin_bin(), args, Some(nobody), None).await.expect("plugin as nobody");
    next_event(&mut events, "refused", failed_at(&socket)).await;
    let status = node.status_of(&socket).await.expect("listed");
    assert_ne!(status.state, PluginState::Registered);
    let error = status.last_error.unwrap_or_default();
    assert!(
        error.contains("refused")
            && error.contains("runs as uid 65534, which is neither root nor in --plugin-allowed-uids"),
        "{error}"
    );
    assert!(node.example.calls().is_empty(), "nothing of the plugin reached a handler");

    // Root, but a socket anyone may connect to and so replace: refused.
    let open = node.socket("open.sock");
    let args = ["--socket", open.to_str().expect("utf8"), "--type", EXAMPLE_TYPE, "--name", "open-1"];
    let _open = PluginProcess::spawn_as(registration_plugin_bin(), args, None, Some(0)).await.expect("plugin");
    next_event(&mut events, "refused", failed_at(&open)).await;
    let error = node.status_of(&open).await.expect("listed").last_error.unwrap_or_default();
    assert!(error.contains("lets users other than its owner write to it"), "{error}");

    // A node that allows uid 65534 takes the same plugin.
    let (root, registry) = root_dir();
    let socket = prepare(root.path(), &registry);
    let node = TestNode::start_in(root, registry, |config| {
        config.plugins.trust = kubelet::plugin_trust::PluginTrust::new([nobody]);
    })
    .await;
    let mut events = node.events();
    let args = ["--socket", socket.to_str().expect("utf8"), "--type", EXAMPLE_TYPE, "--name", "nobody-2"];
    let _plugin =
        PluginProcess::spawn_as(registration_plugin_bin(), args, Some(nobody), None).await.expect("plugin as nobody");
    next_event(&mut events, "registered", registered_at(&socket)).await;
}

/// The same, from a build directory no other user may enter (a checkout
/// under a 0700 home): the plugin uid 65534 runs is a copy it reaches.
#[test]
fn another_users_plugin_is_refused_behind_a_directory_it_cannot_enter() {
    rustlet_testkit::other_user::rerun_behind_a_closed_directory(
        "another_users_plugin_is_refused_behind_a_directory_it_cannot_enter",
        "a_plugin_served_by_another_user_is_refused_with_the_reason",
    );
}
