//! Server-Sent Events, read: the one place that frames a byte stream into
//! events and an event into its lines and data, used by the usage tap,
//! condense's own tool rounds and the replay alike.
//!
//! Framing follows the SSE specification: a line ends at CR LF, LF or a
//! bare CR, and a blank line ends an event. Reading is linear: each byte is
//! looked at for an event end once (a cursor remembers how far a buffer was
//! scanned), and [`Reader`] holds at most one unfinished event, bounded by
//! its caller.

use bytes::{Bytes, BytesMut};

/// Bytes before the end of a buffer that must be looked at again when more
/// arrives: an event end (`\r\n\r\n` at the longest) may straddle chunks.
const RESCAN: usize = 3;

/// The index just past the blank line that ends the first event of `buf`,
/// looking from `from` on (an index where a line may start or end); None
/// when no event ends yet. A CR at the very end of `buf` that could still
/// be the start of a CR LF is not taken as a line end until the next byte
/// is known, unless the line before it ended with a bare CR too.
pub fn event_end(buf: &[u8], from: usize) -> Option<usize> {
    let mut at = from;
    while let Some(i) = memchr::memchr2(b'\n', b'\r', buf.get(at..)?).map(|i| i + at) {
        // The line end at `i`, then what follows it.
        let next = match (buf[i], buf.get(i + 1)) {
            (b'\r', Some(b'\n')) => i + 2,
            (b'\r', None) => return None,
            _ => i + 1,
        };
        let bare_cr = next == i + 1 && buf[i] == b'\r';
        match (buf.get(next), buf.get(next + 1)) {
            (Some(b'\n'), _) => return Some(next + 1),
            (Some(b'\r'), Some(b'\n')) => return Some(next + 2),
            (Some(b'\r'), Some(_)) => return Some(next + 1),
            // A stream that ends its lines with a bare CR ends its events
            // with two; one that uses CR LF may still send the LF.
            (Some(b'\r'), None) => return bare_cr.then_some(next + 1),
            _ => at = next,
        }
    }
    None
}

/// The lines of an event (or of any SSE text), without their line ends.
pub fn lines(event: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut rest = Some(event);
    std::iter::from_fn(move || {
        let text = rest?;
        match memchr::memchr2(b'\n', b'\r', text) {
            Some(i) => {
                let skip = if text[i] == b'\r' && text.get(i + 1) == Some(&b'\n') {
                    2
                } else {
                    1
                };
                rest = Some(&text[i + skip..]);
                Some(&text[..i])
            }
            None => {
                rest = None;
                (!text.is_empty()).then_some(text)
            }
        }
    })
}

/// An event's one `data:` line, as the offset of its data in `event` and
/// the data (after `data:` and one space, without the line end); None
/// when the event has no data line or several.
pub fn single_data_line(event: &[u8]) -> Option<(usize, &[u8])> {
    let mut found = None;
    for line in lines(event) {
        if let Some(data) = line.strip_prefix(b"data:") {
            if found.is_some() {
                return None;
            }
            let data = data.strip_prefix(b" ").unwrap_or(data);
            let offset = data.as_ptr() as usize - event.as_ptr() as usize;
            found = Some((offset, data));
        }
    }
    found
}

/// An event's data: borrowed when it is on one `data:` line, as it is in
/// practice, else its lines joined.
pub fn data_of(event: &[u8]) -> Option<std::borrow::Cow<'_, [u8]>> {
    match single_data_line(event) {
        Some((_, data)) => Some(data.into()),
        None => event_data(event).map(|(_, data)| data.into_bytes().into()),
    }
}

/// An SSE event's text and its data (its `data:` lines joined).
pub fn event_data(event: &[u8]) -> Option<(&str, String)> {
    let text = std::str::from_utf8(event).ok()?;
    let data: Vec<&str> = lines(event)
        .filter_map(|l| l.strip_prefix(b"data:"))
        .map(|d| d.strip_prefix(b" ").unwrap_or(d))
        // Cut from UTF-8 text at ASCII bytes: still UTF-8.
        .map(|d| std::str::from_utf8(d).unwrap_or_default())
        .collect();
    Some((text, data.join("\n")))
}

/// An event's data as JSON (None for `[DONE]` and events without JSON
/// data), with the event's text.
pub fn event_json(event: &[u8]) -> Option<(&str, serde_json::Value)> {
    let (text, data) = event_data(event)?;
    let value = serde_json::from_str(&data).ok()?;
    Some((text, value))
}

/// The event with its data lines replaced by one `data:` line holding `json`.
pub fn rebuild_event(text: &str, json: &[u8]) -> Bytes {
    let mut out = Vec::with_capacity(text.len());
    let mut data_written = false;
    for line in lines(text.as_bytes()).filter(|l| !l.is_empty()) {
        if line.starts_with(b"data:") {
            if !data_written {
                out.extend_from_slice(b"data: ");
                out.extend_from_slice(json);
                out.push(b'\n');
                data_written = true;
            }
        } else {
            out.extend_from_slice(line);
            out.push(b'\n');
        }
    }
    out.push(b'\n');
    Bytes::from(out)
}

/// Splits a stream's chunks into whole events, each byte scanned once.
#[derive(Default)]
pub struct Reader {
    pending: BytesMut,
    /// Bytes of `pending` already scanned for an event end.
    scanned: usize,
}

impl Reader {
    /// Takes a chunk of the stream.
    pub fn push(&mut self, chunk: &[u8]) {
        self.pending.extend_from_slice(chunk);
    }

    /// The next whole event, its blank line included.
    pub fn next_event(&mut self) -> Option<BytesMut> {
        match event_end(&self.pending, self.scanned) {
            Some(end) => {
                self.scanned = 0;
                Some(self.pending.split_to(end))
            }
            None => {
                self.scanned = self.pending.len().saturating_sub(RESCAN);
                None
            }
        }
    }

    /// The bytes of the event not finished yet.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// Takes what is held (an unfinished event).
    pub fn take_rest(&mut self) -> BytesMut {
        self.scanned = 0;
        self.pending.split()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn events(chunks: &[&[u8]]) -> Vec<Vec<u8>> {
        let mut r = Reader::default();
        let mut out = Vec::new();
        for c in chunks {
            r.push(c);
            while let Some(e) = r.next_event() {
                out.push(e.to_vec());
            }
        }
        out
    }

    #[test]
    fn events_end_at_a_blank_line_of_any_line_end() {
        for (stream, first) in [
            (&b"data: a\n\ndata: b\n\n"[..], &b"data: a\n\n"[..]),
            (b"data: a\r\n\r\ndata: b\r\n\r\n", b"data: a\r\n\r\n"),
            (b"data: a\r\rdata: b\r\r", b"data: a\r\r"),
            (b"data: a\n\r\ndata: b\n\n", b"data: a\n\r\n"),
            (b"data: a\r\n\ndata: b\n\n", b"data: a\r\n\n"),
        ] {
            let all = events(&[stream]);
            assert_eq!(all.len(), 2, "{stream:?}");
            assert_eq!(all[0], first);
            // Cut anywhere, the same events come out.
            for cut in 0..stream.len() {
                let (a, b) = stream.split_at(cut);
                assert_eq!(events(&[a, b]), all, "{stream:?} cut at {cut}");
            }
        }
    }

    #[test]
    fn a_trailing_cr_waits_for_the_next_byte() {
        assert_eq!(event_end(b"data: a\r\n\r", 0), None);
        assert_eq!(event_end(b"data: a\r", 0), None);
        assert_eq!(event_end(b"data: a\r\r", 0), Some(9));
        assert_eq!(event_end(b"data: a\n\r", 0), None);
        assert_eq!(event_end(b"data: a\r\rx", 0), Some(9));
    }

    #[test]
    fn lines_and_data_are_read_with_every_line_end() {
        for event in [
            &b"event: e\ndata: {\"a\":1}\n\n"[..],
            b"event: e\r\ndata: {\"a\":1}\r\n\r\n",
            b"event: e\rdata: {\"a\":1}\r\r",
        ] {
            assert_eq!(
                lines(event).collect::<Vec<_>>(),
                [&b"event: e"[..], b"data: {\"a\":1}", b""],
                "{event:?}"
            );
            let (offset, data) = single_data_line(event).unwrap();
            assert_eq!(data, b"{\"a\":1}");
            assert_eq!(&event[offset..offset + data.len()], data);
            assert_eq!(event_json(event).unwrap().1["a"], 1);
        }
        assert_eq!(
            event_data(b"data: a\ndata: b\n\n").unwrap().1,
            "a\nb",
            "several data lines are joined"
        );
        assert!(single_data_line(b"data: a\ndata: b\n\n").is_none());
    }

    #[test]
    fn an_event_is_rebuilt_with_one_data_line() {
        let out = rebuild_event("event: x\r\ndata: {}\r\ndata: {}\r\n\r\n", b"{\"b\":2}");
        assert_eq!(&out[..], b"event: x\ndata: {\"b\":2}\n\n");
    }
}
