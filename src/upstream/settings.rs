//! How many streams an HTTP/2 upstream lets one connection carry at once:
//! the `SETTINGS_MAX_CONCURRENT_STREAMS` of its SETTINGS frames (RFC 9113,
//! 6.5.2), read off the connection's bytes on their way to hyper.
//!
//! hyper keeps the server's settings to itself, and past the limit it
//! queues a request inside the connection, where the request's first-byte
//! deadline runs while it waits: the pool needs the number to open another
//! connection instead. OpenAI, Anthropic and Vertex say about 100. Written
//! by hand because no crate reads it without taking over the connection:
//! what is parsed is the 9-byte frame header of each frame, and the 6-byte
//! entries of the SETTINGS frames on stream 0 (a few a connection); every
//! other payload is counted past, not looked at, so the cost is a few
//! comparisons a read.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// The limit assumed until the server says (what the big providers say).
pub const ASSUMED_STREAMS: usize = 100;

/// The limit used for a server that allows more, or says "unlimited": a
/// connection carrying more gains nothing and loses them all at once.
pub const MOST_STREAMS: usize = 1000;

/// SETTINGS frame type and its ACK flag.
const SETTINGS: u8 = 0x4;
const ACK: u8 = 0x1;
/// The identifier of SETTINGS_MAX_CONCURRENT_STREAMS.
const MAX_CONCURRENT_STREAMS: u16 = 0x3;

/// Where the reader is in the server's frames.
#[derive(Debug, Clone, Copy, PartialEq)]
enum At {
    /// In a frame header: the bytes of it read so far.
    Header { got: usize },
    /// In a payload to count past: the bytes left of it.
    Skip { left: usize },
    /// In a SETTINGS payload: the bytes left of it, and of the entry being
    /// read, the bytes so far.
    Settings { left: usize, got: usize },
}

/// Reads `SETTINGS_MAX_CONCURRENT_STREAMS` out of a server's bytes, fed in
/// pieces of any size.
#[derive(Debug, Clone)]
pub struct Frames {
    at: At,
    /// The frame header or the SETTINGS entry being read.
    buf: [u8; 9],
    /// The limit, shared with the pool.
    limit: Arc<AtomicUsize>,
}

impl Frames {
    /// A reader that writes the limit into `limit` each time the server
    /// sets it.
    pub fn new(limit: Arc<AtomicUsize>) -> Frames {
        Frames {
            at: At::Header { got: 0 },
            buf: [0; 9],
            limit,
        }
    }

    /// Takes in the next bytes the server sent.
    pub fn feed(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            match self.at {
                At::Header { got } => {
                    let n = (9 - got).min(bytes.len());
                    self.buf[got..got + n].copy_from_slice(&bytes[..n]);
                    bytes = &bytes[n..];
                    self.at = if got + n < 9 {
                        At::Header { got: got + n }
                    } else {
                        self.after_header()
                    };
                }
                At::Skip { left } => {
                    let n = left.min(bytes.len());
                    bytes = &bytes[n..];
                    self.at = if left > n {
                        At::Skip { left: left - n }
                    } else {
                        At::Header { got: 0 }
                    };
                }
                At::Settings { left, got } => {
                    let n = (6 - got).min(bytes.len()).min(left);
                    self.buf[got..got + n].copy_from_slice(&bytes[..n]);
                    bytes = &bytes[n..];
                    let (left, got) = (left - n, got + n);
                    if got == 6 {
                        self.entry();
                    }
                    self.at = match (left, got) {
                        (0, _) => At::Header { got: 0 },
                        (_, 6) => At::Settings { left, got: 0 },
                        _ => At::Settings { left, got },
                    };
                }
            }
        }
    }

    /// What follows the frame header in `buf`.
    fn after_header(&self) -> At {
        let b = &self.buf;
        let length = (usize::from(b[0]) << 16) | (usize::from(b[1]) << 8) | usize::from(b[2]);
        let stream = u32::from_be_bytes([b[5], b[6], b[7], b[8]]) & 0x7fff_ffff;
        let settings = b[3] == SETTINGS && b[4] & ACK == 0 && stream == 0;
        match (length, settings) {
            (0, _) => At::Header { got: 0 },
            // A length that is not a whole number of entries is a
            // connection error hyper answers; the entries are not read.
            (n, true) if n % 6 == 0 => At::Settings { left: n, got: 0 },
            (n, _) => At::Skip { left: n },
        }
    }

    /// The SETTINGS entry in `buf[..6]`.
    fn entry(&self) {
        let id = u16::from_be_bytes([self.buf[0], self.buf[1]]);
        if id == MAX_CONCURRENT_STREAMS {
            let value = u32::from_be_bytes([self.buf[2], self.buf[3], self.buf[4], self.buf[5]]);
            let value = usize::try_from(value).unwrap_or(MOST_STREAMS);
            self.limit.store(value.min(MOST_STREAMS), Ordering::Release);
        }
    }
}

/// A connection whose incoming bytes pass through a [`Frames`] reader.
pub struct Sniffed<T> {
    inner: T,
    frames: Frames,
}

impl<T> Sniffed<T> {
    pub fn new(inner: T, limit: Arc<AtomicUsize>) -> Sniffed<T> {
        Sniffed {
            inner,
            frames: Frames::new(limit),
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Sniffed<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.inner).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = polled {
            this.frames.feed(&buf.filled()[before..]);
        }
        polled
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Sniffed<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
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

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let n = payload.len();
        let mut f = vec![(n >> 16) as u8, (n >> 8) as u8, n as u8, kind, flags];
        f.extend_from_slice(&stream.to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    fn settings(entries: &[(u16, u32)]) -> Vec<u8> {
        let payload: Vec<u8> = entries
            .iter()
            .flat_map(|(id, v)| id.to_be_bytes().into_iter().chain(v.to_be_bytes()))
            .collect();
        frame(SETTINGS, 0, 0, &payload)
    }

    /// A server's bytes: SETTINGS with 100, its ACK of ours, a window
    /// update, a DATA frame whose payload looks like a SETTINGS frame
    /// saying 7, then SETTINGS lowering the limit to 50.
    fn conversation() -> Vec<u8> {
        let mut bytes = settings(&[(0x1, 4096), (MAX_CONCURRENT_STREAMS, 100), (0x4, 65535)]);
        bytes.extend(frame(SETTINGS, ACK, 0, &[]));
        bytes.extend(frame(0x8, 0, 0, &[0, 0, 0x10, 0]));
        bytes.extend(frame(0x0, 0, 1, &settings(&[(MAX_CONCURRENT_STREAMS, 7)])));
        bytes.extend(settings(&[(MAX_CONCURRENT_STREAMS, 50)]));
        bytes
    }

    #[test]
    fn the_last_limit_the_server_set_is_kept() {
        let limit = Arc::new(AtomicUsize::new(ASSUMED_STREAMS));
        let mut f = Frames::new(limit.clone());
        let bytes = conversation();
        let first = settings(&[(0x1, 4096), (MAX_CONCURRENT_STREAMS, 100), (0x4, 65535)]).len();
        f.feed(&bytes[..first]);
        assert_eq!(limit.load(Ordering::Acquire), 100);
        f.feed(&bytes[first..]);
        assert_eq!(limit.load(Ordering::Acquire), 50, "not 7: that was data");
        assert_eq!(f.at, At::Header { got: 0 });
    }

    #[test]
    fn unlimited_is_taken_as_the_most_worth_using() {
        let limit = Arc::new(AtomicUsize::new(ASSUMED_STREAMS));
        Frames::new(limit.clone()).feed(&settings(&[(MAX_CONCURRENT_STREAMS, u32::MAX)]));
        assert_eq!(limit.load(Ordering::Acquire), MOST_STREAMS);
    }

    #[test]
    fn a_settings_frame_of_a_stream_or_an_ack_is_not_read() {
        let limit = Arc::new(AtomicUsize::new(ASSUMED_STREAMS));
        let mut f = Frames::new(limit.clone());
        let entry = [0, 3, 0, 0, 0, 9];
        f.feed(&frame(SETTINGS, ACK, 0, &entry));
        f.feed(&frame(SETTINGS, 0, 3, &entry));
        // Not a whole number of entries.
        f.feed(&frame(SETTINGS, 0, 0, &entry[..5]));
        assert_eq!(limit.load(Ordering::Acquire), ASSUMED_STREAMS);
        assert_eq!(f.at, At::Header { got: 0 });
    }

    proptest! {
        /// However the bytes are cut into reads, the same limit comes out.
        #[test]
        fn reads_of_any_size_give_the_same_limit(cuts in proptest::collection::vec(0usize..200, 0..12)) {
            let bytes = conversation();
            let limit = Arc::new(AtomicUsize::new(ASSUMED_STREAMS));
            let mut f = Frames::new(limit.clone());
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % (bytes.len() + 1)).collect();
            cuts.sort_unstable();
            let mut from = 0;
            for c in cuts.into_iter().chain([bytes.len()]) {
                f.feed(&bytes[from..c]);
                from = c;
            }
            prop_assert_eq!(limit.load(Ordering::Acquire), 50);
            prop_assert_eq!(f.at, At::Header { got: 0 });
        }
    }
}
