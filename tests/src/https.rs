//! One HTTPS request to a node's kubelet API, as a client of it would
//! send: a bearer token, a client certificate, or no credentials. The
//! node's serving certificate is not checked (tests use self-signed ones;
//! what they test is the node's side).

use std::net::SocketAddr;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};

/// A client's credentials.
pub enum Credentials<'a> {
    /// None at all.
    Anonymous,
    /// `Authorization: Bearer <token>`.
    Token(&'a str),
    /// A client certificate and its key (PEM).
    Certificate { cert_pem: &'a str, key_pem: &'a str },
}

#[derive(Debug)]
struct AnyServer(Vec<rustls::SignatureScheme>);

impl rustls::client::danger::ServerCertVerifier for AnyServer {
    fn verify_server_cert(
        &self,
        _: &CertificateDer<'_>,
        _: &[CertificateDer<'_>],
        _: &ServerName<'_>,
        _: &[u8],
        _: UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &rustls::crypto::ring::default_provider().signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &rustls::crypto::ring::default_provider().signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.clone()
    }
}

/// The TLS client for `credentials`.
fn connector(credentials: &Credentials<'_>) -> Result<tokio_rustls::TlsConnector, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let schemes = provider.signature_verification_algorithms.supported_schemes();
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AnyServer(schemes)));
    let config = match credentials {
        Credentials::Certificate { cert_pem, key_pem } => {
            let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert_pem.as_bytes())
                .collect::<Result<_, _>>()
                .map_err(|e| e.to_string())?;
            let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).map_err(|e| e.to_string())?;
            builder.with_client_auth_cert(chain, key).map_err(|e| e.to_string())?
        }
        _ => builder.with_no_client_auth(),
    };
    Ok(tokio_rustls::TlsConnector::from(Arc::new(config)))
}

/// One kept-alive connection to a kubelet API, for several requests.
pub struct Session {
    sender: hyper::client::conn::http1::SendRequest<String>,
    host: String,
    token: Option<String>,
}

impl Session {
    /// Connects (TCP and TLS) to `address` with `credentials`.
    pub async fn connect(address: SocketAddr, credentials: Credentials<'_>) -> Result<Session, String> {
        let stream = tokio::net::TcpStream::connect(address).await.map_err(|e| format!("connect {address}: {e}"))?;
        let name = ServerName::IpAddress(address.ip().into());
        let tls = connector(&credentials)?.connect(name, stream).await.map_err(|e| format!("TLS: {e}"))?;
        let (sender, connection) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls))
            .await
            .map_err(|e| e.to_string())?;
        tokio::spawn(connection);
        let token = match credentials {
            Credentials::Token(token) => Some(token.to_owned()),
            _ => None,
        };
        Ok(Session { sender, host: address.to_string(), token })
    }

    /// `method path`: the status code and body.
    pub async fn request(&mut self, method: &str, path: &str) -> Result<(u16, String), String> {
        let mut builder = http::Request::builder().method(method).uri(path).header("host", &self.host);
        if let Some(token) = &self.token {
            builder = builder.header("authorization", format!("Bearer {token}"));
        }
        let request = builder.body(String::new()).map_err(|e| e.to_string())?;
        // The connection takes the next request once the last one is done.
        self.sender.ready().await.map_err(|e| e.to_string())?;
        let response = self.sender.send_request(request).await.map_err(|e| e.to_string())?;
        read(response).await
    }
}

/// `method path` on the kubelet API at `address` on a connection of its
/// own: the status code and body.
pub async fn request(
    address: SocketAddr,
    method: &str,
    path: &str,
    credentials: Credentials<'_>,
) -> Result<(u16, String), String> {
    Session::connect(address, credentials).await?.request(method, path).await
}

async fn read(response: http::Response<hyper::body::Incoming>) -> Result<(u16, String), String> {
    let status = response.status().as_u16();
    let mut body = response.into_body();
    let mut bytes = Vec::new();
    while let Some(frame) =
        std::future::poll_fn(|cx| hyper::body::Body::poll_frame(std::pin::Pin::new(&mut body), cx)).await
    {
        if let Ok(data) = frame.map_err(|e| e.to_string())?.into_data() {
            bytes.extend_from_slice(&data);
        }
    }
    Ok((status, String::from_utf8_lossy(&bytes).into_owned()))
}

/// `GET path`.
pub async fn get(address: SocketAddr, path: &str, credentials: Credentials<'_>) -> Result<(u16, String), String> {
    request(address, "GET", path, credentials).await
}

/// The certificate the server at `address` presents (DER), after a
/// handshake without credentials.
pub async fn server_certificate(address: SocketAddr) -> Result<Vec<u8>, String> {
    let stream = tokio::net::TcpStream::connect(address).await.map_err(|e| format!("connect {address}: {e}"))?;
    let name = ServerName::IpAddress(address.ip().into());
    let tls = connector(&Credentials::Anonymous)?.connect(name, stream).await.map_err(|e| format!("TLS: {e}"))?;
    let chain = tls.get_ref().1.peer_certificates().ok_or("no server certificate")?;
    chain.first().map(|c| c.to_vec()).ok_or_else(|| "an empty chain".to_owned())
}
