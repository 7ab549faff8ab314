//! The CSI drivers registered on this node, by name.
//!
//! Volume stages look a driver up by `PV.spec.csi.driver` (or an inline
//! volume's `csi.driver`) and dial its endpoint. One driver per name is
//! active: a second registration of a name must offer a strictly higher
//! version, and the check and the insert happen under one lock so two sockets
//! racing for a name cannot both win. The driver it replaces is kept as a
//! fallback: if the newer one goes away (or its registration is undone), the
//! older one, still registered with the plugin manager, becomes active again
//! — upstream would forget both.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use tokio::sync::watch;

use super::error::CsiError;
use super::node_info::CsiNodeDriver;
use super::version::CsiVersion;

/// A registered CSI driver.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
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

/// One registration of a name, with the node facts its driver reported.
#[derive(Clone, Debug)]
struct Candidate {
    driver: CsiDriver,
    node: Option<CsiNodeDriver>,
}

/// What removing a registration changed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Removal {
    /// The registration was a replaced (inactive) one: nothing visible changed.
    Inactive,
    /// The active driver went away and no other registration of the name is left.
    Gone,
    /// The active driver went away; this older registration is active again,
    /// with the node facts it reported (if its registration had completed).
    FellBack(Box<(CsiDriver, Option<CsiNodeDriver>)>),
}

/// Shared, cheap-to-clone registry of CSI drivers. Only the `CSIPlugin`
/// handler writes it; consumers read it through [`CsiDrivers`]
/// ([`CsiDriverRegistry::view`]).
#[derive(Clone, Debug)]
pub struct CsiDriverRegistry {
    /// Per name, registrations with the active one first (highest version).
    drivers: Arc<RwLock<BTreeMap<String, Vec<Candidate>>>>,
    /// Bumped whenever the active driver of a name changes.
    changes: Arc<watch::Sender<u64>>,
}

impl Default for CsiDriverRegistry {
    fn default() -> Self {
        CsiDriverRegistry { drivers: Arc::default(), changes: Arc::new(watch::channel(0).0) }
    }
}

/// A read-only view of the CSI drivers on this node, for the volume stages:
/// look a driver up by name, or wait (with a deadline) until one is
/// registered. Cheap to clone.
#[derive(Clone, Debug)]
pub struct CsiDrivers {
    registry: CsiDriverRegistry,
}

impl CsiDrivers {
    /// The active driver registered under `name`.
    pub fn get(&self, name: &str) -> Option<CsiDriver> {
        self.registry.get(name)
    }

    /// Every active driver, sorted by name.
    pub fn list(&self) -> Vec<CsiDriver> {
        self.registry.list()
    }

    /// A counter bumped whenever the active driver of any name changes (a
    /// registration, a removal, a fallback to an older registration).
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.registry.changes.subscribe()
    }

    /// The driver called `name` once it is registered, or `None` if it is
    /// not within `timeout` (the kubelet's volume stages wait the same way
    /// for a driver that has not registered yet).
    pub async fn wait_for(&self, name: &str, timeout: std::time::Duration) -> Option<CsiDriver> {
        let mut changes = self.changes();
        let wait = async {
            loop {
                if let Some(driver) = self.get(name) {
                    return Some(driver);
                }
                // The registry lives as long as this view: the sender never
                // goes away while we wait.
                if changes.changed().await.is_err() {
                    return None;
                }
            }
        };
        tokio::time::timeout(timeout, wait).await.ok().flatten()
    }
}

impl CsiDriverRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// The read-only view consumers use.
    pub fn view(&self) -> CsiDrivers {
        CsiDrivers { registry: self.clone() }
    }

    fn changed(&self) {
        self.changes.send_modify(|n| *n += 1);
    }

    /// The active driver registered under `name`.
    pub fn get(&self, name: &str) -> Option<CsiDriver> {
        self.read().get(name).and_then(|c| c.first()).map(|c| c.driver.clone())
    }

    /// Every active driver, sorted by name.
    pub fn list(&self) -> Vec<CsiDriver> {
        self.read().values().filter_map(|c| c.first()).map(|c| c.driver.clone()).collect()
    }

    /// Fails when a driver named `name` is active with `offered` or higher.
    pub(crate) fn check_newer(&self, name: &str, offered: CsiVersion) -> Result<(), CsiError> {
        match self.read().get(name).and_then(|c| c.first()) {
            Some(active) => Self::newer_than(&active.driver, name, offered),
            None => Ok(()),
        }
    }

    fn newer_than(active: &CsiDriver, name: &str, offered: CsiVersion) -> Result<(), CsiError> {
        if active.version >= offered {
            return Err(CsiError::AlreadyRegistered {
                name: name.to_owned(),
                existing: active.version,
                existing_socket: active.socket_path.clone(),
                offered,
            });
        }
        Ok(())
    }

    /// Makes `driver` the active driver of its name, unless the active one
    /// has an equal or higher version. A replaced driver is kept as fallback.
    pub(crate) fn insert(&self, driver: CsiDriver) -> Result<(), CsiError> {
        let mut drivers = self.write();
        let candidates = drivers.entry(driver.name.clone()).or_default();
        if let Some(active) = candidates.first() {
            Self::newer_than(&active.driver, &driver.name, driver.version)?;
        }
        candidates.insert(0, Candidate { driver, node: None });
        drop(drivers);
        self.changed();
        Ok(())
    }

    /// Records the node facts the driver registered through `socket_path`
    /// reported, so they can be published again if it becomes active again.
    pub(crate) fn set_node_info(&self, name: &str, socket_path: &Path, node: CsiNodeDriver) {
        if let Some(candidate) =
            self.write().get_mut(name).and_then(|c| c.iter_mut().find(|c| c.driver.socket_path == socket_path))
        {
            candidate.node = Some(node);
        }
    }

    /// Removes the registration of `name` made through `socket_path`. Returns
    /// `None` if there is none (another socket's registration of the same
    /// name is left alone).
    pub(crate) fn remove(&self, name: &str, socket_path: &Path) -> Option<Removal> {
        let mut drivers = self.write();
        let candidates = drivers.get_mut(name)?;
        let index = candidates.iter().position(|c| c.driver.socket_path == socket_path)?;
        candidates.remove(index);
        let removal = match (index, candidates.first()) {
            (0, Some(next)) => Removal::FellBack(Box::new((next.driver.clone(), next.node.clone()))),
            (0, None) => Removal::Gone,
            _ => Removal::Inactive,
        };
        if candidates.is_empty() {
            drivers.remove(name);
        }
        drop(drivers);
        if removal != Removal::Inactive {
            self.changed();
        }
        Some(removal)
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<String, Vec<Candidate>>> {
        // A panic while holding the lock cannot leave the map half-written
        // (every write is one insert or remove), so a poisoned lock is usable.
        self.drivers.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, BTreeMap<String, Vec<Candidate>>> {
        self.drivers.write().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn driver(version: &str, socket: &str) -> CsiDriver {
        CsiDriver {
            name: "d.csi.example.com".into(),
            endpoint: format!("{socket}.csi"),
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
        assert_eq!(registry.list().len(), 1, "one active driver per name");
    }

    #[test]
    fn removal_only_by_the_socket_that_registered() {
        let registry = CsiDriverRegistry::new();
        registry.insert(driver("1.0.0", "/a.sock")).expect("insert");
        assert_eq!(registry.remove("d.csi.example.com", Path::new("/b.sock")), None);
        assert!(registry.get("d.csi.example.com").is_some());
        assert_eq!(registry.remove("d.csi.example.com", Path::new("/a.sock")), Some(Removal::Gone));
        assert!(registry.list().is_empty());
    }

    #[test]
    fn a_replaced_driver_becomes_active_again_when_the_newer_one_goes() {
        let registry = CsiDriverRegistry::new();
        registry.insert(driver("1.0.0", "/a.sock")).expect("a");
        let node = CsiNodeDriver {
            name: "d.csi.example.com".into(),
            node_id: "node-a".into(),
            topology_keys: vec![],
            allocatable_count: None,
            topology: Default::default(),
        };
        registry.set_node_info("d.csi.example.com", Path::new("/a.sock"), node.clone());
        registry.insert(driver("1.5.0", "/b.sock")).expect("b replaces a");
        assert_eq!(
            registry.remove("d.csi.example.com", Path::new("/b.sock")),
            Some(Removal::FellBack(Box::new((driver("1.0.0", "/a.sock"), Some(node)))))
        );
        assert_eq!(registry.get("d.csi.example.com"), Some(driver("1.0.0", "/a.sock")));
        // Removing a replaced registration changes nothing visible.
        registry.insert(driver("1.5.0", "/b.sock")).expect("b again");
        assert_eq!(registry.remove("d.csi.example.com", Path::new("/a.sock")), Some(Removal::Inactive));
        assert_eq!(registry.get("d.csi.example.com"), Some(driver("1.5.0", "/b.sock")));
    }
}
