//! Registry credentials for `PullImage`, from a pod's `imagePullSecrets`
//! (docker configs: `{"auths": {"<registry>": {"auth": base64(user:pass)}}}`,
//! or `username`/`password`, `identitytoken`, `registrytoken`): the first
//! secret, in the pod's order, with an entry for the image's registry.

use kubelet_api::cri::v1 as cri;

/// The registry host of `image` (`docker.io` when it names none, as
/// upstream reads references).
pub(crate) fn registry_of(image: &str) -> String {
    match image.split_once('/') {
        Some((first, _)) if first.contains('.') || first.contains(':') || first == "localhost" => {
            if first == "index.docker.io" || first == "registry-1.docker.io" {
                "docker.io".into()
            } else {
                first.into()
            }
        }
        _ => "docker.io".into(),
    }
}

/// A docker config key (`https://index.docker.io/v1/`, `host:port`,
/// `http://host/path`) as a registry host.
fn key_host(key: &str) -> String {
    let key = key.trim_start_matches("https://").trim_start_matches("http://");
    let host = key.split('/').next().unwrap_or(key);
    if host == "index.docker.io" || host == "registry-1.docker.io" { "docker.io".into() } else { host.into() }
}

/// The credentials for `image` among `configs` (each a docker config).
pub(crate) fn auth_for(image: &str, configs: &[Vec<u8>]) -> Option<cri::AuthConfig> {
    let registry = registry_of(image);
    for config in configs {
        let Ok(config) = serde_json::from_slice::<serde_json::Value>(config) else { continue };
        let Some(auths) = config.get("auths").and_then(serde_json::Value::as_object) else { continue };
        for (key, entry) in auths {
            if key_host(key) != registry {
                continue;
            }
            let field = |name: &str| entry.get(name).and_then(serde_json::Value::as_str).unwrap_or_default().to_owned();
            return Some(cri::AuthConfig {
                username: field("username"),
                password: field("password"),
                auth: field("auth"),
                // Matched already; containerd would parse an address as
                // a URL and drop a bare `host:port`.
                server_address: String::new(),
                identity_token: field("identitytoken"),
                registry_token: field("registrytoken"),
            });
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registries_are_read_from_references_and_config_keys() {
        assert_eq!(registry_of("busybox"), "docker.io");
        assert_eq!(registry_of("library/busybox:1"), "docker.io");
        assert_eq!(registry_of("127.0.0.1:5000/test/busybox:v1"), "127.0.0.1:5000");
        assert_eq!(registry_of("ghcr.io/o/i@sha256:00"), "ghcr.io");
        assert_eq!(key_host("https://index.docker.io/v1/"), "docker.io");
        assert_eq!(key_host("http://127.0.0.1:5000"), "127.0.0.1:5000");
    }

    #[test]
    fn the_first_matching_secret_gives_the_credentials() {
        let other = br#"{"auths": {"ghcr.io": {"auth": "Z2g6eA=="}}}"#.to_vec();
        let ours = br#"{"auths": {"127.0.0.1:5000": {"username": "u", "password": "p"}}}"#.to_vec();
        let auth = auth_for("127.0.0.1:5000/a/b:v1", &[other, ours]).expect("found");
        assert_eq!((auth.username.as_str(), auth.password.as_str()), ("u", "p"));
        assert!(auth_for("quay.io/a/b", &[]).is_none());
    }
}
