//! Image tokens by OpenAI's published tile rule for GPT-4o-class vision
//! models:
//!
//! - `detail: "low"`: a flat 85 tokens.
//! - `detail: "high"` or `"auto"` (the default, counted as high): the image
//!   is scaled to fit in 2048×2048, then so that its short side is at most
//!   768 px; it costs 170 tokens per 512-px tile plus 85.
//!
//! The size is read from the image itself when it is inline (a base64 `data:`
//! URL of a PNG, GIF, JPEG or WebP). For an image given by URL the size is
//! unknown; condense then assumes 1024×1024, i.e. 765 tokens, a typical
//! screenshot or photo. Calibration against the upstream's usage absorbs the
//! difference, and other models' image pricing (gpt-4o-mini's, patch-based
//! models') is corrected the same way.

use base64::Engine;

pub const LOW_DETAIL_TOKENS: u64 = 85;
/// The most a single high-detail image can cost under the tile rule
/// (768×2048 after scaling: 2×4 tiles).
pub const MAX_IMAGE_TOKENS: u64 = 170 * 8 + 85;
/// Assumed size of an image whose dimensions cannot be read.
pub const UNKNOWN_SIZE: (u32, u32) = (1024, 1024);

/// Tokens for one `image_url` content part.
pub fn image_tokens(url: &str, detail: Option<&str>) -> u64 {
    if detail == Some("low") {
        return LOW_DETAIL_TOKENS;
    }
    let (w, h) = data_url_dimensions(url).unwrap_or(UNKNOWN_SIZE);
    tile_tokens(w, h)
}

/// The high-detail tile rule for a `w`×`h` image.
pub fn tile_tokens(w: u32, h: u32) -> u64 {
    if w == 0 || h == 0 {
        return LOW_DETAIL_TOKENS;
    }
    let (mut w, mut h) = (f64::from(w), f64::from(h));
    if w.max(h) > 2048.0 {
        let s = 2048.0 / w.max(h);
        w *= s;
        h *= s;
    }
    if w.min(h) > 768.0 {
        let s = 768.0 / w.min(h);
        w *= s;
        h *= s;
    }
    let tiles = (w / 512.0).ceil() as u64 * (h / 512.0).ceil() as u64;
    170 * tiles + 85
}

/// Width and height of an inline base64 image, read from its header.
pub fn data_url_dimensions(url: &str) -> Option<(u32, u32)> {
    let rest = url.strip_prefix("data:")?;
    let (meta, data) = rest.split_once(',')?;
    if !meta.ends_with(";base64") {
        return None;
    }
    // JPEG's size marker can sit after embedded metadata; 64 KiB of
    // decoded header covers practically every real file.
    let take = data.len().min(87_384) & !3;
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(&data.as_bytes()[..take])
        .ok()?;
    png(&bytes)
        .or_else(|| gif(&bytes))
        .or_else(|| webp(&bytes))
        .or_else(|| jpeg(&bytes))
}

fn be32(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_be_bytes(b.get(at..at + 4)?.try_into().ok()?))
}
fn be16(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from(u16::from_be_bytes(
        b.get(at..at + 2)?.try_into().ok()?,
    )))
}
fn le16(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from(u16::from_le_bytes(
        b.get(at..at + 2)?.try_into().ok()?,
    )))
}
fn le24(b: &[u8], at: usize) -> Option<u32> {
    let s = b.get(at..at + 3)?;
    Some(u32::from(s[0]) | u32::from(s[1]) << 8 | u32::from(s[2]) << 16)
}

fn png(b: &[u8]) -> Option<(u32, u32)> {
    (b.starts_with(b"\x89PNG\r\n\x1a\n") && b.get(12..16)? == b"IHDR")
        .then(|| Some((be32(b, 16)?, be32(b, 20)?)))?
}

fn gif(b: &[u8]) -> Option<(u32, u32)> {
    (b.starts_with(b"GIF87a") || b.starts_with(b"GIF89a"))
        .then(|| Some((le16(b, 6)?, le16(b, 8)?)))?
}

fn webp(b: &[u8]) -> Option<(u32, u32)> {
    if !(b.starts_with(b"RIFF") && b.get(8..12)? == b"WEBP") {
        return None;
    }
    match b.get(12..16)? {
        b"VP8 " => Some((le16(b, 26)? & 0x3fff, le16(b, 28)? & 0x3fff)),
        b"VP8L" => {
            let bits = u32::from_le_bytes(b.get(21..25)?.try_into().ok()?);
            Some(((bits & 0x3fff) + 1, ((bits >> 14) & 0x3fff) + 1))
        }
        b"VP8X" => Some((le24(b, 24)? + 1, le24(b, 27)? + 1)),
        _ => None,
    }
}

fn jpeg(b: &[u8]) -> Option<(u32, u32)> {
    if !b.starts_with(&[0xff, 0xd8]) {
        return None;
    }
    let mut i = 2;
    while i + 9 < b.len() {
        if b[i] != 0xff {
            i += 1;
            continue;
        }
        let marker = b[i + 1];
        // Start-of-frame markers carry the size; C4, C8 and CC are not frames.
        if (0xc0..=0xcf).contains(&marker) && !matches!(marker, 0xc4 | 0xc8 | 0xcc) {
            return Some((be16(b, i + 7)?, be16(b, i + 5)?));
        }
        if marker == 0xff || marker == 0x01 || (0xd0..=0xd9).contains(&marker) {
            i += if marker == 0xff { 1 } else { 2 };
            continue;
        }
        i += 2 + be16(b, i + 2)? as usize;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data_url(mime: &str, bytes: &[u8]) -> String {
        format!(
            "data:{mime};base64,{}",
            base64::engine::general_purpose::STANDARD.encode(bytes)
        )
    }

    #[test]
    fn tile_rule_matches_openai_examples() {
        // OpenAI's documented examples: 1024×1024 → 765; 2048×4096 → 1105.
        assert_eq!(tile_tokens(1024, 1024), 765);
        assert_eq!(tile_tokens(2048, 4096), 1105);
        assert_eq!(tile_tokens(512, 512), 255);
        assert!(tile_tokens(768, 2048) <= MAX_IMAGE_TOKENS);
        assert_eq!(image_tokens("https://x/y.png", Some("low")), 85);
        assert_eq!(image_tokens("https://x/y.png", None), 765);
    }

    #[test]
    fn reads_sizes_from_inline_images() {
        let mut png_bytes = b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR".to_vec();
        png_bytes.extend_from_slice(&300u32.to_be_bytes());
        png_bytes.extend_from_slice(&200u32.to_be_bytes());
        png_bytes.extend_from_slice(&[8, 6, 0, 0, 0]);
        assert_eq!(
            data_url_dimensions(&data_url("image/png", &png_bytes)),
            Some((300, 200))
        );
        assert_eq!(
            image_tokens(&data_url("image/png", &png_bytes), Some("high")),
            255
        );

        let gif_bytes = [b"GIF89a".as_slice(), &[0x20, 0x03, 0x58, 0x02], &[0; 8]].concat();
        assert_eq!(
            data_url_dimensions(&data_url("image/gif", &gif_bytes)),
            Some((800, 600))
        );

        // JPEG: SOI, an APP0 segment, then SOF0 with height 480, width 640.
        let mut jpg = vec![0xff, 0xd8, 0xff, 0xe0, 0x00, 0x04, 0x00, 0x00];
        jpg.extend_from_slice(&[0xff, 0xc0, 0x00, 0x11, 0x08, 0x01, 0xe0, 0x02, 0x80, 0x03]);
        jpg.extend_from_slice(&[0; 16]);
        assert_eq!(
            data_url_dimensions(&data_url("image/jpeg", &jpg)),
            Some((640, 480))
        );

        assert_eq!(data_url_dimensions("data:image/png;base64,!!!"), None);
        assert_eq!(data_url_dimensions("https://example.com/a.png"), None);
    }
}
