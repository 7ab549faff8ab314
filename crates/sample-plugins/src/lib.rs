//! Sample kubelet plugins, in the spirit of upstream's sample device plugin:
//! real gRPC servers on real Unix sockets that register with a node the way
//! unmodified upstream plugins do. `rustlet demo` runs them; the tests and
//! benchmarks reuse them (with misbehaviours on demand).
//!
//! - [`registration`]: a plugin-registration server with any type, name,
//!   endpoint and versions, and misbehaviours on demand (hang, fail, stop).
//! - [`csi_driver`]: a CSI driver serving Identity and Node with a
//!   configurable `NodeGetInfo`, plus its registration socket.
//! - [`device_plugin`]: a device plugin with a configurable device list,
//!   health flips on command, and registration through `kubelet.sock` or
//!   `plugins_registry`.
//! - [`dra_driver`]: a DRA driver (`DRAPlugin` v1 and v1beta1) with
//!   per-instance sockets for seamless upgrade, claims prepared from its
//!   own device list and CDI spec files for its devices.
//! - [`report`]: what a plugin saw the node do, as events (JSON lines for
//!   plugin processes), so a caller can wait for "the plugin was told it is
//!   registered" as an event with a deadline.
//!
//! Library code never ends the process: a misbehaviour that a plugin
//! process acts out by exiting is signalled to the caller, who decides.

#![deny(missing_docs)]

pub mod csi_driver;
pub mod device_plugin;
pub mod dra_driver;
pub mod registration;
pub mod report;
