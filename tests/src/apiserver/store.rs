//! The fake API server's storage: JSON objects by resource, namespace and
//! name, one resourceVersion counter for all of them (as etcd's revision),
//! a bounded history of changes that watches resume from, and the patch
//! formats the server accepts.

use std::collections::{BTreeMap, VecDeque};

use serde_json::{Map, Value, json};
use tokio::sync::broadcast;

/// A resource the server knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Resource {
    /// The API group ("" for the core group).
    pub group: &'static str,
    /// The version.
    pub version: &'static str,
    /// The plural name in URLs.
    pub plural: &'static str,
    /// The kind.
    pub kind: &'static str,
    /// Namespaced or cluster-scoped.
    pub namespaced: bool,
    /// Has a `status` subresource (writes to the object keep its status;
    /// writes to `/status` change only the status).
    pub has_status: bool,
}

impl Resource {
    /// `v1` or `group/version`.
    pub fn api_version(&self) -> String {
        if self.group.is_empty() { self.version.to_owned() } else { format!("{}/{}", self.group, self.version) }
    }
}

/// Every resource the fake serves.
pub const RESOURCES: &[Resource] = &[
    Resource { group: "", version: "v1", plural: "nodes", kind: "Node", namespaced: false, has_status: true },
    Resource { group: "", version: "v1", plural: "pods", kind: "Pod", namespaced: true, has_status: true },
    Resource { group: "", version: "v1", plural: "configmaps", kind: "ConfigMap", namespaced: true, has_status: false },
    Resource { group: "", version: "v1", plural: "secrets", kind: "Secret", namespaced: true, has_status: false },
    Resource {
        group: "",
        version: "v1",
        plural: "persistentvolumeclaims",
        kind: "PersistentVolumeClaim",
        namespaced: true,
        has_status: true,
    },
    Resource {
        group: "",
        version: "v1",
        plural: "persistentvolumes",
        kind: "PersistentVolume",
        namespaced: false,
        has_status: true,
    },
    Resource {
        group: "",
        version: "v1",
        plural: "serviceaccounts",
        kind: "ServiceAccount",
        namespaced: true,
        has_status: false,
    },
    Resource { group: "", version: "v1", plural: "events", kind: "Event", namespaced: true, has_status: false },
    Resource { group: "", version: "v1", plural: "namespaces", kind: "Namespace", namespaced: false, has_status: true },
    Resource {
        group: "events.k8s.io",
        version: "v1",
        plural: "events",
        kind: "Event",
        namespaced: true,
        has_status: false,
    },
    Resource {
        group: "coordination.k8s.io",
        version: "v1",
        plural: "leases",
        kind: "Lease",
        namespaced: true,
        has_status: false,
    },
    Resource {
        group: "storage.k8s.io",
        version: "v1",
        plural: "csinodes",
        kind: "CSINode",
        namespaced: false,
        has_status: false,
    },
    Resource {
        group: "storage.k8s.io",
        version: "v1",
        plural: "csidrivers",
        kind: "CSIDriver",
        namespaced: false,
        has_status: false,
    },
    Resource {
        group: "storage.k8s.io",
        version: "v1",
        plural: "storageclasses",
        kind: "StorageClass",
        namespaced: false,
        has_status: false,
    },
    Resource {
        group: "node.k8s.io",
        version: "v1",
        plural: "runtimeclasses",
        kind: "RuntimeClass",
        namespaced: false,
        has_status: false,
    },
    Resource {
        group: "storage.k8s.io",
        version: "v1",
        plural: "volumeattachments",
        kind: "VolumeAttachment",
        namespaced: false,
        has_status: true,
    },
    Resource {
        group: "resource.k8s.io",
        version: "v1",
        plural: "resourceclaims",
        kind: "ResourceClaim",
        namespaced: true,
        has_status: true,
    },
    Resource { group: "", version: "v1", plural: "services", kind: "Service", namespaced: true, has_status: true },
    // Reviews: created and answered, never stored.
    Resource {
        group: "authentication.k8s.io",
        version: "v1",
        plural: "tokenreviews",
        kind: "TokenReview",
        namespaced: false,
        has_status: true,
    },
    Resource {
        group: "authorization.k8s.io",
        version: "v1",
        plural: "subjectaccessreviews",
        kind: "SubjectAccessReview",
        namespaced: false,
        has_status: true,
    },
    Resource {
        group: "resource.k8s.io",
        version: "v1",
        plural: "resourceslices",
        kind: "ResourceSlice",
        namespaced: false,
        has_status: false,
    },
    // The beta versions of the claims and slices above, stored as `v1`
    // and converted at the edge (see `mod.rs`).
    Resource {
        group: "resource.k8s.io",
        version: "v1beta2",
        plural: "resourceclaims",
        kind: "ResourceClaim",
        namespaced: true,
        has_status: true,
    },
    Resource {
        group: "resource.k8s.io",
        version: "v1beta2",
        plural: "resourceslices",
        kind: "ResourceSlice",
        namespaced: false,
        has_status: false,
    },
    // The beta versions of the claims and slices above, stored as `v1`
    // and converted at the edge (see `mod.rs`).
    Resource {
        group: "resource.k8s.io",
        version: "v1beta1",
        plural: "resourceclaims",
        kind: "ResourceClaim",
        namespaced: true,
        has_status: true,
    },
    Resource {
        group: "resource.k8s.io",
        version: "v1beta1",
        plural: "resourceslices",
        kind: "ResourceSlice",
        namespaced: false,
        has_status: false,
    },
];

/// The resource served at `group/version/plural`.
pub fn resource(group: &str, version: &str, plural: &str) -> Option<Resource> {
    RESOURCES.iter().copied().find(|r| r.group == group && r.version == version && r.plural == plural)
}

/// Where objects of `resource` are kept: the first entry with its group
/// and plural (the `v1` of `resource.k8s.io`'s claims and slices, whose
/// beta versions are converted at the edge).
pub fn storage(resource: Resource) -> Resource {
    RESOURCES.iter().copied().find(|r| r.group == resource.group && r.plural == resource.plural).unwrap_or(resource)
}

/// The resource with this kind in the core group or `group`.
pub fn resource_of_kind(group: &str, kind: &str) -> Option<Resource> {
    RESOURCES.iter().copied().find(|r| r.group == group && r.kind == kind)
}

/// Where an object lives.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Key {
    /// Its resource's group and plural (versions share storage).
    pub group: &'static str,
    /// The plural.
    pub plural: &'static str,
    /// The namespace ("" when cluster-scoped).
    pub namespace: String,
    /// The name.
    pub name: String,
}

impl Key {
    /// The key of `name` in `namespace` of `resource`.
    pub fn new(resource: Resource, namespace: &str, name: &str) -> Key {
        Key { group: resource.group, plural: resource.plural, namespace: namespace.to_owned(), name: name.to_owned() }
    }
}

/// A watch event type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventType {
    /// Created.
    Added,
    /// Changed.
    Modified,
    /// Removed.
    Deleted,
}

impl EventType {
    /// The wire name.
    pub fn wire(self) -> &'static str {
        match self {
            EventType::Added => "ADDED",
            EventType::Modified => "MODIFIED",
            EventType::Deleted => "DELETED",
        }
    }
}

/// One change, as watches see it.
#[derive(Debug, Clone)]
pub struct Change {
    /// The resourceVersion it made.
    pub rv: u64,
    /// What changed.
    pub key: Key,
    /// How.
    pub kind: EventType,
    /// The object after the change (before it, for a deletion, with the
    /// deletion's resourceVersion).
    pub object: Value,
    /// The object before a modification.
    pub before: Option<Value>,
}

/// An API error, as the server answers it (a `Status` object).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// The HTTP code.
    pub code: u16,
    /// `NotFound`, `AlreadyExists`, `Conflict`, `Invalid`, ...
    pub reason: &'static str,
    /// The message.
    pub message: String,
}

impl ApiError {
    /// An error.
    pub fn new(code: u16, reason: &'static str, message: impl Into<String>) -> ApiError {
        ApiError { code, reason, message: message.into() }
    }

    /// `404 NotFound` for `name` of `resource`, worded as upstream.
    pub fn not_found(resource: Resource, name: &str) -> ApiError {
        ApiError::new(404, "NotFound", format!("{} \"{name}\" not found", qualified(resource)))
    }

    /// `409 Conflict` for a stale resourceVersion, worded as upstream.
    pub fn conflict(resource: Resource, name: &str) -> ApiError {
        ApiError::new(
            409,
            "Conflict",
            format!(
                "Operation cannot be fulfilled on {} \"{name}\": the object has been modified; please apply your \
                 changes to the latest version and try again",
                qualified(resource)
            ),
        )
    }

    /// The `Status` body.
    pub fn status(&self) -> Value {
        json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": self.message, "reason": self.reason, "code": self.code,
        })
    }
}

/// `pods` or `csinodes.storage.k8s.io`, as upstream names resources in messages.
fn qualified(resource: Resource) -> String {
    if resource.group.is_empty() {
        resource.plural.to_owned()
    } else {
        format!("{}.{}", resource.plural, resource.group)
    }
}

/// How many changes are kept for watches to resume from.
const HISTORY: usize = 10_000;

/// The objects and their history.
#[derive(Debug)]
pub struct Store {
    rv: u64,
    objects: BTreeMap<Key, Value>,
    history: VecDeque<Change>,
    /// Watches from a resourceVersion below this are too old (410).
    floor: u64,
    changes: broadcast::Sender<Change>,
    uids: u64,
}

impl Default for Store {
    fn default() -> Store {
        Store {
            rv: 1,
            objects: BTreeMap::new(),
            history: VecDeque::new(),
            floor: 1,
            changes: broadcast::channel(HISTORY).0,
            uids: 0,
        }
    }
}

/// Now, as Kubernetes writes times.
pub fn now() -> String {
    jiff::Timestamp::now().round(jiff::Unit::Second).unwrap_or_else(|_| jiff::Timestamp::now()).to_string()
}

/// The resourceVersion an object carries, parsed.
pub fn rv_of(object: &Value) -> Option<u64> {
    object.pointer("/metadata/resourceVersion")?.as_str()?.parse().ok()
}

impl Store {
    /// The current resourceVersion.
    pub fn rv(&self) -> u64 {
        self.rv
    }

    /// The oldest resourceVersion a watch may resume from.
    pub fn floor(&self) -> u64 {
        self.floor
    }

    /// Forgets the history: watches from any earlier resourceVersion get 410.
    pub fn compact(&mut self) {
        self.history.clear();
        self.floor = self.rv;
    }

    /// Subscribes to changes after now.
    pub fn subscribe(&self) -> broadcast::Receiver<Change> {
        self.changes.subscribe()
    }

    /// Changes after `rv` still in the history.
    pub fn since(&self, rv: u64) -> Vec<Change> {
        self.history.iter().filter(|c| c.rv > rv).cloned().collect()
    }

    /// The object at `key`.
    pub fn get(&self, key: &Key) -> Option<&Value> {
        self.objects.get(key)
    }

    /// Objects of `resource` (in `namespace` if given), by key order.
    pub fn list(&self, resource: Resource, namespace: Option<&str>) -> Vec<Value> {
        self.objects
            .iter()
            .filter(|(k, _)| k.group == resource.group && k.plural == resource.plural)
            .filter(|(k, _)| namespace.is_none_or(|ns| k.namespace == ns))
            .map(|(_, v)| v.clone())
            .collect()
    }

    fn record(&mut self, key: Key, kind: EventType, object: Value, before: Option<Value>) {
        let change = Change { rv: self.rv, key, kind, object, before };
        if self.history.len() == HISTORY
            && let Some(oldest) = self.history.pop_front()
        {
            self.floor = oldest.rv;
        }
        self.history.push_back(change.clone());
        let _ = self.changes.send(change);
    }

    fn next_rv(&mut self) -> u64 {
        self.rv += 1;
        self.rv
    }

    /// Creates `object` (its metadata completed as the API server does).
    pub fn create(&mut self, resource: Resource, namespace: &str, mut object: Value) -> Result<Value, ApiError> {
        if !object.is_object() {
            return Err(ApiError::new(400, "BadRequest", "the body is not an object"));
        }
        let meta = object.as_object_mut().and_then(|o| {
            o.entry("metadata").or_insert_with(|| json!({}));
            o.get_mut("metadata")?.as_object_mut()
        });
        let Some(meta) = meta else { return Err(ApiError::new(400, "BadRequest", "metadata is not an object")) };
        let mut name = meta.get("name").and_then(Value::as_str).unwrap_or_default().to_owned();
        if name.is_empty() {
            let Some(prefix) = meta.get("generateName").and_then(Value::as_str) else {
                return Err(ApiError::new(
                    422,
                    "Invalid",
                    "metadata.name: Required value: name or generateName is required",
                ));
            };
            self.uids += 1;
            name = format!("{prefix}{:05x}", self.uids);
        }
        let key = Key::new(resource, if resource.namespaced { namespace } else { "" }, &name);
        if self.objects.contains_key(&key) {
            return Err(ApiError::new(
                409,
                "AlreadyExists",
                format!("{} \"{name}\" already exists", qualified(resource)),
            ));
        }
        self.uids += 1;
        let rv = self.next_rv();
        meta.insert("name".into(), name.clone().into());
        if resource.namespaced {
            meta.insert("namespace".into(), namespace.into());
        } else {
            meta.remove("namespace");
        }
        meta.insert("uid".into(), format!("00000000-0000-4000-8000-{:012x}", self.uids).into());
        // The API's defaults the node depends on.
        if resource.plural == "csidrivers"
            && let Some(spec) = object.get_mut("spec").and_then(Value::as_object_mut)
        {
            spec.entry("attachRequired").or_insert(Value::Bool(true));
        }
        // A Service gets a cluster IP (from 10.96.0.0/12, as kubeadm's
        // default range) unless it is headless; its ports' protocol
        // defaults to TCP.
        if resource.plural == "services"
            && let Some(spec) = object.get_mut("spec").and_then(Value::as_object_mut)
        {
            if spec.get("clusterIP").and_then(Value::as_str).is_none_or(str::is_empty) {
                let n = self.uids;
                let ip = format!("10.96.{}.{}", (n >> 8) & 0xff, (n & 0xff).max(1));
                spec.insert("clusterIP".into(), ip.clone().into());
                spec.insert("clusterIPs".into(), json!([ip]));
            }
            for port in spec.get_mut("ports").and_then(Value::as_array_mut).into_iter().flatten() {
                if let Some(port) = port.as_object_mut() {
                    port.entry("protocol").or_insert_with(|| "TCP".into());
                }
            }
        }
        let Some(meta) = object.get_mut("metadata").and_then(Value::as_object_mut) else {
            return Err(ApiError::new(400, "BadRequest", "metadata is not an object"));
        };
        meta.insert("resourceVersion".into(), rv.to_string().into());
        meta.insert("creationTimestamp".into(), now().into());
        meta.insert("generation".into(), 1.into());
        meta.remove("deletionTimestamp");
        let root = object.as_object_mut().expect("an object");
        root.insert("apiVersion".into(), resource.api_version().into());
        root.insert("kind".into(), resource.kind.into());
        if resource.kind == "Pod" && root.get("status").is_none_or(|s| s.get("phase").is_none()) {
            root.insert("status".into(), json!({"phase": "Pending"}));
        }
        self.objects.insert(key.clone(), object.clone());
        self.record(key, EventType::Added, object.clone(), None);
        Ok(object)
    }

    /// Replaces the object at `key` with `new` (a status write replaces only
    /// the status, an object write keeps the status). A resourceVersion in
    /// `new` that is not the current one is a conflict.
    pub fn replace(&mut self, resource: Resource, key: &Key, new: Value, status: bool) -> Result<Value, ApiError> {
        let Some(old) = self.objects.get(key).cloned() else { return Err(ApiError::not_found(resource, &key.name)) };
        if let Some(rv) = new.pointer("/metadata/resourceVersion").and_then(Value::as_str).filter(|rv| !rv.is_empty())
            && Some(rv) != old.pointer("/metadata/resourceVersion").and_then(Value::as_str)
        {
            return Err(ApiError::conflict(resource, &key.name));
        }
        if let Some(name) = new.pointer("/metadata/name").and_then(Value::as_str)
            && name != key.name
        {
            return Err(ApiError::new(
                400,
                "BadRequest",
                format!("the name of the object ({name}) does not match the name on the URL ({})", key.name),
            ));
        }
        let mut object = if status {
            let mut object = old.clone();
            object["status"] = new.get("status").cloned().unwrap_or(Value::Null);
            if resource.kind == "Pod" {
                // The real server writes a container status's `lastState`
                // even when empty (a struct, not a pointer, in its types).
                for list in ["containerStatuses", "initContainerStatuses", "ephemeralContainerStatuses"] {
                    let statuses = object.get_mut("status").and_then(|s| s.get_mut(list)).and_then(Value::as_array_mut);
                    for entry in statuses.into_iter().flatten().filter_map(Value::as_object_mut) {
                        entry.entry("lastState").or_insert_with(|| json!({}));
                    }
                }
            }
            object
        } else {
            let mut object = new;
            if !object.is_object() {
                return Err(ApiError::new(400, "BadRequest", "the body is not an object"));
            }
            // Fields the server owns.
            for field in ["uid", "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds", "namespace"] {
                match old.pointer(&format!("/metadata/{field}")) {
                    Some(value) => object["metadata"][field] = value.clone(),
                    None => {
                        if let Some(meta) = object.get_mut("metadata").and_then(Value::as_object_mut) {
                            meta.remove(field);
                        }
                    }
                }
            }
            if resource.has_status {
                object["status"] = old.get("status").cloned().unwrap_or(Value::Null);
            }
            if object.get("spec") != old.get("spec") {
                let generation = old.pointer("/metadata/generation").and_then(Value::as_i64).unwrap_or(1);
                object["metadata"]["generation"] = (generation + 1).into();
            }
            object
        };
        if let Some(root) = object.as_object_mut() {
            if root.get("status").is_some_and(Value::is_null) {
                root.remove("status");
            }
            root.insert("apiVersion".into(), resource.api_version().into());
            root.insert("kind".into(), resource.kind.into());
        }
        if object == old {
            // A write that changes nothing makes no new version, as upstream.
            return Ok(old);
        }
        let rv = self.next_rv();
        object["metadata"]["resourceVersion"] = rv.to_string().into();
        self.objects.insert(key.clone(), object.clone());
        self.record(key.clone(), EventType::Modified, object.clone(), Some(old));
        Ok(object)
    }

    /// Removes the object at `key` now.
    pub fn remove(&mut self, resource: Resource, key: &Key) -> Result<Value, ApiError> {
        let Some(mut object) = self.objects.remove(key) else { return Err(ApiError::not_found(resource, &key.name)) };
        let rv = self.next_rv();
        object["metadata"]["resourceVersion"] = rv.to_string().into();
        self.record(key.clone(), EventType::Deleted, object.clone(), None);
        Ok(object)
    }

    /// Marks the object at `key` as terminating with `grace` seconds.
    pub fn mark_deleting(&mut self, resource: Resource, key: &Key, grace: i64) -> Result<Value, ApiError> {
        let Some(old) = self.objects.get(key).cloned() else {
            return Err(ApiError::not_found(resource, &key.name));
        };
        let mut object = old.clone();
        let current = object.pointer("/metadata/deletionGracePeriodSeconds").and_then(Value::as_i64);
        if current.is_some_and(|c| c <= grace) {
            return Ok(object);
        }
        let when = jiff::Timestamp::now()
            .checked_add(jiff::SignedDuration::from_secs(grace))
            .unwrap_or_else(|_| jiff::Timestamp::now())
            .round(jiff::Unit::Second)
            .unwrap_or_else(|_| jiff::Timestamp::now());
        object["metadata"]["deletionTimestamp"] = when.to_string().into();
        object["metadata"]["deletionGracePeriodSeconds"] = grace.into();
        let rv = self.next_rv();
        object["metadata"]["resourceVersion"] = rv.to_string().into();
        self.objects.insert(key.clone(), object.clone());
        self.record(key.clone(), EventType::Modified, object.clone(), Some(old));
        Ok(object)
    }
}

/// RFC 7386 JSON merge patch.
pub fn merge_patch(target: &mut Value, patch: &Value) {
    let Value::Object(patch) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = Value::Object(Map::new());
    }
    let target = target.as_object_mut().expect("an object");
    for (key, value) in patch {
        if value.is_null() {
            target.remove(key);
        } else {
            merge_patch(target.entry(key.clone()).or_insert(Value::Null), value);
        }
    }
}

/// The lists a strategic merge patch merges by a key (path from the
/// object's root, the key); every other list is replaced whole. Only what
/// the node writes is here: pod and node status conditions, pod IPs.
const MERGE_KEYS: [(&str, &str); 7] = [
    ("status.conditions", "type"),
    ("status.podIPs", "ip"),
    ("status.hostIPs", "ip"),
    ("spec.containers", "name"),
    ("spec.initContainers", "name"),
    ("spec.containers.resizePolicy", "resourceName"),
    ("spec.initContainers.resizePolicy", "resourceName"),
];

/// A strategic merge patch, as the API server applies one to the objects
/// the node patches this way (pod status): a merge patch, except that the
/// lists of `MERGE_KEYS` merge entry by entry (an entry with
/// `"$patch": "delete"` removes its match), and `$setElementOrder/` and
/// `$retainKeys` directives are ignored.
pub fn strategic_merge_patch(target: &mut Value, patch: &Value) {
    strategic_merge_at(target, patch, "");
}

fn strategic_merge_at(target: &mut Value, patch: &Value, path: &str) {
    let Value::Object(patch) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = Value::Object(Map::new());
    }
    let target = target.as_object_mut().expect("an object");
    for (key, value) in patch {
        if key.starts_with("$setElementOrder/") || key == "$retainKeys" {
            continue;
        }
        let here = if path.is_empty() { key.clone() } else { format!("{path}.{key}") };
        let merge_key = MERGE_KEYS.iter().find(|(p, _)| *p == here).map(|(_, k)| *k);
        match (value, merge_key) {
            (Value::Null, _) => {
                target.remove(key);
            }
            // `{"$patch": "replace"}` in a list: the list is replaced whole.
            (Value::Array(entries), _)
                if entries.iter().any(|e| e.get("$patch").and_then(Value::as_str) == Some("replace")) =>
            {
                let kept: Vec<Value> = entries.iter().filter(|e| e.get("$patch").is_none()).cloned().collect();
                target.insert(key.clone(), Value::Array(kept));
            }
            (Value::Array(entries), Some(merge_key)) => {
                let list = target.entry(key.clone()).or_insert_with(|| Value::Array(Vec::new()));
                if !list.is_array() {
                    *list = Value::Array(Vec::new());
                }
                let list = list.as_array_mut().expect("an array");
                for entry in entries {
                    let id = entry.get(merge_key);
                    let position = list.iter().position(|e| e.get(merge_key) == id);
                    if entry.get("$patch").and_then(Value::as_str) == Some("delete") {
                        if let Some(i) = position {
                            list.remove(i);
                        }
                        continue;
                    }
                    match position {
                        Some(i) => strategic_merge_at(&mut list[i], entry, &here),
                        None => list.push(entry.clone()),
                    }
                }
            }
            _ => strategic_merge_at(target.entry(key.clone()).or_insert(Value::Null), value, &here),
        }
    }
}

/// RFC 6902 JSON patch (add, remove, replace, test, copy, move).
pub fn json_patch(target: &mut Value, ops: &Value) -> Result<(), ApiError> {
    let bad = |m: String| ApiError::new(422, "Invalid", m);
    let Some(ops) = ops.as_array() else { return Err(bad("a JSON patch is an array of operations".into())) };
    for op in ops {
        let kind = op.get("op").and_then(Value::as_str).unwrap_or_default();
        let path = op.get("path").and_then(Value::as_str).ok_or_else(|| bad(format!("{op}: no path")))?;
        match kind {
            "add" | "replace" => {
                let value = op.get("value").cloned().ok_or_else(|| bad(format!("{op}: no value")))?;
                if kind == "replace" && target.pointer(path).is_none() {
                    return Err(bad(format!("replace operation does not apply: doc is missing key: {path}")));
                }
                put(target, path, value).map_err(bad)?;
            }
            "remove" => {
                take(target, path).map_err(bad)?;
            }
            "test" => {
                if target.pointer(path) != op.get("value") {
                    return Err(bad(format!("testing value {path} failed")));
                }
            }
            "copy" | "move" => {
                let from = op.get("from").and_then(Value::as_str).ok_or_else(|| bad(format!("{op}: no from")))?;
                let value = if kind == "move" {
                    take(target, from).map_err(bad)?
                } else {
                    target.pointer(from).cloned().ok_or_else(|| bad(format!("{from}: missing")))?
                };
                put(target, path, value).map_err(bad)?;
            }
            other => return Err(bad(format!("unknown JSON patch operation {other:?}"))),
        }
    }
    Ok(())
}

fn split_pointer(path: &str) -> Result<(String, String), String> {
    let (parent, last) = path.rsplit_once('/').ok_or_else(|| format!("{path}: not a JSON pointer"))?;
    Ok((parent.to_owned(), last.replace("~1", "/").replace("~0", "~")))
}

fn put(target: &mut Value, path: &str, value: Value) -> Result<(), String> {
    if path.is_empty() {
        *target = value;
        return Ok(());
    }
    let (parent, last) = split_pointer(path)?;
    match target.pointer_mut(&parent) {
        Some(Value::Object(map)) => {
            map.insert(last, value);
            Ok(())
        }
        Some(Value::Array(items)) => {
            let index =
                if last == "-" { items.len() } else { last.parse().map_err(|_| format!("{path}: bad index"))? };
            if index > items.len() {
                return Err(format!("{path}: index out of range"));
            }
            items.insert(index, value);
            Ok(())
        }
        _ => Err(format!("add operation does not apply: doc is missing path: {path}")),
    }
}

fn take(target: &mut Value, path: &str) -> Result<Value, String> {
    let (parent, last) = split_pointer(path)?;
    match target.pointer_mut(&parent) {
        Some(Value::Object(map)) => {
            map.remove(&last).ok_or_else(|| format!("remove operation does not apply: doc is missing key: {path}"))
        }
        Some(Value::Array(items)) => {
            let index: usize = last.parse().map_err(|_| format!("{path}: bad index"))?;
            if index >= items.len() {
                return Err(format!("{path}: index out of range"));
            }
            Ok(items.remove(index))
        }
        _ => Err(format!("remove operation does not apply: doc is missing path: {path}")),
    }
}

/// A label or field selector: `k=v`, `k==v`, `k!=v`, `k` (exists), `!k`.
#[derive(Debug, Clone, Default)]
pub struct Selector {
    terms: Vec<(String, Op)>,
}

#[derive(Debug, Clone)]
enum Op {
    Eq(String),
    Ne(String),
    Exists,
    Missing,
}

impl Selector {
    /// Parses a selector; `in`/`notin` sets are refused.
    pub fn parse(text: &str) -> Result<Selector, ApiError> {
        let mut terms = Vec::new();
        for term in text.split(',').map(str::trim).filter(|t| !t.is_empty()) {
            if term.contains(" in ") || term.contains(" notin ") || term.contains('(') {
                return Err(ApiError::new(
                    400,
                    "BadRequest",
                    format!("set-based selector {term:?} not supported by the fake"),
                ));
            }
            let parsed = if let Some((k, v)) = term.split_once("!=") {
                (k.trim().to_owned(), Op::Ne(v.trim().to_owned()))
            } else if let Some((k, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
                (k.trim().to_owned(), Op::Eq(v.trim().to_owned()))
            } else if let Some(k) = term.strip_prefix('!') {
                (k.trim().to_owned(), Op::Missing)
            } else {
                (term.to_owned(), Op::Exists)
            };
            terms.push(parsed);
        }
        Ok(Selector { terms })
    }

    /// Whether the label selector matches `object`'s labels.
    pub fn matches_labels(&self, object: &Value) -> bool {
        let labels = object.pointer("/metadata/labels");
        self.terms.iter().all(|(key, op)| {
            let value = labels.and_then(|l| l.get(key)).and_then(Value::as_str);
            matches(value, op)
        })
    }

    /// Whether the field selector matches `object` (`spec.nodeName`,
    /// `metadata.name`, ... as dotted paths).
    pub fn matches_fields(&self, object: &Value) -> bool {
        self.terms.iter().all(|(path, op)| {
            let pointer = format!("/{}", path.replace('.', "/"));
            let value = object.pointer(&pointer).and_then(Value::as_str).unwrap_or_default();
            // An absent field is the empty string, as upstream.
            matches(Some(value), op)
        })
    }
}

fn matches(value: Option<&str>, op: &Op) -> bool {
    match op {
        Op::Eq(want) => value == Some(want.as_str()),
        Op::Ne(want) => value != Some(want.as_str()),
        Op::Exists => value.is_some(),
        Op::Missing => value.is_none(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pods() -> Resource {
        resource("", "v1", "pods").expect("pods")
    }

    #[test]
    fn versions_grow_and_stale_writes_conflict() {
        let mut store = Store::default();
        let created = store
            .create(pods(), "default", json!({"metadata": {"name": "a"}, "spec": {"nodeName": "n1"}}))
            .expect("create");
        let rv = rv_of(&created).expect("rv");
        assert_eq!(created["status"]["phase"], "Pending");
        let key = Key::new(pods(), "default", "a");
        let mut changed = created.clone();
        changed["metadata"]["labels"] = json!({"x": "1"});
        let after = store.replace(pods(), &key, changed.clone(), false).expect("replace");
        assert!(rv_of(&after).expect("rv") > rv);
        // The same write again carries the old version: a conflict.
        let err = store.replace(pods(), &key, changed, false).expect_err("stale");
        assert_eq!(err.code, 409);
        assert!(err.message.contains("the object has been modified"), "{}", err.message);
        // An object write keeps the status; a status write only the status.
        let mut spec_write = after.clone();
        spec_write["status"] = json!({"phase": "Running"});
        let kept = store.replace(pods(), &key, spec_write, false).expect("replace");
        assert_eq!(kept["status"]["phase"], "Pending");
        let mut status_write = kept.clone();
        status_write["status"] = json!({"phase": "Running"});
        status_write["metadata"]["labels"] = json!({"ignored": "yes"});
        let written = store.replace(pods(), &key, status_write, true).expect("status");
        assert_eq!(written["status"]["phase"], "Running");
        assert_eq!(written["metadata"]["labels"], json!({"x": "1"}));
        assert_eq!(store.create(pods(), "default", json!({"metadata": {"name": "a"}})).expect_err("dup").code, 409);
    }

    #[test]
    fn history_resumes_watches_until_compacted() {
        let mut store = Store::default();
        let start = store.rv();
        store.create(pods(), "default", json!({"metadata": {"name": "a"}})).expect("create");
        store.remove(pods(), &Key::new(pods(), "default", "a")).expect("remove");
        let kinds: Vec<EventType> = store.since(start).iter().map(|c| c.kind).collect();
        assert_eq!(kinds, [EventType::Added, EventType::Deleted]);
        store.compact();
        assert!(store.floor() > start);
    }

    #[test]
    fn strategic_merge_patches_merge_conditions_by_type() {
        let mut pod = json!({"status": {
            "phase": "Pending",
            "message": "waiting",
            "conditions": [{"type": "Ready", "status": "False"}, {"type": "example.com/gate", "status": "True"}],
            "podIPs": [{"ip": "10.0.0.1"}, {"ip": "fd00::1"}],
            "containerStatuses": [{"name": "a"}, {"name": "b"}],
        }});
        strategic_merge_patch(
            &mut pod,
            &json!({"status": {
                "phase": "Running",
                "message": null,
                "$setElementOrder/conditions": [{"type": "Ready"}],
                "conditions": [{"type": "Ready", "status": "True"}, {"type": "Initialized", "status": "True"}],
                "podIPs": [{"ip": "fd00::1", "$patch": "delete"}],
                "containerStatuses": [{"name": "a"}],
            }}),
        );
        assert_eq!(
            pod,
            json!({"status": {
                "phase": "Running",
                "conditions": [
                    {"type": "Ready", "status": "True"},
                    {"type": "example.com/gate", "status": "True"},
                    {"type": "Initialized", "status": "True"},
                ],
                "podIPs": [{"ip": "10.0.0.1"}],
                "containerStatuses": [{"name": "a"}],
            }})
        );
    }

    #[test]
    fn patches_follow_their_rfcs() {
        let mut doc = json!({"a": {"b": 1, "c": [1, 2]}, "d": "x"});
        merge_patch(&mut doc, &json!({"a": {"b": null, "c": [3]}, "e": true}));
        assert_eq!(doc, json!({"a": {"c": [3]}, "d": "x", "e": true}));
        json_patch(
            &mut doc,
            &json!([
                {"op": "test", "path": "/d", "value": "x"},
                {"op": "add", "path": "/a/c/-", "value": 4},
                {"op": "replace", "path": "/d", "value": "y"},
                {"op": "remove", "path": "/e"},
                {"op": "add", "path": "/k~1v", "value": 1}
            ]),
        )
        .expect("patch");
        assert_eq!(doc, json!({"a": {"c": [3, 4]}, "d": "y", "k/v": 1}));
        let err = json_patch(&mut doc, &json!([{"op": "test", "path": "/d", "value": "x"}])).expect_err("test fails");
        assert_eq!(err.code, 422);
    }

    #[test]
    fn selectors_match_labels_and_fields() {
        let pod = json!({"metadata": {"name": "p", "labels": {"app": "web"}}, "spec": {"nodeName": "n1"}});
        assert!(Selector::parse("app=web").expect("parse").matches_labels(&pod));
        assert!(!Selector::parse("app!=web").expect("parse").matches_labels(&pod));
        assert!(Selector::parse("!tier,app").expect("parse").matches_labels(&pod));
        assert!(Selector::parse("spec.nodeName=n1,metadata.name=p").expect("parse").matches_fields(&pod));
        assert!(!Selector::parse("spec.nodeName=n2").expect("parse").matches_fields(&pod));
        assert!(Selector::parse("spec.nodeName=").expect("parse").matches_fields(&json!({"spec": {}})));
    }
}
