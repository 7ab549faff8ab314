//! Test plugins for Rustlet, written once and used by the tests, the
//! benchmarks and the demo: real gRPC servers on real Unix sockets.
//!
//! - [`registration`]: a plugin-registration server with any type, name,
//!   endpoint and versions, and misbehaviours on demand (hang, fail, exit).
//! - [`csi_driver`]: a CSI driver serving Identity and Node with a
//!   configurable `NodeGetInfo`.
//! - [`device_plugin`]: a device plugin with a configurable device list,
//!   health flips on command, and registration through `kubelet.sock` or
//!   `plugins_registry`.
//! - [`report`]: the JSON lines the plugin binaries print, so a test can wait
//!   for "the plugin was told it is registered" as an event with a deadline.
//! - [`raw_h2`]: a bare HTTP/2 gRPC client that sends any `:authority`, to
//!   play an old grpc-go client.
//! - [`process`]: spawning the plugin binaries and reading those events.

pub mod csi_driver;
pub mod device_plugin;
pub mod process;
pub mod raw_h2;
pub mod registration;
pub mod report;
