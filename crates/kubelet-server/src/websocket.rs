//! `exec` and `attach` over WebSocket, for direct clients of the kubelet
//! API, on sessions the node serves itself (WebAssembly containers): the
//! channel protocol `v5.channel.k8s.io` (and `v4.channel.k8s.io`). Each
//! binary message starts with its channel: 0 stdin, 1 stdout, 2 stderr,
//! 3 error (the outcome, a `v1.Status` as on SPDY v4), 4 resize (read and
//! dropped), and, in v5, 255 "close" (`[255, 0]`: the client's stdin
//! ended). Client frames are masked, the node's are not; pings are
//! answered; the session ends with the outcome on channel 3 and a close
//! frame.

use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _};
use tokio::sync::mpsc;

use super::spdy::{drain, run_while_connected};
use crate::provider::{SessionStreams, StreamRequest, StreamSession};

/// The channel protocols served, best first.
pub(crate) const PROTOCOLS: &[&str] = &["v5.channel.k8s.io", "v4.channel.k8s.io"];

/// A message larger than this ends the connection.
const MAX_MESSAGE: usize = 16 << 20;
const DATA_CHUNK: usize = 32 * 1024;
const PIPE: usize = 64 * 1024;
/// A session with no frame from the client for this long is over.
const IDLE_DEADLINE: Duration = Duration::from_secs(4 * 3600);

const STDIN: u8 = 0;
const STDOUT: u8 = 1;
const STDERR: u8 = 2;
const ERROR: u8 = 3;
const CLOSE: u8 = 255;

/// The `Sec-WebSocket-Accept` answer to a client's key.
pub(crate) fn accept_key(key: &str) -> String {
    use base64::Engine as _;
    let digest = ring::digest::digest(
        &ring::digest::SHA1_FOR_LEGACY_USE_ONLY,
        format!("{}258EAFA5-E914-47DA-95CA-C5AB0DC85B11", key.trim()).as_bytes(),
    );
    base64::engine::general_purpose::STANDARD.encode(digest.as_ref())
}

/// The first of the client's protocols (in its order) the node serves.
pub(crate) fn negotiate<'a>(client: impl Iterator<Item = &'a str>) -> Option<&'static str> {
    let offered: Vec<&str> = client.flat_map(|v| v.split(',')).map(str::trim).collect();
    offered.iter().find_map(|p| PROTOCOLS.iter().find(|s| *s == p).copied())
}

/// A frame as read: its opcode and (unmasked) payload.
struct Frame {
    fin: bool,
    opcode: u8,
    payload: Vec<u8>,
}

async fn read_frame<R: AsyncRead + Unpin>(io: &mut R) -> std::io::Result<Option<Frame>> {
    let mut head = [0u8; 2];
    match io.read_exact(&mut head).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let fin = head[0] & 0x80 != 0;
    let opcode = head[0] & 0x0f;
    let masked = head[1] & 0x80 != 0;
    // RFC 6455 5.1: a server closes the connection on an unmasked client
    // frame (masking keeps a client's bytes from steering proxies between).
    if !masked {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "an unmasked client WebSocket frame"));
    }
    let length = match head[1] & 0x7f {
        126 => u64::from(io.read_u16().await?),
        127 => io.read_u64().await?,
        n => u64::from(n),
    };
    // A control frame carries at most 125 bytes (RFC 6455 5.5).
    if opcode >= 0x8 && length > 125 {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "a WebSocket control frame over 125 bytes"));
    }
    let length = usize::try_from(length)
        .ok()
        .filter(|n| *n <= MAX_MESSAGE)
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidData, "WebSocket frame too large"))?;
    let mut mask = [0u8; 4];
    io.read_exact(&mut mask).await?;
    let mut payload = vec![0u8; length];
    io.read_exact(&mut payload).await?;
    for (i, byte) in payload.iter_mut().enumerate() {
        *byte ^= mask[i % 4];
    }
    Ok(Some(Frame { fin, opcode, payload }))
}

/// An unmasked frame (the server's).
fn frame(opcode: u8, payload: &[u8]) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(payload.len() + 10);
    bytes.push(0x80 | opcode);
    match payload.len() {
        n if n < 126 => bytes.push(n as u8),
        n if n <= usize::from(u16::MAX) => {
            bytes.push(126);
            bytes.extend_from_slice(&(n as u16).to_be_bytes());
        }
        n => {
            bytes.push(127);
            bytes.extend_from_slice(&(n as u64).to_be_bytes());
        }
    }
    bytes.extend_from_slice(payload);
    bytes
}

fn channel_message(channel: u8, data: &[u8]) -> Vec<u8> {
    let mut payload = Vec::with_capacity(data.len() + 1);
    payload.push(channel);
    payload.extend_from_slice(data);
    frame(0x2, &payload)
}

/// Serves one session on an upgraded WebSocket connection, to its end.
pub(crate) async fn serve<IO>(io: IO, protocol: &'static str, options: StreamRequest, session: Box<dyn StreamSession>)
where
    IO: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let (mut read_half, write_half) = tokio::io::split(io);
    let (out, writer) = spawn_writer(write_half);
    let (streams, mut stdin_pipe, forwarders) = session_streams(&options, &out);
    let mut message: Vec<u8> = Vec::new();
    let (read_half, out_ref) = (&mut read_half, &out);
    let client = async move {
        while let Ok(Ok(Some(frame))) = tokio::time::timeout(IDLE_DEADLINE, read_frame(read_half)).await {
            if !take_frame(frame, &mut message, &mut stdin_pipe, out_ref).await {
                return;
            }
        }
    };
    let Some(outcome) = run_while_connected(session.run(streams), client, forwarders).await else {
        drain(out, writer).await;
        return;
    };
    let outcome = outcome.map_err(|e| e.message);
    // Both channel protocols carry the outcome as SPDY v4 does.
    if let Some(status) = super::spdy::outcome_message("v4.channel.k8s.io", &outcome, &options.command) {
        let _ = out.send(channel_message(ERROR, &status)).await;
    }
    let _ = out.send(frame(0x8, &1000u16.to_be_bytes())).await;
    drain(out, writer).await;
    tracing::debug!(protocol, "WebSocket session ended");
}

/// The session's one writer of frames to the client: what is sent on the
/// channel it returns goes out in order; the connection is shut down when
/// every sender is gone.
fn spawn_writer<W>(mut write_half: W) -> (mpsc::Sender<Vec<u8>>, tokio::task::JoinHandle<()>)
where
    W: AsyncWrite + Send + Unpin + 'static,
{
    let (out, mut outgoing) = mpsc::channel::<Vec<u8>>(64);
    // Not supervised: one session's writer.
    let writer = tokio::spawn(async move {
        while let Some(bytes) = outgoing.recv().await {
            if write_half.write_all(&bytes).await.is_err() {
                return;
            }
        }
        let _ = write_half.flush().await;
        let _ = write_half.shutdown().await;
    });
    (out, writer)
}

/// The streams the session runs with (those the request asked for), the
/// node's end of its stdin, and the tasks that forward its stdout and
/// stderr to the client as channel messages.
fn session_streams(
    options: &StreamRequest,
    out: &mpsc::Sender<Vec<u8>>,
) -> (SessionStreams, Option<tokio::io::DuplexStream>, Vec<tokio::task::JoinHandle<()>>) {
    let mut streams = SessionStreams::default();
    let mut stdin_pipe = None;
    if options.stdin {
        let (ours, theirs) = tokio::io::duplex(PIPE);
        stdin_pipe = Some(ours);
        streams.stdin = Some(theirs);
    }
    let mut forwarders = Vec::new();
    for (channel, wanted, slot) in
        [(STDOUT, options.stdout, &mut streams.stdout), (STDERR, options.stderr, &mut streams.stderr)]
    {
        if !wanted {
            continue;
        }
        let (mut ours, theirs) = tokio::io::duplex(PIPE);
        *slot = Some(theirs);
        let out = out.clone();
        // Not supervised: one session's stream.
        forwarders.push(tokio::spawn(async move {
            let mut buffer = vec![0u8; DATA_CHUNK];
            loop {
                match ours.read(&mut buffer).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => {
                        if out.send(channel_message(channel, &buffer[..n])).await.is_err() {
                            return;
                        }
                    }
                }
            }
        }));
    }
    (streams, stdin_pipe, forwarders)
}

/// Takes one frame from the client: data for stdin (a message may span
/// frames), the v5 close of stdin, a ping. False when the session is over
/// for the client (a close frame, a message too large).
async fn take_frame(
    frame: Frame,
    message: &mut Vec<u8>,
    stdin_pipe: &mut Option<tokio::io::DuplexStream>,
    out: &mpsc::Sender<Vec<u8>>,
) -> bool {
    match frame.opcode {
        // Continuation, text, binary: one message may span frames.
        0x0..=0x2 => {
            message.extend_from_slice(&frame.payload);
            if message.len() > MAX_MESSAGE {
                return false;
            }
            if !frame.fin {
                return true;
            }
            let whole = std::mem::take(message);
            match whole.split_first() {
                Some((&STDIN, data)) => {
                    if let Some(pipe) = stdin_pipe.as_mut()
                        && !data.is_empty()
                        && pipe.write_all(data).await.is_err()
                    {
                        *stdin_pipe = None;
                    }
                }
                // v5: the client closed a channel (stdin).
                Some((&CLOSE, [STDIN, ..])) => *stdin_pipe = None,
                _ => {}
            }
        }
        0x8 => return false,
        0x9 => {
            let _ = out.send(frame_pong(&frame.payload)).await;
        }
        _ => {}
    }
    true
}

fn frame_pong(payload: &[u8]) -> Vec<u8> {
    frame(0xA, payload)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_accept_key_is_rfc_6455s() {
        // The example of RFC 6455, section 1.3.
        assert_eq!(accept_key("dGhlIHNhbXBsZSBub25jZQ=="), "s3pPLMBiTxaQ9kYGzzhZRbK+xOo=");
    }

    #[test]
    fn frames_carry_their_length_and_channel() {
        let short = channel_message(STDOUT, b"hi");
        assert_eq!(short, [0x82, 3, 1, b'h', b'i']);
        let long = channel_message(STDERR, &[7u8; 300]);
        assert_eq!(&long[..4], &[0x82, 126, 0x01, 0x2d]);
        assert_eq!(long[4], STDERR);
        assert_eq!(negotiate(["v4.channel.k8s.io, v5.channel.k8s.io"].into_iter()), Some("v4.channel.k8s.io"));
        assert_eq!(negotiate(["channel.k8s.io"].into_iter()), None);
    }

    #[tokio::test]
    async fn masked_client_frames_are_read() {
        let mask = [1u8, 2, 3, 4];
        let data = [STDIN, b'a', b'b'];
        let mut bytes = vec![0x82, 0x80 | 3];
        bytes.extend_from_slice(&mask);
        bytes.extend(data.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
        let frame = read_frame(&mut bytes.as_slice()).await.expect("read").expect("a frame");
        assert!(frame.fin);
        assert_eq!((frame.opcode, frame.payload.as_slice()), (0x2, &data[..]));
    }

    #[tokio::test]
    async fn unmasked_and_oversized_client_frames_are_refused() {
        let unmasked = [0x82, 3, STDIN, b'a', b'b'];
        let error = read_frame(&mut unmasked.as_slice()).await.err().expect("refused");
        assert_eq!(error.to_string(), "an unmasked client WebSocket frame");
        // A ping claiming 126 bytes (the 16-bit length form).
        let ping = [0x89, 0x80 | 126, 0, 126, 1, 2, 3, 4];
        let error = read_frame(&mut ping.as_slice()).await.err().expect("refused");
        assert_eq!(error.to_string(), "a WebSocket control frame over 125 bytes");
        // A frame over the message bound is refused before its payload is
        // allocated (8 EiB claimed, nothing sent).
        let huge = [0x82, 0x80 | 127, 0x7f, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff];
        let error = read_frame(&mut huge.as_slice()).await.err().expect("refused");
        assert_eq!(error.to_string(), "WebSocket frame too large");
    }

    /// A client's (masked) frame.
    fn masked(first: u8, payload: &[u8]) -> Vec<u8> {
        let mask = [0x11, 0x22, 0x33, 0x44];
        let mut bytes = vec![first];
        match payload.len() {
            n if n < 126 => bytes.push(0x80 | n as u8),
            n => {
                bytes.push(0x80 | 126);
                bytes.extend_from_slice(&(n as u16).to_be_bytes());
            }
        }
        bytes.extend_from_slice(&mask);
        bytes.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
        bytes
    }

    /// Fuzz target: the bytes a WebSocket client sends, read frame by
    /// frame as a session reads them: every input ends in frames, an end
    /// or an error; no frame's payload is over the message bound.
    #[test]
    fn fuzz_websocket_frames() {
        let runtime = tokio::runtime::Builder::new_current_thread().build().expect("runtime");
        let session =
            [masked(0x82, b"\x00ls\n"), masked(0x89, b"ping"), masked(0x02, b"\x00a"), masked(0x80, b"b")].concat();
        let long = masked(0x82, &[7u8; 300]);
        let close = masked(0x88, &1000u16.to_be_bytes());
        let ran = crate::fuzz::Fuzz::new("websocket-frames").seed(session).seed(long).seed(close).run(|input| {
            runtime.block_on(async {
                let mut reader = input;
                for _ in 0..=input.len() {
                    match read_frame(&mut reader).await {
                        Ok(Some(frame)) => assert!(frame.payload.len() <= MAX_MESSAGE),
                        Ok(None) | Err(_) => break,
                    }
                }
            });
        });
        assert!(ran > 3);
    }
}
