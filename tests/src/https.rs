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
    Certificate {
        /// The certificate (PEM).
        cert_pem: &'a str,
        /// Its key (PEM).
        key_pem: &'a str,
    },
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

/// What a WebSocket exec session returned: stdout, stderr and the outcome
/// (channel 3: a `v1.Status` JSON).
#[derive(Debug, Default)]
pub struct WebSocketOutput {
    /// Channel 1.
    pub stdout: Vec<u8>,
    /// Channel 2.
    pub stderr: Vec<u8>,
    /// Channel 3.
    pub status: String,
}

/// A `v5.channel.k8s.io` WebSocket session on `path` (an `/exec/...` or
/// `/attach/...` URL with its query): sends `stdin` then closes it
/// (`[255, 0]`), and reads every channel until the server closes.
pub async fn websocket_session(
    address: SocketAddr,
    path: &str,
    credentials: Credentials<'_>,
    stdin: &[u8],
) -> Result<WebSocketOutput, String> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let stream = tokio::net::TcpStream::connect(address).await.map_err(|e| format!("connect {address}: {e}"))?;
    let name = ServerName::IpAddress(address.ip().into());
    let mut tls = connector(&credentials)?.connect(name, stream).await.map_err(|e| format!("TLS: {e}"))?;
    let authorization = match credentials {
        Credentials::Token(token) => format!("Authorization: Bearer {token}\r\n"),
        _ => String::new(),
    };
    let request = format!(
        "GET {path} HTTP/1.1\r\nHost: {address}\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\
         Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\
         Sec-WebSocket-Protocol: v5.channel.k8s.io\r\n{authorization}\r\n"
    );
    tls.write_all(request.as_bytes()).await.map_err(|e| e.to_string())?;
    // The answer's head, byte by byte up to the blank line.
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        let byte = tls.read_u8().await.map_err(|e| format!("reading the answer: {e}"))?;
        head.push(byte);
        if head.len() > 16 * 1024 {
            return Err("answer head too long".into());
        }
    }
    let head = String::from_utf8_lossy(&head).into_owned();
    if !head.starts_with("HTTP/1.1 101") {
        let mut body = vec![0u8; 4096];
        let n = tls.read(&mut body).await.unwrap_or(0);
        return Err(format!("no upgrade: {head}{}", String::from_utf8_lossy(&body[..n])));
    }
    if !head.to_ascii_lowercase().contains("sec-websocket-accept: s3pplmbitxaq9kygzzhzrbk+xoo=") {
        return Err(format!("a wrong Sec-WebSocket-Accept: {head}"));
    }
    let masked = |payload: &[u8]| {
        let mask = [0x5au8, 0xa5, 0x3c, 0xc3];
        let mut frame = vec![0x82u8];
        match payload.len() {
            n if n < 126 => frame.push(0x80 | n as u8),
            n => {
                frame.push(0x80 | 126);
                frame.extend_from_slice(&(n as u16).to_be_bytes());
            }
        }
        frame.extend_from_slice(&mask);
        frame.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
        frame
    };
    if !stdin.is_empty() {
        let mut payload = vec![0u8];
        payload.extend_from_slice(stdin);
        tls.write_all(&masked(&payload)).await.map_err(|e| e.to_string())?;
    }
    tls.write_all(&masked(&[255, 0])).await.map_err(|e| e.to_string())?;
    let mut output = WebSocketOutput::default();
    loop {
        let mut frame_head = [0u8; 2];
        if tls.read_exact(&mut frame_head).await.is_err() {
            return Ok(output);
        }
        let length = match frame_head[1] & 0x7f {
            126 => u64::from(tls.read_u16().await.map_err(|e| e.to_string())?),
            127 => tls.read_u64().await.map_err(|e| e.to_string())?,
            n => u64::from(n),
        };
        let mut payload = vec![0u8; usize::try_from(length).map_err(|e| e.to_string())?];
        tls.read_exact(&mut payload).await.map_err(|e| e.to_string())?;
        match (frame_head[0] & 0x0f, payload.split_first()) {
            (0x8, _) => return Ok(output),
            (0x2, Some((1, data))) => output.stdout.extend_from_slice(data),
            (0x2, Some((2, data))) => output.stderr.extend_from_slice(data),
            (0x2, Some((3, data))) => output.status.push_str(&String::from_utf8_lossy(data)),
            _ => {}
        }
    }
}

/// The value of the unlabelled series `name` on the kubelet API's
/// `/metrics` (a gauge such as `kubelet_api_streaming_sessions`).
pub async fn metric(address: SocketAddr, name: &str, credentials: Credentials<'_>) -> Result<f64, String> {
    let (code, metrics) = get(address, "/metrics", credentials).await?;
    if code != 200 {
        return Err(format!("/metrics answered {code}: {metrics}"));
    }
    metrics
        .lines()
        .find(|l| l.strip_prefix(name).is_some_and(|rest| rest.starts_with(' ')))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| format!("no {name} in {metrics}"))
}

/// A new self-signed CA certificate (PEM), for a `--client-ca-file` that
/// no client is meant to chain to.
pub fn throwaway_ca_pem() -> String {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};
    let key = KeyPair::generate().expect("a key");
    let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, "rustlet-throwaway-ca");
    params.self_signed(&key).expect("a certificate").pem()
}
