//! Accepting the raw socket path that older grpc-go clients send as the
//! HTTP/2 `:authority`.
//!
//! grpc-go clients that dial a Unix socket send the socket path as
//! `:authority`. Recent grpc-go percent-encodes it (`%2Fvar%2Flib%2F…`), but
//! the grpc-go vendored in Kubernetes 1.28 — and in many device plugins still
//! deployed — sends `/var/lib/…` as is. That is not a valid authority, and the
//! Rust `h2` server refuses the stream (`PROTOCOL_ERROR`) before tonic sees
//! the request.
//!
//! [`AuthorityFix`] sits between the socket and the HTTP/2 server and
//! rewrites, in the client-to-server direction only, every header block: it
//! decodes the block with the connection's HPACK state, replaces an
//! `:authority` the server would refuse with `localhost`, and encodes the
//! block again with an HPACK encoder of its own whose dynamic table is
//! empty (static-table references and literals only), so the server's
//! decoder never depends on state the client built. Every other frame passes
//! through untouched. A connection that does not start with the HTTP/2
//! preface is passed through untouched too.
//!
//! A header block is buffered (HEADERS + CONTINUATION frames) only up to
//! [`MAX_HEADER_LIST_SIZE`], the limit our servers announce: a larger one is
//! handed to the server as it came, and from then on the connection passes
//! through, so the server rejects it as the protocol error it is (h2 answers
//! with GOAWAY) and a client cannot make the node buffer without bound.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use fluke_hpack::{Decoder, Encoder};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const FRAME_HEADER: usize = 9;
const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// The smallest SETTINGS_MAX_FRAME_SIZE a server may announce: re-encoded
/// blocks are split to fit it whatever the server announced.
const MAX_FRAME: usize = 16_384;
/// Frames larger than any server accepts: stop interpreting, pass through.
const MAX_SANE_FRAME: usize = 16 * 1024 * 1024;
/// The largest header block buffered: the header list size limit the
/// servers behind this announce (hyper's default, which tonic keeps). An
/// encoded block larger than this decodes larger still, so the server would
/// refuse it anyway.
pub(crate) const MAX_HEADER_LIST_SIZE: usize = 16 * 1024;

enum Mode {
    Preface,
    Frames,
    PassThrough,
}

/// A header block being collected over HEADERS + CONTINUATION frames.
struct Pending {
    stream_id: u32,
    end_stream: bool,
    priority: Option<[u8; 5]>,
    block: Vec<u8>,
    original: Vec<u8>,
}

/// An IO stream whose incoming HTTP/2 header blocks get a valid `:authority`.
pub struct AuthorityFix<IO> {
    inner: IO,
    mode: Mode,
    /// Bytes read from `inner`, not yet processed.
    raw: Vec<u8>,
    /// Processed bytes, not yet handed to the reader.
    out: Vec<u8>,
    out_pos: usize,
    eof: bool,
    decoder: Decoder<'static>,
    encoder: Encoder<'static>,
    pending: Option<Pending>,
}

impl<IO> AuthorityFix<IO> {
    /// Wraps an accepted connection.
    pub fn new(inner: IO) -> Self {
        AuthorityFix {
            inner,
            mode: Mode::Preface,
            raw: Vec::new(),
            out: Vec::new(),
            out_pos: 0,
            eof: false,
            decoder: Decoder::new(),
            encoder: {
                // No dynamic table: nothing the server decodes depends on
                // blocks this layer did not re-encode.
                let mut encoder = Encoder::new();
                encoder.set_max_table_size(0);
                encoder
            },
            pending: None,
        }
    }

    /// The wrapped connection.
    pub fn get_ref(&self) -> &IO {
        &self.inner
    }

    /// Moves whatever can be processed from `raw` to `out`.
    fn process(&mut self) {
        loop {
            match self.mode {
                Mode::PassThrough => {
                    self.out.append(&mut self.raw);
                    return;
                }
                Mode::Preface => {
                    let n = self.raw.len().min(PREFACE.len());
                    if self.raw[..n] != PREFACE[..n] {
                        self.mode = Mode::PassThrough;
                        continue;
                    }
                    if n < PREFACE.len() {
                        return;
                    }
                    self.out.extend(self.raw.drain(..PREFACE.len()));
                    self.mode = Mode::Frames;
                }
                Mode::Frames => {
                    if self.raw.len() < FRAME_HEADER {
                        return;
                    }
                    let len = usize::from(self.raw[0]) << 16 | usize::from(self.raw[1]) << 8 | usize::from(self.raw[2]);
                    if len > MAX_SANE_FRAME {
                        self.flush_pending_as_is();
                        self.mode = Mode::PassThrough;
                        continue;
                    }
                    if self.raw.len() < FRAME_HEADER + len {
                        return;
                    }
                    let frame: Vec<u8> = self.raw.drain(..FRAME_HEADER + len).collect();
                    self.frame(frame);
                }
            }
        }
    }

    fn frame(&mut self, frame: Vec<u8>) {
        let kind = frame[3];
        let flags = frame[4];
        let stream_id = u32::from_be_bytes([frame[5], frame[6], frame[7], frame[8]]) & 0x7fff_ffff;
        let payload = &frame[FRAME_HEADER..];
        match kind {
            HEADERS => {
                self.flush_pending_as_is();
                let Some((priority, fragment)) = split_headers_payload(flags, payload) else {
                    self.out.extend_from_slice(&frame);
                    return;
                };
                self.pending = Some(Pending {
                    stream_id,
                    end_stream: flags & END_STREAM != 0,
                    priority,
                    block: fragment.to_vec(),
                    original: frame.clone(),
                });
            }
            CONTINUATION if self.pending.as_ref().is_some_and(|p| p.stream_id == stream_id) => {
                if let Some(pending) = self.pending.as_mut() {
                    pending.block.extend_from_slice(payload);
                    pending.original.extend_from_slice(&frame);
                }
            }
            _ => {
                // Anything else inside a header block is a protocol error the
                // server will report; hand it the bytes as they came.
                self.flush_pending_as_is();
                self.out.extend_from_slice(&frame);
                return;
            }
        }
        if self.pending.as_ref().is_some_and(|p| p.block.len() > MAX_HEADER_LIST_SIZE) {
            // Too large to be accepted: the server says so, not us.
            self.flush_pending_as_is();
            self.mode = Mode::PassThrough;
            return;
        }
        if flags & END_HEADERS != 0
            && let Some(pending) = self.pending.take()
        {
            self.finish(pending);
        }
    }

    fn flush_pending_as_is(&mut self) {
        if let Some(pending) = self.pending.take() {
            self.out.extend_from_slice(&pending.original);
        }
    }

    fn finish(&mut self, pending: Pending) {
        let Ok(headers) = self.decoder.decode(&pending.block) else {
            // Undecodable: the server's own decoder will say so.
            self.out.extend_from_slice(&pending.original);
            self.mode = Mode::PassThrough;
            return;
        };
        let fixed: Vec<(Vec<u8>, Vec<u8>)> = headers
            .into_iter()
            .map(|(name, value)| {
                let value = if name.as_slice() == b":authority" { fix_authority(&value) } else { value };
                (name, value)
            })
            .collect();
        let block = self.encoder.encode(fixed.iter().map(|(n, v)| (n.as_slice(), v.as_slice())));
        let mut chunks = block.chunks(MAX_FRAME - 5).peekable();
        let mut first = true;
        // An empty block still needs its HEADERS frame.
        let empty: [&[u8]; 1] = [&[]];
        let mut iter: Box<dyn Iterator<Item = &[u8]>> =
            if chunks.peek().is_none() { Box::new(empty.into_iter()) } else { Box::new(chunks) };
        let mut next = iter.next();
        while let Some(chunk) = next {
            next = iter.next();
            let last = next.is_none();
            let mut flags = if last { END_HEADERS } else { 0 };
            let mut payload = Vec::with_capacity(chunk.len() + 5);
            let kind = if first {
                if pending.end_stream {
                    flags |= END_STREAM;
                }
                if let Some(priority) = pending.priority {
                    flags |= PRIORITY;
                    payload.extend_from_slice(&priority);
                }
                HEADERS
            } else {
                CONTINUATION
            };
            payload.extend_from_slice(chunk);
            write_frame_header(&mut self.out, payload.len(), kind, flags, pending.stream_id);
            self.out.extend_from_slice(&payload);
            first = false;
        }
    }
}

/// The priority fields and the header block fragment of a HEADERS payload.
fn split_headers_payload(flags: u8, payload: &[u8]) -> Option<(Option<[u8; 5]>, &[u8])> {
    let mut start = 0;
    let mut pad = 0;
    if flags & PADDED != 0 {
        pad = usize::from(*payload.first()?);
        start = 1;
    }
    let mut priority = None;
    if flags & PRIORITY != 0 {
        priority = Some(payload.get(start..start + 5)?.try_into().ok()?);
        start += 5;
    }
    let end = payload.len().checked_sub(pad)?;
    Some((priority, payload.get(start..end)?))
}

/// Keeps an authority the `http` crate accepts; anything else becomes
/// `localhost`. Both grpc-go forms need this: the raw path (old) and the
/// percent-encoded path (recent), which `http` refuses as well. Over a Unix
/// socket the authority names nothing, so nothing is lost.
fn fix_authority(value: &[u8]) -> Vec<u8> {
    if http::uri::Authority::try_from(value).is_ok() { value.to_vec() } else { b"localhost".to_vec() }
}

fn write_frame_header(out: &mut Vec<u8>, len: usize, kind: u8, flags: u8, stream_id: u32) {
    out.extend_from_slice(&[(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags]);
    out.extend_from_slice(&stream_id.to_be_bytes());
}

impl<IO: AsyncRead + Unpin> AsyncRead for AuthorityFix<IO> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        loop {
            if this.out_pos < this.out.len() {
                let n = buf.remaining().min(this.out.len() - this.out_pos);
                buf.put_slice(&this.out[this.out_pos..this.out_pos + n]);
                this.out_pos += n;
                if this.out_pos == this.out.len() {
                    this.out.clear();
                    this.out_pos = 0;
                }
                return Poll::Ready(Ok(()));
            }
            if this.eof {
                // Whatever is left is an incomplete frame: hand it over as is.
                this.flush_pending_as_is();
                this.out.append(&mut this.raw);
                if this.out.is_empty() {
                    return Poll::Ready(Ok(()));
                }
                continue;
            }
            let mut chunk = [0u8; 16 * 1024];
            let mut read = ReadBuf::new(&mut chunk);
            match Pin::new(&mut this.inner).poll_read(cx, &mut read) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Ready(Ok(())) => {
                    if read.filled().is_empty() {
                        this.eof = true;
                    } else {
                        this.raw.extend_from_slice(read.filled());
                        this.process();
                    }
                }
            }
        }
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for AuthorityFix<IO> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

impl<IO: tonic::transport::server::Connected> tonic::transport::server::Connected for AuthorityFix<IO> {
    type ConnectInfo = IO::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn invalid_authorities_become_localhost_and_valid_ones_are_kept() {
        assert_eq!(fix_authority(b"/var/lib/kubelet/device-plugins/kubelet.sock"), b"localhost");
        assert_eq!(fix_authority(b"%2Fvar%2Flib%2Fkubelet%2Fdevice-plugins%2Fkubelet.sock"), b"localhost");
        assert_eq!(fix_authority(b"plugin.example:1234"), b"plugin.example:1234");
    }

    #[test]
    fn reencoded_blocks_decode_to_the_same_headers_with_the_authority_fixed() {
        let mut encoder = fluke_hpack::Encoder::new();
        let headers: Vec<(&[u8], &[u8])> = vec![
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", b"/v1beta1.Registration/Register"),
            (b":authority", b"/var/lib/kubelet/device-plugins/kubelet.sock"),
            (b"content-type", b"application/grpc"),
        ];
        let mut input = PREFACE.to_vec();
        for stream in [1u32, 3] {
            // The second block reuses the encoder's dynamic table.
            let block = encoder.encode(headers.iter().copied());
            write_frame_header(&mut input, block.len(), HEADERS, END_HEADERS, stream);
            input.extend_from_slice(&block);
        }
        let mut fix = AuthorityFix::new(());
        fix.raw = input;
        fix.process();
        let out = std::mem::take(&mut fix.out);
        assert_eq!(&out[..PREFACE.len()], PREFACE);
        let mut decoder = Decoder::new();
        let mut rest = &out[PREFACE.len()..];
        for _ in 0..2 {
            let len = usize::from(rest[1]) << 8 | usize::from(rest[2]);
            let decoded = decoder.decode(&rest[FRAME_HEADER..FRAME_HEADER + len]).expect("decodes");
            let authority = decoded.iter().find(|(n, _)| n == b":authority").map(|(_, v)| v.clone());
            assert_eq!(authority.as_deref(), Some(&b"localhost"[..]));
            assert_eq!(decoded.len(), headers.len());
            rest = &rest[FRAME_HEADER + len..];
        }
        assert!(rest.is_empty());
    }

    /// Bad input: a header block that never ends (CONTINUATION after
    /// CONTINUATION). Past the header list size limit nothing more is
    /// buffered: the bytes go to the server as they came, which refuses them.
    #[test]
    fn an_endless_header_block_is_not_buffered_past_the_limit() {
        let mut input = PREFACE.to_vec();
        write_frame_header(&mut input, 4, HEADERS, 0, 1);
        input.extend_from_slice(&[0x82, 0x86, 0x84, 0x41]);
        let chunk = vec![b'a'; 4096];
        for _ in 0..(MAX_HEADER_LIST_SIZE / chunk.len() + 2) {
            write_frame_header(&mut input, chunk.len(), CONTINUATION, 0, 1);
            input.extend_from_slice(&chunk);
        }
        let mut fix = AuthorityFix::new(());
        fix.raw = input.clone();
        fix.process();
        assert!(fix.pending.is_none(), "nothing is held back");
        assert!(matches!(fix.mode, Mode::PassThrough));
        assert_eq!(fix.out, input, "the server gets the bytes as they came");
        // More of the same is passed on at once, not buffered.
        fix.out.clear();
        fix.raw.extend_from_slice(&chunk);
        fix.process();
        assert_eq!(fix.out, chunk);
    }
}
