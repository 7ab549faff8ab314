//! [`ApiError`]: why a read the node made of the API for a pod failed.

/// Why a read of the API made for a pod failed: the answer of cluster mode's
/// [`VolumeClaims`](crate::volume::VolumeClaims) and
/// [`ApiObjects`](crate::volume::ApiObjects). Its text is what the pod's
/// events and status show, so each variant keeps upstream's words; the
/// variant says what kind of failure it is (the lifecycle retries them all
/// with the pod's backoff).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ApiError {
    /// The node has no API client yet.
    #[error("not connected to the API server yet")]
    NotConnected,
    /// The API server failed or refused a request: what was asked, and why.
    #[error("{request}: {reason}")]
    Request {
        /// What was asked ("cannot read PersistentVolumeClaim ns/name").
        request: String,
        /// The server's answer, or why there was none.
        reason: String,
    },
    /// What the pod needs is not there yet (a claim not bound, a volume not
    /// attached): it may be later.
    #[error("{0}")]
    NotReady(String),
    /// What the API holds cannot serve the pod (an object not found, a
    /// volume that is not CSI, a key that is not UTF-8, an answer without
    /// what was asked for).
    #[error("{0}")]
    Invalid(String),
}
