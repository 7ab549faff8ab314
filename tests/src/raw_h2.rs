//! A bare HTTP/2 gRPC client for one unary call with any `:authority`.
//!
//! Real clients (tonic, recent grpc-go) never send a raw socket path as the
//! authority, and Rust HTTP clients cannot: their URI types refuse it. Older
//! grpc-go does, so tests need a client that writes the frames by hand.

use std::path::Path;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len();
    let mut out = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
    out.extend_from_slice(&stream.to_be_bytes());
    out.extend_from_slice(payload);
    out
}

/// Calls `path` (e.g. `/v1beta1.Registration/Register`) on the socket with
/// `message` (an encoded protobuf), sending `authority` as is. Returns the
/// `grpc-status` and `grpc-message`, or how the server refused the stream.
pub async fn unary_call(
    socket: &Path,
    path: &str,
    authority: &str,
    message: &[u8],
) -> Result<(String, String), String> {
    let call = async {
        let mut stream = UnixStream::connect(socket).await.map_err(|e| e.to_string())?;
        let mut request = PREFACE.to_vec();
        request.extend(frame(0x4, 0, 0, &[]));
        let headers: [(&[u8], &[u8]); 6] = [
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", path.as_bytes()),
            (b":authority", authority.as_bytes()),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
        ];
        let block = fluke_hpack::Encoder::new().encode(headers);
        request.extend(frame(0x1, 0x4, 1, &block));
        let mut data = vec![0u8];
        data.extend_from_slice(&(message.len() as u32).to_be_bytes());
        data.extend_from_slice(message);
        request.extend(frame(0x0, 0x1, 1, &data));
        stream.write_all(&request).await.map_err(|e| e.to_string())?;

        let mut decoder = fluke_hpack::Decoder::new();
        loop {
            let mut header = [0u8; 9];
            stream.read_exact(&mut header).await.map_err(|e| format!("connection closed: {e}"))?;
            let len = usize::from(header[0]) << 16 | usize::from(header[1]) << 8 | usize::from(header[2]);
            let mut payload = vec![0u8; len];
            stream.read_exact(&mut payload).await.map_err(|e| e.to_string())?;
            match header[3] {
                0x4 if header[4] & 0x1 == 0 => {
                    stream.write_all(&frame(0x4, 0x1, 0, &[])).await.map_err(|e| e.to_string())?;
                }
                0x3 => {
                    let code = u32::from_be_bytes([payload[0], payload[1], payload[2], payload[3]]);
                    return Err(format!("stream reset by the server, HTTP/2 error code {code}"));
                }
                0x7 => return Err("the server sent GOAWAY".to_owned()),
                0x1 => {
                    let headers = decoder.decode(&payload).map_err(|e| format!("{e:?}"))?;
                    let get = |name: &[u8]| {
                        headers.iter().find(|(n, _)| n == name).map(|(_, v)| String::from_utf8_lossy(v).into_owned())
                    };
                    if let Some(status) = get(b"grpc-status") {
                        return Ok((status, get(b"grpc-message").unwrap_or_default()));
                    }
                }
                _ => {}
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(10), call).await.map_err(|_| "no answer within 10s".to_owned())?
}
