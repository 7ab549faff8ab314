//! Extended resource names, as the API server's quota rules define them.
//!
//! A device plugin's resource name must be an extended resource: it contains
//! `/`, is not in the `kubernetes.io/` namespace, does not start with
//! `requests.`, and `requests.<name>` is a qualified name: a DNS-1123
//! subdomain prefix (lowercase, ≤ 253 characters) and a name part of at most
//! 63 characters of `[A-Za-z0-9][-A-Za-z0-9_.]*[A-Za-z0-9]`.

/// Whether `name` is an extended resource name.
pub fn is_extended_resource_name(name: &str) -> bool {
    if !name.contains('/') || name.contains("kubernetes.io/") || name.starts_with("requests.") {
        return false;
    }
    let quota = format!("requests.{name}");
    let Some((prefix, rest)) = quota.split_once('/') else { return false };
    is_dns1123_subdomain(prefix) && is_qualified_name_part(rest)
}

fn is_dns1123_subdomain(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|label| {
            let bytes = label.as_bytes();
            !bytes.is_empty()
                && bytes.iter().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
                && bytes[0] != b'-'
                && bytes[bytes.len() - 1] != b'-'
        })
}

fn is_qualified_name_part(s: &str) -> bool {
    let bytes = s.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= 63
        && bytes[0].is_ascii_alphanumeric()
        && bytes[bytes.len() - 1].is_ascii_alphanumeric()
        && bytes.iter().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extended_resource_names() {
        for good in
            ["vendor.com/gpu", "squat.ai/null", "example.com/a_b.c-d", "x/y", "nvidia.com/gpu-3g.20gb", "a.b/C9"]
        {
            assert!(is_extended_resource_name(good), "{good} should be valid");
        }
        let long_name = format!("vendor.com/{}", "a".repeat(64));
        let long_prefix = format!("{}.com/gpu", "a".repeat(250));
        for bad in [
            "gpu",                       // no prefix
            "cpu",                       // native
            "kubernetes.io/gpu",         // reserved namespace
            "example.kubernetes.io/gpu", // reserved namespace
            "requests.vendor.com/gpu",   // quota prefix
            "Vendor.com/gpu",            // uppercase prefix
            "vendor.com/",               // empty name
            "/gpu",                      // empty prefix
            "vendor.com/gpu/extra",      // two slashes
            "vendor.com/-gpu",           // bad first character
            "vendor.com/gpu-",           // bad last character
            "vendor..com/gpu",           // empty label
            "vendor.com/g pu",           // space
            long_name.as_str(),          // name part > 63
            long_prefix.as_str(),        // prefix > 253 with "requests."
        ] {
            assert!(!is_extended_resource_name(bad), "{bad} should be invalid");
        }
    }
}
