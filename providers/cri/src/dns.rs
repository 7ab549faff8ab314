//! A pod's DNS settings (its sandbox's `resolv.conf`), as the kubelet
//! derives them from `dnsPolicy` and `dnsConfig`:
//!
//! | policy | nameservers, searches, options |
//! |---|---|
//! | `ClusterFirst` (the default) | the cluster's DNS (`--cluster-dns`); `<ns>.svc.<domain>`, `svc.<domain>`, `<domain>` (`--cluster-domain`), then the node's searches; `ndots:5` |
//! | `ClusterFirst` on the host network, or with no cluster DNS set | as `Default` |
//! | `ClusterFirstWithHostNet` | as `ClusterFirst`, also on the host network |
//! | `Default` | the node's `resolv.conf` (`--resolv-conf`; empty: none) |
//! | `None` | nothing but `dnsConfig` |
//!
//! `dnsConfig` is then added: its nameservers and searches after the
//! policy's (duplicates dropped), its options over the policy's of the
//! same name. Upstream's limits hold: at most 3 nameservers and 32
//! searches (the rest are dropped, with a warning in the log).

use std::path::PathBuf;

use k8s_openapi::api::core::v1::Pod;
use kubelet_api::cri::v1 as cri;

/// How many nameservers a resolver reads.
const MAX_NAMESERVERS: usize = 3;
/// How many search domains the kubelet passes.
const MAX_SEARCHES: usize = 32;

/// The node's DNS settings (the kubelet's flags).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DnsSettings {
    /// `--cluster-dns`: the cluster DNS service's IPs.
    pub cluster_dns: Vec<String>,
    /// `--cluster-domain` (`cluster.local` in most clusters; empty: no
    /// cluster searches).
    pub cluster_domain: String,
    /// `--resolv-conf`: the node's resolver configuration (`None`: none).
    pub resolv_conf: Option<PathBuf>,
}

impl Default for DnsSettings {
    /// Upstream's defaults: no cluster DNS, no domain, `/etc/resolv.conf`.
    fn default() -> Self {
        DnsSettings {
            cluster_dns: Vec::new(),
            cluster_domain: String::new(),
            resolv_conf: Some("/etc/resolv.conf".into()),
        }
    }
}

/// A parsed `resolv.conf`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Resolver {
    servers: Vec<String>,
    searches: Vec<String>,
    options: Vec<String>,
}

fn parse_resolv_conf(text: &str) -> Resolver {
    let mut resolver = Resolver::default();
    for line in text.lines() {
        let line = line.split(['#', ';']).next().unwrap_or_default();
        let mut fields = line.split_whitespace();
        match fields.next() {
            Some("nameserver") => resolver.servers.extend(fields.next().map(str::to_owned)),
            // The last search (or domain) line wins.
            Some("search" | "domain") => resolver.searches = fields.map(str::to_owned).collect(),
            Some("options") => resolver.options.extend(fields.map(str::to_owned)),
            _ => {}
        }
    }
    resolver
}

fn push_unique(into: &mut Vec<String>, items: impl IntoIterator<Item = String>) {
    for item in items {
        if !into.contains(&item) {
            into.push(item);
        }
    }
}

/// The option's name (`ndots` of `ndots:5`).
fn option_name(option: &str) -> &str {
    option.split(':').next().unwrap_or(option)
}

/// The DNS config of `pod`'s sandbox.
pub(crate) fn dns_config(pod: &Pod, settings: &DnsSettings) -> cri::DnsConfig {
    let spec = pod.spec.clone().unwrap_or_default();
    let host_network = spec.host_network.unwrap_or(false);
    let host = || match &settings.resolv_conf {
        Some(path) => match std::fs::read_to_string(path) {
            Ok(text) => parse_resolv_conf(&text),
            Err(error) => {
                tracing::warn!(path = %path.display(), %error, "cannot read the node's resolv.conf; the pod gets none of it");
                Resolver::default()
            }
        },
        None => Resolver::default(),
    };
    let cluster = match spec.dns_policy.as_deref().unwrap_or("ClusterFirst") {
        "None" => None,
        "Default" => Some(false),
        "ClusterFirstWithHostNet" => Some(true),
        _ => Some(!host_network),
    };
    let cluster = cluster.map(|cluster| {
        if cluster && settings.cluster_dns.is_empty() {
            tracing::warn!(pod = ?pod.metadata.name, "ClusterFirst policy but no cluster DNS set (--cluster-dns): the node's resolv.conf is used");
            return false;
        }
        cluster
    });
    let mut config = match cluster {
        None => Resolver::default(),
        Some(false) => host(),
        Some(true) => {
            let namespace = pod.metadata.namespace.clone().unwrap_or_else(|| "default".into());
            let domain = &settings.cluster_domain;
            let mut searches = Vec::new();
            if !domain.is_empty() {
                searches = vec![format!("{namespace}.svc.{domain}"), format!("svc.{domain}"), domain.clone()];
            }
            push_unique(&mut searches, host().searches);
            Resolver { servers: settings.cluster_dns.clone(), searches, options: vec!["ndots:5".into()] }
        }
    };
    if let Some(extra) = spec.dns_config {
        push_unique(&mut config.servers, extra.nameservers.unwrap_or_default());
        push_unique(&mut config.searches, extra.searches.unwrap_or_default());
        for option in extra.options.unwrap_or_default() {
            let value = match option.value {
                Some(value) => format!("{}:{value}", option.name.clone().unwrap_or_default()),
                None => option.name.clone().unwrap_or_default(),
            };
            let name = option.name.unwrap_or_default();
            config.options.retain(|o| option_name(o) != name);
            config.options.push(value);
        }
    }
    if config.servers.len() > MAX_NAMESERVERS {
        tracing::warn!(pod = ?pod.metadata.name, servers = ?config.servers, "more than 3 nameservers: the rest are dropped");
        config.servers.truncate(MAX_NAMESERVERS);
    }
    if config.searches.len() > MAX_SEARCHES {
        tracing::warn!(pod = ?pod.metadata.name, "more than 32 search domains: the rest are dropped");
        config.searches.truncate(MAX_SEARCHES);
    }
    cri::DnsConfig { servers: config.servers, searches: config.searches, options: config.options }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(spec: serde_json::Value) -> Pod {
        serde_json::from_value(serde_json::json!({"metadata": {"name": "p", "namespace": "team"}, "spec": spec}))
            .expect("pod")
    }

    fn settings(dir: &tempfile::TempDir) -> DnsSettings {
        let path = dir.path().join("resolv.conf");
        std::fs::write(&path, "# node\nnameserver 192.0.2.53\nsearch corp.example\noptions edns0 ndots:2\n")
            .expect("write");
        DnsSettings {
            cluster_dns: vec!["10.96.0.10".into()],
            cluster_domain: "cluster.local".into(),
            resolv_conf: Some(path),
        }
    }

    #[test]
    fn policies_follow_upstream() {
        let dir = tempfile::tempdir().expect("tempdir");
        let settings = settings(&dir);
        let cluster = dns_config(&pod(serde_json::json!({"containers": []})), &settings);
        assert_eq!(cluster.servers, ["10.96.0.10"]);
        assert_eq!(cluster.searches, ["team.svc.cluster.local", "svc.cluster.local", "cluster.local", "corp.example"]);
        assert_eq!(cluster.options, ["ndots:5"]);
        let host = dns_config(&pod(serde_json::json!({"containers": [], "hostNetwork": true})), &settings);
        assert_eq!(
            (host.servers, host.searches, host.options),
            (
                vec!["192.0.2.53".to_owned()],
                vec!["corp.example".to_owned()],
                vec!["edns0".to_owned(), "ndots:2".to_owned()]
            )
        );
        let with_host_net = dns_config(
            &pod(serde_json::json!({"containers": [], "hostNetwork": true, "dnsPolicy": "ClusterFirstWithHostNet"})),
            &settings,
        );
        assert_eq!(with_host_net.servers, ["10.96.0.10"]);
        let no_cluster_dns = DnsSettings { cluster_dns: Vec::new(), ..settings.clone() };
        let fallback = dns_config(&pod(serde_json::json!({"containers": []})), &no_cluster_dns);
        assert_eq!(fallback.servers, ["192.0.2.53"], "ClusterFirst without cluster DNS is Default");
    }

    #[test]
    fn dns_config_is_added_with_options_overriding() {
        let dir = tempfile::tempdir().expect("tempdir");
        let settings = settings(&dir);
        let none = dns_config(
            &pod(serde_json::json!({"containers": [], "dnsPolicy": "None", "dnsConfig": {
                "nameservers": ["1.1.1.1", "1.1.1.1"], "searches": ["a.example"],
                "options": [{"name": "ndots", "value": "1"}, {"name": "rotate"}]
            }})),
            &settings,
        );
        assert_eq!((none.servers, none.searches), (vec!["1.1.1.1".to_owned()], vec!["a.example".to_owned()]));
        assert_eq!(none.options, ["ndots:1", "rotate"]);
        let merged = dns_config(
            &pod(serde_json::json!({"containers": [], "dnsConfig": {
                "nameservers": ["1.1.1.1", "2.2.2.2", "3.3.3.3"], "options": [{"name": "ndots", "value": "2"}]
            }})),
            &settings,
        );
        assert_eq!(merged.servers, ["10.96.0.10", "1.1.1.1", "2.2.2.2"], "at most three");
        assert_eq!(merged.options, ["ndots:2"]);
    }
}
