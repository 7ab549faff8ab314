//! The `pods/<name>/resize` subresource, as a 1.33 API server judges it:
//! only the cpu and memory of app and sidecar containers (and their
//! `resizePolicy`) change; anything else in the request is dropped, and
//! upstream's validation refuses what it refuses, with its messages.

use kubelet::provider::qos::qos_class;
use serde_json::Value;

use super::store::ApiError;

/// What the pod becomes when `new` (the object after the request) resizes
/// `old`, or why not.
pub fn admit(old: &Value, new: &Value) -> Result<Value, ApiError> {
    let name = old.pointer("/metadata/name").and_then(Value::as_str).unwrap_or_default().to_owned();
    let invalid = |errors: Vec<String>| {
        ApiError::new(422, "Invalid", format!("Pod \"{name}\" is invalid: [{}]", errors.join(", ")))
    };
    let forbidden =
        |message: &str| ApiError::new(422, "Invalid", format!("Pod \"{name}\" is invalid: : Forbidden: {message}"));
    if old.pointer("/metadata/annotations/kubernetes.io~1config.mirror").is_some() {
        return Err(forbidden("static pods cannot be resized"));
    }
    let mut errors = Vec::new();
    for list in ["containers", "initContainers"] {
        let (was, is) = (containers(old, list), containers(new, list));
        if was.len() != is.len() {
            errors.push(format!("spec.{list}: Forbidden: {list} may not be added or removed on resize"));
            continue;
        }
        for (i, (a, b)) in was.iter().zip(&is).enumerate() {
            if a.get("name") != b.get("name") {
                errors.push(format!(
                    "spec.{list}[{i}].name: Forbidden: {list} may not be renamed or reordered on resize"
                ));
            }
        }
    }
    if !errors.is_empty() {
        return Err(invalid(errors));
    }
    // Only the resizable containers' resources and resize policies are
    // taken from the request.
    let mut result = old.clone();
    for list in ["containers", "initContainers"] {
        let news = containers(new, list);
        let Some(entries) = result.pointer_mut(&format!("/spec/{list}")).and_then(Value::as_array_mut) else {
            continue;
        };
        for (i, (entry, new)) in entries.iter_mut().zip(&news).enumerate() {
            let sidecar = entry.get("restartPolicy").and_then(Value::as_str) == Some("Always");
            let path = format!("spec.{list}[{i}].resources");
            let (was, is) = (
                entry.get("resources").cloned().unwrap_or_default(),
                new.get("resources").cloned().unwrap_or_default(),
            );
            if list == "initContainers" && !sidecar {
                if was != is {
                    errors.push("spec: Forbidden: resources for non-sidecar init containers are immutable".to_owned());
                }
                continue;
            }
            let policy = new.get("resizePolicy").cloned().unwrap_or(Value::Null);
            errors.extend(validate(&was, &is, &policy, &path));
            for kind in ["requests", "limits"] {
                let others = |r: &Value| {
                    let mut map = r.get(kind).and_then(Value::as_object).cloned().unwrap_or_default();
                    map.remove("cpu");
                    map.remove("memory");
                    map
                };
                if others(&was) != others(&is) {
                    errors.push("spec: Forbidden: only cpu and memory resources are mutable".to_owned());
                }
            }
            entry["resources"] = is;
            if !policy.is_null() {
                entry["resizePolicy"] = policy;
            }
        }
    }
    errors.dedup();
    let parse = |v: &Value| serde_json::from_value::<k8s_openapi::api::core::v1::Pod>(v.clone()).ok();
    if let (Some(before), Some(after)) = (parse(old), parse(&result))
        && qos_class(&before) != qos_class(&after)
    {
        let class = qos_class(&after).as_str();
        errors.push(format!("spec: Invalid value: \"{class}\": Pod QOS Class may not change as a result of resizing"));
    }
    let running_without_sizes = old
        .pointer("/status/containerStatuses")
        .and_then(Value::as_array)
        .and_then(|s| s.iter().find(|c| c.pointer("/state/running").is_some()))
        .is_some_and(|c| c.get("resources").is_none());
    if running_without_sizes {
        errors.push("spec: Forbidden: Pod running on node without support for resize".to_owned());
    }
    if errors.is_empty() { Ok(result) } else { Err(invalid(errors)) }
}

fn containers(pod: &Value, list: &str) -> Vec<Value> {
    pod.pointer(&format!("/spec/{list}")).and_then(Value::as_array).cloned().unwrap_or_default()
}

/// Upstream's `validateContainerResize`.
fn validate(was: &Value, is: &Value, policy: &Value, path: &str) -> Vec<String> {
    let mut errors = Vec::new();
    let keys = |r: &Value, kind: &str| r.get(kind).and_then(Value::as_object).cloned().unwrap_or_default();
    for kind in ["requests", "limits"] {
        let (a, b) = (keys(was, kind), keys(is, kind));
        if a.keys().any(|k| !b.contains_key(k)) {
            errors.push(format!("{path}.{kind}: Forbidden: resource {kind} cannot be removed"));
        }
    }
    let memory_policy = policy
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p.get("resourceName").and_then(Value::as_str) == Some("memory"))
        .and_then(|p| p.get("restartPolicy").and_then(Value::as_str))
        .unwrap_or("NotRequired");
    if memory_policy == "NotRequired" {
        let bytes = |r: &Value| {
            r.pointer("/limits/memory").and_then(Value::as_str).and_then(|q| kubelet::pod::parse_units(q).ok())
        };
        match (bytes(was), bytes(is)) {
            (Some(old), Some(new)) if new < old => errors.push(format!(
                "{path}.limits[memory]: Forbidden: memory limits cannot be decreased unless resizePolicy is RestartContainer"
            )),
            (None, Some(_)) => errors.push(format!(
                "{path}.limits[memory]: Forbidden: memory limits cannot be added unless resizePolicy is RestartContainer"
            )),
            _ => {}
        }
    }
    errors
}
