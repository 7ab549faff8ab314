//! The CSI drivers registered on this node, by name.
//!
//! Volume stages look a driver up by `PV.spec.csi.driver` (or an inline
//! volume's `csi.driver`) and dial its endpoint. One driver per name: a second
//! registration of a name must offer a strictly higher version, and the check
//! and the insert happen under one lock so two sockets racing for a name
//! cannot both win.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};

use super::error::CsiError;
use super::version::CsiVersion;

/// A registered CSI driver.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct CsiDriver {
    /// Driver name, e.g. `hostpath.csi.k8s.io`.
    pub name: String,
    /// The driver's CSI endpoint (socket path, possibly `unix://`-prefixed).
    pub endpoint: String,
    /// The highest version both sides speak.
    pub version: CsiVersion,
    /// The registration socket the driver came through.
    pub socket_path: PathBuf,
}

/// Shared, cheap-to-clone registry of CSI drivers.
#[derive(Clone, Debug, Default)]
pub struct CsiDriverRegistry {
    drivers: Arc<RwLock<BTreeMap<String, CsiDriver>>>,
}

impl CsiDriverRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// The driver registered under `name`.
    pub fn get(&self, name: &str) -> Option<CsiDriver> {
        self.read().get(name).cloned()
    }

    /// Every registered driver, sorted by name.
    pub fn list(&self) -> Vec<CsiDriver> {
        self.read().values().cloned().collect()
    }

    /// Fails when a driver named `name` is registered with `offered` or higher.
    pub fn check_newer(&self, name: &str, offered: CsiVersion) -> Result<(), CsiError> {
        match self.read().get(name) {
            Some(existing) if existing.version >= offered => Err(CsiError::AlreadyRegistered {
                name: name.to_owned(),
                existing: existing.version,
                existing_socket: existing.socket_path.clone(),
                offered,
            }),
            _ => Ok(()),
        }
    }

    /// Inserts `driver` unless a driver of that name with an equal or higher
    /// version is registered; a lower one is replaced.
    pub fn insert(&self, driver: CsiDriver) -> Result<(), CsiError> {
        let mut drivers = self.write();
        if let Some(existing) = drivers.get(&driver.name)
            && existing.version >= driver.version
        {
            return Err(CsiError::AlreadyRegistered {
                name: driver.name,
                existing: existing.version,
                existing_socket: existing.socket_path.clone(),
                offered: driver.version,
            });
        }
        drivers.insert(driver.name.clone(), driver);
        Ok(())
    }

    /// Removes the driver `name` if it came through `socket_path`; returns
    /// whether anything was removed. Another socket's driver of the same name
    /// is left alone.
    pub fn remove(&self, name: &str, socket_path: &std::path::Path) -> bool {
        let mut drivers = self.write();
        if drivers.get(name).is_some_and(|d| d.socket_path == socket_path) {
            drivers.remove(name);
            true
        } else {
            false
        }
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<String, CsiDriver>> {
        // A panic while holding the lock cannot leave the map half-written
        // (every write is one insert or remove), so a poisoned lock is usable.
        self.drivers.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, BTreeMap<String, CsiDriver>> {
        self.drivers.write().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn driver(version: &str, socket: &str) -> CsiDriver {
        CsiDriver {
            name: "d.csi.example.com".into(),
            endpoint: "/e.sock".into(),
            version: version.parse().expect("version"),
            socket_path: socket.into(),
        }
    }

    #[test]
    fn same_name_needs_a_strictly_higher_version() {
        let registry = CsiDriverRegistry::new();
        registry.insert(driver("1.0.0", "/a.sock")).expect("first");
        let err = registry.insert(driver("1.0.0", "/b.sock")).expect_err("equal version");
        assert!(err.to_string().contains("already registered with version 1.0.0 from socket /a.sock"), "{err}");
        registry.insert(driver("1.2.0", "/b.sock")).expect("higher version replaces");
        assert_eq!(registry.get("d.csi.example.com").expect("present").socket_path, Path::new("/b.sock"));
    }

    #[test]
    fn removal_only_by_the_socket_that_registered() {
        let registry = CsiDriverRegistry::new();
        registry.insert(driver("1.0.0", "/a.sock")).expect("insert");
        assert!(!registry.remove("d.csi.example.com", Path::new("/b.sock")));
        assert!(registry.get("d.csi.example.com").is_some());
        assert!(registry.remove("d.csi.example.com", Path::new("/a.sock")));
        assert!(registry.list().is_empty());
    }
}
