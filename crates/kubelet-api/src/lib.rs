//! Wire contracts of the kubelet plugin system, as Rust types.
//!
//! This crate holds no logic. It has three parts:
//! - generated gRPC clients and servers (tonic + prost), grouped by API and
//!   version: [`pluginregistration`], [`deviceplugin::v1beta1`], [`csi::v1`],
//!   [`cri::v1`], [`health::v1`], [`dra::v1`], [`dra::v1beta1`],
//!   [`podresources::v1`];
//! - wire constants shared by both sides ([`constants`]), and the
//!   versions of `resource.k8s.io` with the conversion between them
//!   ([`resource`]);
//! - Unix-socket dial and serve helpers ([`uds`]), because every plugin API
//!   runs over a Unix socket rather than TCP.
//!
//! Generated types stay at the edge: the `kubelet` crate converts them into its
//! own types in one place per API.

#![deny(missing_docs)]

pub mod authority;
pub mod constants;
pub mod resource;
pub mod uds;

/// Plugin registration (`pluginregistration` package): the plugin serves
/// `Registration` on a socket in `plugins_registry/`, the node is the client.
#[allow(missing_docs, clippy::all)]
pub mod pluginregistration {
    tonic::include_proto!("pluginregistration");
}

/// Device plugins.
pub mod deviceplugin {
    /// Device plugin API `v1beta1`.
    #[allow(missing_docs, clippy::all)]
    pub mod v1beta1 {
        tonic::include_proto!("v1beta1");
    }
}

/// Container Storage Interface.
pub mod csi {
    /// CSI v1: the Identity and Node services, the parts a node calls.
    #[allow(missing_docs, clippy::all)]
    pub mod v1 {
        tonic::include_proto!("csi.v1");
    }
}

/// Container Runtime Interface.
pub mod cri {
    /// CRI v1 (`runtime.v1`): the RuntimeService and ImageService a
    /// container runtime (containerd) serves, the parts the node calls.
    #[allow(missing_docs, clippy::all)]
    pub mod v1 {
        tonic::include_proto!("runtime.v1");
    }
}

/// gRPC health checking (`grpc.health.v1`): what a gRPC probe calls.
pub mod health {
    /// `grpc.health.v1.Health`, `Check` only.
    #[allow(missing_docs, clippy::all)]
    pub mod v1 {
        tonic::include_proto!("grpc.health.v1");
    }
}

/// Dynamic Resource Allocation kubelet plugins (`DRAPlugin`): the node is
/// the client of each driver's endpoint.
pub mod dra {
    /// `k8s.io.kubelet.pkg.apis.dra.v1` (registered as `v1.DRAPlugin`).
    #[allow(missing_docs, clippy::all)]
    pub mod v1 {
        tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1");
    }
    /// `k8s.io.kubelet.pkg.apis.dra.v1beta1` (registered as
    /// `v1beta1.DRAPlugin`); the same messages as `v1`.
    #[allow(missing_docs, clippy::all)]
    pub mod v1beta1 {
        tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1beta1");
    }
}

/// The PodResources API (`v1.PodResourcesLister`) the node serves on
/// `<root-dir>/pod-resources/kubelet.sock`.
pub mod podresources {
    /// PodResources `v1`.
    #[allow(missing_docs, clippy::all)]
    pub mod v1 {
        tonic::include_proto!("v1");
    }
}
