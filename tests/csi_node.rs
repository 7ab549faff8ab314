//! The CSI node client against the sample CSI driver over real sockets:
//! capabilities, the stage → publish → unpublish → unstage round trip as
//! the driver received it, deadlines, error codes, and the read-only view of
//! the driver registry that the volume stages will use.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;
use kubelet::csi::{
    AccessMode, AccessType, CsiDriver, CsiNodeClient, CsiNodeError, CsiNodeTimeouts, PublishVolume, Secrets,
    StageVolume, VolumeCapability,
};
use rustlet_testkit::csi_driver::{
    CsiDriverConfig, FakeCsiDriver, PUBLISHED_MARKER, STAGED_MARKER, VolumeCall, VolumeCallBehaviour, VolumeCalls,
};
use rustlet_testkit::report::Reporter;
use tempfile::TempDir;
use tokio_util::sync::CancellationToken;

/// A sample driver served in this process, and what the node knows of it.
struct Driver {
    driver: CsiDriver,
    calls: VolumeCalls,
    dir: TempDir,
    _stop: tokio_util::sync::DropGuard,
}

fn start(name: &str, tweak: impl FnOnce(&mut CsiDriverConfig)) -> Driver {
    let dir = tempfile::Builder::new().prefix("rustlet-csi-node-").tempdir().expect("tempdir");
    let endpoint = dir.path().join("csi.sock");
    let mut config = CsiDriverConfig { name: name.into(), node_id: "n1".into(), ..Default::default() };
    tweak(&mut config);
    let fake = FakeCsiDriver::new(&endpoint, config, Reporter::Discard);
    let calls = fake.calls();
    let stop = CancellationToken::new();
    fake.spawn(stop.clone()).expect("serve");
    let driver = CsiDriver {
        name: name.into(),
        endpoint: format!("unix://{}", endpoint.display()),
        version: "1.0.0".parse().expect("version"),
        socket_path: dir.path().join("reg.sock"),
    };
    Driver { driver, calls, dir, _stop: stop.drop_guard() }
}

fn mount(fs_type: &str, flags: &[&str], mode: AccessMode) -> VolumeCapability {
    VolumeCapability {
        access_type: AccessType::Mount {
            fs_type: fs_type.into(),
            mount_flags: flags.iter().map(|f| (*f).to_owned()).collect(),
            volume_mount_group: String::new(),
        },
        access_mode: mode,
    }
}

fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
}

fn publish(volume_id: &str, staging: Option<PathBuf>, target: PathBuf) -> PublishVolume {
    PublishVolume {
        volume_id: volume_id.into(),
        staging_target_path: staging,
        target_path: target,
        capability: mount("ext4", &[], AccessMode::SingleNodeWriter),
        read_only: true,
        publish_context: BTreeMap::new(),
        volume_context: map(&[("csi.storage.k8s.io/pod.name", "web-0")]),
        secrets: Secrets(map(&[("token", "publish-secret")])),
    }
}

fn pairs(map: &[(&str, &str)]) -> Vec<(String, String)> {
    map.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
}

#[tokio::test]
async fn stage_publish_unpublish_unstage_reach_the_driver_as_sent() {
    let d = start("hostpath.csi.example.com", |c| c.stage_unstage = true);
    let client = CsiNodeClient::connect(&d.driver, CsiNodeTimeouts::default()).await.expect("connect");
    assert!(client.capabilities().await.expect("capabilities").stages(), "the driver stages volumes");

    let staging = d.dir.path().join("plugins/kubernetes.io/csi/hostpath/globalmount");
    let target = d.dir.path().join("pods/uid-1/volumes/kubernetes.io~csi/data/mount");
    let stage = StageVolume {
        volume_id: "vol-1".into(),
        staging_target_path: staging.clone(),
        capability: mount("ext4", &["noatime"], AccessMode::SingleNodeWriter),
        publish_context: map(&[("device", "/dev/fake0")]),
        volume_context: map(&[("size", "1Gi")]),
        secrets: Secrets(map(&[("password", "stage-secret")])),
    };
    client.stage_volume(&stage).await.expect("stage");
    assert_eq!(std::fs::read_to_string(staging.join(STAGED_MARKER)).expect("staged"), "vol-1");
    client.publish_volume(&publish("vol-1", Some(staging.clone()), target.clone())).await.expect("publish");
    assert_eq!(std::fs::read_to_string(target.join(PUBLISHED_MARKER)).expect("published"), "vol-1");
    client.unpublish_volume("vol-1", &target).await.expect("unpublish");
    assert!(!target.exists());
    client.unstage_volume("vol-1", &staging).await.expect("unstage");
    assert!(!staging.exists());
    // The CSI spec wants repeated calls to succeed.
    client.unpublish_volume("vol-1", &target).await.expect("unpublish again");
    client.unstage_volume("vol-1", &staging).await.expect("unstage again");

    let calls = d.calls.all();
    let rpcs: Vec<&str> = calls.iter().map(|c| c.rpc).collect();
    assert_eq!(
        rpcs,
        [
            "NodeStageVolume",
            "NodePublishVolume",
            "NodeUnpublishVolume",
            "NodeUnstageVolume",
            "NodeUnpublishVolume",
            "NodeUnstageVolume"
        ]
    );
    let s = path_str(&staging);
    assert_eq!(
        calls[0],
        VolumeCall {
            rpc: "NodeStageVolume",
            volume_id: "vol-1".into(),
            staging_target_path: s.clone(),
            target_path: String::new(),
            access_type: "ext4".into(),
            mount_flags: vec!["noatime".into()],
            access_mode: 1,
            read_only: false,
            secrets: pairs(&[("password", "stage-secret")]),
            volume_context: pairs(&[("size", "1Gi")]),
            publish_context: pairs(&[("device", "/dev/fake0")]),
            volume_mount_group: String::new(),
            required_bytes: 0,
        }
    );
    let p = &calls[1];
    assert_eq!((p.staging_target_path.as_str(), p.target_path.as_str()), (s.as_str(), path_str(&target).as_str()));
    assert!(p.read_only);
    assert_eq!(p.secrets, pairs(&[("token", "publish-secret")]));
    assert_eq!(p.volume_context, pairs(&[("csi.storage.k8s.io/pod.name", "web-0")]));
    assert_eq!((calls[2].volume_id.as_str(), calls[2].target_path.as_str()), ("vol-1", path_str(&target).as_str()));
}

fn path_str(path: &Path) -> String {
    path.to_str().expect("utf8").to_owned()
}

/// A driver without STAGE_UNSTAGE_VOLUME: no staging, publish straight away
/// (what the kubelet does after asking for the capabilities).
#[tokio::test]
async fn a_driver_that_does_not_stage_is_published_directly() {
    let d = start("nostage.csi.example.com", |_| {});
    let client = CsiNodeClient::connect(&d.driver, CsiNodeTimeouts::default()).await.expect("connect");
    assert!(!client.capabilities().await.expect("capabilities").stages());
    let target = d.dir.path().join("target");
    client.publish_volume(&publish("vol-2", None, target.clone())).await.expect("publish");
    assert!(target.join(PUBLISHED_MARKER).exists());
    assert_eq!(d.calls.all()[0].staging_target_path, "", "no staging path is sent");
}

/// Bad input: publishing a volume that was never staged. The driver's code
/// (FAILED_PRECONDITION) reaches the caller, with the driver, RPC and volume.
#[tokio::test]
async fn an_error_status_keeps_its_code() {
    let d = start("strict.csi.example.com", |c| c.stage_unstage = true);
    let client = CsiNodeClient::connect(&d.driver, CsiNodeTimeouts::default()).await.expect("connect");
    let staging = d.dir.path().join("never-staged");
    let err = client
        .publish_volume(&publish("vol-3", Some(staging.clone()), d.dir.path().join("t")))
        .await
        .expect_err("not staged");
    assert_eq!(err.code(), Some(tonic::Code::FailedPrecondition));
    assert_eq!(
        err.to_string(),
        format!(
            "CSI driver strict.csi.example.com: NodePublishVolume for volume \"vol-3\" failed: FailedPrecondition: volume vol-3 is not staged at {}",
            staging.display()
        )
    );
    let aborted = start("busy.csi.example.com", |c| {
        c.volume_calls =
            HashMap::from([("NodeUnstageVolume".to_owned(), VolumeCallBehaviour::Fail(tonic::Code::Aborted))]);
    });
    let client = CsiNodeClient::connect(&aborted.driver, CsiNodeTimeouts::default()).await.expect("connect");
    let err = client.unstage_volume("vol-4", Path::new("/nowhere")).await.expect_err("aborted");
    assert_eq!(err.code(), Some(tonic::Code::Aborted));
}

/// Bad input: a driver that never answers. The call fails at its deadline
/// with the driver, RPC and volume named, and another driver is served
/// meanwhile.
#[tokio::test]
async fn a_hung_call_times_out_without_blocking_another_driver() {
    let hung = start("hung.csi.example.com", |c| {
        c.volume_calls = HashMap::from([("NodePublishVolume".to_owned(), VolumeCallBehaviour::Hang)]);
    });
    let fine = start("fine.csi.example.com", |_| {});
    let timeouts = CsiNodeTimeouts { volume: Duration::from_millis(300), ..CsiNodeTimeouts::default() };
    let stuck = CsiNodeClient::connect(&hung.driver, timeouts).await.expect("connect");
    let target = hung.dir.path().join("t");
    let call = tokio::spawn(async move { stuck.publish_volume(&publish("vol-5", None, target)).await });
    // The hung call has reached the driver before the other one starts.
    hung.calls.wait_for(1, SOON).await;
    let other = CsiNodeClient::connect(&fine.driver, CsiNodeTimeouts::default()).await.expect("connect");
    other.publish_volume(&publish("vol-6", None, fine.dir.path().join("t"))).await.expect("the other driver");
    let err = tokio::time::timeout(SOON, call).await.expect("ends").expect("task").expect_err("deadline");
    assert!(matches!(err, CsiNodeError::Timeout { .. }), "{err:?}");
    assert_eq!(
        err.to_string(),
        "CSI driver hung.csi.example.com: NodePublishVolume for volume \"vol-5\" did not answer within 300ms"
    );
}

/// Bad input: a driver whose endpoint is gone.
#[tokio::test]
async fn a_missing_endpoint_is_a_dial_error_naming_the_driver() {
    let gone = CsiDriver {
        name: "gone.csi.example.com".into(),
        endpoint: "/nonexistent/csi.sock".into(),
        version: "1.0.0".parse().expect("version"),
        socket_path: "/nonexistent/reg.sock".into(),
    };
    let err = CsiNodeClient::connect(&gone, CsiNodeTimeouts::default()).await.expect_err("no socket");
    assert!(err.to_string().starts_with("CSI driver gone.csi.example.com: dial /nonexistent/csi.sock"), "{err}");
}

/// The volume stages look drivers up through the read-only view: it sees a
/// driver registered through the real registration path, and can wait for
/// one that registers later.
#[tokio::test]
async fn the_registry_view_waits_for_a_driver_registered_later() {
    let node = TestNode::start().await;
    let view = node.csi_drivers.view();
    assert_eq!(view.wait_for("absent.csi.example.com", Duration::from_millis(50)).await, None);
    let waiting = {
        let view = view.clone();
        tokio::spawn(async move { view.wait_for("late.csi.example.com", SOON).await })
    };
    let endpoint = node.root.path().join("plugins/late/csi.sock");
    let mut driver = csi_driver(&[
        "--registration-socket",
        &node.socket_str("late.sock"),
        "--endpoint",
        endpoint.to_str().expect("utf8"),
        "--name",
        "late.csi.example.com",
        "--stage-unstage",
    ])
    .await;
    let found = tokio::time::timeout(SOON, waiting).await.expect("in time").expect("task").expect("registered");
    assert_eq!(found.endpoint, endpoint.display().to_string());
    assert_eq!(view.list(), vec![found.clone()]);
    let client = CsiNodeClient::connect(&found, CsiNodeTimeouts::default()).await.expect("connect");
    assert!(client.capabilities().await.expect("capabilities").stages());
    driver.kill().await;
}
