//! One cluster test body, two API servers: the in-process fake
//! ([`crate::apiserver`], which also injects faults) and the real
//! kube-apiserver ([`crate::control_plane`]). A [`TestApi`] hands a test
//! what both give: an administrator's client, a node identity with its
//! client and kubeconfig, and waits on objects through the API.
//!
//! [`on_both_api_servers!`](crate::on_both_api_servers) makes a module with
//! a `fake` and a `real` test from one `async fn(TestApi)`; the real one
//! skips (printing why) where the Kubernetes binaries are missing, unless
//! `RUSTLET_REQUIRE_KUBE=1`.

use std::path::PathBuf;
use std::time::Duration;

use futures_util::StreamExt as _;
use kube::Resource;
use kube::api::Api;
use kube::runtime::watcher;
use serde::de::DeserializeOwned;

use crate::apiserver::ApiServer;
use crate::control_plane::ControlPlane;

/// Which server a [`TestApi`] talks to.
pub enum Server {
    /// The in-process fake.
    Fake(ApiServer),
    /// The real kube-apiserver.
    Real(&'static ControlPlane),
}

/// An API server for one test, with a node identity of its own.
pub struct TestApi {
    /// The server.
    pub server: Server,
    /// An administrator's client.
    pub admin: kube::Client,
    /// The node's name (its identity is `system:node:<node>`).
    pub node: String,
    /// The node's bearer token.
    pub node_token: String,
    /// A client with the node's identity.
    pub node_client: kube::Client,
    /// A kubeconfig file with the node's identity (for the binary).
    pub node_kubeconfig: PathBuf,
    _dir: tempfile::TempDir,
}

impl TestApi {
    /// The in-process server, with node `n1`.
    pub async fn fake() -> TestApi {
        let server = ApiServer::start().await.expect("start the in-process API server");
        let node = "n1".to_owned();
        let node_token = server.node_token(&node);
        let admin = server.client(server.admin_token()).await.expect("admin client");
        let node_client = server.client(&node_token).await.expect("node client");
        let dir = tempfile::tempdir().expect("tempdir");
        let node_kubeconfig = dir.path().join("node.kubeconfig");
        server.write_kubeconfig(&node_kubeconfig, &node_token).expect("kubeconfig");
        TestApi { server: Server::Fake(server), admin, node, node_token, node_client, node_kubeconfig, _dir: dir }
    }

    /// The real kube-apiserver with a node identity of this test's own;
    /// `None` (after printing why) when it cannot run here.
    pub async fn real(test: &str) -> Option<TestApi> {
        let plane = ControlPlane::shared(test)?;
        let identity = plane.node();
        let admin = plane.admin_client().await.expect("admin client");
        let node_client = plane.client(&identity.token).await.expect("node client");
        let dir = tempfile::tempdir().expect("tempdir");
        let node_kubeconfig = dir.path().join("node.kubeconfig");
        plane.write_kubeconfig(&node_kubeconfig, &identity.token).expect("kubeconfig");
        Some(TestApi {
            server: Server::Real(plane),
            admin,
            node: identity.name,
            node_token: identity.token,
            node_client,
            node_kubeconfig,
            _dir: dir,
        })
    }

    /// `"fake"` or `"real"`, for messages.
    pub fn kind(&self) -> &'static str {
        match self.server {
            Server::Fake(_) => "fake",
            Server::Real(_) => "real",
        }
    }

    /// The in-process server, for what only it can do (faults, request logs).
    pub fn fake_server(&self) -> Option<&ApiServer> {
        match &self.server {
            Server::Fake(server) => Some(server),
            Server::Real(_) => None,
        }
    }

    /// The real control plane, for what only it has (the scheduler, the
    /// controller manager).
    pub fn control_plane(&self) -> Option<&'static ControlPlane> {
        match self.server {
            Server::Fake(_) => None,
            Server::Real(plane) => Some(plane),
        }
    }

    /// A bearer token allowed `get nodes/metrics` and nothing else, as
    /// kube-prometheus gives Prometheus: a service account of the
    /// in-process server, or the real server's metrics reader bound to a
    /// ClusterRole of that one rule.
    pub async fn metrics_reader_token(&self) -> String {
        match &self.server {
            Server::Fake(server) => {
                server.service_account_token("monitoring", "prometheus-k8s", &[("get", "nodes", "metrics")])
            }
            Server::Real(plane) => {
                use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
                let role: ClusterRole = serde_json::from_value(serde_json::json!({
                    "metadata": {"name": "rustlet-metrics-reader"},
                    "rules": [{"apiGroups": [""], "resources": ["nodes/metrics"], "verbs": ["get"]}],
                }))
                .expect("a ClusterRole");
                let binding: ClusterRoleBinding = serde_json::from_value(serde_json::json!({
                    "metadata": {"name": "rustlet-metrics-reader"},
                    "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "rustlet-metrics-reader"},
                    "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": crate::control_plane::METRICS_READER}],
                }))
                .expect("a ClusterRoleBinding");
                let params = kube::api::PostParams::default();
                for created in [
                    Api::<ClusterRole>::all(self.admin.clone()).create(&params, &role).await.map(|_| ()),
                    Api::<ClusterRoleBinding>::all(self.admin.clone()).create(&params, &binding).await.map(|_| ()),
                ] {
                    match created {
                        Ok(()) => {}
                        Err(kube::Error::Api(status)) if status.code == 409 => {}
                        Err(error) => panic!("RBAC for the metrics reader: {error}"),
                    }
                }
                plane.reader_token().to_owned()
            }
        }
    }

    /// Creates the CSIDriver object `name` with `spec` (JSON), unless one
    /// of that name exists already (a real API server serves every test of
    /// a binary: give each test's driver a name of its own).
    pub async fn csi_driver_object(&self, name: &str, spec: serde_json::Value) {
        use k8s_openapi::api::storage::v1::CSIDriver;
        let drivers: Api<CSIDriver> = Api::all(self.admin.clone());
        let driver: CSIDriver =
            serde_json::from_value(serde_json::json!({"metadata": {"name": name}, "spec": spec})).expect("a CSIDriver");
        match drivers.create(&kube::api::PostParams::default(), &driver).await {
            Ok(_) => {}
            Err(kube::Error::Api(status)) if status.code == 409 => {}
            Err(error) => panic!("CSIDriver {name}: {error}"),
        }
    }

    /// Waits up to `deadline` until object `name` (in `api`) satisfies
    /// `pred` (`None`: it does not exist); returns it. Panics with the last
    /// object seen when the deadline passes.
    pub async fn wait_for<K>(
        &self,
        api: &Api<K>,
        name: &str,
        what: &str,
        deadline: Duration,
        pred: impl Fn(Option<&K>) -> bool,
    ) -> Option<K>
    where
        K: Resource + Clone + std::fmt::Debug + DeserializeOwned + Send + 'static,
    {
        wait_for(api, name, what, deadline, pred).await
    }
}

/// An API object as JSON (for tests that look at it by path).
pub fn json_of<K: serde::Serialize>(object: &K) -> serde_json::Value {
    serde_json::to_value(object).expect("an object serializes to JSON")
}

/// Waits up to `deadline` until object `name` in `api` satisfies `pred`
/// (`None`: it does not exist), following a watch; returns it. Panics with
/// the last object seen when the deadline passes.
pub async fn wait_for<K>(
    api: &Api<K>,
    name: &str,
    what: &str,
    deadline: Duration,
    pred: impl Fn(Option<&K>) -> bool,
) -> Option<K>
where
    K: Resource + Clone + std::fmt::Debug + DeserializeOwned + Send + 'static,
{
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let mut events = watcher(api.clone(), config).boxed();
    let mut current: Option<K> = None;
    let mut listing: Option<K> = None;
    let mut synced = false;
    let wait = async {
        while let Some(event) = events.next().await {
            match event {
                Ok(watcher::Event::Init) => {
                    listing = None;
                    synced = false;
                }
                Ok(watcher::Event::InitApply(object)) => listing = Some(object),
                Ok(watcher::Event::InitDone) => {
                    current = listing.take();
                    synced = true;
                }
                Ok(watcher::Event::Apply(object)) => current = Some(object),
                Ok(watcher::Event::Delete(_)) => current = None,
                Err(error) => {
                    eprintln!("watch of {name} failed ({error}); resuming");
                    continue;
                }
            }
            if synced && pred(current.as_ref()) {
                return current.clone();
            }
        }
        None
    };
    match tokio::time::timeout(deadline, wait).await {
        Ok(found) => found,
        Err(_) => panic!("{name}: not {what} within {deadline:?}; last seen: {current:#?}"),
    }
}

/// A module `$name` with two tests running `$body(api)`: `fake`, on the
/// in-process server, and `real`, on the real kube-apiserver.
#[macro_export]
macro_rules! on_both_api_servers {
    ($name:ident, $body:ident) => {
        mod $name {
            #[tokio::test]
            async fn fake() {
                super::$body($crate::test_api::TestApi::fake().await).await;
            }

            #[tokio::test]
            async fn real() {
                let Some(api) = $crate::test_api::TestApi::real(concat!(module_path!(), "::real")).await else {
                    return;
                };
                super::$body(api).await;
            }
        }
    };
}
