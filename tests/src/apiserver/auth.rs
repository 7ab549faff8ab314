//! Who may do what: an administrator may do anything; a node identity
//! (`system:node:<name>`, group `system:nodes`) gets what the Node
//! authorizer, the `system:node` role and the NodeRestriction admission
//! plugin give it:
//! - nodes: read all; create, change and delete only its own;
//! - leases: only its own, in `kube-node-lease`;
//! - pods: get those bound to it (the Node authorizer of 1.32+: another's,
//!   or one that does not exist, is forbidden), list and watch those
//!   bound to it (`spec.nodeName=<node>`);
//!   change the status of (never `status.resourceClaimStatuses`, which
//!   NodeRestriction keeps for the controller), and delete, pods bound to it;
//!   create only mirror pods bound to it and owned by its Node;
//! - its own Node's labels: none in the `kubernetes.io` and `k8s.io`
//!   namespaces but the kubelet's own;
//! - secrets, configmaps, persistentvolumeclaims, persistentvolumes and
//!   service account tokens: only those referenced by pods bound to it
//!   (reading one object, or listing or watching with
//!   `metadata.name=<that object>`);
//! - csinodes: its own; csidrivers, runtimeclasses, services: read; core/v1 events: create and patch;
//! - resourceclaims: read those referenced by pods bound to it (by name,
//!   or as generated for a template and recorded in the pod's status);
//! - resourceslices: read all, delete collections of its own (a
//!   `spec.nodeName=<node>` field selector); create, change and delete
//!   those whose `spec.nodeName` is itself (NodeRestriction).

use std::collections::HashSet;

use serde_json::Value;

use super::store::{ApiError, Resource, Store};

/// Who a request comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Identity {
    /// May do anything.
    Admin,
    /// `system:node:<name>`.
    Node(String),
    /// `system:serviceaccount:<namespace>:<name>`: nothing in the API;
    /// what `allowed` names (verb, resource, subresource) in
    /// SubjectAccessReviews (a kubelet asking whether it may serve it).
    ServiceAccount {
        /// Its namespace.
        namespace: String,
        /// Its name.
        name: String,
        /// What SubjectAccessReviews allow it.
        allowed: Vec<(String, String, String)>,
    },
}

impl Identity {
    /// The groups a TokenReview names for it.
    pub fn groups(&self) -> Vec<String> {
        let own = match self {
            Identity::Admin => "system:masters",
            Identity::Node(_) => "system:nodes",
            Identity::ServiceAccount { namespace, .. } => {
                return vec![
                    "system:serviceaccounts".to_owned(),
                    format!("system:serviceaccounts:{namespace}"),
                    "system:authenticated".to_owned(),
                ];
            }
        };
        vec![own.to_owned(), "system:authenticated".to_owned()]
    }

    /// The user name, as upstream's messages print it.
    pub fn user(&self) -> String {
        match self {
            Identity::Admin => "admin".to_owned(),
            Identity::Node(name) => format!("system:node:{name}"),
            Identity::ServiceAccount { namespace, name, .. } => format!("system:serviceaccount:{namespace}:{name}"),
        }
    }
}

/// A request, as the authorizer sees it.
#[derive(Debug)]
pub struct Request<'a> {
    /// `get`, `list`, `watch`, `create`, `update`, `patch`, `delete`.
    pub verb: &'a str,
    /// The resource.
    pub resource: Resource,
    /// `status`, `token` or none.
    pub subresource: Option<&'a str>,
    /// The namespace ("" for cluster scope).
    pub namespace: &'a str,
    /// The object's name (from the URL, the body of a create, or a
    /// `metadata.name=` field selector).
    pub name: Option<&'a str>,
    /// The body of a create, an update or a patch.
    pub body: Option<&'a Value>,
    /// The `fieldSelector` of a list or a watch ("" for none).
    pub field_selector: &'a str,
}

fn forbidden(identity: &Identity, request: &Request<'_>, why: &str) -> ApiError {
    let name = request.name.map(|n| format!(" \"{n}\"")).unwrap_or_default();
    let resource = match request.subresource {
        Some(sub) => format!("{}/{sub}", request.resource.plural),
        None => request.resource.plural.to_owned(),
    };
    let scope = if request.namespace.is_empty() {
        "at the cluster scope".to_owned()
    } else {
        format!("in the namespace \"{}\"", request.namespace)
    };
    ApiError::new(
        403,
        "Forbidden",
        format!(
            "{}{name} is forbidden: User \"{}\" cannot {} resource \"{resource}\" in API group \"{}\" {scope}: {why}",
            request.resource.plural,
            identity.user(),
            request.verb,
            request.resource.group,
        ),
    )
}

/// Allows or refuses `request` from `identity`.
pub fn authorize(identity: &Identity, request: &Request<'_>, store: &Store) -> Result<(), ApiError> {
    if let Identity::ServiceAccount { .. } = identity {
        return Err(forbidden(identity, request, "a service account is granted nothing in this API server"));
    }
    let Identity::Node(node) = identity else { return Ok(()) };
    let reading = matches!(request.verb, "get" | "list" | "watch");
    let own = request.name == Some(node.as_str());
    let deny = |why: &str| Err(forbidden(identity, request, why));
    match request.resource.plural {
        "nodes" if own && request.verb == "create" => admit_node_labels(request, node),
        // RBAC's system:node role grants nodes/status patch and update
        // only (the real server refuses a node's GET of it).
        "nodes" if request.subresource == Some("status") && reading => {
            deny("a node may patch or update nodes/status, not read it (read the Node itself)")
        }
        "nodes" if reading || own => Ok(()),
        "nodes" => deny(&format!("node '{node}' cannot modify node '{}'", request.name.unwrap_or_default())),
        "leases" if own && request.namespace == "kube-node-lease" && request.verb != "list" => Ok(()),
        "leases" => deny("can only access its own lease"),
        "csinodes" if own && request.verb != "list" => Ok(()),
        "csinodes" => deny(&format!("can only access CSINode with the same name as the requesting node '{node}'")),
        "csidrivers" | "runtimeclasses" | "services" if reading => Ok(()),
        // The Node authorizer: a VolumeAttachment to this node, by name.
        "volumeattachments" if request.verb == "get" => {
            let attachments = super::store::resource("storage.k8s.io", "v1", "volumeattachments").expect("resource");
            let key = super::store::Key::new(attachments, "", request.name.unwrap_or_default());
            // One that does not exist is no more related to the node than
            // another node's: 403, as the real authorizer answers.
            match store.get(&key) {
                Some(attachment) if attachment.pointer("/spec/nodeName").and_then(Value::as_str) == Some(node) => {
                    Ok(())
                }
                _ => deny(&format!("no relationship found between node '{node}' and this object")),
            }
        }
        // The Node authorizer's rules: core/v1 events only (a node cannot
        // write events.k8s.io Events).
        "events" if request.resource.group.is_empty() && matches!(request.verb, "create" | "patch" | "update") => {
            Ok(())
        }
        "namespaces" if request.verb == "get" => Ok(()),
        // RBAC's system:node role: a kubelet checks its own callers.
        "tokenreviews" | "subjectaccessreviews" if request.verb == "create" => Ok(()),
        "resourceclaims" if reading => {
            let Some(name) = request.name else {
                return deny("no relationship found between node and this object (a node may not list all of them)");
            };
            if references(store, node).contains(&("resourceclaims", request.namespace.to_owned(), name.to_owned())) {
                Ok(())
            } else {
                deny(&format!("no relationship found between node '{node}' and this object"))
            }
        }
        "resourceslices" => authorize_slice(identity, request, store, node),
        "pods" => authorize_pod(identity, request, store, node),
        "secrets" | "configmaps" | "persistentvolumeclaims" | "persistentvolumes" | "serviceaccounts" => {
            let allowed_verb = match (request.resource.plural, request.subresource) {
                ("serviceaccounts", Some("token")) => request.verb == "create",
                ("serviceaccounts", _) => request.verb == "get",
                // A claim's status: the node's steps of an expansion.
                ("persistentvolumeclaims", Some("status")) => reading || matches!(request.verb, "update" | "patch"),
                _ => reading,
            };
            let Some(name) = request.name else {
                return deny("no relationship found between node and this object (a node may not list all of them)");
            };
            if !allowed_verb {
                return deny("a node may only read this object");
            }
            if request.resource.plural == "persistentvolumeclaims" && !reading {
                admit_claim_status(request, node)?;
            }
            if references(store, node).contains(&(
                request.resource.plural,
                request.namespace.to_owned(),
                name.to_owned(),
            )) {
                Ok(())
            } else {
                deny(&format!("no relationship found between node '{node}' and this object"))
            }
        }
        _ => deny("not allowed for nodes"),
    }
}

/// ResourceSlices: the Node authorizer lets a node read them and delete
/// collections; NodeRestriction lets it write only its own.
fn authorize_slice(identity: &Identity, request: &Request<'_>, store: &Store, node: &str) -> Result<(), ApiError> {
    let deny = |why: &str| Err(forbidden(identity, request, why));
    let own = |slice: &Value| slice.pointer("/spec/nodeName").and_then(Value::as_str) == Some(node);
    match request.verb {
        "get" | "list" | "watch" | "deletecollection" => Ok(()),
        "create" => {
            if request.body.is_some_and(own) {
                Ok(())
            } else {
                Err(admission_forbidden(
                    request,
                    &format!("node \"{node}\" is not allowed to create resourceslices with a different nodeName"),
                ))
            }
        }
        _ => {
            let key = super::store::Key::new(request.resource, "", request.name.unwrap_or_default());
            match store.get(&key) {
                Some(slice) if own(slice) => Ok(()),
                None => Ok(()),
                Some(_) => deny(&format!("node \"{node}\" can only modify its own resourceslices")),
            }
        }
    }
}

fn authorize_pod(identity: &Identity, request: &Request<'_>, store: &Store, node: &str) -> Result<(), ApiError> {
    let deny = |why: &str| Err(forbidden(identity, request, why));
    // The pod the request names, as stored (none for a list without a
    // name), and whether it is bound to this node.
    let stored =
        request.name.and_then(|name| store.get(&super::store::Key::new(request.resource, request.namespace, name)));
    let bound_here = stored.is_some_and(|pod| pod.pointer("/spec/nodeName").and_then(Value::as_str) == Some(node));
    match (request.verb, request.subresource) {
        // The Node authorizer with `AuthorizeNodeWithSelectors` (on since
        // 1.32): a node reads one pod only when it is bound to it; a pod
        // of another node's, or none at all, has no relationship to it.
        ("get", _) if bound_here => Ok(()),
        ("get", _) => deny(&format!("no relationship found between node '{node}' and this object")),
        // ... and lists and watches only the pods bound to it (a
        // `spec.nodeName=<node>` field selector), or one pod bound to it.
        ("list" | "watch", _) => {
            let own = format!("spec.nodeName={node}");
            if bound_here || request.field_selector.split(',').any(|term| term == own) {
                Ok(())
            } else {
                deny("can only list/watch pods with spec.nodeName field selector")
            }
        }
        ("create", None) => admit_mirror_pod(request, store, node),
        ("update" | "patch", Some("status")) | ("delete", None) => match stored {
            Some(pod) if bound_here && request.subresource == Some("status") => admit_pod_status(request, pod, node),
            Some(_) if bound_here => Ok(()),
            // Not there: let the handler answer 404.
            None => Ok(()),
            Some(_) => deny(&format!("node '{node}' can only modify pods bound to it")),
        },
        _ => deny("a node may not change pods' specs"),
    }
}

/// NodeRestriction's check of a node's write of a pod's status: the
/// resource claim controller owns `status.resourceClaimStatuses`, and a
/// write that would change them is refused (upstream's message, its typo
/// kept). A patch that leaves them out changes nothing; one that sets them
/// to `null`, or a PUT without them, would.
fn admit_pod_status(request: &Request<'_>, pod: &Value, node: &str) -> Result<(), ApiError> {
    let Some(body) = request.body else { return Ok(()) };
    let stored = pod.pointer("/status/resourceClaimStatuses").unwrap_or(&Value::Null);
    let written = match (request.verb, body.pointer("/status/resourceClaimStatuses")) {
        // A patch that leaves them out leaves them as they are.
        ("patch", None) => return Ok(()),
        (_, written) => written.unwrap_or(&Value::Null),
    };
    let names = |statuses: &Value| -> Vec<(Value, Value)> {
        statuses
            .as_array()
            .into_iter()
            .flatten()
            .map(|s| {
                (
                    s.get("name").cloned().unwrap_or(Value::Null),
                    s.get("resourceClaimName").cloned().unwrap_or(Value::Null),
                )
            })
            .collect()
    };
    if names(stored) == names(written) {
        Ok(())
    } else {
        Err(admission_forbidden(request, &format!("node \"{node}\" cannot update resource claim statues")))
    }
}

/// NodeRestriction's check of a node's write of a claim's status (an
/// expansion's steps): only `status.capacity`, `status.conditions` and,
/// with `RecoverVolumeExpansionFailure` (on since 1.32),
/// `status.allocatedResourceStatuses` and `status.allocatedResources` may
/// change (checked on what the write names; the resourceVersion aside).
fn admit_claim_status(request: &Request<'_>, node: &str) -> Result<(), ApiError> {
    const ALLOWED: [&str; 4] = ["capacity", "conditions", "allocatedResourceStatuses", "allocatedResources"];
    let Some(body) = request.body else { return Ok(()) };
    if request.verb != "patch" {
        // A whole object: what it changes is not known here; the node
        // writes patches.
        return Ok(());
    }
    let status_fields = body.get("status").and_then(Value::as_object).into_iter().flat_map(|o| o.keys());
    let other_status = status_fields.filter(|k| !ALLOWED.contains(&k.as_str())).count();
    let metadata_fields = body.get("metadata").and_then(Value::as_object).into_iter().flat_map(|o| o.keys());
    let other_metadata = metadata_fields.filter(|k| k.as_str() != "resourceVersion").count();
    let other_top = body
        .as_object()
        .into_iter()
        .flat_map(|o| o.keys())
        .filter(|k| !matches!(k.as_str(), "status" | "metadata"))
        .count();
    if other_status + other_metadata + other_top == 0 {
        return Ok(());
    }
    Err(admission_forbidden(
        request,
        &format!("node \"{node}\" is not allowed to update fields other than status.quantity and status.conditions"),
    ))
}

/// NodeRestriction's checks of a pod a node creates (upstream's order and
/// messages): a mirror pod, bound to the node, owned by the node's Node
/// object (one owner reference: `v1`, `Node`, its name and uid, controller,
/// no `blockOwnerDeletion`).
fn admit_mirror_pod(request: &Request<'_>, store: &Store, node: &str) -> Result<(), ApiError> {
    let body = request.body.cloned().unwrap_or(Value::Null);
    let deny = |why: String| Err(admission_forbidden(request, &why));
    if body.pointer("/metadata/annotations/kubernetes.io~1config.mirror").is_none() {
        return deny(format!(
            "pod does not have \"kubernetes.io/config.mirror\" annotation, node \"{node}\" can only create mirror pods"
        ));
    }
    if body.pointer("/spec/nodeName").and_then(Value::as_str) != Some(node) {
        return deny(format!("node \"{node}\" can only create pods with spec.nodeName set to itself"));
    }
    let owners = body.pointer("/metadata/ownerReferences").and_then(Value::as_array).cloned().unwrap_or_default();
    if owners.len() > 1 {
        return deny(format!("node \"{node}\" can only create pods with a single owner reference set to itself"));
    }
    let Some(owner) = owners.first() else {
        return deny(format!("node \"{node}\" can only create pods with an owner reference set to itself"));
    };
    if owner["apiVersion"] != "v1" || owner["kind"] != "Node" || owner["name"] != node {
        return deny(format!("node \"{node}\" can only create pods with an owner reference set to itself"));
    }
    if owner["controller"] != true {
        return deny(format!("node \"{node}\" can only create pods with a controller owner reference set to itself"));
    }
    if owner["blockOwnerDeletion"] == true {
        return deny(format!("node \"{node}\" must not set blockOwnerDeletion on an owner reference"));
    }
    let nodes = super::store::resource("", "v1", "nodes").expect("nodes");
    let Some(registered) = store.get(&super::store::Key::new(nodes, "", node)) else {
        return Err(ApiError::new(404, "NotFound", format!("nodes \"{node}\" not found")));
    };
    let (want, got) = (registered.pointer("/metadata/uid"), owner.get("uid"));
    if want != got {
        return deny(format!(
            "node {node} UID mismatch: expected {} got {}",
            want.unwrap_or(&Value::Null),
            got.unwrap_or(&Value::Null)
        ));
    }
    Ok(())
}

/// NodeRestriction's checks of the labels a node gives its own Node when it
/// creates it: none in the `kubernetes.io` / `k8s.io` namespaces but the
/// kubelet's own (the same rule as the kubelet's `--node-labels`).
pub fn admit_node_labels(request: &Request<'_>, node: &str) -> Result<(), ApiError> {
    let labels = request.body.and_then(|b| b.pointer("/metadata/labels")).and_then(Value::as_object);
    let forbidden: Vec<&str> = labels
        .into_iter()
        .flatten()
        .map(|(key, _)| key.as_str())
        .filter(|key| !kubelet::node::labels::kubelet_may_set(key))
        .collect();
    if forbidden.is_empty() {
        return Ok(());
    }
    Err(admission_forbidden(
        request,
        &format!("node \"{node}\" is not allowed to set the following labels: {}", forbidden.join(", ")),
    ))
}

/// An admission plugin's refusal (`<plural> "<name>" is forbidden: <why>`).
fn admission_forbidden(request: &Request<'_>, why: &str) -> ApiError {
    let name = request.name.map(|n| format!(" \"{n}\"")).unwrap_or_default();
    ApiError::new(403, "Forbidden", format!("{}{name} is forbidden: {why}", request.resource.plural))
}

/// Objects referenced by pods bound to `node`: (plural, namespace, name).
fn references(store: &Store, node: &str) -> HashSet<(&'static str, String, String)> {
    let pods = super::store::resource("", "v1", "pods").expect("pods");
    let mut found = HashSet::new();
    let mut claims = Vec::new();
    for pod in store.list(pods, None) {
        if pod.pointer("/spec/nodeName").and_then(Value::as_str) != Some(node) {
            continue;
        }
        let ns = pod.pointer("/metadata/namespace").and_then(Value::as_str).unwrap_or("default").to_owned();
        let spec = pod.get("spec").cloned().unwrap_or(Value::Null);
        let sa = spec.get("serviceAccountName").and_then(Value::as_str).unwrap_or("default");
        found.insert(("serviceaccounts", ns.clone(), sa.to_owned()));
        for claim in spec.get("resourceClaims").and_then(Value::as_array).into_iter().flatten() {
            if let Some(name) = claim.get("resourceClaimName").and_then(Value::as_str) {
                found.insert(("resourceclaims", ns.clone(), name.to_owned()));
            }
        }
        for status in pod.pointer("/status/resourceClaimStatuses").and_then(Value::as_array).into_iter().flatten() {
            if let Some(name) = status.get("resourceClaimName").and_then(Value::as_str) {
                found.insert(("resourceclaims", ns.clone(), name.to_owned()));
            }
        }
        let mut add = |plural: &'static str, name: Option<&Value>| {
            if let Some(name) = name.and_then(Value::as_str) {
                found.insert((plural, ns.clone(), name.to_owned()));
            }
        };
        for secret in spec.get("imagePullSecrets").and_then(Value::as_array).into_iter().flatten() {
            add("secrets", secret.get("name"));
        }
        for volume in spec.get("volumes").and_then(Value::as_array).into_iter().flatten() {
            add("secrets", volume.pointer("/secret/secretName"));
            add("configmaps", volume.pointer("/configMap/name"));
            add("secrets", volume.pointer("/csi/nodePublishSecretRef/name"));
            if let Some(claim) = volume.pointer("/persistentVolumeClaim/claimName").and_then(Value::as_str) {
                claims.push((ns.clone(), claim.to_owned()));
            }
            // A generic ephemeral volume's claim, `<pod>-<volume>`, as the
            // node authorizer's graph has it.
            if volume.get("ephemeral").is_some()
                && let (Some(pod_name), Some(volume_name)) =
                    (pod.pointer("/metadata/name").and_then(Value::as_str), volume.get("name").and_then(Value::as_str))
            {
                claims.push((ns.clone(), format!("{pod_name}-{volume_name}")));
            }
            for source in volume.pointer("/projected/sources").and_then(Value::as_array).into_iter().flatten() {
                add("secrets", source.pointer("/secret/name"));
                add("configmaps", source.pointer("/configMap/name"));
            }
        }
        let containers = ["initContainers", "containers", "ephemeralContainers"]
            .into_iter()
            .flat_map(|field| spec.get(field).and_then(Value::as_array).cloned().unwrap_or_default());
        for container in containers {
            for env in container.get("env").and_then(Value::as_array).into_iter().flatten() {
                add("secrets", env.pointer("/valueFrom/secretKeyRef/name"));
                add("configmaps", env.pointer("/valueFrom/configMapKeyRef/name"));
            }
            for from in container.get("envFrom").and_then(Value::as_array).into_iter().flatten() {
                add("secrets", from.pointer("/secretRef/name"));
                add("configmaps", from.pointer("/configMapRef/name"));
            }
        }
    }
    let pvs = super::store::resource("", "v1", "persistentvolumes").expect("pvs");
    // As the Node authorizer's graph: a PersistentVolume is related to a
    // claim through the volume's `spec.claimRef` (not the claim's
    // `volumeName`).
    let volumes = store.list(pvs, None);
    for (ns, claim) in claims {
        found.insert(("persistentvolumeclaims", ns.clone(), claim.clone()));
        let claimed_by = |pv: &&Value| {
            pv.pointer("/spec/claimRef/namespace").and_then(Value::as_str) == Some(ns.as_str())
                && pv.pointer("/spec/claimRef/name").and_then(Value::as_str) == Some(claim.as_str())
        };
        for pv in volumes.iter().filter(claimed_by) {
            let volume = pv.pointer("/metadata/name").and_then(Value::as_str).unwrap_or_default();
            found.insert(("persistentvolumes", String::new(), volume.to_owned()));
            for secret in ["nodeStageSecretRef", "nodePublishSecretRef", "nodeExpandSecretRef"] {
                let name = pv.pointer(&format!("/spec/csi/{secret}/name")).and_then(Value::as_str);
                let namespace = pv.pointer(&format!("/spec/csi/{secret}/namespace")).and_then(Value::as_str);
                if let (Some(name), Some(namespace)) = (name, namespace) {
                    found.insert(("secrets", namespace.to_owned(), name.to_owned()));
                }
            }
        }
    }
    found
}
