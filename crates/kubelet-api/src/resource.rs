//! The versions of `resource.k8s.io` (Dynamic Resource Allocation with
//! structured parameters) a node reads and writes, and the conversion of
//! their objects between them.
//!
//! | version   | served by Kubernetes                    | shape |
//! |-----------|------------------------------------------|-------|
//! | `v1`      | 1.34+ (on by default)                    | hub |
//! | `v1beta2` | 1.33+ (off by default until 1.34)        | as `v1` |
//! | `v1beta1` | 1.32–1.33 (off by default), later kept   | requests flat, devices under `basic` |
//!
//! The node holds one model, `v1`'s: [`to_hub`] turns an object of any
//! version into `v1`'s shape and [`from_hub`] turns it back, field for
//! field. The two differences between the versions:
//! - a claim's (or claim template's) device request: in `v1beta1` the
//!   fields of an exact request (`deviceClassName`, `selectors`,
//!   `allocationMode`, `count`, `adminAccess`, `tolerations`, ...) sit on
//!   the request itself; in `v1beta2` and `v1` they sit under `exactly`,
//!   beside `firstAvailable`;
//! - a ResourceSlice's device: in `v1beta1` everything but its `name`
//!   sits under `basic`; in `v1beta2` and `v1` on the device itself.
//!
//! Claim status (allocation, `reservedFor`, device status), device
//! classes and pools have the same JSON in all three.

use serde_json::{Map, Value};

/// The API group.
pub const GROUP: &str = "resource.k8s.io";

/// A version of `resource.k8s.io` the node knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ResourceVersion {
    /// `resource.k8s.io/v1` (Kubernetes 1.34+).
    V1,
    /// `resource.k8s.io/v1beta2` (Kubernetes 1.33+).
    V1beta2,
    /// `resource.k8s.io/v1beta1` (Kubernetes 1.32+).
    V1beta1,
}

impl ResourceVersion {
    /// Every version, the node's preference first (upstream's discovery
    /// order: the newest).
    pub const PREFERENCE: [ResourceVersion; 3] =
        [ResourceVersion::V1, ResourceVersion::V1beta2, ResourceVersion::V1beta1];

    /// The version's name (`v1`).
    pub fn as_str(self) -> &'static str {
        match self {
            ResourceVersion::V1 => "v1",
            ResourceVersion::V1beta2 => "v1beta2",
            ResourceVersion::V1beta1 => "v1beta1",
        }
    }

    /// `resource.k8s.io/<version>`.
    pub fn api_version(self) -> &'static str {
        match self {
            ResourceVersion::V1 => "resource.k8s.io/v1",
            ResourceVersion::V1beta2 => "resource.k8s.io/v1beta2",
            ResourceVersion::V1beta1 => "resource.k8s.io/v1beta1",
        }
    }

    /// The version named `name` (`v1beta1`), if the node knows it.
    pub fn parse(name: &str) -> Option<ResourceVersion> {
        Self::PREFERENCE.into_iter().find(|v| v.as_str() == name)
    }

    /// The version of an `apiVersion` (`resource.k8s.io/v1beta1`).
    pub(crate) fn of_api_version(api_version: &str) -> Option<ResourceVersion> {
        api_version.strip_prefix("resource.k8s.io/").and_then(Self::parse)
    }
}

impl std::fmt::Display for ResourceVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.api_version())
    }
}

/// The fields of an exact device request: under `exactly` in `v1beta2`
/// and `v1`, on the request itself in `v1beta1`. (`v1beta1` also writes
/// `deviceClassName: ""` beside `firstAvailable`; an empty class is no
/// class.)
const EXACT_FIELDS: [&str; 7] =
    ["deviceClassName", "selectors", "allocationMode", "count", "adminAccess", "tolerations", "capacity"];

/// Turns `object` (a ResourceClaim, ResourceClaimTemplate, ResourceSlice,
/// DeviceClass or a list of them, of the version its `apiVersion` names)
/// into `v1`'s shape, `apiVersion` included. An object of no
/// `resource.k8s.io` version the node knows is left alone.
pub fn to_hub(object: &mut Value) {
    convert(object, ResourceVersion::V1);
}

/// Turns `object` in `v1`'s shape into `to`'s, `apiVersion` included.
pub fn from_hub(object: &mut Value, to: ResourceVersion) {
    convert(object, to);
}

/// Turns `object` from the version its `apiVersion` names into `to`'s.
pub fn convert(object: &mut Value, to: ResourceVersion) {
    let Some(from) = object.get("apiVersion").and_then(Value::as_str).and_then(ResourceVersion::of_api_version) else {
        return;
    };
    let kind = object.get("kind").and_then(Value::as_str).unwrap_or_default().to_owned();
    if let Some(items) = object.get_mut("items").and_then(Value::as_array_mut) {
        let item_kind = kind.strip_suffix("List").unwrap_or(&kind).to_owned();
        for item in items {
            convert_body(item, &item_kind, from, to);
            if let Some(map) = item.as_object_mut()
                && map.contains_key("apiVersion")
            {
                map.insert("apiVersion".into(), to.api_version().into());
            }
        }
    } else {
        convert_body(object, &kind, from, to);
    }
    object["apiVersion"] = to.api_version().into();
}

/// Converts the fields of one object of `kind` from `from`'s shape to
/// `to`'s (through `v1`'s).
pub(crate) fn convert_body(object: &mut Value, kind: &str, from: ResourceVersion, to: ResourceVersion) {
    let flat = |v: ResourceVersion| v == ResourceVersion::V1beta1;
    if flat(from) == flat(to) {
        return;
    }
    let requests = match kind {
        "ResourceClaim" => object.pointer_mut("/spec/devices/requests"),
        "ResourceClaimTemplate" => object.pointer_mut("/spec/spec/devices/requests"),
        "ResourceSlice" => {
            if let Some(devices) = object.pointer_mut("/spec/devices").and_then(Value::as_array_mut) {
                for device in devices.iter_mut().filter_map(Value::as_object_mut) {
                    if flat(from) { unwrap_basic(device) } else { wrap_basic(device) }
                }
            }
            return;
        }
        _ => return,
    };
    if let Some(requests) = requests.and_then(Value::as_array_mut) {
        for request in requests.iter_mut().filter_map(Value::as_object_mut) {
            if flat(from) { nest_exactly(request) } else { lift_exactly(request) }
        }
    }
}

/// `v1beta1` → `v1`: the exact request's fields go under `exactly`
/// (when any is set), as upstream's conversion does.
fn nest_exactly(request: &mut Map<String, Value>) {
    let mut exactly = Map::new();
    for field in EXACT_FIELDS {
        if let Some(value) = request.remove(field) {
            let unset = value.is_null() || (field == "deviceClassName" && value.as_str() == Some(""));
            if !unset {
                exactly.insert(field.to_owned(), value);
            }
        }
    }
    if !exactly.is_empty() {
        request.insert("exactly".into(), Value::Object(exactly));
    }
}

/// `v1` → `v1beta1`: the fields under `exactly` go onto the request.
fn lift_exactly(request: &mut Map<String, Value>) {
    if let Some(Value::Object(exactly)) = request.remove("exactly") {
        for (field, value) in exactly {
            request.insert(field, value);
        }
    }
}

/// `v1beta1` → `v1`: a device's `basic` fields go onto the device.
fn unwrap_basic(device: &mut Map<String, Value>) {
    if let Some(Value::Object(basic)) = device.remove("basic") {
        for (field, value) in basic {
            device.entry(field).or_insert(value);
        }
    }
}

/// `v1` → `v1beta1`: everything but the device's name goes under `basic`.
fn wrap_basic(device: &mut Map<String, Value>) {
    let fields: Vec<String> = device.keys().filter(|k| k.as_str() != "name").cloned().collect();
    let mut basic = Map::new();
    for field in fields {
        if let Some(value) = device.remove(&field) {
            basic.insert(field, value);
        }
    }
    device.insert("basic".into(), Value::Object(basic));
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn claim(api_version: &str, requests: Value) -> Value {
        json!({
            "apiVersion": api_version, "kind": "ResourceClaim",
            "metadata": {"name": "c", "namespace": "default", "uid": "u-1"},
            "spec": {"devices": {
                "requests": requests,
                "constraints": [{"requests": ["gpu"], "matchAttribute": "example.com/model"}],
                "config": [{"requests": ["gpu"], "opaque": {"driver": "gpu.example.com", "parameters": {"a": "b"}}}],
            }},
            "status": {
                "allocation": {"devices": {
                    "results": [{"request": "gpu", "driver": "gpu.example.com", "pool": "node-a", "device": "gpu-0", "adminAccess": true}],
                    "config": [{"source": "FromClaim", "requests": ["gpu"], "opaque": {"driver": "gpu.example.com", "parameters": {"a": "b"}}}],
                }},
                "reservedFor": [{"resource": "pods", "name": "p", "uid": "pod-1"}],
                "devices": [{"driver": "gpu.example.com", "pool": "node-a", "device": "gpu-0", "conditions": [],
                              "data": {"x": 1}, "networkData": {"interfaceName": "eth1", "ips": ["10.0.0.1/24"]}}],
            },
        })
    }

    fn exact_v1beta1() -> Value {
        json!([{"name": "gpu", "deviceClassName": "gpu.example.com", "selectors": [{"cel": {"expression": "true"}}],
                "allocationMode": "ExactCount", "count": 2, "adminAccess": true,
                "tolerations": [{"key": "k", "operator": "Exists", "effect": "NoSchedule"}]},
               {"name": "any", "deviceClassName": "",
                "firstAvailable": [{"name": "big", "deviceClassName": "big.example.com", "count": 1},
                                   {"name": "small", "deviceClassName": "small.example.com", "allocationMode": "All"}]}])
    }

    fn exact_v1() -> Value {
        json!([{"name": "gpu", "exactly": {"deviceClassName": "gpu.example.com", "selectors": [{"cel": {"expression": "true"}}],
                "allocationMode": "ExactCount", "count": 2, "adminAccess": true,
                "tolerations": [{"key": "k", "operator": "Exists", "effect": "NoSchedule"}]}},
               {"name": "any",
                "firstAvailable": [{"name": "big", "deviceClassName": "big.example.com", "count": 1},
                                   {"name": "small", "deviceClassName": "small.example.com", "allocationMode": "All"}]}])
    }

    #[test]
    fn a_v1beta1_claim_becomes_v1_and_back_with_nothing_lost() {
        let mut object = claim("resource.k8s.io/v1beta1", exact_v1beta1());
        to_hub(&mut object);
        assert_eq!(object, claim("resource.k8s.io/v1", exact_v1()));
        from_hub(&mut object, ResourceVersion::V1beta1);
        // Back in v1beta1: the same, but the empty class beside
        // firstAvailable (which means "none") is not written again.
        let mut want = claim("resource.k8s.io/v1beta1", exact_v1beta1());
        want["spec"]["devices"]["requests"][1].as_object_mut().expect("request").remove("deviceClassName");
        assert_eq!(object, want);
    }

    #[test]
    fn v1beta2_and_v1_share_a_shape() {
        let mut object = claim("resource.k8s.io/v1beta2", exact_v1());
        to_hub(&mut object);
        assert_eq!(object, claim("resource.k8s.io/v1", exact_v1()));
        from_hub(&mut object, ResourceVersion::V1beta2);
        assert_eq!(object, claim("resource.k8s.io/v1beta2", exact_v1()));
    }

    #[test]
    fn a_template_list_converts_each_item() {
        let template = |api: &str, requests: Value| {
            json!({"apiVersion": api, "kind": "ResourceClaimTemplate", "metadata": {"name": "t"},
                   "spec": {"metadata": {"labels": {"a": "b"}}, "spec": {"devices": {"requests": requests}}}})
        };
        let mut list = json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplateList",
                              "items": [template("resource.k8s.io/v1", exact_v1())]});
        from_hub(&mut list, ResourceVersion::V1beta1);
        let mut want = template("resource.k8s.io/v1beta1", exact_v1beta1());
        want["spec"]["spec"]["devices"]["requests"][1].as_object_mut().expect("request").remove("deviceClassName");
        assert_eq!(list["items"][0], want);
        assert_eq!(list["apiVersion"], "resource.k8s.io/v1beta1");
    }

    #[test]
    fn slice_devices_move_under_basic_in_v1beta1() {
        let slice = |api: &str, devices: Value| {
            json!({"apiVersion": api, "kind": "ResourceSlice", "metadata": {"name": "s"},
                   "spec": {"driver": "gpu.example.com", "nodeName": "node-a",
                            "pool": {"name": "node-a", "generation": 3, "resourceSliceCount": 1}, "devices": devices}})
        };
        let attrs = json!({"model": {"string": "a100"}, "index": {"int": 0}, "example.com/healthy": {"bool": true},
                           "driverVersion": {"version": "1.2.3"}});
        let capacity = json!({"memory": {"value": "40Gi"}});
        let flat = json!([{"name": "gpu-0", "attributes": attrs, "capacity": capacity,
                           "taints": [{"key": "k", "effect": "NoSchedule"}]}, {"name": "bare"}]);
        let basic = json!([{"name": "gpu-0", "basic": {"attributes": attrs, "capacity": capacity,
                            "taints": [{"key": "k", "effect": "NoSchedule"}]}}, {"name": "bare", "basic": {}}]);
        let mut object = slice("resource.k8s.io/v1", flat.clone());
        from_hub(&mut object, ResourceVersion::V1beta1);
        assert_eq!(object, slice("resource.k8s.io/v1beta1", basic.clone()));
        to_hub(&mut object);
        assert_eq!(object, slice("resource.k8s.io/v1", flat));
    }

    #[test]
    fn objects_of_other_groups_are_left_alone() {
        let pod = json!({"apiVersion": "v1", "kind": "Pod", "spec": {"devices": {"requests": [{"count": 1}]}}});
        let mut converted = pod.clone();
        from_hub(&mut converted, ResourceVersion::V1beta1);
        assert_eq!(converted, pod);
        assert_eq!(ResourceVersion::of_api_version("resource.k8s.io/v1beta2"), Some(ResourceVersion::V1beta2));
        assert_eq!(ResourceVersion::of_api_version("resource.k8s.io/v1alpha3"), None);
    }
}
