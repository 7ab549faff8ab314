//! Upstream's "Pods Extended Pod Container Status" specs, as a scenario any
//! cluster test node can be put through: pods whose container (or init
//! container) exits 1 are deleted at every point of their lives, and every
//! status the API holds between their creation and their deletion is held
//! to the rules those specs check.

use std::time::Duration;

use futures_util::StreamExt as _;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, PostParams, WatchEvent, WatchParams};
use serde_json::{Value, json};

use crate::test_api::json_of;

/// The rules upstream's "Pods Extended Pod Container Status" specs hold
/// every status of a pod to, from its creation to its deletion: one
/// container `fail` (that exits 1) and, where given, one init container;
/// a container that is `blocked` behind a failing init container never
/// shows started; once terminated, `fail` stays terminated, with exit code
/// 1 (or 137 when it was killed: reason `Error` or `ContainerStatusUnknown`)
/// and a start time; a terminal phase never reverts; and the last status
/// before the deletion is terminal, or `Pending` with nothing running.
#[derive(Default)]
pub struct StatusRules {
    seen_init: bool,
    seen_containers: bool,
    terminated: bool,
    terminal: bool,
    running: bool,
}

impl StatusRules {
    /// Checks one status; an error says which rule it breaks.
    pub fn check(&mut self, pod: &Value) -> Result<(), String> {
        let status = &pod["status"];
        let has_init = pod["spec"]["initContainers"].as_array().is_some_and(|a| !a.is_empty());
        let inits = status["initContainerStatuses"].as_array().cloned().unwrap_or_default();
        if has_init {
            if inits.is_empty() {
                return if self.seen_init { Err(format!("init statuses went away: {status}")) } else { Ok(()) };
            }
            self.seen_init = true;
            if inits.len() != 1 {
                return Err(format!("init statuses: {status}"));
            }
        } else if !inits.is_empty() {
            return Err(format!("init statuses without init containers: {status}"));
        }
        let containers = status["containerStatuses"].as_array().cloned().unwrap_or_default();
        if containers.is_empty() {
            return if self.seen_containers { Err(format!("container statuses went away: {status}")) } else { Ok(()) };
        }
        self.seen_containers = true;
        if containers.len() != 1 {
            return Err(format!("container statuses: {status}"));
        }
        let named = |name: &str| inits.iter().chain(&containers).find(|c| c["name"] == name).cloned();
        if let Some(blocked) = named("blocked") {
            let started = blocked["started"] == true;
            if started || blocked["lastState"]["terminated"].is_object() || !blocked["state"]["waiting"].is_object() {
                return Err(format!("the blocked container started: {blocked}"));
            }
        }
        let fail = named("fail").ok_or_else(|| format!("no status of `fail`: {status}"))?;
        let state = &fail["state"];
        let ended = &state["terminated"];
        if self.terminated && (!ended.is_object() || state["waiting"].is_object() || state["running"].is_object()) {
            return Err(format!("`fail` was terminated, then changed: {fail}"));
        }
        self.running = !state["waiting"].is_object() && !ended.is_object();
        if ended.is_object() {
            self.terminated = true;
            let code = ended["exitCode"].as_i64();
            let reason = ended["reason"].as_str().unwrap_or_default();
            let expected =
                code == Some(1) || (code == Some(137) && matches!(reason, "Error" | "ContainerStatusUnknown"));
            if !expected {
                return Err(format!("`fail` ended unexpectedly: {fail}"));
            }
            if ended["finishedAt"].is_string() && !ended["startedAt"].is_string() {
                return Err(format!("`fail` has an end but no start: {fail}"));
            }
        }
        let phase = status["phase"].as_str().unwrap_or_default();
        if matches!(phase, "Failed" | "Succeeded") {
            self.terminal = true;
        } else if self.terminal {
            return Err(format!("the phase reverted from terminal: {status}"));
        }
        Ok(())
    }

    /// The rules for the status the deletion carries.
    pub fn check_final(&self, pod: &Value) -> Result<(), String> {
        let status = &pod["status"];
        if self.running {
            return Err(format!("a container was running or unknown at the deletion: {status}"));
        }
        if !self.terminal && status["phase"] != "Pending" {
            return Err(format!("not terminal, and not Pending, with nothing running: {status}"));
        }
        Ok(())
    }
}

/// When a scenario's pod is deleted.
#[derive(Clone, Copy, Debug)]
enum Point {
    /// Right after its creation.
    AtOnce,
    /// Once the node reported its container statuses.
    Reported,
    /// Once it failed.
    Failed,
    /// A while after its creation, whatever it is doing then (the
    /// upstream specs delete after a random delay of up to 2 s).
    After(Duration),
}

/// Runs the scenarios on node `node` through `admin`: pods of `image`,
/// with and without a failing init container, each deleted at every
/// [`Point`], all at once, each within `soon`. The rules broken, by pod.
pub async fn run_scenarios(admin: &Api<Pod>, node: &str, image: &str, soon: Duration) -> Vec<String> {
    let mut points = vec![Point::AtOnce, Point::Reported, Point::Failed];
    points.extend([50, 150, 300, 500, 800, 1200, 2000].map(|ms| Point::After(Duration::from_millis(ms))));
    let mut runs = Vec::new();
    for init in [false, true] {
        for (i, point) in points.iter().enumerate() {
            let name = format!("terminate-{}-{i}", if init { "init" } else { "plain" });
            runs.push(scenario(admin, node, image, init, *point, name, soon));
        }
    }
    futures_util::future::join_all(runs).await.into_iter().flatten().collect()
}

/// One pod of the scenarios: the rule it broke, if any.
async fn scenario(
    admin: &Api<Pod>,
    node: &str,
    image: &str,
    init: bool,
    point: Point,
    pod_name: String,
    soon: Duration,
) -> Option<String> {
    let failing = json!({"name": "fail", "image": image, "command": ["sh", "-c", "exit 1"]});
    let mut spec = json!({"nodeName": node, "restartPolicy": "Never", "automountServiceAccountToken": false,
                          "terminationGracePeriodSeconds": 1, "containers": [failing]});
    if init {
        spec["initContainers"] = json!([failing]);
        spec["containers"] = json!([{"name": "blocked", "image": image, "command": ["true"]}]);
    }
    let pod: Pod = serde_json::from_value(json!({"metadata": {"name": pod_name}, "spec": spec})).expect("pod");
    let created = admin.create(&PostParams::default(), &pod).await.expect("create");
    let version = created.metadata.resource_version.clone().expect("resourceVersion");
    let params = WatchParams::default().fields(&format!("metadata.name={pod_name}"));
    let mut stream = admin.watch(&params, &version).await.expect("watch").boxed();
    let mut rules = StatusRules::default();
    let delete = || async { admin.delete(&pod_name, &DeleteParams::default()).await.expect("delete") };
    let mut deleted = false;
    let delay = match point {
        Point::AtOnce => {
            delete().await;
            deleted = true;
            None
        }
        Point::After(delay) => Some(tokio::time::sleep(delay)),
        Point::Reported | Point::Failed => None,
    };
    let outcome = tokio::time::timeout(soon, async {
        let mut delay = delay.map(Box::pin);
        loop {
            let event = tokio::select! {
                event = stream.next() => event,
                () = async { delay.as_mut().expect("a delay").await }, if delay.is_some() && !deleted => {
                    delete().await;
                    deleted = true;
                    continue;
                }
            };
            let Some(event) = event else { return Err("the watch ended before the deletion".to_owned()) };
            let (object, last) = match event.expect("watch event") {
                WatchEvent::Added(p) | WatchEvent::Modified(p) => (p, false),
                WatchEvent::Deleted(p) => (p, true),
                WatchEvent::Bookmark(_) => continue,
                WatchEvent::Error(e) => return Err(format!("watch error: {e:?}")),
            };
            let object = json_of(&object);
            rules.check(&object)?;
            if last {
                return rules.check_final(&object);
            }
            let reached = match point {
                Point::Reported => object["status"]["containerStatuses"].is_array(),
                Point::Failed => object["status"]["phase"] == "Failed",
                Point::AtOnce | Point::After(_) => false,
            };
            if reached && !deleted {
                delete().await;
                deleted = true;
            }
        }
    })
    .await;
    match outcome {
        Ok(Ok(())) => None,
        Ok(Err(error)) => Some(format!("{pod_name} (deleted {point:?}): {error}")),
        Err(_) => Some(format!("{pod_name} (deleted {point:?}): not deleted within {soon:?}")),
    }
}

/// Deletes `pod` (created through `admin`) and returns the object its
/// deletion carried (the watch's `Deleted` event), within `soon`.
pub async fn delete_and_watch(admin: &Api<Pod>, pod: &Pod, soon: Duration) -> Value {
    let name = pod.metadata.name.clone().expect("name");
    let version = pod.metadata.resource_version.clone().expect("resourceVersion");
    let params = WatchParams::default().fields(&format!("metadata.name={name}"));
    let mut stream = admin.watch(&params, &version).await.expect("watch").boxed();
    admin.delete(&name, &DeleteParams::default()).await.expect("delete");
    let deleted = tokio::time::timeout(soon, async {
        while let Some(event) = stream.next().await {
            if let WatchEvent::Deleted(object) = event.expect("watch event") {
                return json_of(&object);
            }
        }
        panic!("the watch of {name} ended before its deletion");
    });
    deleted.await.unwrap_or_else(|_| panic!("{name} not deleted within {soon:?}"))
}
