//! What the node writes of a pod's status, and how: the status manager's
//! two pure steps.
//!
//! 1. [`desired`]: the status the lifecycle computed, reconciled with the
//!    status the API last returned: the start time the API has is kept
//!    (across node restarts too); a condition keeps its
//!    `lastTransitionTime` while its status does not change; readiness
//!    gates (`spec.readinessGates`) must all be `True` in the API's
//!    conditions for `Ready` to be `True`.
//! 2. [`patch`]: a two-way strategic merge patch from the API's status to
//!    the desired one, as the kubelet sends it: changed fields set, fields
//!    that became empty removed (`null`), `conditions` merged by `type`
//!    with only the node's own conditions in it (conditions other writers
//!    own, such as readiness-gate conditions and `DisruptionTarget`, are
//!    never touched), `podIPs`/`hostIPs` merged by `ip`, and the pod's UID
//!    so the patch cannot land on a newer pod of the same name. Fields
//!    other writers own ([`OTHERS_FIELDS`]) are never named.

use k8s_openapi::api::core::v1::{PodCondition, PodStatus};
use serde_json::{Map, Value, json};

/// The node's conditions that come and go (in-place resize): one the
/// desired status no longer has is deleted from the API's.
pub(crate) const TRANSIENT_CONDITIONS: [&str; 2] = ["PodResizePending", "PodResizeInProgress"];

/// Status fields other writers own, which the node's patch never names:
/// the resource claim controller's `resourceClaimStatuses` (NodeRestriction
/// refuses a node's write that changes them, `null` included) and the
/// scheduler's `nominatedNodeName`.
pub(crate) const OTHERS_FIELDS: [&str; 2] = ["resourceClaimStatuses", "nominatedNodeName"];

/// The reason of a `Ready` condition held back by a readiness gate.
pub(crate) const READINESS_GATES_NOT_READY: &str = "ReadinessGatesNotReady";

/// The status to write: `computed` (the lifecycle's) reconciled with `api`
/// (the status the API last returned) for a pod with readiness gates
/// `gates`.
pub(crate) fn desired(mut computed: PodStatus, api: Option<&PodStatus>, gates: &[String]) -> PodStatus {
    let api_conditions: &[PodCondition] = api.and_then(|s| s.conditions.as_deref()).unwrap_or_default();
    if let Some(start) = api.and_then(|s| s.start_time.clone()) {
        computed.start_time = Some(start);
    }
    if let Some(conditions) = computed.conditions.as_mut() {
        if !gates.is_empty() {
            gate_ready(conditions, api_conditions, gates);
        }
        for condition in conditions.iter_mut() {
            if let Some(before) = api_conditions.iter().find(|c| c.type_ == condition.type_)
                && before.status == condition.status
            {
                condition.last_transition_time = before.last_transition_time.clone();
            }
        }
    }
    computed
}

/// Holds `Ready` at `False` while a readiness gate's condition (in the
/// API's conditions) is missing or not `True` (upstream's messages).
fn gate_ready(conditions: &mut [PodCondition], api_conditions: &[PodCondition], gates: &[String]) {
    let Some(ready) = conditions.iter_mut().find(|c| c.type_ == "Ready") else { return };
    if ready.status != "True" {
        return;
    }
    let unready: Vec<String> = gates
        .iter()
        .filter_map(|gate| match api_conditions.iter().find(|c| &c.type_ == gate) {
            None => Some(format!("corresponding condition of pod readiness gate \"{gate}\" does not exist.")),
            Some(c) if c.status != "True" => {
                Some(format!("the status of pod readiness gate \"{gate}\" is not \"True\", but {}", c.status))
            }
            Some(_) => None,
        })
        .collect();
    if !unready.is_empty() {
        ready.status = "False".into();
        ready.reason = Some(READINESS_GATES_NOT_READY.into());
        ready.message = Some(unready.join(", "));
    }
}

/// The strategic merge patch (for `pods/<name>/status`) that turns `api`
/// into `desired`; `None` when there is nothing to change.
pub(crate) fn patch(uid: &str, api: Option<&PodStatus>, desired: &PodStatus) -> Option<Value> {
    let before = as_object(api.map(serde_json::to_value));
    let after = as_object(Some(serde_json::to_value(desired)));
    let mut status = Map::new();
    for (key, new) in &after {
        let old = before.get(key);
        match key.as_str() {
            others if OTHERS_FIELDS.contains(&others) => {}
            "conditions" => {
                let mut changed = changed_conditions(old, new);
                changed.extend(gone_conditions(old, Some(new)));
                if !changed.is_empty() {
                    status.insert(key.clone(), Value::Array(changed));
                }
            }
            "podIPs" | "hostIPs" if old != Some(new) => {
                status.insert(key.clone(), merge_list_by(old, new, "ip"));
            }
            "podIPs" | "hostIPs" => {}
            // The API server writes a container status's `lastState` even
            // when it is empty (`{}`): the same as none.
            _ if old.map(without_empty_objects) != Some(without_empty_objects(new)) => {
                status.insert(key.clone(), new.clone());
            }
            _ => {}
        }
    }
    for (key, old) in &before {
        if key == "conditions" && !after.contains_key(key) {
            let gone = gone_conditions(Some(old), None);
            if !gone.is_empty() {
                status.insert(key.clone(), Value::Array(gone));
            }
        }
        if after.contains_key(key) || key == "conditions" || OTHERS_FIELDS.contains(&key.as_str()) {
            continue;
        }
        match key.as_str() {
            // Entries merged by key are deleted one by one.
            "podIPs" | "hostIPs" => {
                status.insert(key.clone(), merge_list_by(Some(old), &Value::Array(Vec::new()), "ip"));
            }
            _ => {
                status.insert(key.clone(), Value::Null);
            }
        }
    }
    (!status.is_empty()).then(|| json!({"metadata": {"uid": uid}, "status": status}))
}

/// `value` with every object member whose value is `{}` left out, at any
/// depth: how the API server's defaults (`lastState: {}`) compare with a
/// status that leaves them out.
fn without_empty_objects(value: &Value) -> Value {
    match value {
        Value::Object(map) => Value::Object(
            map.iter()
                .filter(|(_, v)| !matches!(v, Value::Object(inner) if inner.is_empty()))
                .map(|(k, v)| (k.clone(), without_empty_objects(v)))
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.iter().map(without_empty_objects).collect()),
        other => other.clone(),
    }
}

fn as_object(value: Option<Result<Value, serde_json::Error>>) -> Map<String, Value> {
    match value {
        Some(Ok(Value::Object(map))) => map,
        _ => Map::new(),
    }
}

/// The node's conditions in `new` that differ from those in `old`. A
/// strategic merge patch merges a listed condition into the one of its
/// `type` field by field, so a field the condition no longer has (a
/// `reason` or `message` once it is True again) is sent as `null`.
fn changed_conditions(old: Option<&Value>, new: &Value) -> Vec<Value> {
    let old = old.and_then(Value::as_array).cloned().unwrap_or_default();
    let mut changed = Vec::new();
    for condition in new.as_array().into_iter().flatten() {
        let before = old.iter().find(|o| o.get("type") == condition.get("type"));
        if before == Some(condition) {
            continue;
        }
        let mut entry = condition.clone();
        if let (Some(before), Some(entry)) = (before.and_then(Value::as_object), entry.as_object_mut()) {
            for key in before.keys() {
                entry.entry(key.clone()).or_insert(Value::Null);
            }
        }
        changed.push(entry);
    }
    changed
}

/// A `$patch: delete` for each transient condition of `old` that `new`
/// no longer has.
fn gone_conditions(old: Option<&Value>, new: Option<&Value>) -> Vec<Value> {
    let has = |kind: &Value| new.and_then(Value::as_array).into_iter().flatten().any(|c| c.get("type") == Some(kind));
    old.and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|c| c.get("type"))
        .filter(|kind| kind.as_str().is_some_and(|k| TRANSIENT_CONDITIONS.contains(&k)) && !has(kind))
        .map(|kind| json!({"type": kind, "$patch": "delete"}))
        .collect()
}

/// A list merged by `key`: the entries of `new`, then a `$patch: delete`
/// for each entry of `old` that `new` no longer has.
fn merge_list_by(old: Option<&Value>, new: &Value, key: &str) -> Value {
    let mut entries: Vec<Value> = new.as_array().cloned().unwrap_or_default();
    for gone in old.and_then(Value::as_array).into_iter().flatten() {
        let id = gone.get(key);
        if !entries.iter().any(|e| e.get(key) == id) {
            entries.push(json!({key: id, "$patch": "delete"}));
        }
    }
    Value::Array(entries)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_servers_empty_last_state_is_no_change_but_a_real_one_is() {
        let status = |statuses: Value| -> PodStatus {
            serde_json::from_value(json!({"phase": "Running", "containerStatuses": statuses})).expect("status")
        };
        let ours = json!([{"name": "c", "image": "i", "imageID": "", "ready": true, "restartCount": 0,
                           "state": {"running": {"startedAt": "2026-11-27T00:00:00Z"}}}]);
        let mut api = ours.clone();
        api[0]["lastState"] = json!({});
        assert_eq!(patch("u", Some(&status(api.clone())), &status(ours.clone())), None, "lastState {{}} is none");
        api[0]["lastState"] = json!({"terminated": {"exitCode": 1}});
        assert!(patch("u", Some(&status(api)), &status(ours)).is_some(), "a real lastState differs");
    }

    #[test]
    fn a_resize_condition_that_went_is_deleted_and_no_other() {
        let api = PodStatus {
            conditions: Some(vec![
                condition("Ready", "True", 1),
                condition("PodResizePending", "True", 1),
                condition("DisruptionTarget", "True", 1),
            ]),
            ..PodStatus::default()
        };
        let desired = PodStatus { conditions: Some(vec![condition("Ready", "True", 1)]), ..PodStatus::default() };
        let patch = patch("u", Some(&api), &desired).expect("a patch");
        assert_eq!(patch["status"]["conditions"], json!([{"type": "PodResizePending", "$patch": "delete"}]));
    }
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    fn condition(kind: &str, status: &str, at: i64) -> PodCondition {
        PodCondition {
            type_: kind.into(),
            status: status.into(),
            last_transition_time: Some(Time(k8s_openapi::jiff::Timestamp::from_second(at).expect("time"))),
            ..PodCondition::default()
        }
    }

    fn status(conditions: Vec<PodCondition>) -> PodStatus {
        PodStatus { phase: Some("Running".into()), conditions: Some(conditions), ..PodStatus::default() }
    }

    #[test]
    fn transition_times_stay_while_a_condition_keeps_its_status() {
        let api = status(vec![condition("Ready", "True", 100), condition("Initialized", "True", 100)]);
        let computed = status(vec![condition("Ready", "True", 200), condition("Initialized", "False", 200)]);
        let desired = desired(computed, Some(&api), &[]);
        let conditions = desired.conditions.expect("conditions");
        assert_eq!(conditions[0].last_transition_time, api.conditions.as_ref().expect("c")[0].last_transition_time);
        assert_eq!(conditions[1].last_transition_time.as_ref().map(|t| t.0.as_second()), Some(200));
        // Only the condition that changed is in the patch.
        let patch = patch("u1", Some(&api), &PodStatus { conditions: Some(conditions), ..api.clone() }).expect("patch");
        assert_eq!(patch["status"]["conditions"].as_array().map(Vec::len), Some(1), "{patch}");
        assert_eq!(patch["status"]["conditions"][0]["type"], "Initialized");
        assert_eq!(patch["metadata"]["uid"], "u1");
    }

    #[test]
    fn ready_waits_for_every_readiness_gate() {
        let gates = vec!["example.com/lb".to_owned(), "example.com/dns".to_owned()];
        let computed = status(vec![condition("ContainersReady", "True", 1), condition("Ready", "True", 1)]);
        let none = desired(computed.clone(), None, &gates);
        let ready = &none.conditions.as_ref().expect("c")[1];
        assert_eq!(ready.status, "False");
        assert_eq!(ready.reason.as_deref(), Some(READINESS_GATES_NOT_READY));
        assert_eq!(
            ready.message.as_deref(),
            Some(
                "corresponding condition of pod readiness gate \"example.com/lb\" does not exist., \
                 corresponding condition of pod readiness gate \"example.com/dns\" does not exist."
            )
        );
        let half = status(vec![condition("example.com/lb", "True", 1), condition("example.com/dns", "False", 1)]);
        let ready = desired(computed.clone(), Some(&half), &gates).conditions.expect("c")[1].clone();
        assert_eq!(
            ready.message.as_deref(),
            Some("the status of pod readiness gate \"example.com/dns\" is not \"True\", but False")
        );
        let both = status(vec![condition("example.com/lb", "True", 1), condition("example.com/dns", "True", 1)]);
        assert_eq!(desired(computed, Some(&both), &gates).conditions.expect("c")[1].status, "True");
    }

    #[test]
    fn others_conditions_are_never_in_the_patch_and_cleared_fields_are_removed() {
        let mut api = status(vec![condition("Ready", "False", 1), condition("DisruptionTarget", "True", 1)]);
        api.message = Some("volumes not ready".into());
        api.start_time = Some(Time(k8s_openapi::jiff::Timestamp::from_second(5).expect("t")));
        let computed = status(vec![condition("Ready", "True", 9)]);
        let desired = desired(computed, Some(&api), &[]);
        assert_eq!(desired.start_time, api.start_time, "the API's start time is kept");
        let patch = patch("u1", Some(&api), &desired).expect("patch");
        assert_eq!(patch["status"]["message"], Value::Null);
        assert!(patch["status"].as_object().expect("status").contains_key("message"));
        let conditions = patch["status"]["conditions"].as_array().expect("conditions");
        assert!(conditions.iter().all(|c| c["type"] != "DisruptionTarget"), "{patch}");
        assert!(patch["status"].get("startTime").is_none(), "{patch}");
    }

    #[test]
    fn a_condition_that_loses_its_reason_clears_it() {
        let mut unready = condition("Ready", "False", 1);
        unready.reason = Some("ContainersNotReady".into());
        unready.message = Some("containers with unready status: [main]".into());
        let api = status(vec![unready]);
        let desired = desired(status(vec![condition("Ready", "True", 2)]), Some(&api), &[]);
        let patch = patch("u1", Some(&api), &desired).expect("patch");
        let ready = &patch["status"]["conditions"][0];
        assert_eq!(ready["status"], "True");
        assert!(ready.as_object().expect("object").contains_key("reason") && ready["reason"].is_null(), "{patch}");
        assert!(ready["message"].is_null(), "{patch}");
    }

    #[test]
    fn nothing_to_write_when_the_api_has_it_already() {
        let api = status(vec![condition("Ready", "True", 1), condition("example.com/gate", "True", 1)]);
        let desired = desired(status(vec![condition("Ready", "True", 7)]), Some(&api), &["example.com/gate".into()]);
        assert_eq!(patch("u1", Some(&api), &desired), None);
    }

    #[test]
    fn pod_ips_are_merged_by_ip() {
        use k8s_openapi::api::core::v1::PodIP;
        let api = PodStatus {
            pod_ips: Some(vec![PodIP { ip: "10.0.0.1".into() }, PodIP { ip: "fd00::1".into() }]),
            ..PodStatus::default()
        };
        let desired = PodStatus { pod_ips: Some(vec![PodIP { ip: "10.0.0.1".into() }]), ..PodStatus::default() };
        let patch = patch("u1", Some(&api), &desired).expect("patch");
        assert_eq!(patch["status"]["podIPs"], json!([{"ip": "10.0.0.1"}, {"ip": "fd00::1", "$patch": "delete"}]));
    }

    /// The controller's `resourceClaimStatuses` and the scheduler's
    /// `nominatedNodeName` in the API's status, absent from the node's: the
    /// patch names neither (a `null` for the claims was refused by
    /// NodeRestriction: "cannot update resource claim statues").
    #[test]
    fn the_patch_never_names_the_fields_others_own() {
        let api: PodStatus = serde_json::from_value(json!({
            "phase": "Pending",
            "nominatedNodeName": "n1",
            "resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": "pod-gpu-x7k2p"}],
        }))
        .expect("status");
        let desired: PodStatus = serde_json::from_value(json!({"phase": "Running"})).expect("status");
        let written = patch("u1", Some(&api), &desired).expect("a patch");
        assert_eq!(written, json!({"metadata": {"uid": "u1"}, "status": {"phase": "Running"}}));
        // Nor when the node's status carries them (a provider copied them).
        let carrying: PodStatus = serde_json::from_value(json!({
            "phase": "Running",
            "nominatedNodeName": "n2",
            "resourceClaimStatuses": [],
        }))
        .expect("status");
        let written = patch("u1", Some(&api), &carrying).expect("a patch");
        assert_eq!(written, json!({"metadata": {"uid": "u1"}, "status": {"phase": "Running"}}));
    }
}
