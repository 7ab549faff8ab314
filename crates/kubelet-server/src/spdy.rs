//! `kubectl exec` and `attach` served by the node itself (for providers
//! that run sessions: [`StreamingEndpoint::Session`]): the SPDY/3.1
//! connection the API server passes through from kubectl, with Kubernetes'
//! remote-command protocol on it (`v4.channel.k8s.io` down to
//! `channel.k8s.io`).
//!
//! The client opens its streams (a `streamtype` header: `error`, `stdin`,
//! `stdout`, `stderr`, `resize`), each answered at once; when all it asked
//! for are there (within 30 s), the session runs with them: stdin's data
//! goes to the provider, its stdout and stderr come back as data frames,
//! each ended with FIN when the provider closes it. Then the error stream
//! carries the outcome (v4: a `v1.Status`, `NonZeroExitCode` with the
//! exit code in its causes; v2/v3: the message on failure only), the
//! streams are reset, a GOAWAY is sent and the connection closed.
//! Header blocks are zlib with the SPDY/3 dictionary (read), plain zlib
//! with a sync flush after each block (written); there is no flow control
//! (kubectl's SPDY has none), PINGs are echoed.
//!
//! [`StreamingEndpoint::Session`]: crate::provider::StreamingEndpoint::Session

use std::collections::HashMap;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _};
use tokio::sync::mpsc;

use super::spdy_dictionary::SPDY3_DICTIONARY;
use crate::provider::{SessionStreams, StreamRequest, StreamSession};

/// The remote-command protocols the node serves, best first.
pub(crate) const PROTOCOLS: &[&str] =
    &["v4.channel.k8s.io", "v3.channel.k8s.io", "v2.channel.k8s.io", "channel.k8s.io"];

/// How long the client has to open its streams.
const STREAM_CREATION_DEADLINE: Duration = Duration::from_secs(30);
/// A session with no frame from the client for this long is over
/// (upstream's streaming idle timeout; kubectl pings every 5 s).
const IDLE_DEADLINE: Duration = Duration::from_secs(4 * 3600);
/// How long the session's output may take to drain after it ended.
const DRAIN_DEADLINE: Duration = Duration::from_secs(10);
/// Inflate passes for one header block at most (each yields at least 1 KiB).
const MAX_INFLATE_PASSES: usize = 2048;
/// A header block larger than this is refused.
const MAX_HEADER_BLOCK: usize = 1 << 20;
/// Bytes read from a provider's output per data frame at most.
const DATA_CHUNK: usize = 32 * 1024;
/// A duplex pipe's buffer.
const PIPE: usize = 64 * 1024;

const SYN_STREAM: u16 = 1;
const SYN_REPLY: u16 = 2;
const RST_STREAM: u16 = 3;
const PING: u16 = 6;
const GOAWAY: u16 = 7;
const FLAG_FIN: u8 = 0x01;
const RST_CANCEL: u32 = 5;
const RST_PROTOCOL_ERROR: u32 = 1;

/// A frame as read.
#[derive(Debug)]
enum Frame {
    Data { stream: u32, fin: bool, data: Vec<u8> },
    SynStream { stream: u32, headers: Vec<(String, String)> },
    RstStream { stream: u32 },
    Ping { id: u32 },
    GoAway,
    Other,
}

/// A frame to write.
#[derive(Debug)]
enum Out {
    Data { stream: u32, fin: bool, data: Vec<u8> },
    SynReply { stream: u32 },
    RstStream { stream: u32, status: u32 },
    Ping { id: u32 },
    GoAway { last: u32 },
}

fn invalid(message: impl Into<String>) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, message.into())
}

/// Reads frames; inflates header blocks with one zlib stream.
struct Reader<R> {
    io: R,
    inflate: flate2::Decompress,
}

impl<R: AsyncRead + Unpin> Reader<R> {
    fn new(io: R) -> Self {
        Reader { io, inflate: flate2::Decompress::new(true) }
    }

    /// The next frame; `None` at the end of the connection.
    async fn next(&mut self) -> std::io::Result<Option<Frame>> {
        let mut head = [0u8; 8];
        match self.io.read_exact(&mut head).await {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
            Err(e) => return Err(e),
        }
        let word = u32::from_be_bytes([head[0], head[1], head[2], head[3]]);
        let flags = head[4];
        let length = usize::from(head[5]) << 16 | usize::from(head[6]) << 8 | usize::from(head[7]);
        let mut payload = vec![0u8; length];
        self.io.read_exact(&mut payload).await?;
        if word & 0x8000_0000 == 0 {
            return Ok(Some(Frame::Data { stream: word & 0x7fff_ffff, fin: flags & FLAG_FIN != 0, data: payload }));
        }
        let kind = (word & 0xffff) as u16;
        let u32_at = |i: usize| -> std::io::Result<u32> {
            payload
                .get(i..i + 4)
                .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
                .ok_or_else(|| invalid(format!("SPDY frame of type {kind} is too short")))
        };
        Ok(Some(match kind {
            SYN_STREAM => {
                let stream = u32_at(0)? & 0x7fff_ffff;
                let block = payload.get(10..).ok_or_else(|| invalid("SYN_STREAM too short"))?;
                Frame::SynStream { stream, headers: self.headers(block)? }
            }
            RST_STREAM => Frame::RstStream { stream: u32_at(0)? & 0x7fff_ffff },
            PING => Frame::Ping { id: u32_at(0)? },
            GOAWAY => Frame::GoAway,
            // SYN_REPLY and HEADERS carry header blocks: they go through
            // the inflater to keep its state, and are otherwise ignored.
            2 | 8 => {
                let block = payload.get(4..).ok_or_else(|| invalid("header frame too short"))?;
                self.headers(block)?;
                Frame::Other
            }
            _ => Frame::Other,
        }))
    }

    /// Inflates and parses one header block. The zlib stream never ends
    /// (each block is sync-flushed): an end, or a pass that makes no
    /// progress, is an error, never a loop.
    fn headers(&mut self, block: &[u8]) -> std::io::Result<Vec<(String, String)>> {
        let mut out: Vec<u8> = Vec::with_capacity(block.len() * 4 + 64);
        let mut input = block;
        for _ in 0..MAX_INFLATE_PASSES {
            let (before_in, before_out) = (self.inflate.total_in(), self.inflate.total_out());
            if out.capacity() - out.len() < 1024 {
                out.reserve(4096);
            }
            let result = self.inflate.decompress_vec(input, &mut out, flate2::FlushDecompress::Sync);
            let consumed = usize::try_from(self.inflate.total_in() - before_in).unwrap_or(usize::MAX);
            let produced = self.inflate.total_out() - before_out;
            input = &input[consumed.min(input.len())..];
            match result {
                Ok(flate2::Status::StreamEnd) => return Err(invalid("the SPDY header stream ended")),
                Ok(_) => {}
                Err(error) if error.needs_dictionary().is_some() => {
                    self.inflate
                        .set_dictionary(SPDY3_DICTIONARY)
                        .map_err(|e| invalid(format!("SPDY header dictionary: {e}")))?;
                    continue;
                }
                Err(error) => return Err(invalid(format!("SPDY header block: {error}"))),
            }
            if out.len() > MAX_HEADER_BLOCK {
                return Err(invalid("SPDY header block too large"));
            }
            if input.is_empty() && out.capacity() > out.len() {
                return parse_header_block(&out);
            }
            if consumed == 0 && produced == 0 && out.capacity() > out.len() {
                return Err(invalid("SPDY header block: no progress"));
            }
        }
        Err(invalid("SPDY header block: too many inflate passes"))
    }
}

/// `u32 count`, then `u32 len, name, u32 len, value` pairs.
fn parse_header_block(block: &[u8]) -> std::io::Result<Vec<(String, String)>> {
    let mut rest = block;
    let take_u32 = |rest: &mut &[u8]| -> std::io::Result<usize> {
        let bytes = rest.get(..4).ok_or_else(|| invalid("header block truncated"))?;
        let value = u32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
        *rest = &rest[4..];
        usize::try_from(value).map_err(|_| invalid("header length"))
    };
    let count = take_u32(&mut rest)?;
    let mut headers = Vec::with_capacity(count.min(64));
    for _ in 0..count {
        let text = |rest: &mut &[u8]| -> std::io::Result<String> {
            let length = take_u32(rest)?;
            let bytes = rest.get(..length).ok_or_else(|| invalid("header block truncated"))?;
            *rest = &rest[length..];
            Ok(String::from_utf8_lossy(bytes).into_owned())
        };
        let name = text(&mut rest)?;
        let value = text(&mut rest)?;
        headers.push((name.to_ascii_lowercase(), value));
    }
    Ok(headers)
}

/// Serializes frames; deflates header blocks with one zlib stream.
struct Writer {
    deflate: flate2::Compress,
}

impl Writer {
    fn new() -> Self {
        Writer { deflate: flate2::Compress::new(flate2::Compression::default(), true) }
    }

    /// An empty header block, deflated and sync-flushed.
    fn empty_block(&mut self) -> std::io::Result<Vec<u8>> {
        let block = 0u32.to_be_bytes();
        let mut out = Vec::with_capacity(64);
        let mut input: &[u8] = &block;
        loop {
            let before_in = self.deflate.total_in();
            out.reserve(64);
            self.deflate
                .compress_vec(input, &mut out, flate2::FlushCompress::Sync)
                .map_err(|e| invalid(format!("SPDY header block: {e}")))?;
            let consumed = usize::try_from(self.deflate.total_in() - before_in).unwrap_or(usize::MAX);
            input = &input[consumed.min(input.len())..];
            // Done once the input is in and the flush marker is out.
            if input.is_empty() && out.len() < out.capacity() {
                return Ok(out);
            }
        }
    }

    fn encode(&mut self, frame: &Out) -> std::io::Result<Vec<u8>> {
        let control = |kind: u16, flags: u8, payload: &[u8]| {
            let mut bytes = Vec::with_capacity(8 + payload.len());
            bytes.extend_from_slice(&(0x8003_0000u32 | u32::from(kind)).to_be_bytes());
            let length = u32::try_from(payload.len()).unwrap_or(0) & 0x00ff_ffff;
            bytes.extend_from_slice(&(u32::from(flags) << 24 | length).to_be_bytes());
            bytes.extend_from_slice(payload);
            bytes
        };
        Ok(match frame {
            Out::Data { stream, fin, data } => {
                let mut bytes = Vec::with_capacity(8 + data.len());
                bytes.extend_from_slice(&(stream & 0x7fff_ffff).to_be_bytes());
                let flags = if *fin { FLAG_FIN } else { 0 };
                let length = u32::try_from(data.len()).unwrap_or(0) & 0x00ff_ffff;
                bytes.extend_from_slice(&(u32::from(flags) << 24 | length).to_be_bytes());
                bytes.extend_from_slice(data);
                bytes
            }
            Out::SynReply { stream } => {
                let mut payload = stream.to_be_bytes().to_vec();
                payload.extend_from_slice(&self.empty_block()?);
                control(SYN_REPLY, 0, &payload)
            }
            Out::RstStream { stream, status } => {
                let mut payload = stream.to_be_bytes().to_vec();
                payload.extend_from_slice(&status.to_be_bytes());
                control(RST_STREAM, 0, &payload)
            }
            Out::Ping { id } => control(PING, 0, &id.to_be_bytes()),
            Out::GoAway { last } => {
                let mut payload = last.to_be_bytes().to_vec();
                payload.extend_from_slice(&0u32.to_be_bytes());
                control(GOAWAY, 0, &payload)
            }
        })
    }
}

/// The protocol to answer with: the first of the client's (in its order)
/// that the node serves.
pub(crate) fn negotiate<'a>(client: impl Iterator<Item = &'a str>) -> Option<&'static str> {
    let offered: Vec<&str> = client.flat_map(|v| v.split(',')).map(str::trim).filter(|v| !v.is_empty()).collect();
    offered.iter().find_map(|p| PROTOCOLS.iter().find(|s| *s == p).copied())
}

/// What the session's outcome puts on the error stream.
pub(crate) fn outcome_message(protocol: &str, outcome: &Result<i32, String>, command: &[String]) -> Option<Vec<u8>> {
    let v4 = protocol == "v4.channel.k8s.io";
    match outcome {
        Ok(0) if v4 => Some(br#"{"metadata":{},"status":"Success"}"#.to_vec()),
        Ok(0) => None,
        Ok(code) => {
            let code = (*code).clamp(0, 255);
            let message = format!(
                "command terminated with non-zero exit code: error executing command {command:?}, exit code {code}"
            );
            Some(if v4 {
                serde_json::json!({
                    "metadata": {}, "status": "Failure", "message": message, "reason": "NonZeroExitCode",
                    "details": {"causes": [{"reason": "ExitCode", "message": code.to_string()}]},
                })
                .to_string()
                .into_bytes()
            } else {
                message.into_bytes()
            })
        }
        Err(error) => {
            let message = format!("error executing command in container: {error}");
            Some(if v4 {
                serde_json::json!({
                    "metadata": {}, "status": "Failure", "message": format!("Internal error occurred: {message}"),
                    "reason": "InternalError", "details": {"causes": [{"message": message}]}, "code": 500,
                })
                .to_string()
                .into_bytes()
            } else {
                message.into_bytes()
            })
        }
    }
}

/// Serves one session on an upgraded connection, to its end.
pub(crate) async fn serve<IO>(io: IO, protocol: &'static str, options: StreamRequest, session: Box<dyn StreamSession>)
where
    IO: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let (read_half, write_half) = tokio::io::split(io);
    let (out, outgoing) = mpsc::channel::<Out>(64);
    // Not supervised: one session's writer.
    let writer = tokio::spawn(write_frames(write_half, outgoing));
    let mut reader = Reader::new(read_half);
    let resize_expected = options.tty && matches!(protocol, "v4.channel.k8s.io" | "v3.channel.k8s.io");
    let expected = 1
        + usize::from(options.stdin)
        + usize::from(options.stdout)
        + usize::from(options.stderr)
        + usize::from(resize_expected);
    let mut opened = Opened::default();
    match tokio::time::timeout(STREAM_CREATION_DEADLINE, opened.gather(&mut reader, &out, expected)).await {
        Ok(Ok(())) => {}
        Ok(Err(error)) => {
            tracing::debug!(%error, "streaming session ended before it began");
            return;
        }
        Err(_) => {
            tracing::warn!("timed out waiting for the client to create its streams");
            drain(out, writer).await;
            return;
        }
    }
    let (mut stdin_pipe, provider_streams, forwarders) = opened.join(&out);
    // The session runs while the connection's frames are read.
    let stdin_stream = opened.streams.get("stdin").copied();
    let (reader, out_ref) = (&mut reader, &out);
    let client = async move {
        loop {
            let frame =
                tokio::time::timeout(IDLE_DEADLINE, reader.next()).await.unwrap_or_else(|_| Err(invalid("idle")));
            if !client_frame(frame, stdin_stream, &mut stdin_pipe, out_ref).await {
                return;
            }
        }
    };
    let Some(outcome) = run_while_connected(session.run(provider_streams), client, forwarders).await else {
        drain(out, writer).await;
        return;
    };
    opened.close(&out, protocol, outcome.map_err(|e| e.message), &options.command).await;
    drain(out, writer).await;
}

/// Runs a session to its end while `client` takes the client's frames
/// (it ends when the client left, or was idle too long). `None` when the
/// client left first. The session and `client` (the node's end of the
/// session's stdin with it) are dropped before this returns; after a
/// session's end, its output still in `forwarders` is sent first.
pub(crate) async fn run_while_connected<T>(
    run: impl Future<Output = T>,
    client: impl Future<Output = ()>,
    forwarders: Vec<tokio::task::JoinHandle<()>>,
) -> Option<T> {
    let outcome = tokio::select! {
        outcome = run => Some(outcome),
        () = client => None,
    };
    match outcome {
        // The session was dropped (a provider's instance with it).
        None => tracing::debug!("the client left the streaming session"),
        Some(_) => {
            let _ = tokio::time::timeout(DRAIN_DEADLINE, futures_util::future::join_all(forwarders)).await;
        }
    }
    outcome
}

/// Drops the session's last sender `out` and lets its `writer` send what
/// is queued, for at most the drain deadline.
pub(crate) async fn drain<T>(out: mpsc::Sender<T>, writer: tokio::task::JoinHandle<()>) {
    drop(out);
    let _ = tokio::time::timeout(DRAIN_DEADLINE, writer).await;
}

/// Encodes and writes the session's frames until the channel closes or a
/// GOAWAY is sent.
async fn write_frames<W: AsyncWrite + Unpin>(mut write_half: W, mut outgoing: mpsc::Receiver<Out>) {
    let mut writer = Writer::new();
    while let Some(frame) = outgoing.recv().await {
        let is_goaway = matches!(frame, Out::GoAway { .. });
        let bytes = match writer.encode(&frame) {
            Ok(bytes) => bytes,
            Err(error) => {
                tracing::debug!(%error, "cannot encode a SPDY frame");
                return;
            }
        };
        if write_half.write_all(&bytes).await.is_err() {
            return;
        }
        if is_goaway {
            let _ = write_half.flush().await;
            let _ = write_half.shutdown().await;
            return;
        }
    }
    let _ = write_half.shutdown().await;
}

/// One frame from the client while the session runs: stdin data goes to
/// the session, pings are answered. `false`: the client is gone.
async fn client_frame(
    frame: std::io::Result<Option<Frame>>,
    stdin_stream: Option<u32>,
    stdin_pipe: &mut Option<tokio::io::DuplexStream>,
    out: &mpsc::Sender<Out>,
) -> bool {
    match frame {
        Ok(Some(Frame::Data { stream, fin, data })) if Some(stream) == stdin_stream => {
            if let Some(pipe) = stdin_pipe.as_mut()
                && !data.is_empty()
                && pipe.write_all(&data).await.is_err()
            {
                *stdin_pipe = None;
            }
            if fin {
                // End of input.
                *stdin_pipe = None;
            }
        }
        Ok(Some(Frame::RstStream { stream })) if Some(stream) == stdin_stream => *stdin_pipe = None,
        Ok(Some(Frame::Ping { id })) => {
            let _ = out.send(Out::Ping { id }).await;
        }
        Ok(Some(Frame::GoAway)) | Ok(None) | Err(_) => return false,
        Ok(Some(_)) => {}
    }
    true
}

/// The streams the client opened, by type (`error`, `stdin`, `stdout`,
/// `stderr`, `resize`), and the last stream ID it used.
#[derive(Default)]
struct Opened {
    streams: HashMap<String, u32>,
    last_stream: u32,
}

impl Opened {
    /// Reads frames until the client opened `expected` streams, answering
    /// each at once.
    async fn gather<R: AsyncRead + Unpin>(
        &mut self,
        reader: &mut Reader<R>,
        out: &mpsc::Sender<Out>,
        expected: usize,
    ) -> std::io::Result<()> {
        while self.streams.len() < expected {
            let Some(frame) = reader.next().await? else {
                return Err(invalid("the client left before opening its streams"));
            };
            match frame {
                Frame::SynStream { stream, headers } => {
                    if stream <= self.last_stream {
                        let _ = out.send(Out::RstStream { stream, status: RST_PROTOCOL_ERROR }).await;
                        continue;
                    }
                    self.last_stream = stream;
                    let _ = out.send(Out::SynReply { stream }).await;
                    let kind = headers.iter().find(|(n, _)| n == "streamtype").map(|(_, v)| v.clone());
                    match kind.as_deref() {
                        Some(kind @ ("error" | "stdin" | "stdout" | "stderr" | "resize")) => {
                            self.streams.insert(kind.to_owned(), stream);
                        }
                        other => tracing::debug!(?other, "a SPDY stream of an unknown type"),
                    }
                }
                Frame::Ping { id } => {
                    let _ = out.send(Out::Ping { id }).await;
                }
                Frame::GoAway => return Err(invalid("the client went away")),
                _ => {}
            }
        }
        Ok(())
    }

    /// The session's ends of the client's streams: a pipe for stdin (our
    /// end returned), and tasks forwarding stdout and stderr as DATA frames.
    fn join(
        &self,
        out: &mpsc::Sender<Out>,
    ) -> (Option<tokio::io::DuplexStream>, SessionStreams, Vec<tokio::task::JoinHandle<()>>) {
        let mut provider_streams = SessionStreams::default();
        let mut stdin_pipe = None;
        if self.streams.contains_key("stdin") {
            let (ours, theirs) = tokio::io::duplex(PIPE);
            stdin_pipe = Some(ours);
            provider_streams.stdin = Some(theirs);
        }
        let mut forwarders = Vec::new();
        for (kind, slot) in [("stdout", &mut provider_streams.stdout), ("stderr", &mut provider_streams.stderr)] {
            let Some(&stream) = self.streams.get(kind) else { continue };
            let (mut ours, theirs) = tokio::io::duplex(PIPE);
            *slot = Some(theirs);
            let out = out.clone();
            // Not supervised: one session's stream.
            forwarders.push(tokio::spawn(async move {
                let mut buffer = vec![0u8; DATA_CHUNK];
                loop {
                    match ours.read(&mut buffer).await {
                        Ok(0) | Err(_) => {
                            let _ = out.send(Out::Data { stream, fin: true, data: Vec::new() }).await;
                            return;
                        }
                        Ok(n) => {
                            if out.send(Out::Data { stream, fin: false, data: buffer[..n].to_vec() }).await.is_err() {
                                return;
                            }
                        }
                    }
                }
            }));
        }
        (stdin_pipe, provider_streams, forwarders)
    }

    /// Sends the session's outcome on the error stream, resets stdin and
    /// resize, and says GOAWAY.
    async fn close(&self, out: &mpsc::Sender<Out>, protocol: &str, outcome: Result<i32, String>, command: &[String]) {
        if let (Some(&stream), Some(message)) =
            (self.streams.get("error"), outcome_message(protocol, &outcome, command))
        {
            let _ = out.send(Out::Data { stream, fin: true, data: message }).await;
        }
        for (kind, &stream) in &self.streams {
            if matches!(kind.as_str(), "stdin" | "resize") {
                let _ = out.send(Out::RstStream { stream, status: RST_CANCEL }).await;
            }
        }
        let _ = out.send(Out::GoAway { last: self.last_stream }).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_protocol_of_the_client_the_node_serves_is_chosen() {
        let offered = ["v4.channel.k8s.io", "v3.channel.k8s.io", "v2.channel.k8s.io", "channel.k8s.io"];
        assert_eq!(negotiate(offered.into_iter()), Some("v4.channel.k8s.io"));
        assert_eq!(negotiate(["v9.channel.k8s.io, v2.channel.k8s.io"].into_iter()), Some("v2.channel.k8s.io"));
        assert_eq!(negotiate(["portforward.k8s.io"].into_iter()), None);
        assert_eq!(negotiate(std::iter::empty()), None);
    }

    #[test]
    fn kubectls_header_block_is_read_with_the_dictionary() {
        // {streamtype: error}, deflated with the dictionary as kubectl does.
        let block = [
            0x78, 0xf9, 0xe3, 0xc6, 0xa7, 0xc2, 0x02, 0xa6, 0x23, 0x46, 0x70, 0x3a, 0x2b, 0x29, 0x4a, 0x4d, 0xcc, 0x85,
            0x16, 0x25, 0xac, 0xa9, 0xa0, 0x80, 0x06, 0x00, 0x00, 0x00, 0xff, 0xff,
        ];
        let mut reader = Reader::new(tokio::io::empty());
        assert_eq!(reader.headers(&block).expect("headers"), [("streamtype".to_owned(), "error".to_owned())]);
    }

    #[test]
    fn a_header_block_that_ends_the_zlib_stream_is_an_error_not_a_loop() {
        use std::io::Write as _;
        let mut encoder = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
        encoder.write_all(&[0, 0, 0, 0]).expect("write");
        let mut block = encoder.finish().expect("finish");
        block.push(0x42);
        let mut reader = Reader::new(tokio::io::empty());
        assert!(reader.headers(&block).is_err());
        assert!(reader.headers(&[0x78, 0x9c, 0xff, 0xff, 0xff]).is_err(), "garbage");
    }

    #[test]
    fn written_header_blocks_end_with_the_sync_flush_marker() {
        let mut writer = Writer::new();
        let first = writer.encode(&Out::SynReply { stream: 1 }).expect("frame");
        assert_eq!(&first[..4], &[0x80, 0x03, 0x00, 0x02]);
        assert_eq!(&first[8..12], &1u32.to_be_bytes());
        assert_eq!(&first[first.len() - 4..], &[0x00, 0x00, 0xff, 0xff]);
        let second = writer.encode(&Out::SynReply { stream: 3 }).expect("frame");
        assert_eq!(&second[second.len() - 4..], &[0x00, 0x00, 0xff, 0xff]);
        // Our own reader reads them back (one stream across frames).
        let mut reader = Reader::new(tokio::io::empty());
        assert_eq!(reader.headers(&first[12..]).expect("first"), []);
        assert_eq!(reader.headers(&second[12..]).expect("second"), []);
    }

    #[test]
    fn the_outcome_is_a_status_on_v4_and_text_before() {
        let command = vec!["sh".to_owned()];
        let ok = outcome_message("v4.channel.k8s.io", &Ok(0), &command).expect("v4 says success");
        assert_eq!(ok, br#"{"metadata":{},"status":"Success"}"#);
        let failed = outcome_message("v4.channel.k8s.io", &Ok(3), &command).expect("a status");
        let status: serde_json::Value = serde_json::from_slice(&failed).expect("json");
        assert_eq!(status["reason"], "NonZeroExitCode");
        assert_eq!(status["details"]["causes"][0], serde_json::json!({"reason": "ExitCode", "message": "3"}));
        assert_eq!(outcome_message("v3.channel.k8s.io", &Ok(0), &command), None);
        let text = outcome_message("v2.channel.k8s.io", &Err("boom".into()), &command).expect("text");
        assert_eq!(String::from_utf8(text).expect("utf8"), "error executing command in container: boom");
    }

    /// Fuzz target: the bytes a SPDY client sends, read frame by frame
    /// (header blocks inflated with the dictionary, `u32`-counted header
    /// lists); the reader must end every input with a frame, an end or an
    /// error, never a panic or a loop.
    #[test]
    fn fuzz_spdy_frames() {
        let runtime = tokio::runtime::Builder::new_current_thread().build().expect("runtime");
        let kubectl_block: [u8; 30] = [
            0x78, 0xf9, 0xe3, 0xc6, 0xa7, 0xc2, 0x02, 0xa6, 0x23, 0x46, 0x70, 0x3a, 0x2b, 0x29, 0x4a, 0x4d, 0xcc, 0x85,
            0x16, 0x25, 0xac, 0xa9, 0xa0, 0x80, 0x06, 0x00, 0x00, 0x00, 0xff, 0xff,
        ];
        let mut syn = (0x8003_0001u32).to_be_bytes().to_vec();
        syn.extend_from_slice(&((10 + kubectl_block.len()) as u32).to_be_bytes());
        syn.extend_from_slice(&1u32.to_be_bytes());
        syn.extend_from_slice(&[0, 0, 0, 0, 0, 0]);
        syn.extend_from_slice(&kubectl_block);
        let mut writer = Writer::new();
        let mut session = syn.clone();
        session.extend(writer.encode(&Out::Data { stream: 1, fin: false, data: b"ls\n".to_vec() }).expect("data"));
        session.extend(writer.encode(&Out::Ping { id: 7 }).expect("ping"));
        session.extend(writer.encode(&Out::RstStream { stream: 1, status: 5 }).expect("rst"));
        let ran = crate::fuzz::Fuzz::new("spdy-frames").seed(syn).seed(session).run(|input| {
            runtime.block_on(async {
                let mut reader = Reader::new(input);
                for _ in 0..=input.len() {
                    match reader.next().await {
                        Ok(Some(_)) => {}
                        Ok(None) | Err(_) => break,
                    }
                }
            });
            let _ = parse_header_block(input);
        });
        assert!(ran > 2);
    }
}
