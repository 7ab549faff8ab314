//! `rustlet get pods|node` and `rustlet logs`: kubectl's tables and texts,
//! read from the running node's `/pods`, `/node` and `/containerLogs`.

use anyhow::{Context, bail};
use jiff::Timestamp;
use k8s_openapi::api::core::v1::{ContainerStatus, Node, Pod};

use crate::cli::{GetArgs, LogsArgs, Output, Resource};
use crate::client;

pub(crate) fn get(args: &GetArgs) -> anyhow::Result<()> {
    let root = &args.node.root_dir;
    match args.resource {
        Resource::Pods => {
            let body = client::get_ok(root, "/pods")?;
            let list: serde_json::Value = serde_json::from_str(&body).context("the node's /pods is not JSON")?;
            let mut pods: Vec<Pod> = serde_json::from_value(list.get("items").cloned().unwrap_or_default())
                .context("the node's /pods is not a PodList")?;
            pods.retain(|p| args.all_namespaces || p.metadata.namespace.as_deref() == Some(args.namespace.as_str()));
            if let Some(name) = &args.name {
                pods.retain(|p| p.metadata.name.as_deref() == Some(name.as_str()));
                if pods.is_empty() {
                    bail!("pods \"{name}\" not found");
                }
            }
            pods.sort_by(|a, b| {
                (&a.metadata.namespace, &a.metadata.name).cmp(&(&b.metadata.namespace, &b.metadata.name))
            });
            if args.output == Some(Output::Json) {
                let list = serde_json::json!({"apiVersion": "v1", "kind": "List", "metadata": {}, "items": pods});
                println!("{}", serde_json::to_string_pretty(&list)?);
            } else if pods.is_empty() {
                if args.all_namespaces {
                    eprintln!("No resources found");
                } else {
                    eprintln!("No resources found in {} namespace.", args.namespace);
                }
            } else {
                print!(
                    "{}",
                    pod_table(&pods, args.output == Some(Output::Wide), args.all_namespaces, Timestamp::now())
                );
            }
        }
        Resource::Node => {
            let body = client::get_ok(root, "/node")?;
            let node: Node = serde_json::from_str(&body).context("the node's /node is not a Node")?;
            if let Some(name) = &args.name
                && node.metadata.name.as_deref() != Some(name.as_str())
            {
                bail!("nodes \"{name}\" not found");
            }
            if args.output == Some(Output::Json) {
                println!("{}", serde_json::to_string_pretty(&serde_json::from_str::<serde_json::Value>(&body)?)?);
            } else {
                print!("{}", node_table(&node, args.output == Some(Output::Wide), Timestamp::now()));
            }
        }
    }
    Ok(())
}

pub(crate) fn logs(args: &LogsArgs) -> anyhow::Result<()> {
    let root = &args.node.root_dir;
    let container = match &args.container {
        Some(container) => container.clone(),
        None => {
            let body = client::get_ok(root, "/pods")?;
            let list: serde_json::Value = serde_json::from_str(&body).context("the node's /pods is not JSON")?;
            let pods: Vec<Pod> = serde_json::from_value(list.get("items").cloned().unwrap_or_default())?;
            let pod = pods
                .iter()
                .find(|p| {
                    p.metadata.namespace.as_deref() == Some(args.namespace.as_str())
                        && p.metadata.name.as_deref() == Some(args.pod.as_str())
                })
                .with_context(|| format!("pods \"{}\" not found", args.pod))?;
            let names: Vec<String> =
                pod.spec.iter().flat_map(|s| s.containers.iter().map(|c| c.name.clone())).collect();
            match names.as_slice() {
                [one] => one.clone(),
                _ => bail!(
                    "a container name must be specified for pod {}, choose one of: [{}]",
                    args.pod,
                    names.join(" ")
                ),
            }
        }
    };
    let mut path = format!("/containerLogs/{}/{}/{container}", args.namespace, args.pod);
    let mut query = Vec::new();
    if args.previous {
        query.push("previous=true".to_owned());
    }
    if let Some(tail) = args.tail {
        query.push(format!("tailLines={tail}"));
    }
    if args.follow {
        query.push("follow=true".to_owned());
    }
    if !query.is_empty() {
        path = format!("{path}?{}", query.join("&"));
    }
    if args.follow {
        return client::stream_to(root, &path, &mut std::io::stdout().lock());
    }
    print!("{}", client::get_ok(root, &path)?);
    Ok(())
}

/// kubectl's pod table.
fn pod_table(pods: &[Pod], wide: bool, all_namespaces: bool, now: Timestamp) -> String {
    let mut header = vec!["NAME", "READY", "STATUS", "RESTARTS", "AGE"];
    if all_namespaces {
        header.insert(0, "NAMESPACE");
    }
    if wide {
        header.extend(["IP", "NODE", "NOMINATED NODE", "READINESS GATES", "RUNTIME"]);
    }
    let mut rows = vec![header.into_iter().map(str::to_owned).collect::<Vec<_>>()];
    for pod in pods {
        let row = pod_row(pod, now);
        let mut cells = Vec::new();
        if all_namespaces {
            cells.push(pod.metadata.namespace.clone().unwrap_or_default());
        }
        cells.extend([row.name, row.ready, row.status, row.restarts, row.age]);
        if wide {
            let ip = pod.status.as_ref().and_then(|s| s.pod_ip.clone()).unwrap_or_else(|| "<none>".into());
            let node = pod.spec.as_ref().and_then(|s| s.node_name.clone()).unwrap_or_else(|| "<none>".into());
            cells.extend([ip, node, "<none>".into(), "<none>".into(), runtime_of(pod)]);
        }
        rows.push(cells);
    }
    columns(&rows)
}

/// The runtime that runs the pod: the scheme of its containers' IDs
/// (`containerd://…`, `wasmtime://…`), `<none>` before one started.
fn runtime_of(pod: &Pod) -> String {
    let status = pod.status.as_ref();
    let statuses = status
        .into_iter()
        .flat_map(|s| s.container_statuses.iter().flatten().chain(s.init_container_statuses.iter().flatten()));
    let mut ids = statuses.filter_map(|c| c.container_id.as_deref());
    ids.find_map(|id| id.split_once("://").map(|(scheme, _)| scheme.to_owned())).unwrap_or_else(|| "<none>".into())
}

struct PodRow {
    name: String,
    ready: String,
    status: String,
    restarts: String,
    age: String,
}

/// One pod as kubectl prints it (its STATUS column follows kubectl's rules:
/// the pod's reason or phase, then init container progress, then the last
/// waiting or terminated reason of a container, and `Terminating`).
fn pod_row(pod: &Pod, now: Timestamp) -> PodRow {
    let status = pod.status.clone().unwrap_or_default();
    let spec = pod.spec.clone().unwrap_or_default();
    let mut reason = status.reason.clone().or(status.phase.clone()).unwrap_or_else(|| "Pending".into());
    let mut restarts = 0;
    let mut last_restart: Option<Timestamp> = None;
    let mut note_restart = |s: &ContainerStatus| {
        restarts += s.restart_count;
        let finished = s.last_state.as_ref().and_then(|l| l.terminated.as_ref()).and_then(|t| t.finished_at.clone());
        if let Some(finished) = finished {
            last_restart = Some(last_restart.map_or(finished.0, |l: Timestamp| l.max(finished.0)));
        }
    };
    let init_specs = spec.init_containers.clone().unwrap_or_default();
    let sidecar =
        |name: &str| init_specs.iter().any(|c| c.name == name && c.restart_policy.as_deref() == Some("Always"));
    let total = spec.containers.len() + init_specs.iter().filter(|c| sidecar(&c.name)).count();
    let mut ready = 0;
    let mut initializing = false;
    for (i, s) in status.init_container_statuses.iter().flatten().enumerate() {
        note_restart(s);
        let state = s.state.clone().unwrap_or_default();
        if sidecar(&s.name) && s.started == Some(true) {
            if s.ready {
                ready += 1;
            }
            continue;
        }
        if state.terminated.as_ref().is_some_and(|t| t.exit_code == 0) {
            continue;
        }
        reason = if let Some(t) = &state.terminated {
            match &t.reason {
                Some(r) if !r.is_empty() => format!("Init:{r}"),
                _ if t.signal.unwrap_or(0) != 0 => format!("Init:Signal:{}", t.signal.unwrap_or(0)),
                _ => format!("Init:ExitCode:{}", t.exit_code),
            }
        } else if let Some(r) = state.waiting.and_then(|w| w.reason).filter(|r| !r.is_empty() && r != "PodInitializing")
        {
            format!("Init:{r}")
        } else {
            format!("Init:{i}/{}", init_specs.len())
        };
        initializing = true;
        break;
    }
    if !initializing {
        let mut running = false;
        for s in status.container_statuses.iter().flatten().rev() {
            note_restart(s);
            let state = s.state.clone().unwrap_or_default();
            if let Some(r) = state.waiting.as_ref().and_then(|w| w.reason.clone()).filter(|r| !r.is_empty()) {
                reason = r;
            } else if let Some(t) = &state.terminated {
                reason = match &t.reason {
                    Some(r) if !r.is_empty() => r.clone(),
                    _ if t.signal.unwrap_or(0) != 0 => format!("Signal:{}", t.signal.unwrap_or(0)),
                    _ => format!("ExitCode:{}", t.exit_code),
                };
            } else if state.running.is_some() && s.ready {
                running = true;
                ready += 1;
            }
        }
        if reason == "Completed" && running {
            let pod_ready = status.conditions.iter().flatten().any(|c| c.type_ == "Ready" && c.status == "True");
            reason = if pod_ready { "Running".into() } else { "NotReady".into() };
        }
    }
    if pod.metadata.deletion_timestamp.is_some() {
        reason = "Terminating".into();
    }
    let restarts = match last_restart {
        Some(at) if restarts > 0 => format!("{restarts} ({} ago)", human_duration(now.duration_since(at))),
        _ => restarts.to_string(),
    };
    let age = pod.metadata.creation_timestamp.as_ref().map(|t| t.0).or(status.start_time.as_ref().map(|t| t.0));
    PodRow {
        name: pod.metadata.name.clone().unwrap_or_default(),
        ready: format!("{ready}/{total}"),
        status: reason,
        restarts,
        age: age.map_or_else(|| "<unknown>".into(), |at| human_duration(now.duration_since(at))),
    }
}

/// kubectl's node table.
fn node_table(node: &Node, wide: bool, now: Timestamp) -> String {
    let mut header = vec!["NAME", "STATUS", "ROLES", "AGE", "VERSION"];
    if wide {
        header.extend(["INTERNAL-IP", "EXTERNAL-IP", "OS-IMAGE", "KERNEL-VERSION", "CONTAINER-RUNTIME"]);
    }
    let status = node.status.clone().unwrap_or_default();
    let ready = status.conditions.iter().flatten().find(|c| c.type_ == "Ready");
    let state = match ready.map(|c| c.status.as_str()) {
        Some("True") => "Ready",
        Some(_) => "NotReady",
        None => "Unknown",
    };
    let info = status.node_info.clone().unwrap_or_default();
    let age = node.metadata.creation_timestamp.as_ref().map(|t| human_duration(now.duration_since(t.0)));
    let mut row = vec![
        node.metadata.name.clone().unwrap_or_default(),
        state.to_owned(),
        "<none>".to_owned(),
        age.unwrap_or_else(|| "<unknown>".into()),
        info.kubelet_version.clone(),
    ];
    if wide {
        let address = |kind: &str| {
            status
                .addresses
                .iter()
                .flatten()
                .find(|a| a.type_ == kind)
                .map_or_else(|| "<none>".to_owned(), |a| a.address.clone())
        };
        row.extend([
            address("InternalIP"),
            address("ExternalIP"),
            info.os_image,
            info.kernel_version,
            info.container_runtime_version,
        ]);
    }
    columns(&[header.into_iter().map(str::to_owned).collect(), row])
}

/// Left-aligned columns, three spaces apart (kubectl's tab writer).
fn columns(rows: &[Vec<String>]) -> String {
    let widths: Vec<usize> = (0..rows.first().map_or(0, Vec::len))
        .map(|i| rows.iter().map(|r| r.get(i).map_or(0, |c| c.chars().count())).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for row in rows {
        let last = row.len().saturating_sub(1);
        for (i, cell) in row.iter().enumerate() {
            out.push_str(cell);
            if i < last {
                out.push_str(&" ".repeat(widths[i] - cell.chars().count() + 3));
            }
        }
        out.push('\n');
    }
    out
}

/// kubectl's short ages: `45s`, `3m12s`, `25m`, `5h3m`, `20h`, `3d4h`, `45d`, `2y40d`.
fn human_duration(span: jiff::SignedDuration) -> String {
    let seconds = span.as_secs().max(0);
    let (minutes, hours, days) = (seconds / 60, seconds / 3600, seconds / 86_400);
    if seconds < 120 {
        format!("{seconds}s")
    } else if minutes < 10 {
        match seconds % 60 {
            0 => format!("{minutes}m"),
            s => format!("{minutes}m{s}s"),
        }
    } else if hours < 3 {
        format!("{minutes}m")
    } else if hours < 8 {
        match minutes % 60 {
            0 => format!("{hours}h"),
            m => format!("{hours}h{m}m"),
        }
    } else if hours < 48 {
        format!("{hours}h")
    } else if days < 8 {
        match hours % 24 {
            0 => format!("{days}d"),
            h => format!("{days}d{h}h"),
        }
    } else if days < 365 * 2 {
        format!("{days}d")
    } else {
        format!("{}y{}d", days / 365, days % 365)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(seconds: i64) -> jiff::SignedDuration {
        jiff::SignedDuration::from_secs(seconds)
    }

    #[test]
    fn ages_print_as_kubectl_prints_them() {
        assert_eq!(human_duration(span(45)), "45s");
        assert_eq!(human_duration(span(192)), "3m12s");
        assert_eq!(human_duration(span(25 * 60)), "25m");
        assert_eq!(human_duration(span(5 * 3600 + 180)), "5h3m");
        assert_eq!(human_duration(span(20 * 3600)), "20h");
        assert_eq!(human_duration(span(3 * 86_400 + 4 * 3600)), "3d4h");
        assert_eq!(human_duration(span(45 * 86_400)), "45d");
        assert_eq!(human_duration(span(-5)), "0s");
    }

    fn pod(status: serde_json::Value) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "web-n1", "namespace": "default", "creationTimestamp": "2026-01-01T00:00:00Z"},
            "spec": {
                "nodeName": "n1",
                "initContainers": [{"name": "setup"}],
                "containers": [{"name": "a"}, {"name": "b"}]
            },
            "status": status
        }))
        .expect("pod")
    }

    #[test]
    fn the_runtime_column_is_the_scheme_of_container_ids() {
        let status = |id: &str| {
            pod(serde_json::json!({"phase": "Running", "containerStatuses": [
                {"name": "a", "ready": true, "restartCount": 0, "image": "", "imageID": "", "containerID": id, "state": {"running": {}}}
            ]}))
        };
        assert_eq!(runtime_of(&status("containerd://0123abcd")), "containerd");
        assert_eq!(runtime_of(&status("wasmtime://wasm-1")), "wasmtime");
        assert_eq!(runtime_of(&pod(serde_json::json!({"phase": "Pending"}))), "<none>");
        let table = pod_table(&[status("containerd://0123abcd")], true, false, Timestamp::now());
        let header = table.lines().next().unwrap_or_default();
        assert!(header.ends_with("READINESS GATES   RUNTIME"), "{table}");
        assert!(table.lines().nth(1).is_some_and(|l| l.ends_with("<none>            containerd")), "{table}");
    }

    #[test]
    fn the_status_column_follows_kubectl() {
        let now: Timestamp = "2026-01-01T00:10:00Z".parse().expect("time");
        let init = pod(serde_json::json!({"phase": "Pending", "initContainerStatuses": [
            {"name": "setup", "ready": false, "restartCount": 0, "image": "", "imageID": "", "state": {"running": {}}}
        ]}));
        assert_eq!(pod_row(&init, now).status, "Init:0/1");
        let crash = pod(serde_json::json!({"phase": "Running", "containerStatuses": [
            {"name": "a", "ready": true, "restartCount": 0, "image": "", "imageID": "", "state": {"running": {}}},
            {"name": "b", "ready": false, "restartCount": 3, "image": "", "imageID": "",
             "state": {"waiting": {"reason": "CrashLoopBackOff"}},
             "lastState": {"terminated": {"exitCode": 1, "finishedAt": "2026-01-01T00:09:30Z"}}}
        ]}));
        let row = pod_row(&crash, now);
        assert_eq!(
            (row.ready.as_str(), row.status.as_str(), row.restarts.as_str(), row.age.as_str()),
            ("1/2", "CrashLoopBackOff", "3 (30s ago)", "10m")
        );
        let table = pod_table(&[crash], true, false, now);
        let lines: Vec<&str> = table.lines().collect();
        assert!(lines[0].starts_with("NAME     READY   STATUS             RESTARTS      AGE   IP"), "{table}");
        assert!(lines[1].starts_with("web-n1   1/2     CrashLoopBackOff   3 (30s ago)   10m   <none>   n1"), "{table}");
        let done = pod(serde_json::json!({"phase": "Succeeded", "containerStatuses": [
            {"name": "a", "ready": false, "restartCount": 0, "image": "", "imageID": "", "state": {"terminated": {"exitCode": 0, "reason": "Completed"}}},
            {"name": "b", "ready": false, "restartCount": 0, "image": "", "imageID": "", "state": {"terminated": {"exitCode": 2}}}
        ]}));
        assert_eq!(pod_row(&done, now).status, "Completed", "the first container's reason is kubectl's last word");
        let mut deleting = pod(serde_json::json!({"phase": "Running"}));
        deleting.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(now));
        assert_eq!(pod_row(&deleting, now).status, "Terminating");
    }
}
