//! Keys and certificates on disk and in memory: PEM files, private keys
//! written durably with mode 0600, self-signed serving certificates, the
//! rustls configurations built from them ([`tls`]), and the few facts the
//! node reads from an X.509 certificate ([`x509`]). The cluster's
//! certificate requests and the kubelet API both build on these.

pub mod tls;
pub mod x509;
