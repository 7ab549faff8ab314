//! The node-conformance behaviours of the upstream e2e suite (v1.28.7), each
//! checked on a real containerd with the busybox image: the downward API,
//! volume contents and modes, lifecycle hooks, termination messages,
//! `/etc/hosts`, init and ephemeral containers, restart counting, the
//! active deadline and admission. docs/conformance.md names the upstream
//! test each one mirrors.

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kubelet::provider::decode_cri_log;
use rustlet_testkit::containerd::Containerd;
use rustlet_testkit::pod_state::container_status;
use serde_json::json;

use super::{CriNode, SOON, cri_node, cri_node_with, merge, phase, terminated};

/// The node's IP the tests give `status.hostIP`.
const HOST_IP: &str = "192.0.2.77";

async fn conformance_node(containerd: &Containerd) -> CriNode {
    cri_node_with(containerd, 0, |config| {
        config.host_ips = vec![HOST_IP.parse().expect("ip")];
        config.cluster_domain = "cluster.local".into();
        config.volume_refresh = Duration::from_millis(200);
    })
    .await
}

impl CriNode {
    /// The lines container `container` of pod `name` (UID `uid`) wrote in
    /// its run `run`.
    fn log_of(&self, name: &str, uid: &str, container: &str, run: u32) -> Vec<String> {
        let path = self.root.path().join(format!("logs/pods/default_{name}_{uid}/{container}/{run}.log"));
        decode_cri_log(&std::fs::read_to_string(&path).unwrap_or_default())
    }

    /// Applies `pod` again (same UID) with `change` merged into its spec and
    /// `labels` (if any) as its labels: what an API update delivers.
    fn update(&self, uid: &str, labels: Option<serde_json::Value>, change: serde_json::Value) {
        let pod = self.pods.store().get(uid).expect("the pod");
        let mut value = serde_json::to_value(&pod).expect("json");
        if let Some(labels) = labels {
            value["metadata"]["labels"] = labels;
        }
        merge(&mut value["spec"], change);
        value.as_object_mut().expect("object").remove("status");
        self.pods.apply(serde_json::from_value(value).expect("pod"));
    }
}

/// The trimmed lines of a log.
fn trimmed(lines: &[String]) -> Vec<&str> {
    lines.iter().map(|l| l.trim_end()).collect()
}

fn pod_ip(pod: &Pod) -> String {
    pod.status.as_ref().and_then(|s| s.pod_ip.clone()).unwrap_or_default()
}

/// `fieldRef` (`status.podIP`, `status.hostIP`, the pod's name and
/// namespace) and `resourceFieldRef` (limits and requests, divided and
/// rounded up; an unset limit is the node's allocatable) reach the env.
#[tokio::test]
async fn the_downward_api_reaches_the_env() {
    let Some(containerd) = Containerd::shared("the_downward_api_reaches_the_env") else { return };
    let node = conformance_node(containerd).await;
    let field = |path: &str| json!({"fieldRef": {"fieldPath": path}});
    let resource = |name: &str| json!({"resourceFieldRef": {"resource": name}});
    let env = json!([
        {"name": "POD_NAME", "valueFrom": field("metadata.name")},
        {"name": "POD_NAMESPACE", "valueFrom": field("metadata.namespace")},
        {"name": "POD_IP", "valueFrom": field("status.podIP")},
        {"name": "HOST_IP", "valueFrom": field("status.hostIP")},
        {"name": "CPU_LIMIT", "valueFrom": resource("limits.cpu")},
        {"name": "MEMORY_LIMIT", "valueFrom": resource("limits.memory")},
        {"name": "CPU_REQUEST", "valueFrom": resource("requests.cpu")},
        {"name": "MEMORY_REQUEST", "valueFrom": resource("requests.memory")},
    ]);
    let script = "env | grep -E '^(POD_|HOST_|CPU_|MEMORY_)' | sort";
    let limited = node.run(
        "env-limited",
        script,
        json!({}),
        json!({"env": env, "resources": {"limits": {"cpu": "1250m", "memory": "64Mi"},
                                           "requests": {"cpu": "250m", "memory": "32Mi"}}}),
    );
    let bare = node.run("env-bare", script, json!({}), json!({"env": env}));
    let done = node.wait(&limited, "finished", |p| terminated(p).is_some()).await;
    assert_eq!(terminated(&done).map(|t| t.exit_code), Some(0), "{done:?}");
    let ip = pod_ip(&done);
    assert!(ip.starts_with("10."), "the pod's own IP: {ip:?}");
    assert_eq!(
        trimmed(&node.log("env-limited", &limited)),
        [
            "CPU_LIMIT=2".to_owned(),
            "CPU_REQUEST=1".into(),
            format!("HOST_IP={HOST_IP}"),
            "MEMORY_LIMIT=67108864".into(),
            "MEMORY_REQUEST=33554432".into(),
            format!("POD_IP={ip}"),
            "POD_NAME=env-limited".into(),
            "POD_NAMESPACE=default".into(),
        ]
    );
    node.wait(&bare, "finished", |p| terminated(p).is_some()).await;
    let lines = node.log("env-bare", &bare);
    let lines = trimmed(&lines);
    // The node's allocatable (2 cpus, 4 GiB) for the limits it does not set.
    assert!(lines.contains(&"CPU_LIMIT=2") && lines.contains(&"MEMORY_LIMIT=4294967296"), "{lines:?}");
    assert!(lines.contains(&"CPU_REQUEST=0") && lines.contains(&"MEMORY_REQUEST=0"), "{lines:?}");
}

/// downwardAPI volumes: resources with divisors, the
/// pod's name, per-item and default modes, the kubelet's `..data` layout;
/// a label change reaches the running container's file.
#[tokio::test]
async fn downward_api_volumes_carry_resources_and_follow_label_changes() {
    let Some(containerd) = Containerd::shared("downward_api_volumes_carry_resources_and_follow_label_changes") else {
        return;
    };
    let node = conformance_node(containerd).await;
    let volumes = json!([
        {"name": "podinfo", "downwardAPI": {"defaultMode": 0o440, "items": [
            {"path": "podname", "fieldRef": {"fieldPath": "metadata.name"}, "mode": 0o400},
            {"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}},
            {"path": "cpu_limit", "resourceFieldRef": {"containerName": "main", "resource": "limits.cpu", "divisor": "1m"}},
            {"path": "memory_request", "resourceFieldRef": {"containerName": "main", "resource": "requests.memory", "divisor": "1Mi"}},
        ]}},
        {"name": "memory", "downwardAPI": {"items": [
            {"path": "memory_limit", "resourceFieldRef": {"containerName": "main", "resource": "limits.memory"}},
        ]}},
    ]);
    let script = "for f in podname cpu_limit memory_request; do cat /podinfo/$f; echo; done; \
                  stat -L -c %a /podinfo/podname /podinfo/cpu_limit; readlink /podinfo/..data | grep -q '^\\.\\.2' && echo atomic; \
                  cat /memory/memory_limit; echo; stat -L -c %a /memory/memory_limit; \
                  while true; do echo \"labels: $(cat /podinfo/labels | tr '\\n' ' ')\"; sleep 0.2; done";
    let uid = node.run(
        "podinfo",
        script,
        json!({"restartPolicy": "Always", "volumes": volumes}),
        json!({
            "resources": {"limits": {"cpu": "1250m"}, "requests": {"cpu": "250m", "memory": "32Mi"}},
            "volumeMounts": [{"name": "podinfo", "mountPath": "/podinfo"}, {"name": "memory", "mountPath": "/memory"}],
        }),
    );
    node.wait(&uid, "running", super::running).await;
    let log = node.root.path().join(format!("logs/pods/default_podinfo_{uid}/main/0.log"));
    common_wait(&log, |text| text.contains("labels:")).await;
    let lines = node.log("podinfo", &uid);
    // An unset limit is the node's allocatable (4 GiB here); the default
    // mode 0644.
    assert_eq!(
        trimmed(&lines)[..8],
        ["podinfo", "1250", "32", "400", "440", "atomic", &(4u64 << 30).to_string(), "644"],
        "{lines:?}"
    );
    // A new label reaches the file while the container runs.
    node.update(&uid, Some(json!({"key1": "value1", "key3": "value3"})), json!({}));
    let text = common_wait(&log, |text| text.contains("key3=\\\"value3\\\"") || text.contains("key3=\"value3\"")).await;
    assert!(text.contains("key1=\"value1\""), "{text}");
}

async fn common_wait(path: &std::path::Path, pred: impl FnMut(&str) -> bool) -> String {
    crate::common::wait_file(path, pred).await
}

/// A pod whose name is longer than a hostname may be runs with the name
/// cut to 63 characters (the kernel refuses longer); termination messages
/// come from the file at `terminationMessagePath` (written by a non-root
/// user at a custom path too), or from the log's end under
/// `FallbackToLogsOnError` when the container failed, and are empty when it
/// succeeded without writing one.
#[tokio::test]
async fn long_names_run_and_termination_messages_are_reported() {
    let Some(containerd) = Containerd::shared("long_names_run_and_termination_messages_are_reported") else { return };
    let node = conformance_node(containerd).await;
    let long = format!("termination-message-container-{}", "x".repeat(45));
    let from_file = node.run(
        &long,
        "hostname; echo -n DONE > /dev/termination-log",
        json!({}),
        json!({"terminationMessagePath": "/dev/termination-log", "terminationMessagePolicy": "FallbackToLogsOnError"}),
    );
    let non_root = node.run(
        "termination-non-root",
        "echo -n DONE > /dev/termination-custom-log",
        json!({}),
        json!({"terminationMessagePath": "/dev/termination-custom-log", "securityContext": {"runAsUser": 1000}}),
    );
    let from_log = node.run(
        "termination-from-log",
        "echo -n DONE; exit 1",
        json!({}),
        json!({"terminationMessagePath": "/dev/termination-log", "terminationMessagePolicy": "FallbackToLogsOnError"}),
    );
    let empty = node.run(
        "termination-empty",
        "echo -n DONE",
        json!({}),
        json!({"terminationMessagePath": "/dev/termination-log", "terminationMessagePolicy": "FallbackToLogsOnError"}),
    );
    for (uid, want_phase, want_message) in [
        (&from_file, "Succeeded", Some("DONE")),
        (&non_root, "Succeeded", Some("DONE")),
        (&from_log, "Failed", Some("DONE")),
        (&empty, "Succeeded", None),
    ] {
        let done = node.wait(uid, "finished", |p| matches!(phase(p), Some("Succeeded" | "Failed"))).await;
        assert_eq!(phase(&done), Some(want_phase), "{uid}: {done:?}");
        assert_eq!(terminated(&done).and_then(|t| t.message).as_deref(), want_message, "{uid}");
    }
    let hostname = node.log(&long, &from_file);
    assert_eq!(trimmed(&hostname), [&long[..63]], "the hostname is the name cut to 63");
}

/// An emptyDir is world-writable (a non-root container writes it); with
/// an `fsGroup` it belongs to that group and is set-group-ID; `$(VAR)`
/// references in command and args expand; a `subPathExpr` names a
/// directory made in the volume; a memory-backed one is a tmpfs of its
/// `sizeLimit` and a missing subPath in it gets its mode and group.
#[tokio::test]
async fn empty_dirs_are_writable_by_any_user_and_env_references_expand() {
    let Some(containerd) = Containerd::shared("empty_dirs_are_writable_by_any_user_and_env_references_expand") else {
        return;
    };
    let node = conformance_node(containerd).await;
    let uid = node.run(
        "writer",
        "",
        json!({"securityContext": {"runAsUser": 1001, "fsGroup": 2000},
               "volumes": [{"name": "scratch", "emptyDir": {}},
                           {"name": "mem", "emptyDir": {"medium": "Memory", "sizeLimit": "10Mi"}}]}),
        json!({
            "command": ["sh", "-c", "echo $(GREETING); stat -c '%a %g' /scratch; touch /scratch/f && echo wrote; \
                                      test -d /all/$(POD_NAME) && echo sub-exists; touch /logs/x && ls /all/writer; \
                                      df -k /mem | tail -1 | awk '{print $2}'; stat -c '%A %u %g' /mem-sub"],
            "env": [{"name": "GREETING", "value": "hello"},
                    {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
            "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"},
                             {"name": "scratch", "mountPath": "/all"},
                             {"name": "scratch", "mountPath": "/logs", "subPathExpr": "$(POD_NAME)"},
                             {"name": "mem", "mountPath": "/mem"},
                             {"name": "mem", "mountPath": "/mem-sub", "subPath": "test-sub"}],
        }),
    );
    let done = node.wait(&uid, "finished", |p| terminated(p).is_some()).await;
    let lines = node.log("writer", &uid);
    assert_eq!(terminated(&done).map(|t| t.exit_code), Some(0), "{lines:?}");
    // A memory-backed emptyDir is a tmpfs of its sizeLimit (10Mi: 10240
    // KiB), sticky as the kernel mounts it; a subPath made in it copies its
    // mode (set-group-ID and sticky) and belongs to the fsGroup.
    assert_eq!(trimmed(&lines), ["hello", "2777 2000", "wrote", "sub-exists", "x", "10240", "drwxrwsrwt 0 2000"]);
}

/// A local server the tests' HTTP hooks call: the request lines it got.
struct HookServer {
    port: u16,
    requests: tokio::sync::mpsc::UnboundedReceiver<String>,
}

impl HookServer {
    async fn start() -> HookServer {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let (tx, requests) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let tx = tx.clone();
                tokio::spawn(async move {
                    let mut buffer = vec![0u8; 4096];
                    let n = stream.read(&mut buffer).await.unwrap_or(0);
                    let line = String::from_utf8_lossy(&buffer[..n]).lines().next().unwrap_or_default().to_owned();
                    let _ = stream.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n").await;
                    let _ = tx.send(line);
                });
            }
        });
        HookServer { port, requests }
    }

    async fn next(&mut self) -> String {
        tokio::time::timeout(SOON, self.requests.recv()).await.expect("a hook request in time").expect("server")
    }
}

/// postStart and preStop hooks, exec and httpGet: postStart runs once the
/// container started, preStop before it is stopped on removal; a failed
/// postStart stops the container.
#[tokio::test]
async fn lifecycle_hooks_run_after_start_and_before_stop() {
    let Some(containerd) = Containerd::shared("lifecycle_hooks_run_after_start_and_before_stop") else { return };
    let node = conformance_node(containerd).await;
    let hooks = node.root.path().join("hooks");
    std::fs::create_dir_all(&hooks).expect("hooks dir");
    let exec = node.run(
        "hooked-exec",
        "while [ ! -e /hooks/post ]; do sleep 0.1; done; cat /hooks/post; exec sleep 3600",
        json!({"restartPolicy": "Always", "terminationGracePeriodSeconds": 5,
               "volumes": [{"name": "hooks", "hostPath": {"path": hooks.display().to_string()}}]}),
        json!({
            "volumeMounts": [{"name": "hooks", "mountPath": "/hooks"}],
            "lifecycle": {
                "postStart": {"exec": {"command": ["sh", "-c", "echo poststart > /hooks/post"]}},
                "preStop": {"exec": {"command": ["sh", "-c", "echo prestop > /hooks/pre"]}},
            },
        }),
    );
    let mut server = HookServer::start().await;
    let http = node.run(
        "hooked-http",
        "exec sleep 3600",
        json!({"restartPolicy": "Always", "terminationGracePeriodSeconds": 5}),
        json!({"lifecycle": {
            "postStart": {"httpGet": {"host": "127.0.0.1", "port": server.port, "path": "/echo?msg=poststart"}},
            "preStop": {"httpGet": {"host": "127.0.0.1", "port": server.port, "path": "/echo?msg=prestop"}},
        }}),
    );
    let failing = node.run(
        "hooked-failing",
        "exec sleep 3600",
        json!({"terminationGracePeriodSeconds": 1}),
        json!({"lifecycle": {"postStart": {"exec": {"command": ["sh", "-c", "exit 3"]}}}}),
    );
    assert_eq!(server.next().await, "GET /echo?msg=poststart HTTP/1.1");
    node.wait(&exec, "running", super::running).await;
    let log = node.root.path().join(format!("logs/pods/default_hooked-exec_{exec}/main/0.log"));
    common_wait(&log, |text| text.contains("poststart")).await;
    let failed = node.wait(&failing, "stopped after its postStart hook failed", |p| terminated(p).is_some()).await;
    assert_eq!(phase(&failed), Some("Failed"), "{failed:?}");

    node.pods.delete(&exec);
    node.pods.delete(&http);
    assert_eq!(server.next().await, "GET /echo?msg=prestop HTTP/1.1");
    let gone = node.pods.store().wait_for(SOON, |pods| !pods.contains_key(&exec)).await;
    assert!(gone.is_some(), "the pod was removed");
    assert_eq!(std::fs::read_to_string(hooks.join("pre")).expect("the preStop hook ran").trim(), "prestop");
}

/// Init containers: while one runs, the app container waits as
/// `PodInitializing`; one that completed is ready.
#[tokio::test]
async fn init_containers_complete_ready_and_apps_wait_as_pod_initializing() {
    let Some(containerd) = Containerd::shared("init_containers_complete_ready_and_apps_wait_as_pod_initializing")
    else {
        return;
    };
    let node = conformance_node(containerd).await;
    let gate = node.root.path().join("gate");
    std::fs::create_dir_all(&gate).expect("gate dir");
    let image = node.image.clone();
    let uid = node.run(
        "initialized",
        "exec sleep 3600",
        json!({
            "restartPolicy": "Always",
            "volumes": [{"name": "gate", "hostPath": {"path": gate.display().to_string()}}],
            "initContainers": [{"name": "init1", "image": image, "command": ["sh", "-c", "while [ ! -e /gate/open ]; do sleep 0.1; done"],
                                "volumeMounts": [{"name": "gate", "mountPath": "/gate"}]}],
        }),
        json!({}),
    );
    let init_running = |p: &Pod| {
        p.status
            .as_ref()
            .and_then(|s| s.init_container_statuses.as_ref())
            .and_then(|c| c.first())
            .is_some_and(|c| c.state.as_ref().is_some_and(|s| s.running.is_some()))
    };
    let waiting = node.wait(&uid, "initializing", init_running).await;
    let main = container_status(&waiting, "main").expect("main");
    let reason = main.state.as_ref().and_then(|s| s.waiting.as_ref()).and_then(|w| w.reason.as_deref());
    assert_eq!(reason, Some("PodInitializing"), "{main:?}");
    std::fs::write(gate.join("open"), "").expect("open the gate");
    let started = node.wait(&uid, "running", super::running).await;
    let init = &started.status.as_ref().and_then(|s| s.init_container_statuses.clone()).expect("init statuses")[0];
    assert!(init.ready, "a completed init container is ready: {init:?}");
    assert_eq!(init.state.as_ref().and_then(|s| s.terminated.as_ref()).map(|t| t.exit_code), Some(0));
}

/// A restart counts when the new container starts (upstream's count of
/// the instances before it): the first status with `restartCount` 2 shows
/// the third instance running, not the second one's backoff.
#[tokio::test]
async fn the_restart_count_rises_when_the_new_container_starts() {
    let Some(containerd) = Containerd::shared("the_restart_count_rises_when_the_new_container_starts") else { return };
    let node = conformance_node(containerd).await;
    let uid = node.run(
        "counted",
        "f=/rc/count; echo x >> $f; n=$(wc -l < $f); if [ $n -eq 1 ]; then exit 1; fi; if [ $n -eq 2 ]; then exit 0; fi; \
         exec sleep 3600",
        json!({"restartPolicy": "Always", "volumes": [{"name": "rc", "emptyDir": {}}]}),
        json!({"volumeMounts": [{"name": "rc", "mountPath": "/rc"}]}),
    );
    let seen = std::sync::Mutex::new(Vec::new());
    let counted = node
        .wait(&uid, "restarted twice", |p| {
            let Some(status) = container_status(p, "main") else { return false };
            let state = status.state.as_ref();
            let what = if state.is_some_and(|s| s.running.is_some()) { "running" } else { "not running" };
            seen.lock().expect("seen").push((status.restart_count, what));
            status.restart_count >= 2
        })
        .await;
    let status = container_status(&counted, "main").expect("main");
    assert_eq!(status.restart_count, 2, "{status:?}");
    assert!(
        status.state.as_ref().is_some_and(|s| s.running.is_some()),
        "restartCount 2 first appears with the third instance running; seen {:?}",
        seen.lock().expect("seen")
    );
    let counts: Vec<i32> = seen.lock().expect("seen").iter().map(|(c, _)| *c).collect();
    assert!(counts.windows(2).all(|w| w[0] <= w[1]), "{counts:?}");
}

/// `/etc/hosts` is the kubelet's: the managed header, the pod's IP with
/// its fully qualified name under its subdomain, then its `hostAliases`.
#[tokio::test]
async fn etc_hosts_is_kubelet_managed_with_host_aliases() {
    let Some(containerd) = Containerd::shared("etc_hosts_is_kubelet_managed_with_host_aliases") else { return };
    let node = conformance_node(containerd).await;
    let uid = node.run(
        "hosts",
        "cat /etc/hosts",
        json!({"hostname": "web", "subdomain": "sub",
               "hostAliases": [{"ip": "123.45.67.89", "hostnames": ["foo", "bar"]}]}),
        json!({}),
    );
    let done = node.wait(&uid, "finished", |p| terminated(p).is_some()).await;
    let lines = node.log("hosts", &uid);
    let lines = trimmed(&lines);
    assert_eq!(lines.first(), Some(&"# Kubernetes-managed hosts file."), "{lines:?}");
    let ip = pod_ip(&done);
    assert!(lines.contains(&format!("{ip}\tweb.sub.default.svc.cluster.local\tweb").as_str()), "{lines:?}");
    assert_eq!(lines[lines.len() - 2..], ["# Entries added by HostAliases.", "123.45.67.89\tfoo\tbar"]);
}

/// Admission refuses a pod for another operating system
/// (`PodOSNotSupported`) and one setting a sysctl the node does not allow
/// (`SysctlForbidden`), with upstream's reasons.
#[tokio::test]
async fn pods_for_another_os_or_with_unsafe_sysctls_are_rejected() {
    let Some(containerd) = Containerd::shared("pods_for_another_os_or_with_unsafe_sysctls_are_rejected") else {
        return;
    };
    let node = cri_node(containerd).await;
    let windows = node.run("windows", "true", json!({"os": {"name": "windows"}}), json!({}));
    let sysctl = node.run(
        "sysctl",
        "true",
        json!({"securityContext": {"sysctls": [{"name": "kernel.msgmax", "value": "10000000000"}]}}),
        json!({}),
    );
    for (uid, reason) in [(&windows, "PodOSNotSupported"), (&sysctl, "SysctlForbidden")] {
        let done = node.wait(uid, "rejected", |p| phase(p) == Some("Failed")).await;
        let status = done.status.as_ref().expect("status");
        assert_eq!(status.reason.as_deref(), Some(reason), "{status:?}");
        assert!(status.message.as_deref().is_some_and(|m| m.starts_with("Pod was rejected: ")), "{status:?}");
    }
}

/// An ephemeral container added to a running pod (`kubectl debug
/// --target`) starts, shares its target's process namespace, runs once and
/// is reported in `ephemeralContainerStatuses`; the pod stays ready.
#[tokio::test]
async fn an_ephemeral_container_starts_in_a_running_pod() {
    let Some(containerd) = Containerd::shared("an_ephemeral_container_starts_in_a_running_pod") else { return };
    let node = conformance_node(containerd).await;
    let uid = node.run("debugged", "exec sleep 3600", json!({"restartPolicy": "Always"}), json!({}));
    node.wait(&uid, "running", super::running).await;
    let image = node.image.clone();
    node.update(
        &uid,
        None,
        json!({"ephemeralContainers": [{"name": "debugger", "image": image, "targetContainerName": "main",
                                        "command": ["sh", "-c", "echo debugging; ps"]}]}),
    );
    let ephemeral = |p: &Pod| {
        p.status.as_ref().and_then(|s| s.ephemeral_container_statuses.as_ref()).and_then(|c| c.first()).cloned()
    };
    let done = node
        .wait(&uid, "debugger finished", |p| ephemeral(p).and_then(|c| c.state).is_some_and(|s| s.terminated.is_some()))
        .await;
    let status = ephemeral(&done).expect("ephemeral status");
    assert_eq!(status.name, "debugger");
    assert_eq!(status.state.and_then(|s| s.terminated).map(|t| t.exit_code), Some(0));
    let lines = node.log_of("debugged", &uid, "debugger", 0);
    assert_eq!(lines.first().map(|l| l.trim_end()), Some("debugging"), "{lines:?}");
    assert!(lines.iter().any(|l| l.contains("sleep 3600")), "the target's processes are visible: {lines:?}");
    assert!(super::pod_ready(&done), "an ephemeral container does not change the pod's readiness");
    assert_eq!(phase(&done), Some("Running"));
}

/// `activeDeadlineSeconds`, lowered while the pod runs, ends it: Failed,
/// `DeadlineExceeded`, its container stopped.
#[tokio::test]
async fn a_lowered_active_deadline_ends_the_pod() {
    let Some(containerd) = Containerd::shared("a_lowered_active_deadline_ends_the_pod") else { return };
    let node = conformance_node(containerd).await;
    let uid = node.run(
        "deadline",
        "exec sleep 3600",
        json!({"restartPolicy": "Always", "activeDeadlineSeconds": 3600, "terminationGracePeriodSeconds": 1}),
        json!({}),
    );
    node.wait(&uid, "running", super::running).await;
    node.update(&uid, None, json!({"activeDeadlineSeconds": 1}));
    let done = node.wait(&uid, "failed", |p| phase(p) == Some("Failed")).await;
    let status = done.status.as_ref().expect("status");
    assert_eq!(status.reason.as_deref(), Some("DeadlineExceeded"), "{status:?}");
    assert_eq!(status.message.as_deref(), Some("Pod was active on the node longer than the specified deadline"));
    assert!(terminated(&done).is_some(), "its container was stopped: {status:?}");
}

/// `runAsNonRoot` as the kubelet checks it before creating a container
/// (upstream's "Security Context When creating a container with
/// runAsNonRoot"): an explicit `runAsUser: 0` and an image that runs as
/// root (busybox has no `USER`) are refused with upstream's messages
/// (`CreateContainerConfigError`, a `Failed` event); a non-root
/// `runAsUser` runs.
#[tokio::test]
async fn run_as_non_root_refuses_root_users_and_runs_others() {
    let Some(containerd) = Containerd::shared("run_as_non_root_refuses_root_users_and_runs_others") else { return };
    let node = conformance_node(containerd).await;
    let waiting_message = |pod: &Pod| {
        container_status(pod, "main")
            .and_then(|c| c.state.as_ref()?.waiting.clone())
            .filter(|w| w.reason.as_deref() == Some("CreateContainerConfigError"))
            .and_then(|w| w.message)
    };
    let explicit = node.run(
        "explicit-root-uid",
        "id -u",
        json!({}),
        json!({"securityContext": {"runAsNonRoot": true, "runAsUser": 0}}),
    );
    let refused = node.wait(&explicit, "refused", |p| waiting_message(p).is_some()).await;
    assert_eq!(
        waiting_message(&refused).as_deref(),
        Some(
            "container's runAsUser breaks non-root policy (pod: \"explicit-root-uid_default(cri-explicit-root-uid)\", container: main)"
        )
    );
    let implicit =
        node.run("implicit-root-uid", "id -u", json!({"securityContext": {"runAsNonRoot": true}}), json!({}));
    let refused = node.wait(&implicit, "refused", |p| waiting_message(p).is_some()).await;
    let message = waiting_message(&refused).unwrap_or_default();
    assert!(message.starts_with("container has runAsNonRoot and image will run as root"), "{message}");
    let allowed = node.run(
        "non-root-uid",
        "id -u",
        json!({}),
        json!({"securityContext": {"runAsNonRoot": true, "runAsUser": 1234}}),
    );
    let done = node.wait(&allowed, "finished", |p| terminated(p).is_some()).await;
    assert_eq!(terminated(&done).map(|t| t.exit_code), Some(0));
    assert_eq!(trimmed(&node.log("non-root-uid", &allowed)), ["1234"]);
}
