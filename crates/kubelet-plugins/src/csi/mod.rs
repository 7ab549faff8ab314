//! CSI drivers on this node: the `CSIPlugin` registration handler and the
//! driver registry the volume stages resolve drivers from.
//!
//! A CSI driver registers through the plugin registration service (usually
//! via the node-driver-registrar sidecar). [`CsiPluginHandler`] checks its
//! versions, records it in the [`CsiDriverRegistry`], asks the driver
//! `NodeGetInfo`, and publishes the node's CSI facts through a
//! [`NodeInfoPublisher`] (in memory when standalone; Node and CSINode objects
//! in cluster mode).
//!
//! Consumers (the volume stages) read the registry through [`CsiDrivers`]
//! and call a driver through a [`CsiNodeClient`].

mod client;
mod error;
mod handler;
mod node_client;
mod node_info;
mod registry;
mod version;

pub use client::{CsiNodeInfo, node_get_info};
pub use error::{CsiClientError, CsiError, CsiVersionError, PublishError};
pub use handler::{CsiHandlerConfig, CsiPluginHandler};
pub use node_client::{
    AccessMode, AccessType, CsiNodeClient, CsiNodeError, CsiNodeTimeouts, ExpandVolume, NodeCapabilities,
    NodeCapability, PublishVolume, Secrets, StageVolume, VolumeCapability, VolumeUsage,
};
pub use node_info::{CsiNodeDriver, InMemoryNodeInfo, NodeCsiInfo, NodeInfoPublisher};
pub use registry::{CsiDriver, CsiDriverRegistry, CsiDrivers};
pub use version::CsiVersion;
