//! Errors of the CSI handler, registry, client and node-info publisher.

use std::path::PathBuf;
use std::time::Duration;

use super::version::CsiVersion;

/// Why a driver's version list is unacceptable.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CsiVersionError {
    /// The driver sent no versions.
    #[error("CSI driver reported an empty list of supported versions")]
    Empty,
    /// No entry parsed as a version with major ≤ 1.
    #[error("none of the versions {0:?} reported by the driver is supported")]
    NoneSupported(Vec<String>),
    /// The highest usable version is not 1.x.
    #[error("highest supported version reported by driver is {0}, must be v1.x")]
    NotV1(CsiVersion),
}

/// Errors of calling a CSI driver.
#[derive(Debug, thiserror::Error)]
pub enum CsiClientError {
    /// The driver's endpoint could not be dialed.
    #[error(transparent)]
    Dial(#[from] kubelet_api::uds::UdsError),
    /// The call returned an error.
    #[error("{rpc} at {endpoint}: {status}")]
    Rpc {
        /// The RPC called.
        rpc: &'static str,
        /// The driver endpoint.
        endpoint: PathBuf,
        /// The gRPC status.
        status: tonic::Status,
    },
    /// The call did not answer within its deadline.
    #[error("{rpc} at {endpoint} did not answer within {timeout:?}")]
    Timeout {
        /// The RPC called.
        rpc: &'static str,
        /// The driver endpoint.
        endpoint: PathBuf,
        /// The deadline.
        timeout: Duration,
    },
    /// The answer is unusable.
    #[error("{rpc} at {endpoint} returned an invalid answer: {reason}")]
    Invalid {
        /// The RPC called.
        rpc: &'static str,
        /// The driver endpoint.
        endpoint: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
}

/// Errors of publishing the node's CSI facts.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// The publisher could not store the change.
    #[error("cannot publish CSI node info for driver {driver}: {reason}")]
    Failed {
        /// The driver concerned.
        driver: String,
        /// Why.
        reason: String,
    },
}

/// Why a CSI driver could not be validated or registered.
#[derive(Debug, thiserror::Error)]
pub enum CsiError {
    /// The version list is unacceptable.
    #[error("validation failed for CSI driver {name} at endpoint {endpoint}: {source}")]
    Versions {
        /// Driver name.
        name: String,
        /// Driver endpoint.
        endpoint: String,
        /// The version problem.
        #[source]
        source: CsiVersionError,
    },
    /// A driver of the same name is registered with an equal or higher version.
    #[error(
        "CSI driver {name} is already registered with version {existing} from socket {existing_socket}; \
         a second registration needs a higher version than that (got {offered})"
    )]
    AlreadyRegistered {
        /// Driver name.
        name: String,
        /// The registered driver's version.
        existing: CsiVersion,
        /// The registered driver's registration socket.
        existing_socket: PathBuf,
        /// The version the newcomer offers.
        offered: CsiVersion,
    },
    /// `NodeGetInfo` failed; the registration was undone.
    #[error("CSI driver {name}: NodeGetInfo failed: {source}")]
    NodeGetInfo {
        /// Driver name.
        name: String,
        /// The call's failure.
        #[source]
        source: CsiClientError,
    },
    /// The node's CSI facts could not be published; the registration was undone.
    #[error(transparent)]
    Publish(#[from] PublishError),
}
