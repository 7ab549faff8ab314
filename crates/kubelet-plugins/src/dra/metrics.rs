//! Prometheus metrics of DRA, upstream's names, labels and buckets
//! (exponential from 0.1 s to 40 s in 15, under the 45 s call deadline):
//! - `dra_operations_duration_seconds{operation_name, is_error}`: all the
//!   claims of one pod prepared (`PrepareResources`) or released
//!   (`UnprepareResources`). Upstream observes every pod start, with or
//!   without claims, and its 1.33 code writes `is_error="true"` for a
//!   successful prepare; here only pods with claims are observed, and
//!   `is_error` means what it says.
//! - `dra_grpc_operations_duration_seconds{driver_name, method_name,
//!   grpc_status_code}`: each call to a driver, by its full gRPC method
//!   (`/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodePrepareResources`)
//!   and gRPC's name of the status code (`OK`, `DeadlineExceeded`, ...).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets_range};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OperationLabels {
    operation_name: &'static str,
    is_error: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CallLabels {
    driver_name: String,
    method_name: String,
    grpc_status_code: &'static str,
}

fn histogram() -> Histogram {
    Histogram::new(exponential_buckets_range(0.1, 40.0, 15))
}

/// DRA's metric families; clones share their values.
#[derive(Clone)]
pub(crate) struct DraMetrics {
    operations: Family<OperationLabels, Histogram>,
    calls: Family<CallLabels, Histogram>,
}

impl Default for DraMetrics {
    fn default() -> Self {
        DraMetrics {
            operations: Family::new_with_constructor(histogram),
            calls: Family::new_with_constructor(histogram),
        }
    }
}

impl DraMetrics {
    pub(crate) fn register(&self, registry: &mut Registry) {
        registry.register(
            "dra_operations_duration_seconds",
            "Latency histogram in seconds for the duration of handling all ResourceClaims referenced by a pod when the pod starts or stops. Identified by the name of the operation (PrepareResources or UnprepareResources) and separated by the success of the operation",
            self.operations.clone(),
        );
        registry.register(
            "dra_grpc_operations_duration_seconds",
            "Duration in seconds of the DRA gRPC operations",
            self.calls.clone(),
        );
    }

    /// One pod's claims prepared or released.
    pub(crate) fn operation(&self, prepare: bool, failed: bool, took: std::time::Duration) {
        let labels = OperationLabels {
            operation_name: if prepare { "PrepareResources" } else { "UnprepareResources" },
            is_error: if failed { "true" } else { "false" },
        };
        self.operations.get_or_create(&labels).observe(took.as_secs_f64());
    }

    /// One call to a driver.
    pub(crate) fn call(&self, driver: &str, method: String, code: Option<tonic::Code>, took: std::time::Duration) {
        let labels = CallLabels {
            driver_name: kubelet_support::metrics::escape_label(driver).into_owned(),
            method_name: method,
            grpc_status_code: code_name(code),
        };
        self.calls.get_or_create(&labels).observe(took.as_secs_f64());
    }
}

/// gRPC's name of a status code (Go's `codes.Code.String()`); `None` is a
/// call that ran out of time here.
fn code_name(code: Option<tonic::Code>) -> &'static str {
    use tonic::Code;
    match code {
        None | Some(Code::DeadlineExceeded) => "DeadlineExceeded",
        Some(Code::Ok) => "OK",
        Some(Code::Cancelled) => "Canceled",
        Some(Code::Unknown) => "Unknown",
        Some(Code::InvalidArgument) => "InvalidArgument",
        Some(Code::NotFound) => "NotFound",
        Some(Code::AlreadyExists) => "AlreadyExists",
        Some(Code::PermissionDenied) => "PermissionDenied",
        Some(Code::ResourceExhausted) => "ResourceExhausted",
        Some(Code::FailedPrecondition) => "FailedPrecondition",
        Some(Code::Aborted) => "Aborted",
        Some(Code::OutOfRange) => "OutOfRange",
        Some(Code::Unimplemented) => "Unimplemented",
        Some(Code::Internal) => "Internal",
        Some(Code::Unavailable) => "Unavailable",
        Some(Code::DataLoss) => "DataLoss",
        Some(Code::Unauthenticated) => "Unauthenticated",
    }
}
