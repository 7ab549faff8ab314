//! The fake API server, driven through kube-rs as the node will drive it:
//! its semantics are what cluster-mode tests rely on, so they are checked
//! here against what a real API server does.

use std::time::Duration;

use futures_util::{StreamExt as _, TryStreamExt as _};
use k8s_openapi::api::core::v1::{Node, Pod, Secret};
use kube::Client;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams, Preconditions, WatchEvent, WatchParams};
use rustlet_testkit::apiserver::{ApiServer, Fault};
use serde_json::json;

const SOON: Duration = Duration::from_secs(20);

async fn client(server: &ApiServer, token: &str) -> Client {
    server.client(token).await.expect("client")
}

fn api_error(error: kube::Error) -> (u16, String, String) {
    match error {
        kube::Error::Api(status) => (status.code, status.reason.clone(), status.message.clone()),
        other => panic!("not an API error: {other}"),
    }
}

fn node(name: &str) -> Node {
    serde_json::from_value(json!({"metadata": {"name": name}, "status": {"capacity": {"pods": "110"}}})).expect("node")
}

fn pod(name: &str, node: &str, secret: Option<&str>) -> Pod {
    let mut spec = json!({"containers": [{"name": "main", "image": "x"}]});
    if let Some(secret) = secret {
        spec["volumes"] = json!([{"name": "s", "secret": {"secretName": secret}}]);
    }
    rustlet_testkit::pod_state::bound_pod(name, node, spec)
}

#[tokio::test]
async fn writes_make_versions_and_stale_writes_conflict() {
    let server = ApiServer::start().await.expect("start");
    let nodes: Api<Node> = Api::all(client(&server, server.admin_token()).await);
    let created = nodes.create(&PostParams::default(), &node("n1")).await.expect("create");
    let first = created.metadata.resource_version.clone().expect("rv");
    assert!(created.metadata.uid.is_some() && created.metadata.creation_timestamp.is_some());
    let (code, reason, message) = api_error(nodes.create(&PostParams::default(), &node("n1")).await.expect_err("dup"));
    assert_eq!((code, reason.as_str()), (409, "AlreadyExists"));
    assert_eq!(message, "nodes \"n1\" already exists");

    let patched = nodes
        .patch("n1", &PatchParams::default(), &Patch::Merge(json!({"metadata": {"labels": {"a": "b"}}})))
        .await
        .expect("patch");
    assert_ne!(patched.metadata.resource_version.as_deref(), Some(first.as_str()));
    // A replace carrying the first version is stale.
    let (code, reason, message) =
        api_error(nodes.replace("n1", &PostParams::default(), &created).await.expect_err("stale"));
    assert_eq!((code, reason.as_str()), (409, "Conflict"));
    assert!(message.contains("the object has been modified"), "{message}");
    // A merge patch naming a stale version is refused too.
    let stale = json!({"metadata": {"resourceVersion": first, "labels": {"c": "d"}}});
    assert_eq!(
        api_error(nodes.patch("n1", &PatchParams::default(), &Patch::Merge(stale)).await.expect_err("stale")).0,
        409
    );
    // The status subresource changes the status only.
    let status = json!({"status": {"capacity": {"pods": "7"}}, "metadata": {"labels": {"ignored": "1"}}});
    let after = nodes.patch_status("n1", &PatchParams::default(), &Patch::Merge(status)).await.expect("status");
    let capacity = after.status.and_then(|s| s.capacity).expect("capacity");
    assert_eq!(capacity["pods"].0, "7");
    assert_eq!(after.metadata.labels.expect("labels").get("ignored"), None);
    // Strategic merge patches of a node's status merge conditions by type.
    for kind in ["A", "B"] {
        let patch = Patch::Strategic(json!({"status": {"conditions": [{"type": kind, "status": "True"}]}}));
        nodes.patch_status("n1", &PatchParams::default(), &patch).await.expect("strategic");
    }
    let merged = nodes.get("n1").await.expect("node");
    let kinds: Vec<String> =
        merged.status.and_then(|s| s.conditions).unwrap_or_default().into_iter().map(|c| c.type_).collect();
    assert!(kinds.contains(&"A".to_owned()) && kinds.contains(&"B".to_owned()), "{kinds:?}");
    assert_eq!(api_error(nodes.get("n2").await.expect_err("missing")).0, 404);
}

#[tokio::test]
async fn watches_resume_from_a_version_and_expire_after_compaction() {
    let server = ApiServer::start().await.expect("start");
    let pods: Api<Pod> = Api::namespaced(client(&server, server.admin_token()).await, "default");
    let list = pods.list(&Default::default()).await.expect("list");
    let from = list.metadata.resource_version.expect("rv");
    pods.create(&PostParams::default(), &pod("a", "n1", None)).await.expect("create");
    pods.create(&PostParams::default(), &pod("b", "n2", None)).await.expect("create");
    // Resumed from the list's version, with a field selector: only a.
    let params = WatchParams::default().fields("spec.nodeName=n1");
    let mut events = pods.watch(&params, &from).await.expect("watch").boxed();
    let first = tokio::time::timeout(SOON, events.try_next()).await.expect("in time").expect("event").expect("some");
    match first {
        WatchEvent::Added(p) => assert_eq!(p.metadata.name.as_deref(), Some("a")),
        other => panic!("{other:?}"),
    }
    pods.delete("a", &DeleteParams { grace_period_seconds: Some(0), ..Default::default() }).await.expect("delete");
    let next = tokio::time::timeout(SOON, events.try_next()).await.expect("in time").expect("event").expect("some");
    assert!(matches!(next, WatchEvent::Deleted(p) if p.metadata.name.as_deref() == Some("a")));

    // After a compaction the old version is gone: 410 Expired.
    server.compact();
    let mut events = pods.watch(&WatchParams::default(), &from).await.expect("watch").boxed();
    let expired = tokio::time::timeout(SOON, events.try_next()).await.expect("in time").expect("event").expect("some");
    match expired {
        WatchEvent::Error(status) => assert_eq!(status.code, 410),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn pods_bound_to_a_node_terminate_gracefully_and_deletes_check_the_uid() {
    let server = ApiServer::start().await.expect("start");
    let pods: Api<Pod> = Api::namespaced(client(&server, server.admin_token()).await, "default");
    let created = pods.create(&PostParams::default(), &pod("p", "n1", None)).await.expect("create");
    pods.delete("p", &DeleteParams::default()).await.expect("delete");
    let terminating = pods.get("p").await.expect("still there");
    assert!(terminating.metadata.deletion_timestamp.is_some());
    assert_eq!(terminating.metadata.deletion_grace_period_seconds, Some(30));
    let wrong = DeleteParams {
        grace_period_seconds: Some(0),
        preconditions: Some(Preconditions { uid: Some("other".into()), resource_version: None }),
        ..Default::default()
    };
    let (code, _, message) = api_error(pods.delete("p", &wrong).await.expect_err("precondition"));
    assert_eq!(code, 409);
    assert!(message.starts_with("Precondition failed: UID in precondition: other"), "{message}");
    let right = DeleteParams {
        grace_period_seconds: Some(0),
        preconditions: Some(Preconditions { uid: created.metadata.uid.clone(), resource_version: None }),
        ..Default::default()
    };
    pods.delete("p", &right).await.expect("delete");
    assert_eq!(api_error(pods.get("p").await.expect_err("gone")).0, 404);
}

#[tokio::test]
async fn a_node_identity_gets_what_the_node_authorizer_gives() {
    let server = ApiServer::start().await.expect("start");
    let admin = client(&server, server.admin_token()).await;
    let node_client = client(&server, &server.node_token("n1")).await;
    let nodes: Api<Node> = Api::all(node_client.clone());
    nodes.create(&PostParams::default(), &node("n1")).await.expect("own node");
    Api::<Node>::all(admin.clone()).create(&PostParams::default(), &node("n2")).await.expect("admin");
    let (code, reason, message) = api_error(
        nodes
            .patch("n2", &PatchParams::default(), &Patch::Merge(json!({"metadata": {"labels": {"x": "y"}}})))
            .await
            .expect_err("other node"),
    );
    assert_eq!((code, reason.as_str()), (403, "Forbidden"));
    assert!(message.contains("User \"system:node:n1\" cannot patch resource \"nodes\""), "{message}");
    // Its own Node it reads; the status subresource it may only write.
    nodes.get("n1").await.expect("own node");
    assert_eq!(api_error(nodes.get_status("n1").await.expect_err("nodes/status is write-only")).0, 403);

    let admin_secrets: Api<Secret> = Api::namespaced(admin.clone(), "default");
    let secret: Secret =
        serde_json::from_value(json!({"metadata": {"name": "s"}, "data": {"k": "dg=="}})).expect("secret");
    admin_secrets.create(&PostParams::default(), &secret).await.expect("secret");
    let node_secrets: Api<Secret> = Api::namespaced(node_client.clone(), "default");
    assert_eq!(api_error(node_secrets.get("s").await.expect_err("not referenced")).0, 403);
    assert_eq!(api_error(node_secrets.list(&Default::default()).await.expect_err("no list")).0, 403);
    let admin_pods: Api<Pod> = Api::namespaced(admin, "default");
    admin_pods.create(&PostParams::default(), &pod("uses-s", "n1", Some("s"))).await.expect("pod");
    admin_pods.create(&PostParams::default(), &pod("elsewhere", "n2", None)).await.expect("pod");
    node_secrets.get("s").await.expect("referenced by a pod bound to n1");

    let node_pods: Api<Pod> = Api::namespaced(node_client, "default");
    let status = Patch::Merge(json!({"status": {"phase": "Running"}}));
    node_pods.patch_status("uses-s", &PatchParams::default(), &status).await.expect("own pod");
    assert_eq!(
        api_error(node_pods.patch_status("elsewhere", &PatchParams::default(), &status).await.expect_err("other")).0,
        403
    );
    // A node may not create ordinary pods, only mirror pods of its static pods.
    assert_eq!(
        api_error(node_pods.create(&PostParams::default(), &pod("mine", "n1", None)).await.expect_err("no")).0,
        403
    );
    // A mirror pod must be owned by the node's own Node object.
    let mut mirror = pod("static-n1", "n1", None);
    mirror.metadata.annotations = Some([("kubernetes.io/config.mirror".to_owned(), "hash".to_owned())].into());
    let refused = node_pods.create(&PostParams::default(), &mirror).await.expect_err("no owner");
    assert_eq!(
        api_error(refused),
        (
            403,
            "Forbidden".into(),
            "pods \"static-n1\" is forbidden: node \"n1\" can only create pods with an owner reference set to itself"
                .into()
        )
    );
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(node_pods.clone().into_client());
    let n1 = nodes.get("n1").await.expect("its own Node, registered above");
    let owner = |uid: &str| {
        serde_json::from_value(
            json!([{"apiVersion": "v1", "kind": "Node", "name": "n1", "uid": uid, "controller": true}]),
        )
        .expect("owner")
    };
    mirror.metadata.owner_references = Some(owner("not-the-node"));
    let refused = node_pods.create(&PostParams::default(), &mirror).await.expect_err("wrong uid");
    assert!(api_error(refused).2.contains("UID mismatch"));
    mirror.metadata.owner_references = Some(owner(n1.metadata.uid.as_deref().expect("uid")));
    node_pods.create(&PostParams::default(), &mirror).await.expect("mirror pod");
    // Nor may it give its Node a role.
    let labelled: k8s_openapi::api::core::v1::Node =
        serde_json::from_value(json!({"metadata": {"name": "n1", "labels": {"node-role.kubernetes.io/worker": ""}}}))
            .expect("node");
    nodes.delete("n1", &Default::default()).await.expect("delete own node");
    let refused = nodes.create(&PostParams::default(), &labelled).await.expect_err("role label");
    assert_eq!(
        api_error(refused),
        (
            403,
            "Forbidden".into(),
            "nodes \"n1\" is forbidden: node \"n1\" is not allowed to set the following labels: node-role.kubernetes.io/worker".into()
        )
    );
}

#[tokio::test]
async fn injected_faults_answer_then_clear_and_watches_can_be_dropped() {
    let server = ApiServer::start().await.expect("start");
    let client = client(&server, server.admin_token()).await;
    let nodes: Api<Node> = Api::all(client.clone());
    nodes.create(&PostParams::default(), &node("n1")).await.expect("create");
    server.inject(Fault::status(Some(http::Method::GET), "/api/v1/nodes/n1", 500, 1));
    server.inject(Fault::status(Some(http::Method::GET), "/api/v1/nodes/n1", 429, 1));
    assert_eq!(api_error(nodes.get("n1").await.expect_err("500")).0, 500);
    // kube-rs retries a 429 itself (after Retry-After): the get succeeds,
    // and the server saw both answers.
    nodes.get("n1").await.expect("retried past the 429");
    let answers: Vec<u16> =
        server.requests().iter().filter(|r| r.uri == "/api/v1/nodes/n1").map(|r| r.status).collect();
    assert_eq!(answers, [500, 429, 200]);
    nodes.get("n1").await.expect("recovered");

    let mut events = nodes.watch(&WatchParams::default(), "0").await.expect("watch").boxed();
    let added = tokio::time::timeout(SOON, events.try_next()).await.expect("in time").expect("event");
    assert!(matches!(added, Some(WatchEvent::Added(_))));
    server.drop_watches();
    let end = tokio::time::timeout(SOON, events.next()).await.expect("the stream ends in time");
    assert!(end.is_none(), "{end:?}");
    // Unauthenticated requests are refused.
    let anonymous: Api<Node> = Api::all(self::client(&server, "nobody").await);
    assert_eq!(api_error(anonymous.get("n1").await.expect_err("401")).0, 401);
}
