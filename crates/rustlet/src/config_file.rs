//! `--config FILE`: the kubelet's `KubeletConfiguration`
//! (`kubelet.config.k8s.io/v1beta1`, YAML or JSON), as kubeadm writes it.
//!
//! Each field Rustlet implements becomes the flag of the same setting
//! ([`FIELDS`]); a flag given on the command line (or through its
//! environment variable) wins over the file, as upstream. Zero durations
//! and zero counts mean "the default", as they do to the kubelet. Fields
//! Rustlet does not implement are listed once at start, as a warning.

use std::collections::BTreeSet;
use std::path::Path;

use serde_json::Value;

/// The API version and kind the file must have.
pub(crate) const API_VERSION: &str = "kubelet.config.k8s.io/v1beta1";
/// …
pub(crate) const KIND: &str = "KubeletConfiguration";

/// How a field's value becomes a flag's.
#[derive(Clone, Copy, Debug)]
enum Form {
    /// A string, as is; empty is unset.
    Text,
    /// A number; zero is unset (the kubelet's default).
    Count,
    /// A number, zero included.
    Number,
    /// `true` or `false`.
    Bool,
    /// A Go duration (`2m0s`); zero is unset.
    Duration,
    /// A list of strings, comma-joined.
    List,
    /// A map, `k=v,k=v`.
    Pairs,
    /// A threshold map, `signal<value,…`.
    Thresholds,
    /// A map of booleans (feature gates), `Name=true,…`.
    Gates,
    /// A list of taints, `key=value:Effect,…`.
    Taints,
}

/// The fields Rustlet implements: (path in the file, flag, form).
const FIELDS: &[(&str, &str, Form)] = &[
    ("address", "address", Form::Text),
    ("port", "port", Form::Count),
    ("healthzBindAddress", "healthz-bind-address", Form::Text),
    ("healthzPort", "healthz-port", Form::Number),
    ("tlsCertFile", "tls-cert-file", Form::Text),
    ("tlsPrivateKeyFile", "tls-private-key-file", Form::Text),
    ("serverTLSBootstrap", "rotate-server-certificates", Form::Bool),
    ("rotateCertificates", "rotate-certificates", Form::Bool),
    ("authentication.anonymous.enabled", "anonymous-auth", Form::Bool),
    ("authentication.webhook.enabled", "authentication-token-webhook", Form::Bool),
    ("authentication.webhook.cacheTTL", "authentication-token-webhook-cache-ttl", Form::Duration),
    ("authentication.x509.clientCAFile", "client-ca-file", Form::Text),
    ("authorization.mode", "authorization-mode", Form::Text),
    ("authorization.webhook.cacheAuthorizedTTL", "authorization-webhook-cache-authorized-ttl", Form::Duration),
    ("authorization.webhook.cacheUnauthorizedTTL", "authorization-webhook-cache-unauthorized-ttl", Form::Duration),
    ("staticPodPath", "pod-manifest-path", Form::Text),
    ("clusterDNS", "cluster-dns", Form::List),
    ("clusterDomain", "cluster-domain", Form::Text),
    ("resolvConf", "resolv-conf", Form::Text),
    ("maxPods", "max-pods", Form::Count),
    ("kubeAPIQPS", "kube-api-qps", Form::Number),
    ("kubeAPIBurst", "kube-api-burst", Form::Count),
    ("containerRuntimeEndpoint", "container-runtime-endpoint", Form::Text),
    ("allowedUnsafeSysctls", "allowed-unsafe-sysctls", Form::List),
    ("registerWithTaints", "register-with-taints", Form::Taints),
    ("cgroupsPerQOS", "cgroups-per-qos", Form::Bool),
    ("cgroupRoot", "cgroup-root", Form::Text),
    ("cgroupDriver", "cgroup-driver", Form::Text),
    ("podPidsLimit", "pod-max-pids", Form::Number),
    ("cpuCFSQuota", "cpu-cfs-quota", Form::Bool),
    ("systemReserved", "system-reserved", Form::Pairs),
    ("kubeReserved", "kube-reserved", Form::Pairs),
    ("containerLogMaxSize", "container-log-max-size", Form::Text),
    ("containerLogMaxFiles", "container-log-max-files", Form::Count),
    ("imageGCHighThresholdPercent", "image-gc-high-threshold", Form::Number),
    ("imageGCLowThresholdPercent", "image-gc-low-threshold", Form::Number),
    ("imageMinimumGCAge", "minimum-image-ttl-duration", Form::Duration),
    ("volumeStatsAggPeriod", "volume-stats-agg-period", Form::Duration),
    ("evictionHard", "eviction-hard", Form::Thresholds),
    ("evictionSoft", "eviction-soft", Form::Thresholds),
    ("evictionSoftGracePeriod", "eviction-soft-grace-period", Form::Pairs),
    ("evictionMinimumReclaim", "eviction-minimum-reclaim", Form::Pairs),
    ("evictionPressureTransitionPeriod", "eviction-pressure-transition-period", Form::Duration),
    ("evictionMaxPodGracePeriod", "eviction-max-pod-grace-period", Form::Number),
    ("enforceNodeAllocatable", "enforce-node-allocatable", Form::List),
    ("enableSystemLogHandler", "enable-system-log-handler", Form::Bool),
    ("enableSystemLogQuery", "enable-system-log-query", Form::Bool),
    ("featureGates", "feature-gates", Form::Gates),
];

/// What a configuration file says.
#[derive(Debug, Default)]
pub(crate) struct FileSettings {
    /// `(clap id, --flag=value)` per field set in the file.
    pub(crate) flags: Vec<(String, String)>,
    /// The fields present that Rustlet does not implement (dotted paths;
    /// a wholly unknown object by its name).
    pub(crate) ignored: Vec<String>,
}

/// Reads `path`.
pub(crate) fn read(path: &Path) -> Result<FileSettings, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    parse(&text).map_err(|e| format!("{}: {e}", path.display()))
}

/// Parses a file's text.
pub(crate) fn parse(text: &str) -> Result<FileSettings, String> {
    let document: Value = if text.trim_start().starts_with('{') {
        serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?
    } else {
        serde_saphyr::from_str(text).map_err(|e| format!("not YAML: {e}"))?
    };
    let Value::Object(_) = &document else { return Err("not a KubeletConfiguration object".into()) };
    let api_version = document["apiVersion"].as_str().unwrap_or_default();
    let kind = document["kind"].as_str().unwrap_or_default();
    if api_version != API_VERSION || kind != KIND {
        return Err(format!("apiVersion {api_version:?}, kind {kind:?}: expected {API_VERSION} {KIND}"));
    }
    let mut settings = FileSettings::default();
    for (field, flag, form) in FIELDS {
        let pointer = format!("/{}", field.replace('.', "/"));
        let Some(value) = document.pointer(&pointer) else { continue };
        let bad = |want: &str| format!("{field}: {value} is not {want}");
        let text = match form {
            Form::Text => value.as_str().ok_or_else(|| bad("a string"))?.to_owned(),
            Form::Count | Form::Number => {
                let number = value.as_f64().ok_or_else(|| bad("a number"))?;
                if matches!(form, Form::Count) && number == 0.0 {
                    continue;
                }
                value.to_string()
            }
            Form::Bool => value.as_bool().ok_or_else(|| bad("true or false"))?.to_string(),
            Form::Duration => {
                let text = value.as_str().ok_or_else(|| bad("a duration"))?;
                let millis = go_duration_millis(text).ok_or_else(|| bad("a duration such as 1m30s"))?;
                if millis == 0 {
                    continue;
                }
                format!("{millis}ms")
            }
            Form::List => {
                let items = value.as_array().ok_or_else(|| bad("a list"))?;
                let strings: Option<Vec<&str>> = items.iter().map(Value::as_str).collect();
                strings.ok_or_else(|| bad("a list of strings"))?.join(",")
            }
            Form::Pairs | Form::Thresholds => {
                let map = value.as_object().ok_or_else(|| bad("a map"))?;
                let separator = if matches!(form, Form::Pairs) { "=" } else { "<" };
                let pairs: Option<Vec<String>> =
                    map.iter().map(|(k, v)| v.as_str().map(|v| format!("{k}{separator}{v}"))).collect();
                pairs.ok_or_else(|| bad("a map of strings"))?.join(",")
            }
            Form::Gates => {
                let map = value.as_object().ok_or_else(|| bad("a map"))?;
                let pairs: Option<Vec<String>> =
                    map.iter().map(|(k, v)| v.as_bool().map(|v| format!("{k}={v}"))).collect();
                pairs.ok_or_else(|| bad("a map of booleans"))?.join(",")
            }
            Form::Taints => {
                let items = value.as_array().ok_or_else(|| bad("a list of taints"))?;
                let mut taints = Vec::new();
                for taint in items {
                    let key = taint["key"].as_str().ok_or_else(|| bad("a list of taints with keys"))?;
                    let effect = taint["effect"].as_str().unwrap_or_default();
                    taints.push(match taint["value"].as_str().filter(|v| !v.is_empty()) {
                        Some(v) => format!("{key}={v}:{effect}"),
                        None => format!("{key}:{effect}"),
                    });
                }
                taints.join(",")
            }
        };
        // An empty threshold map is a setting of its own: upstream's
        // defaulting fills only a missing one, so `evictionHard: {}` means no
        // hard thresholds (the flag given empty), not the defaults.
        if text.is_empty() && !matches!(form, Form::Thresholds) {
            continue;
        }
        settings.flags.push((flag.replace('-', "_"), format!("--{flag}={text}")));
    }
    let known: BTreeSet<&str> = ["apiVersion", "kind"].into_iter().chain(FIELDS.iter().map(|f| f.0)).collect();
    unimplemented_fields(&document, "", &known, &mut settings.ignored);
    Ok(settings)
}

/// The paths under `value` (at `prefix`) that no known field covers: a
/// leaf by its path, an object none of whose fields is known by its own.
fn unimplemented_fields(value: &Value, prefix: &str, known: &BTreeSet<&str>, out: &mut Vec<String>) {
    let Value::Object(map) = value else { return };
    for (key, child) in map {
        let path = if prefix.is_empty() { key.clone() } else { format!("{prefix}.{key}") };
        if known.contains(path.as_str()) {
            continue;
        }
        let below = format!("{path}.");
        if known.iter().any(|k| k.starts_with(&below)) {
            unimplemented_fields(child, &path, known, out);
        } else {
            out.push(path);
        }
    }
}

/// A Go duration (`1h2m3.5s`, `250ms`, `0s`) in milliseconds.
pub(crate) fn go_duration_millis(text: &str) -> Option<u128> {
    let text = text.trim();
    if text == "0" {
        return Some(0);
    }
    let mut rest = text;
    let mut total = 0.0_f64;
    if rest.is_empty() {
        return None;
    }
    while !rest.is_empty() {
        let number_end = rest.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(rest.len());
        let number: f64 = rest[..number_end].parse().ok()?;
        rest = &rest[number_end..];
        let unit_end = rest.find(|c: char| c.is_ascii_digit() || c == '.').unwrap_or(rest.len());
        let millis_per = match &rest[..unit_end] {
            "ns" => 1e-6,
            "us" | "µs" => 1e-3,
            "ms" => 1.0,
            "s" => 1e3,
            "m" => 60e3,
            "h" => 3600e3,
            _ => return None,
        };
        total += number * millis_per;
        rest = &rest[unit_end..];
    }
    Some(total.round() as u128)
}

/// The command line with the file's settings in front of it, leaving out
/// those the command line (or the environment) gives itself: `args` as
/// given, `explicit(id)` whether flag `id` was.
pub(crate) fn merged_args(
    args: &[std::ffi::OsString],
    settings: &FileSettings,
    explicit: impl Fn(&str) -> bool,
) -> (Vec<std::ffi::OsString>, Vec<String>, Vec<String>) {
    let mut merged: Vec<std::ffi::OsString> = args.iter().take(1).cloned().collect();
    let (mut applied, mut overridden) = (Vec::new(), Vec::new());
    for (id, flag) in &settings.flags {
        if explicit(id) {
            overridden.push(flag.clone());
        } else {
            applied.push(flag.clone());
            merged.push(flag.into());
        }
    }
    merged.extend(args.iter().skip(1).cloned());
    (merged, applied, overridden)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_durations_read_as_go_writes_them() {
        assert_eq!(go_duration_millis("2m0s"), Some(120_000));
        assert_eq!(go_duration_millis("1h2m3.5s"), Some(3_723_500));
        assert_eq!(go_duration_millis("250ms"), Some(250));
        assert_eq!(go_duration_millis("0s"), Some(0));
        assert_eq!(go_duration_millis("5 minutes"), None);
        assert_eq!(go_duration_millis(""), None);
    }

    #[test]
    fn fields_become_flags_and_unknown_ones_are_listed() {
        let text = "apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\nmaxPods: 7\nport: 0\n\
                    clusterDNS: [10.96.0.10, 10.96.0.11]\nsystemReserved: {memory: 1Gi, cpu: 500m}\n\
                    evictionHard: {memory.available: 200Mi}\nauthentication: {webhook: {enabled: true, cacheTTL: 0s}}\n\
                    registerWithTaints: [{key: dedicated, value: gpu, effect: NoSchedule}]\n\
                    featureGates: {NodeLogQuery: true, Other: false}\nenableSystemLogQuery: true\n\
                    logging: {verbosity: 0}\nshutdownGracePeriod: 30s\n";
        let settings = parse(text).expect("parsed");
        let flags: Vec<&str> = settings.flags.iter().map(|(_, f)| f.as_str()).collect();
        assert_eq!(
            flags,
            [
                "--authentication-token-webhook=true",
                "--cluster-dns=10.96.0.10,10.96.0.11",
                "--max-pods=7",
                "--register-with-taints=dedicated=gpu:NoSchedule",
                "--system-reserved=cpu=500m,memory=1Gi",
                "--eviction-hard=memory.available<200Mi",
                "--enable-system-log-query=true",
                "--feature-gates=NodeLogQuery=true,Other=false",
            ]
        );
        assert_eq!(settings.flags[2].0, "max_pods");
        assert_eq!(settings.ignored, ["logging", "shutdownGracePeriod"]);
        // The same as JSON.
        let json = r#"{"apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration", "maxPods": 9}"#;
        assert_eq!(parse(json).expect("json").flags, [("max_pods".to_owned(), "--max-pods=9".to_owned())]);
    }

    #[test]
    fn an_empty_threshold_map_means_none_and_a_missing_one_the_defaults() {
        let text = "apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\nevictionHard: {}\n\
                    imageGCHighThresholdPercent: 100\n";
        let flags: Vec<String> = parse(text).expect("parsed").flags.into_iter().map(|(_, f)| f).collect();
        assert_eq!(flags, ["--image-gc-high-threshold=100", "--eviction-hard="]);
        let text = "apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\nmaxPods: 5\n";
        assert_eq!(parse(text).expect("parsed").flags, [("max_pods".to_owned(), "--max-pods=5".to_owned())]);
    }

    #[test]
    fn other_kinds_and_bad_values_are_refused_by_name() {
        let other = parse("apiVersion: v1\nkind: Pod\n").expect_err("a pod");
        assert!(other.contains("expected kubelet.config.k8s.io/v1beta1 KubeletConfiguration"), "{other}");
        let bad = parse("apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\nmaxPods: many\n")
            .expect_err("bad");
        assert!(bad.starts_with("maxPods: "), "{bad}");
        assert!(parse("{ not json").expect_err("broken").starts_with("not JSON"));
    }

    /// Every field's flag is one of the command line's.
    #[test]
    fn every_field_names_a_flag() {
        use clap::CommandFactory as _;
        let command = crate::cli::Cli::command();
        for (field, flag, _) in FIELDS {
            let found = command.get_arguments().find(|a| a.get_long() == Some(*flag));
            let found = found.unwrap_or_else(|| panic!("{field}: no --{flag}"));
            assert_eq!(found.get_id().as_str(), flag.replace('-', "_"), "{field}");
        }
    }

    #[test]
    fn the_command_line_wins() {
        let settings = FileSettings {
            flags: vec![("max_pods".into(), "--max-pods=7".into()), ("port".into(), "--port=11250".into())],
            ignored: Vec::new(),
        };
        let args: Vec<std::ffi::OsString> = ["rustlet", "--port", "0"].iter().map(Into::into).collect();
        let (merged, applied, overridden) = merged_args(&args, &settings, |id| id == "port");
        assert_eq!(merged, ["rustlet", "--max-pods=7", "--port", "0"].map(std::ffi::OsString::from));
        assert_eq!((applied, overridden), (vec!["--max-pods=7".to_owned()], vec!["--port=11250".to_owned()]));
    }
}
