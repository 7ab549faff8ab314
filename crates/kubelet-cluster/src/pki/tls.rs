//! The kubelet API's TLS: the serving certificate (from files, or
//! self-signed under the cert dir as the kubelet makes one) behind a
//! resolver that can swap it while connections are served, and client
//! certificates verified against the client CA.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;

/// Why the TLS setup failed.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    File {
        /// The file.
        path: PathBuf,
        /// The system error.
        #[source]
        source: std::io::Error,
    },
    /// A file holds no usable PEM.
    #[error("{path}: {reason}")]
    Pem {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// The certificate could not be made.
    #[error("cannot make a certificate: {0}")]
    Generate(String),
    /// rustls refused the configuration.
    #[error("{0}")]
    Rustls(#[from] rustls::Error),
}

fn pem_error(path: &Path, reason: impl std::fmt::Display) -> TlsError {
    TlsError::Pem { path: path.to_owned(), reason: reason.to_string() }
}

/// Reads every certificate of a PEM file.
pub(crate) fn read_certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let bytes = std::fs::read(path).map_err(|source| TlsError::File { path: path.to_owned(), source })?;
    let certificates: Vec<_> = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<_, _>>()
        .map_err(|e| pem_error(path, format!("not PEM certificates: {e}")))?;
    if certificates.is_empty() {
        return Err(pem_error(path, "holds no CERTIFICATE block"));
    }
    Ok(certificates)
}

/// Reads a PEM private key (PKCS#8, PKCS#1 or SEC1).
pub(crate) fn read_private_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let bytes = std::fs::read(path).map_err(|source| TlsError::File { path: path.to_owned(), source })?;
    PrivateKeyDer::from_pem_slice(&bytes).map_err(|e| pem_error(path, format!("no usable private key: {e}")))
}

/// A certificate chain and key ready to serve.
pub(crate) fn certified_key(
    chain: Vec<CertificateDer<'static>>,
    key: &PrivateKeyDer<'static>,
    key_path: &Path,
) -> Result<Arc<CertifiedKey>, TlsError> {
    let signer = rustls::crypto::ring::sign::any_supported_type(key)
        .map_err(|e| pem_error(key_path, format!("unsupported key: {e}")))?;
    Ok(Arc::new(CertifiedKey::new(chain, signer)))
}

/// Loads a certificate and key pair from files.
pub fn load_pair(cert: &Path, key: &Path) -> Result<Arc<CertifiedKey>, TlsError> {
    let chain = read_certificates(cert)?;
    let private = read_private_key(key)?;
    let certified = certified_key(chain, &private, key)?;
    certified.keys_match().map_err(|e| pem_error(key, format!("does not match {}: {e}", cert.display())))?;
    Ok(certified)
}

/// The serving certificate in use; replaced whole when it is renewed, so a
/// handshake sees either the old one or the new one. None yet (a requested
/// certificate not issued yet): handshakes fail.
#[derive(Clone, Debug)]
pub struct ServingCertificate {
    current: Arc<RwLock<Option<Arc<CertifiedKey>>>>,
}

impl ServingCertificate {
    /// Serves `key` (none: nothing until [`ServingCertificate::replace`]).
    pub fn new(key: Option<Arc<CertifiedKey>>) -> Self {
        ServingCertificate { current: Arc::new(RwLock::new(key)) }
    }

    /// Serves `key` from now on.
    pub fn replace(&self, key: Arc<CertifiedKey>) {
        *self.current.write().unwrap_or_else(|p| p.into_inner()) = Some(key);
    }

    /// The certificate served now.
    pub(crate) fn current(&self) -> Option<Arc<CertifiedKey>> {
        self.current.read().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

impl ResolvesServerCert for ServingCertificate {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        let current = self.current();
        if current.is_none() {
            tracing::debug!("TLS handshake refused: no serving certificate has been issued yet");
        }
        current
    }
}

/// A certificate and key from PEM text, ready to serve.
pub fn certified_from_pem(cert_pem: &str, key_pem: &str) -> Result<Arc<CertifiedKey>, TlsError> {
    let here = Path::new("<issued certificate>");
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert_pem.as_bytes())
        .collect::<Result<_, _>>()
        .map_err(|e| pem_error(here, format!("not PEM certificates: {e}")))?;
    let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes())
        .map_err(|e| pem_error(here, format!("no usable key: {e}")))?;
    certified_key(chain, &key, here)
}

/// The self-signed certificate the kubelet makes when it is given none:
/// `<cert_dir>/kubelet.crt` and `kubelet.key`, for the host name, the node
/// name and the node's IPs, valid a year; reused while it is valid.
pub fn self_signed(cert_dir: &Path, names: &[String], ips: &[IpAddr]) -> Result<Arc<CertifiedKey>, TlsError> {
    let cert_path = cert_dir.join("kubelet.crt");
    let key_path = cert_dir.join("kubelet.key");
    if cert_path.exists() && key_path.exists() {
        match load_pair(&cert_path, &key_path) {
            Ok(key) if still_valid(&key) => {
                tracing::info!(cert = %cert_path.display(), "serving with the self-signed certificate made earlier");
                return Ok(key);
            }
            Ok(_) => {
                tracing::info!(cert = %cert_path.display(), "the self-signed certificate expired; making a new one")
            }
            Err(error) => tracing::warn!(%error, "the self-signed certificate is unusable; making a new one"),
        }
    }
    let generate = |e: rcgen::Error| TlsError::Generate(e.to_string());
    let key = rcgen::KeyPair::generate().map_err(generate)?;
    let mut params = rcgen::CertificateParams::new(names.to_vec()).map_err(generate)?;
    params.subject_alt_names.extend(ips.iter().map(|ip| rcgen::SanType::IpAddress(*ip)));
    let host = names.first().cloned().unwrap_or_else(|| "rustlet".to_owned());
    let now = jiff::Timestamp::now();
    params.distinguished_name.push(rcgen::DnType::CommonName, format!("{host}@{}", now.as_second()));
    params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
    params.key_usages = vec![rcgen::KeyUsagePurpose::DigitalSignature, rcgen::KeyUsagePurpose::KeyEncipherment];
    let year = time::Duration::days(365);
    params.not_before = time::OffsetDateTime::now_utc() - time::Duration::hours(1);
    params.not_after = time::OffsetDateTime::now_utc() + year;
    let certificate = params.self_signed(&key).map_err(generate)?;
    std::fs::create_dir_all(cert_dir).map_err(|source| TlsError::File { path: cert_dir.to_owned(), source })?;
    write_private(&key_path, key.serialize_pem().as_bytes())?;
    write_private(&cert_path, certificate.pem().as_bytes())?;
    tracing::info!(cert = %cert_path.display(), ?names, ?ips, "made a self-signed serving certificate");
    load_pair(&cert_path, &key_path)
}

/// Whether a certificate is inside its validity period now.
fn still_valid(key: &CertifiedKey) -> bool {
    let Some(leaf) = key.cert.first() else { return false };
    super::x509::certificate_facts(leaf).is_ok_and(|facts| {
        let now = jiff::Timestamp::now();
        facts.not_before <= now && now < facts.not_after
    })
}

/// Writes a file readable by its owner only, durably
/// ([`crate::durable::write()`], mode 0600).
pub(crate) fn write_private(path: &Path, bytes: &[u8]) -> Result<(), TlsError> {
    crate::durable::write(path, bytes, 0o600).map_err(|source| TlsError::File { path: path.to_owned(), source })
}

/// The server's TLS configuration: `serving` as its certificate; client
/// certificates checked against `client_ca` when given (a client without
/// one goes on to the other authenticators).
pub fn server_config(
    serving: ServingCertificate,
    client_ca: Option<&Path>,
) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder =
        rustls::ServerConfig::builder_with_provider(Arc::clone(&provider)).with_safe_default_protocol_versions()?;
    let builder = match client_ca {
        None => builder.with_no_client_auth(),
        Some(path) => {
            let mut roots = rustls::RootCertStore::empty();
            for certificate in read_certificates(path)? {
                roots.add(certificate).map_err(|e| pem_error(path, format!("not a usable CA certificate: {e}")))?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .allow_unauthenticated()
                .build()
                .map_err(|e| pem_error(path, e))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder.with_cert_resolver(Arc::new(serving));
    // Exec, attach and port-forward upgrade HTTP/1.1 connections.
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}
