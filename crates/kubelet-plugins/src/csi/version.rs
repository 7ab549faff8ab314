//! CSI version strings: which of a driver's versions the node will speak.
//!
//! Each entry is parsed as `[v]major.minor[.patch]` (a `-pre` or `+build`
//! suffix is ignored). Entries that do not parse, or whose major is above 1,
//! are skipped; the highest remaining entry must have major 1.

use std::fmt;
use std::str::FromStr;

use super::error::CsiVersionError;

/// A parsed CSI version.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
pub struct CsiVersion {
    /// Major version.
    pub major: u64,
    /// Minor version.
    pub minor: u64,
    /// Patch version (0 when absent).
    pub patch: u64,
}

impl fmt::Display for CsiVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

impl FromStr for CsiVersion {
    type Err = ();

    fn from_str(s: &str) -> Result<Self, ()> {
        let s = s.trim();
        let s = s.strip_prefix('v').unwrap_or(s);
        let core = s.split(['-', '+']).next().unwrap_or_default();
        let parts: Vec<u64> = core.split('.').map(|p| p.parse().map_err(|_| ())).collect::<Result<_, _>>()?;
        match parts.as_slice() {
            [major, minor] => Ok(CsiVersion { major: *major, minor: *minor, patch: 0 }),
            [major, minor, patch] => Ok(CsiVersion { major: *major, minor: *minor, patch: *patch }),
            _ => Err(()),
        }
    }
}

/// The version the node will speak with a driver offering `versions`.
pub(crate) fn highest_supported_version(versions: &[String]) -> Result<CsiVersion, CsiVersionError> {
    if versions.is_empty() {
        return Err(CsiVersionError::Empty);
    }
    let highest = versions
        .iter()
        .filter_map(|v| v.parse::<CsiVersion>().ok())
        .filter(|v| v.major <= 1)
        .max()
        .ok_or_else(|| CsiVersionError::NoneSupported(versions.to_vec()))?;
    if highest.major != 1 {
        return Err(CsiVersionError::NotV1(highest));
    }
    Ok(highest)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn accepted_version_lists() {
        for (input, want) in [
            (v(&["1.0.0"]), "1.0.0"),
            (v(&["v1.0.0"]), "1.0.0"),
            (v(&["0.2.0", "v1.2.3"]), "1.2.3"),
            (v(&["1.2"]), "1.2.0"),
            (v(&["2.0.0", "1.9.0"]), "1.9.0"),
            (v(&["bogus", "1.1.0"]), "1.1.0"),
        ] {
            let got = highest_supported_version(&input).unwrap_or_else(|e| panic!("{input:?}: {e}"));
            assert_eq!(got.to_string(), want, "{input:?}");
        }
    }

    #[test]
    fn rejected_version_lists_say_why() {
        for (input, message) in [
            (v(&["0.3.0"]), "highest supported version reported by driver is 0.3.0, must be v1.x"),
            (v(&[]), "CSI driver reported an empty list of supported versions"),
            (
                v(&["4.9.12", "2.0.1"]),
                "none of the versions [\"4.9.12\", \"2.0.1\"] reported by the driver is supported",
            ),
            (v(&["var", "boo"]), "none of the versions [\"var\", \"boo\"] reported by the driver is supported"),
        ] {
            let err = highest_supported_version(&input).expect_err("must be rejected");
            assert_eq!(err.to_string(), message, "{input:?}");
        }
    }

    /// Fuzz target: a plugin's GetInfo answer (protobuf bytes): decoded or
    /// refused, its type and versions read as registration reads them;
    /// never a panic.
    #[test]
    fn fuzz_get_info_answers() {
        use prost::Message as _;
        let seed = kubelet_api::pluginregistration::PluginInfo {
            r#type: "CSIPlugin".into(),
            name: "hostpath.csi.k8s.io".into(),
            endpoint: "/var/lib/kubelet/plugins/hostpath/csi.sock".into(),
            supported_versions: vec!["1.0.0".into(), "v1.2.3".into(), "0.3".into()],
        }
        .encode_to_vec();
        let ran = crate::fuzz::Fuzz::new("get-info").seed(seed).run(|input| {
            let Ok(info) = kubelet_api::pluginregistration::PluginInfo::decode(input) else { return };
            let _ = crate::plugin_manager::PluginType::from(info.r#type.as_str());
            let _ = highest_supported_version(&info.supported_versions);
        });
        assert!(ran > 1);
    }
}
