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
    driver_in_pool(root, instance, versions, "dra-node", None).await
}

/// An instance for node `pool`, with the node's kubeconfig if given.
async fn driver_in_pool(
    root: &Path,
    instance: &str,
    versions: &[&str],
    pool: &str,
    kubeconfig: Option<&Path>,
) -> PluginProcess {
    let mut args: Vec<String> = ["--root-dir", &root.display().to_string(), "--driver", DRIVER, "--instance", instance]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
    args.extend(["--pool".into(), pool.into(), "--count".into(), "4".into()]);
    for version in versions {
        args.extend(["--version".to_owned(), (*version).to_owned()]);
    }
    if let Some(kubeconfig) = kubeconfig {
        args.extend(["--kubeconfig".to_owned(), kubeconfig.display().to_string()]);
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
/// Kubernetes 1.28–1.31 drivers) is refused with both lists named, and a
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
    assert!(error.contains("older DRA API"), "{error}");
    // What the Kubernetes 1.28 kubelet-plugin helper (and so its
    // dra-test-driver) announces.
    let mut legacy = driver(root.path(), "legacy", &["1.0.0"]).await;
    let (registered, error) = verdict(&mut legacy).await;
    assert!(!registered);
    assert!(error.contains("none of services supported by the plugin ([\"1.0.0\"])"), "{error}");
    assert!(error.contains("upgrade the driver"), "{error}");
    assert_eq!(node.dra_drivers().list().len(), 1, "the refused drivers are not registered");

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

mod cluster {
    //! Pods with resource claims on a node in a cluster (the in-process API
    //! server: the v1.28 binaries predate `resource.k8s.io/v1`), their
    //! claims prepared through a real driver process.

    use std::sync::Arc;

    use k8s_openapi::api::core::v1::Pod;
    use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
    use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
    use kubelet::cluster::{ApiSource, ClusterSettings};
    use kubelet::node::{Node, NodeBuilder, NodeConfig};
    use kubelet_api::podresources::v1 as podresources;
    use rustlet_testkit::host_provider::HostProcessProvider;
    use rustlet_testkit::report::Report;
    use rustlet_testkit::test_api::{TestApi, json_of};
    use serde_json::json;
    use tokio_util::sync::CancellationToken;

    use super::{DRIVER, SOON, driver_in_pool, test_config, wait_file};

    pub(super) async fn cluster_node(api: &TestApi, root: &std::path::Path) -> (Node, CancellationToken) {
        let mut config = NodeConfig::new(root, api.node.clone());
        config.http_address = None;
        config.plugins = test_config(&root.join("plugins_registry"));
        // The sample driver writes its CDI spec there; the host provider
        // does not read CDI, so the node resolves the devices' edits.
        config.pods.cdi_spec_dirs = vec![root.join("cdi")];
        let mut settings = ClusterSettings::new(ApiSource::Client(api.node_client.clone()));
        settings.slice_wiping_delay = std::time::Duration::from_millis(500);
        let shutdown = CancellationToken::new();
        let node = NodeBuilder::new(config)
            .provider(Arc::new(HostProcessProvider::new()))
            .cluster(settings)
            .start(shutdown.clone())
            .await
            .expect("node");
        (node, shutdown)
    }

    fn claim(name: &str) -> ResourceClaim {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.example.com"}}]}},
        }))
        .expect("claim")
    }

    fn pod(name: &str, node: &str, claim: &str) -> Pod {
        let spec = json!({
            "automountServiceAccountToken": false,
            "terminationGracePeriodSeconds": 1,
            "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}],
            "containers": [{
                "name": "main", "image": "busybox",
                "command": ["sh", "-c", "echo \"cdi=$CDI_DEVICES spec=$DRA_DEVICE_DEV_2\"; exec sleep 600"],
                "resources": {"claims": [{"name": "gpu"}]},
            }],
        });
        rustlet_testkit::pod_state::bound_pod(name, node, spec)
    }

    /// Allocates `claim` to device `device` of the driver and reserves it
    /// for `pods` (as the scheduler does).
    async fn allocate(claims: &Api<ResourceClaim>, claim: &str, device: &str, pods: &[&Pod], node: &str) {
        let reserved: Vec<serde_json::Value> =
            pods.iter().map(|p| json!({"resource": "pods", "name": p.metadata.name, "uid": p.metadata.uid})).collect();
        let status = json!({"status": {
            "allocation": {"devices": {"results": [
                {"request": "gpu", "driver": DRIVER, "pool": node, "device": device},
            ]}},
            "reservedFor": reserved,
        }});
        claims.patch_status(claim, &PatchParams::default(), &Patch::Merge(&status)).await.expect("allocate");
    }

    /// A node in a cluster with the driver's instance `a` registered, and
    /// the admin's claims and pods.
    async fn node_with_driver(
        api: &TestApi,
        root: &std::path::Path,
    ) -> (Node, CancellationToken, super::PluginProcess, Api<ResourceClaim>, Api<Pod>) {
        let (node, shutdown) = cluster_node(api, root).await;
        let mut gpu = driver_in_pool(root, "a", &[], &api.node, Some(&api.node_kubeconfig)).await;
        gpu.wait_for(SOON, |r| matches!(r, Report::Notified { registered: true, .. })).await.expect("registered");
        let claims = Api::namespaced(api.admin.clone(), "default");
        let pods = Api::namespaced(api.admin.clone(), "default");
        (node, shutdown, gpu, claims, pods)
    }

    /// The driver's report of preparing `uid` (its refusals skipped).
    fn prepares_of(uid: &str) -> impl FnMut(&Report) -> bool + '_ {
        move |r| matches!(r, Report::DraPrepare { claims, .. } if claims.iter().any(|(u, d)| u == uid && d.is_ok()))
    }

    async fn pod_resources(
        root: &std::path::Path,
    ) -> podresources::pod_resources_lister_client::PodResourcesListerClient<kubelet_api::uds::UdsChannel> {
        let channel = kubelet_api::uds::dial(root.join("pod-resources/kubelet.sock"), SOON).await.expect("dial");
        podresources::pod_resources_lister_client::PodResourcesListerClient::new(channel)
    }

    fn log_of(root: &std::path::Path, pod: &Pod) -> std::path::PathBuf {
        let name = pod.metadata.name.as_deref().unwrap_or_default();
        let uid = pod.metadata.uid.as_deref().unwrap_or_default();
        root.join(format!("logs/pods/default_{name}_{uid}/main/0.log"))
    }

    /// A pod waits with the reason until its claim is reserved for it and
    /// allocated; the claim is prepared once through the driver, its CDI
    /// device reaches the container; a second pod sharing it prepares
    /// nothing; PodResources shows both; the claim is released once, when
    /// the last pod is gone; a restarted node neither prepares again nor
    /// forgets; a static pod with a claim is refused.
    #[tokio::test]
    async fn a_claim_is_prepared_once_shared_and_released_with_its_last_pod() {
        let api = TestApi::fake().await;
        let root = rustlet_testkit::node_root::tempdir("rustlet-dra-");
        let (node, shutdown, mut gpu, claims, pods) = node_with_driver(&api, root.path()).await;
        let created = claims.create(&PostParams::default(), &claim("shared-gpu")).await.expect("claim");
        let claim_uid = created.metadata.uid.clone().expect("uid");
        let first = pods.create(&PostParams::default(), &pod("first", &api.node, "shared-gpu")).await.expect("pod");

        // Not reserved for it yet: it waits, saying why.
        let message =
            |p: Option<&Pod>| p.and_then(|p| p.status.as_ref()).and_then(|s| s.message.clone()).unwrap_or_default();
        let waiting = api
            .wait_for(&pods, "first", "waiting for its claim", SOON, |p| {
                message(p).contains("is not allowed to use ResourceClaim shared-gpu")
            })
            .await
            .expect("pod");
        assert_eq!(waiting.status.as_ref().and_then(|s| s.phase.as_deref()), Some("Pending"));

        // Reserved, but allocated in a pool this driver does not serve
        // here: the driver refuses it, and the pod shows the driver's word.
        let reserved = json!({"status": {
            "allocation": {"devices": {"results": [
                {"request": "gpu", "driver": DRIVER, "pool": "another-node", "device": "dev-0"},
            ]}},
            "reservedFor": [{"resource": "pods", "name": "first", "uid": first.metadata.uid}],
        }});
        claims.patch_status("shared-gpu", &PatchParams::default(), &Patch::Merge(&reserved)).await.expect("patch");
        api.wait_for(&pods, "first", "the driver's refusal", SOON, |p| {
            let message = message(p);
            message.contains("NodePrepareResources failed for ResourceClaim shared-gpu")
                && message.contains("has no device of driver gpu.dra.example.com allocated in pool n1")
        })
        .await
        .expect("pod");

        // The driver prepares the device allocated (not its first).
        allocate(&claims, "shared-gpu", "dev-2", &[&first], &api.node).await;
        let running = |p: Option<&Pod>| p.is_some_and(|p| json_of(p)["status"]["phase"] == "Running");
        let first = api.wait_for(&pods, "first", "Running", SOON, running).await.expect("pod");
        gpu.wait_for(SOON, prepares_of(&claim_uid)).await.expect("prepared");
        let cdi = format!("{DRIVER}/device=dev-2");
        let log = wait_file(&log_of(root.path(), &first), |t| t.contains("cdi=")).await;
        assert!(log.contains(&format!("cdi={cdi}")), "{log}");
        // The env of the device in the driver's CDI spec, which the node
        // applied itself.
        assert!(log.contains("spec=dev-2"), "{log}");

        // A second pod shares the claim: nothing is prepared again.
        let second = pods.create(&PostParams::default(), &pod("second", &api.node, "shared-gpu")).await.expect("pod");
        allocate(&claims, "shared-gpu", "dev-2", &[&first, &second], &api.node).await;
        let second = api.wait_for(&pods, "second", "Running", SOON, running).await.expect("pod");
        let log = wait_file(&log_of(root.path(), &second), |t| t.contains("cdi=")).await;
        assert!(log.contains(&format!("cdi={cdi}")), "{log}");
        assert_eq!(node.dra_claims().pods_of(&claim_uid).len(), 2);

        // PodResources: both pods, with the claim's device.
        let mut lister = pod_resources(root.path()).await;
        let listed = lister.list(podresources::ListPodResourcesRequest {}).await.expect("List").into_inner();
        for name in ["first", "second"] {
            let pod =
                listed.pod_resources.iter().find(|p| p.name == name).unwrap_or_else(|| panic!("{name}: {listed:?}"));
            let dynamic = &pod.containers[0].dynamic_resources;
            assert_eq!(dynamic.len(), 1, "{pod:?}");
            assert_eq!(
                (dynamic[0].claim_name.as_str(), dynamic[0].claim_namespace.as_str()),
                ("shared-gpu", "default")
            );
            let resource = &dynamic[0].claim_resources[0];
            assert_eq!(
                (resource.driver_name.as_str(), resource.pool_name.as_str(), resource.device_name.as_str()),
                (DRIVER, api.node.as_str(), "dev-2")
            );
            assert_eq!(resource.cdi_devices[0].name, cdi);
        }
        let one = lister
            .get(podresources::GetPodResourcesRequest { pod_name: "first".into(), pod_namespace: "default".into() })
            .await
            .expect("Get")
            .into_inner();
        assert_eq!(one.pod_resources.expect("pod").containers[0].dynamic_resources[0].claim_name, "shared-gpu");
        let missing = lister
            .get(podresources::GetPodResourcesRequest { pod_name: "absent".into(), pod_namespace: "default".into() })
            .await
            .expect_err("no such pod");
        assert_eq!(
            (missing.code(), missing.message()),
            (tonic::Code::Unknown, "pod absent in namespace default not found")
        );

        // Upstream's DRA metrics: the pods' prepares (the refused one an
        // error), each call to the driver by method and status code.
        let mut registry = prometheus_client::registry::Registry::default();
        node.dra_drivers().register_metrics(&mut registry);
        let text = kubelet::metrics::encode_text(&registry).expect("encode");
        for series in [
            "dra_operations_duration_seconds_count{operation_name=\"PrepareResources\",is_error=\"false\"} ",
            "dra_operations_duration_seconds_count{operation_name=\"PrepareResources\",is_error=\"true\"} ",
            "dra_grpc_operations_duration_seconds_count{driver_name=\"gpu.dra.example.com\",method_name=\"/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources\",grpc_status_code=\"OK\"} 2",
            "dra_grpc_operations_duration_seconds_bucket{le=\"+Inf\",driver_name=\"gpu.dra.example.com\",method_name=\"/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources\",grpc_status_code=\"OK\"} 2",
        ] {
            assert!(text.contains(series), "missing {series} in:\n{text}");
        }

        // The node restarts (its checkpoint holds the claim): the pods are
        // adopted and nothing is prepared again.
        shutdown.cancel();
        node.stopped().await;
        let (node, shutdown) = cluster_node(&api, root.path()).await;
        assert_eq!(node.dra_claims().pods_of(&claim_uid).len(), 2, "restored from the checkpoint");

        // The first pod goes: the claim stays; the last goes: released once.
        pods.delete("first", &DeleteParams::default()).await.expect("delete");
        api.wait_for(&pods, "first", "deleted", SOON, |p| p.is_none()).await;
        assert!(node.dra_claims().is_prepared(&claim_uid), "still used by the second pod");
        pods.delete("second", &DeleteParams::default()).await.expect("delete");
        api.wait_for(&pods, "second", "deleted", SOON, |p| p.is_none()).await;
        // The next call the driver answers is the release: nothing was
        // prepared again in between (the second pod, the restart).
        let next = gpu
            .wait_for(SOON, |r| matches!(r, Report::DraPrepare { .. } | Report::DraUnprepare { .. }))
            .await
            .expect("released");
        assert!(matches!(&next, Report::DraUnprepare { claims, .. } if claims.contains(&claim_uid)), "{next:?}");
        // Prepared exactly once (the restart prepared nothing), released once.
        let more = gpu
            .wait_for(std::time::Duration::from_millis(300), |r| {
                matches!(r, Report::DraPrepare { .. } | Report::DraUnprepare { .. })
            })
            .await;
        assert!(more.is_err(), "no other call: {more:?}");
        assert!(!node.dra_claims().is_prepared(&claim_uid));
        shutdown.cancel();
        node.stopped().await;
    }

    fn slice(name: &str, node: &str, driver: &str) -> ResourceSlice {
        serde_json::from_value(json!({
            "metadata": {"name": name},
            "spec": {"driver": driver, "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                     "nodeName": node, "devices": [{"name": "dev-0"}]},
        }))
        .expect("slice")
    }

    /// ResourceSlices are the drivers': the node deletes its own at start
    /// (another node's stay), the driver publishes its slice under the
    /// node's identity (and again when it is deleted); during an upgrade
    /// the driver keeps its slice; once no instance is connected for the
    /// wiping delay, its slice of this node is deleted.
    #[tokio::test]
    async fn the_nodes_slices_are_wiped_at_start_and_after_the_last_instance_goes() {
        let api = TestApi::fake().await;
        let slices: Api<ResourceSlice> = Api::all(api.admin.clone());
        let stale = format!("{}-stale", api.node);
        slices.create(&PostParams::default(), &slice(&stale, &api.node, DRIVER)).await.expect("stale slice");
        slices.create(&PostParams::default(), &slice("elsewhere", "n2", DRIVER)).await.expect("other node's slice");
        let root = rustlet_testkit::node_root::tempdir("rustlet-dra-");
        let (node, shutdown) = cluster_node(&api, root.path()).await;
        api.wait_for(&slices, &stale, "wiped at start", SOON, |s| s.is_none()).await;

        let kubeconfig = Some(api.node_kubeconfig.as_path());
        let mut a = driver_in_pool(root.path(), "a", &[], &api.node, kubeconfig).await;
        let published = format!("{}-{DRIVER}", api.node);
        a.wait_for(SOON, |r| matches!(r, Report::SlicePublished { .. })).await.expect("published");
        api.wait_for(&slices, &published, "published", SOON, |s| s.is_some()).await;
        let mut b = driver_in_pool(root.path(), "b", &[], &api.node, kubeconfig).await;
        let drivers = node.dra_drivers();
        assert!(drivers.wait_until(SOON, |i| i.iter().filter(|i| i.connected).count() == 2).await);
        // The old instance goes: the driver stays usable, nothing is wiped.
        a.kill().await;
        assert!(drivers.wait_until(SOON, |i| i.iter().filter(|i| i.connected).count() == 1).await);
        assert!(drivers.usable(DRIVER));
        // A deleted slice is published again by the instance left.
        slices.delete(&published, &DeleteParams::default()).await.expect("delete");
        b.wait_for(SOON, |r| matches!(r, Report::SlicePublished { .. })).await.expect("published again");
        // The last instance goes: after the delay, the slice goes too.
        b.kill().await;
        api.wait_for(&slices, &published, "wiped after the delay", SOON, |s| s.is_none()).await;
        assert!(slices.get_opt("elsewhere").await.expect("get").is_some(), "another node's slice stays");
        shutdown.cancel();
        node.stopped().await;
    }

    /// A server that serves no `resource.k8s.io` (Kubernetes 1.28, or a
    /// 1.33 one without the betas on) holds no slices: the node asks
    /// discovery of each version it knows, deletes nothing and does not
    /// retry (it used to retry a refused delete forever).
    #[tokio::test]
    async fn no_slices_are_deleted_where_the_server_does_not_serve_them() {
        let api = TestApi::fake().await;
        let server = api.fake_server().expect("the in-process server");
        let slices: Api<ResourceSlice> = Api::all(api.admin.clone());
        let stale = format!("{}-stale", api.node);
        slices.create(&PostParams::default(), &slice(&stale, &api.node, DRIVER)).await.expect("stale slice");
        // As a 1.28 server answers: no such group version.
        server.serve_resource_versions(&[]);
        let root = rustlet_testkit::node_root::tempdir("rustlet-dra-");
        let (node, shutdown) = cluster_node(&api, root.path()).await;
        let asked = server
            .wait_requests(SOON, |r| {
                ["v1", "v1beta2", "v1beta1"]
                    .iter()
                    .all(|v| r.iter().any(|l| l.uri == format!("/apis/resource.k8s.io/{v}") && l.status == 404))
            })
            .await;
        assert!(asked.is_ok(), "the node asks discovery of each version first");
        shutdown.cancel();
        node.stopped().await;
        let deletes: Vec<String> = server
            .requests()
            .into_iter()
            .filter(|l| l.method == axum::http::Method::DELETE && l.uri.contains("resourceslices"))
            .map(|l| l.uri)
            .collect();
        assert!(deletes.is_empty(), "{deletes:?}");
    }

    /// A 1.32 server (`v1beta1` only) and a 1.33 one with the betas on
    /// (`v1beta2`, `v1beta1`): the node finds the newest served version by
    /// discovery, wipes its stale slices there, reads the claim there (in
    /// that version's shape, the admin's writes too), prepares it through
    /// the driver (which publishes its slice in that version), runs the
    /// pod, and releases the claim with the pod; it never asks `v1`'s
    /// objects, and its pod status writes never name the claim statuses.
    #[tokio::test]
    async fn claims_and_slices_work_in_whichever_beta_the_server_serves() {
        use kube::api::DynamicObject;
        use kubelet_api::resource::ResourceVersion;
        for served in [&[ResourceVersion::V1beta1][..], &[ResourceVersion::V1beta2, ResourceVersion::V1beta1]] {
            let version = served[0];
            let api = TestApi::fake().await;
            let server = api.fake_server().expect("the in-process server");
            server.serve_resource_versions(served);
            let resource = |kind: &str, plural: &str| rustlet_testkit::dra_test_driver::resource(version, kind, plural);
            // What the admin writes, in the served version's shape.
            let object = |hub: serde_json::Value| rustlet_testkit::dra_test_driver::in_version(hub, version);
            let slices: Api<DynamicObject> =
                Api::all_with(api.admin.clone(), &resource("ResourceSlice", "resourceslices"));
            let stale = format!("{}-stale", api.node);
            let mut stale_slice = serde_json::to_value(slice(&stale, &api.node, DRIVER)).expect("json");
            stale_slice["apiVersion"] = "resource.k8s.io/v1".into();
            stale_slice["kind"] = "ResourceSlice".into();
            slices.create(&PostParams::default(), &object(stale_slice)).await.expect("stale slice");
            let root = rustlet_testkit::node_root::tempdir("rustlet-dra-");
            let (node, shutdown, mut gpu, _, pods) = node_with_driver(&api, root.path()).await;
            api.wait_for(&slices, &stale, "wiped at start", SOON, |s| s.is_none()).await;
            let published = format!("{}-{DRIVER}", api.node);
            let listed = api.wait_for(&slices, &published, "published", SOON, |s| s.is_some()).await.expect("slice");
            let listed = serde_json::to_value(listed).expect("json");
            if version == ResourceVersion::V1beta1 {
                assert!(listed["spec"]["devices"][0]["basic"].is_object(), "a v1beta1 device: {listed}");
            }

            let claims: Api<DynamicObject> =
                Api::namespaced_with(api.admin.clone(), "default", &resource("ResourceClaim", "resourceclaims"));
            let mut hub = serde_json::to_value(claim("beta-gpu")).expect("json");
            hub["apiVersion"] = "resource.k8s.io/v1".into();
            hub["kind"] = "ResourceClaim".into();
            let created = claims.create(&PostParams::default(), &object(hub)).await.expect("claim");
            let written = serde_json::to_value(&created).expect("json");
            let request = &written["spec"]["devices"]["requests"][0];
            match version {
                ResourceVersion::V1beta1 => assert_eq!(request["deviceClassName"], "gpu.example.com", "{written}"),
                _ => assert_eq!(request["exactly"]["deviceClassName"], "gpu.example.com", "{written}"),
            }
            let claim_uid = created.metadata.uid.clone().expect("uid");
            let first = pods.create(&PostParams::default(), &pod("beta", &api.node, "beta-gpu")).await.expect("pod");
            let status = json!({"status": {
                "allocation": {"devices": {"results": [{"request": "gpu", "driver": DRIVER, "pool": api.node, "device": "dev-1"}]}},
                "reservedFor": [{"resource": "pods", "name": "beta", "uid": first.metadata.uid}],
            }});
            claims.patch_status("beta-gpu", &PatchParams::default(), &Patch::Merge(&status)).await.expect("allocate");
            let running = |p: Option<&Pod>| p.is_some_and(|p| json_of(p)["status"]["phase"] == "Running");
            api.wait_for(&pods, "beta", "Running", SOON, running).await.expect("pod");
            gpu.wait_for(SOON, prepares_of(&claim_uid)).await.expect("prepared");
            pods.delete("beta", &DeleteParams::default()).await.expect("delete");
            api.wait_for(&pods, "beta", "deleted", SOON, |p| p.is_none()).await;
            gpu.wait_for(SOON, |r| matches!(r, Report::DraUnprepare { claims, .. } if claims.contains(&claim_uid)))
                .await
                .expect("released");
            shutdown.cancel();
            node.stopped().await;

            let node_user = format!("system:node:{}", api.node);
            let by_node: Vec<_> =
                server.requests().into_iter().filter(|l| l.user.as_deref() == Some(node_user.as_str())).collect();
            let at = |v: &str| format!("/apis/resource.k8s.io/{v}/");
            assert!(
                by_node
                    .iter()
                    .any(|l| l.uri.starts_with(&at(version.as_str())) && l.uri.contains("resourceclaims/beta-gpu")),
                "the claim is read at {version}"
            );
            let wrong: Vec<&String> = by_node.iter().map(|l| &l.uri).filter(|u| u.starts_with(&at("v1"))).collect();
            assert!(wrong.is_empty(), "nothing asked of v1's objects: {wrong:?}");
            // (Discovery of a version not served is a 404, and fine.)
            let discovery = |uri: &str| uri.trim_start_matches("/apis/resource.k8s.io/").split('/').count() == 1;
            let refused: Vec<String> = by_node
                .iter()
                .filter(|l| l.status >= 400 && l.uri.contains("resource.k8s.io") && !discovery(&l.uri))
                .map(|l| format!("{} {}", l.status, l.uri))
                .collect();
            assert!(refused.is_empty(), "{refused:?}");
            let named_claim_statuses =
                by_node.iter().filter_map(|l| l.body.as_deref()).any(|b| b.contains("resourceClaimStatuses"));
            assert!(!named_claim_statuses, "the node's pod status writes leave the claim statuses to the controller");
        }
    }

    /// A pod that finishes (it stays in the API) releases its claim at
    /// once: the claim controller takes a finished pod out of the claim's
    /// reservations, and its devices may go to another claim.
    #[tokio::test]
    async fn a_finished_pod_releases_its_claim() {
        let api = TestApi::fake().await;
        let root = rustlet_testkit::node_root::tempdir("rustlet-dra-");
        let (node, shutdown, mut gpu, claims, pods) = node_with_driver(&api, root.path()).await;
        let claim_uid =
            claims.create(&PostParams::default(), &claim("job-gpu")).await.expect("claim").metadata.uid.expect("uid");
        let mut job = pod("job", &api.node, "job-gpu");
        if let Some(spec) = job.spec.as_mut() {
            spec.restart_policy = Some("Never".into());
            spec.containers[0].command = Some(vec!["sh".into(), "-c".into(), "exit 0".into()]);
        }
        let job = pods.create(&PostParams::default(), &job).await.expect("pod");
        allocate(&claims, "job-gpu", "dev-1", &[&job], &api.node).await;
        let succeeded = |p: Option<&Pod>| p.is_some_and(|p| json_of(p)["status"]["phase"] == "Succeeded");
        api.wait_for(&pods, "job", "Succeeded", SOON, succeeded).await.expect("pod");
        let next = gpu
            .wait_for(SOON, |r| matches!(r, Report::DraPrepare { .. } | Report::DraUnprepare { .. }))
            .await
            .expect("prepared");
        assert!(matches!(&next, Report::DraPrepare { .. }), "{next:?}");
        let next = gpu
            .wait_for(SOON, |r| matches!(r, Report::DraPrepare { .. } | Report::DraUnprepare { .. }))
            .await
            .expect("released");
        assert!(matches!(&next, Report::DraUnprepare { claims, .. } if claims.contains(&claim_uid)), "{next:?}");
        assert!(pods.get_opt("job").await.expect("get").is_some(), "released while the pod is still in the API");
        assert!(!node.dra_claims().is_prepared(&claim_uid));
        shutdown.cancel();
        node.stopped().await;
    }

    /// A static pod cannot use a claim: no API server allocates one to it.
    #[tokio::test]
    async fn a_static_pod_with_a_claim_is_refused() {
        let root = rustlet_testkit::node_root::tempdir("rustlet-dra-");
        let manifests = root.path().join("manifests");
        std::fs::create_dir_all(&manifests).expect("mkdir");
        let pod = json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "static-claim", "namespace": "default"},
            "spec": {
                "resourceClaims": [{"name": "gpu", "resourceClaimName": "some-claim"}],
                "containers": [{"name": "main", "image": "busybox", "command": ["sleep", "600"], "resources": {"claims": [{"name": "gpu"}]}}],
            },
        });
        std::fs::write(manifests.join("pod.json"), pod.to_string()).expect("manifest");
        let mut config = NodeConfig::new(root.path(), "dra-node");
        config.http_address = None;
        config.pods.manifest_dir = Some(manifests);
        let shutdown = CancellationToken::new();
        let node = NodeBuilder::new(config)
            .provider(Arc::new(HostProcessProvider::new()))
            .start(shutdown.clone())
            .await
            .expect("node");
        let failed = node
            .pods()
            .store()
            .wait_for(SOON, |pods| pods.values().any(|p| json_of(p)["status"]["phase"] == "Failed"))
            .await
            .expect("refused");
        let pod = json_of(failed.values().next().expect("pod"));
        assert_eq!(pod["status"]["reason"], "InvalidPod", "{pod}");
        let message = pod["status"]["message"].as_str().unwrap_or_default();
        assert!(message.contains("static pods cannot use resource claims"), "{message}");
        shutdown.cancel();
        node.stopped().await;
    }
}

mod pod_resources {
    //! The PodResources API on a node with a device plugin (real processes,
    //! real sockets): what a monitoring agent reads.

    use std::sync::Arc;

    use kubelet::node::{NodeBuilder, NodeConfig};
    use kubelet_api::podresources::v1 as api;
    use rustlet_testkit::host_provider::HostProcessProvider;
    use rustlet_testkit::process::PluginProcess;
    use rustlet_testkit::report::Report;
    use rustlet_testkit::test_api::json_of;
    use serde_json::json;
    use tokio_util::sync::CancellationToken;

    use super::{SOON, device_plugin_bin};

    const GPU: &str = "example.com/gpu";

    /// `List`, `Get` and `GetAllocatableResources` show the device-plugin
    /// devices per container, grouped by NUMA node, healthy ones only as
    /// allocatable, no CPUs or memory; past the burst, calls are refused
    /// with upstream's status, and never more pass than the token bucket
    /// allows (a bucket of 1 per second here, so that a slow run cannot
    /// refill it as fast as the calls come; upstream's 100 per second is
    /// the unit test's).
    #[tokio::test]
    async fn a_monitoring_agent_reads_each_containers_devices_and_is_rate_limited() {
        let root = rustlet_testkit::node_root::tempdir("rustlet-podres-");
        let manifests = root.path().join("manifests");
        std::fs::create_dir_all(&manifests).expect("mkdir");
        let mut config = NodeConfig::new(root.path(), "res-node");
        config.http_address = None;
        config.pods.manifest_dir = Some(manifests.clone());
        let mut limited = kubelet::pod_resources::PodResourcesConfig::new(root.path());
        limited.qps = 1.0;
        config.pod_resources = Some(limited);
        let shutdown = CancellationToken::new();
        let node = NodeBuilder::new(config)
            .provider(Arc::new(HostProcessProvider::new()))
            .start(shutdown.clone())
            .await
            .expect("node");
        let socket = root.path().join("device-plugins/gpu.sock").display().to_string();
        let args = [
            "--socket",
            &socket,
            "--resource",
            GPU,
            "--device",
            "gpu-0:Healthy:0",
            "--device",
            "gpu-1:Healthy:1",
            "--device",
            "gpu-2:Unhealthy:0",
        ];
        let mut plugin = PluginProcess::spawn(device_plugin_bin(), args).await.expect("device plugin");
        plugin.wait_for(SOON, |r| matches!(r, Report::DeviceRegistered { .. })).await.expect("registered");
        let mut capacity = node.devices().capacity();
        tokio::time::timeout(SOON, capacity.wait_for(|c| c.get(GPU).is_some_and(|c| c.allocatable == 2)))
            .await
            .expect("devices in time")
            .expect("device manager");

        let pod = json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "trainer", "namespace": "ml"},
            "spec": {"containers": [
                {"name": "main", "image": "busybox", "command": ["sleep", "600"], "resources": {"limits": {GPU: "2"}}},
                {"name": "helper", "image": "busybox", "command": ["sleep", "600"]},
            ]},
        });
        std::fs::write(manifests.join("trainer.json"), pod.to_string()).expect("manifest");
        node.pods()
            .store()
            .wait_for(SOON, |pods| pods.values().any(|p| json_of(p)["status"]["phase"] == "Running"))
            .await
            .expect("Running");

        let channel = kubelet_api::uds::dial(root.path().join("pod-resources/kubelet.sock"), SOON).await.expect("dial");
        let mut lister = api::pod_resources_lister_client::PodResourcesListerClient::new(channel.clone());
        let listed = lister.list(api::ListPodResourcesRequest {}).await.expect("List").into_inner();
        assert_eq!(listed.pod_resources.len(), 1, "{listed:?}");
        let trainer = &listed.pod_resources[0];
        assert_eq!((trainer.name.as_str(), trainer.namespace.as_str()), ("trainer-res-node", "ml"));
        let names: Vec<&str> = trainer.containers.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["main", "helper"]);
        let main = &trainer.containers[0];
        let mut placed: Vec<(String, Vec<String>, Vec<i64>)> = main
            .devices
            .iter()
            .map(|d| {
                let numa = d.topology.as_ref().map(|t| t.nodes.iter().map(|n| n.id).collect()).unwrap_or_default();
                (d.resource_name.clone(), d.device_ids.clone(), numa)
            })
            .collect();
        placed.sort();
        assert_eq!(
            placed,
            [(GPU.to_owned(), vec!["gpu-0".to_owned()], vec![0]), (GPU.to_owned(), vec!["gpu-1".to_owned()], vec![1])]
        );
        assert!(main.cpu_ids.is_empty() && main.memory.is_empty() && main.dynamic_resources.is_empty());
        assert!(trainer.containers[1].devices.is_empty());

        let one = lister
            .get(api::GetPodResourcesRequest { pod_name: "trainer-res-node".into(), pod_namespace: "ml".into() })
            .await
            .expect("Get")
            .into_inner();
        assert_eq!(one.pod_resources.as_ref().map(|p| p.containers.len()), Some(2));
        let allocatable = lister
            .get_allocatable_resources(api::AllocatableResourcesRequest {})
            .await
            .expect("allocatable")
            .into_inner();
        let mut ids: Vec<&str> =
            allocatable.devices.iter().flat_map(|d| d.device_ids.iter().map(String::as_str)).collect();
        ids.sort_unstable();
        assert_eq!(ids, ["gpu-0", "gpu-1"], "healthy devices only");
        assert!(allocatable.cpu_ids.is_empty() && allocatable.memory.is_empty());

        // Far more calls at once than the bucket holds.
        const CALLS: usize = 1000;
        let started = std::time::Instant::now();
        let calls = (0..CALLS).map(|_| {
            let mut lister = api::pod_resources_lister_client::PodResourcesListerClient::new(channel.clone());
            async move { lister.list(api::ListPodResourcesRequest {}).await.map(|_| ()) }
        });
        let answers = futures_util::future::join_all(calls).await;
        let elapsed = started.elapsed().as_secs_f64();
        let refused: Vec<&tonic::Status> = answers.iter().filter_map(|a| a.as_ref().err()).collect();
        for status in &refused {
            assert_eq!((status.code(), status.message()), (tonic::Code::ResourceExhausted, "rejected by rate limit"));
        }
        let passed = CALLS - refused.len();
        // The bucket's bound: its burst, plus 1 per second of the run.
        let bound = 10.0 + elapsed + 1.0;
        assert!((passed as f64) <= bound, "{passed} passed in {elapsed:.2} s (bound {bound:.0})");
        assert!(!refused.is_empty(), "{passed} of {CALLS} passed in {elapsed:.2} s");
        shutdown.cancel();
        node.stopped().await;
    }
}

mod real_control_plane {
    //! Structured DRA on a real control plane (1.32+: kube-apiserver with
    //! `resource.k8s.io` on, NodeRestriction, the real kube-scheduler
    //! allocating devices and kube-controller-manager's resource claim
    //! controller) with upstream's own DRA test driver
    //! (`test/e2e/dra/test-driver`, `kubelet-plugin`: the `kubeletplugin`
    //! helper, `v1beta1.DRAPlugin`, ResourceSlices written in `v1beta1`,
    //! one CDI spec per prepared claim). The driver binary is found beside
    //! the Kubernetes binaries (`RUSTLET_KUBE_BIN_DIR/dra-test-driver`);
    //! where it or a control plane serving structured DRA is missing, the
    //! test skips saying so, unless `RUSTLET_REQUIRE_KUBE_DRA=1`.

    use k8s_openapi::api::core::v1::Pod;
    use kube::api::{Api, DeleteParams, DynamicObject, PostParams};
    use rustlet_testkit::dra_test_driver::{self as upstream, SCHEDULED, TEST_DRIVER, in_version, resource};
    use rustlet_testkit::test_api::{TestApi, json_of};
    use serde_json::json;

    use super::SOON;
    use super::cluster::cluster_node;

    /// A pod with a ResourceClaimTemplate, scheduled by the real scheduler
    /// to the node: the claim controller makes its claim, the scheduler
    /// allocates one of the driver's four devices, the node reads the claim
    /// in the version the server serves, prepares it through upstream's
    /// driver, resolves the driver's CDI spec itself (the host provider
    /// reads no CDI) so the container sees the claim's env, and reports
    /// the pod Running through NodeRestriction (its status writes leave the
    /// controller's claim statuses alone); deleting the pod unprepares the
    /// claim (the driver removes its CDI spec) and the controller removes
    /// the claim.
    #[tokio::test]
    async fn upstreams_test_driver_runs_a_template_claim_pod_scheduled_by_the_real_scheduler() {
        const TEST: &str = "upstreams_test_driver_runs_a_template_claim_pod_scheduled_by_the_real_scheduler";
        let Some(api) = TestApi::real(TEST).await else { return };
        let Some((driver_binary, version)) = upstream::setting_up(TEST, &api).await else { return };

        let root = rustlet_testkit::node_root::tempdir("rustlet-dra-real-");
        let (node, shutdown) = cluster_node(&api, root.path()).await;
        let plane = api.control_plane().expect("real");
        let mut driver =
            upstream::start(&driver_binary, plane.admin_kubeconfig(), &api.node, root.path(), "driver.log");
        let drivers = node.dra_drivers();
        let registered = drivers.wait_until(SOON, |i| i.iter().any(|i| i.driver == TEST_DRIVER && i.connected)).await;
        assert!(registered, "the driver registers: {}", upstream::tail(&root.path().join("driver.log")));
        let instance = drivers.list().into_iter().find(|i| i.driver == TEST_DRIVER).expect("instance");
        assert_eq!(instance.version, kubelet::dra::DraVersion::V1beta1, "the helper's only API");

        // Its four devices, published by the driver for this node.
        let slices: Api<DynamicObject> =
            Api::all_with(api.admin.clone(), &resource(version, "ResourceSlice", "resourceslices"));
        let devices = upstream::slice_devices(slices, &api.node, version, 4).await;

        let tag = std::process::id();
        let class = format!("rustlet-example-{tag}");
        let classes: Api<DynamicObject> =
            Api::all_with(api.admin.clone(), &resource(version, "DeviceClass", "deviceclasses"));
        let device_class = json!({"kind": "DeviceClass", "metadata": {"name": class},
            "spec": {"selectors": [{"cel": {"expression": format!("device.driver == \"{TEST_DRIVER}\"")}}]}});
        classes.create(&PostParams::default(), &in_version(device_class, version)).await.expect("DeviceClass");
        let templates: Api<DynamicObject> = Api::namespaced_with(
            api.admin.clone(),
            "default",
            &resource(version, "ResourceClaimTemplate", "resourceclaimtemplates"),
        );
        let template = format!("rustlet-inline-{tag}");
        let claim_template = json!({"kind": "ResourceClaimTemplate", "metadata": {"name": template, "namespace": "default"},
        "spec": {"spec": {"devices": {
            "requests": [{"name": "my-device", "exactly": {"deviceClassName": class}}],
            "config": [{"opaque": {"driver": TEST_DRIVER, "parameters": {"a": "b"}}}],
        }}}});
        templates.create(&PostParams::default(), &in_version(claim_template, version)).await.expect("template");

        let pods: Api<Pod> = Api::namespaced(api.admin.clone(), "default");
        let name = format!("dra-template-{tag}");
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "default"},
            "spec": {
                "nodeSelector": {"kubernetes.io/hostname": api.node},
                "automountServiceAccountToken": false,
                "terminationGracePeriodSeconds": 1,
                "resourceClaims": [{"name": "resource", "resourceClaimTemplateName": template}],
                "containers": [
                    {"name": "with-resource", "image": "busybox", "command": ["sh", "-c", "env | sort; exec sleep 600"],
                     "resources": {"claims": [{"name": "resource"}]}},
                    {"name": "without-resource", "image": "busybox", "command": ["sh", "-c", "env | sort; exec sleep 600"]},
                ],
            },
        }))
        .expect("pod");
        pods.create(&PostParams::default(), &pod).await.expect("pod");
        let running = |p: Option<&Pod>| p.is_some_and(|p| json_of(p)["status"]["phase"] == "Running");
        let running = api.wait_for(&pods, &name, "Running", SCHEDULED, running).await;
        let Some(running) = running else {
            panic!(
                "the pod did not run; node events and the driver's log:\n{}",
                upstream::tail(&root.path().join("driver.log"))
            );
        };
        let status = json_of(&running)["status"].clone();
        let claim_name = status["resourceClaimStatuses"][0]["resourceClaimName"]
            .as_str()
            .expect("the controller's claim")
            .to_owned();

        // Allocated one of the four, reserved for the pod, prepared on the node.
        let claim = kubelet::cluster::claims::ServedVersion::default()
            .get_claim(&api.admin, version, "default", &claim_name)
            .await
            .expect("claim");
        let claim_uid = claim.metadata.uid.clone().expect("uid");
        let results = claim
            .status
            .as_ref()
            .and_then(|s| s.allocation.as_ref())
            .and_then(|a| a.devices.as_ref())
            .and_then(|d| d.results.clone())
            .unwrap_or_default();
        assert_eq!(results.len(), 1, "{claim:?}");
        assert!(devices.contains(&results[0].device), "{results:?}");
        assert!(node.dra_claims().is_prepared(&claim_uid));

        // The container with the claim sees the env of the driver's CDI
        // spec (the opaque config and the claim's own marker); the other
        // does not.
        let uid = running.metadata.uid.clone().expect("uid");
        let log_dir = root.path().join(format!("logs/pods/default_{name}_{uid}"));
        let marker = format!("claim_{}_my_device=true", claim_name.replace(|c: char| !c.is_ascii_alphanumeric(), "_"));
        let with = super::wait_file(&log_dir.join("with-resource/0.log"), |t| t.contains("PATH=")).await;
        assert!(with.contains("user_a=b") && with.contains(&marker), "{marker} in {with}");
        let without = super::wait_file(&log_dir.join("without-resource/0.log"), |t| t.contains("PATH=")).await;
        assert!(!without.contains("user_a=b"), "{without}");
        upstream::wait_entries(&root.path().join("cdi"), 1).await;

        // Deleted: unprepared (the driver removes its spec), and the
        // controller removes the claim.
        pods.delete(&name, &DeleteParams::default()).await.expect("delete");
        api.wait_for(&pods, &name, "deleted", SCHEDULED, |p| p.is_none()).await;
        // NodeUnprepareResources removes the driver's spec.
        upstream::wait_entries(&root.path().join("cdi"), 0).await;
        assert!(!node.dra_claims().is_prepared(&claim_uid));
        let claims: Api<DynamicObject> =
            Api::namespaced_with(api.admin.clone(), "default", &resource(version, "ResourceClaim", "resourceclaims"));
        api.wait_for(&claims, &claim_name, "removed by the claim controller", SCHEDULED, |c| c.is_none()).await;

        shutdown.cancel();
        node.stopped().await;
        let _ = driver.kill().await;
    }
}
