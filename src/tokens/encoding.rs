//! Tokenizer encodings. Each is built once per process (building o200k_base
//! takes a noticeable fraction of a second) and shared by every request;
//! the server builds o200k_base at start-up so no request pays for it.

use std::sync::OnceLock;

use serde::{Deserialize, Serialize};
use tiktoken_rs::CoreBPE;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Encoding {
    #[serde(rename = "o200k_base")]
    O200k,
    #[serde(rename = "cl100k_base")]
    Cl100k,
}

static O200K: OnceLock<Option<CoreBPE>> = OnceLock::new();
static CL100K: OnceLock<Option<CoreBPE>> = OnceLock::new();

impl Encoding {
    /// The encoding OpenAI uses for a model name; `o200k_base` is also the
    /// approximation for models of other vendors (calibration corrects it).
    pub fn for_model(model: &str) -> Encoding {
        let m = model
            .rsplit('/')
            .next()
            .unwrap_or(model)
            .to_ascii_lowercase();
        let gpt4_classic =
            m.starts_with("gpt-4") && !m.starts_with("gpt-4o") && !m.starts_with("gpt-4.");
        let legacy = gpt4_classic || m.starts_with("gpt-3.5") || m.starts_with("text-embedding-");
        if legacy {
            Encoding::Cl100k
        } else {
            Encoding::O200k
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Encoding::O200k => "o200k_base",
            Encoding::Cl100k => "cl100k_base",
        }
    }

    /// A small number mixed into cache keys so counts of different
    /// encodings never collide.
    pub(crate) fn salt(self) -> u64 {
        match self {
            Encoding::O200k => 0x9e37_79b9_7f4a_7c15,
            Encoding::Cl100k => 0xc2b2_ae3d_27d4_eb4f,
        }
    }

    /// The tokenizer, built on first use; None if it could not be built (the
    /// data is compiled in, so this is not expected; callers then fall back
    /// to a byte-based estimate rather than fail the request).
    pub fn bpe(self) -> Option<&'static CoreBPE> {
        let cell = match self {
            Encoding::O200k => &O200K,
            Encoding::Cl100k => &CL100K,
        };
        cell.get_or_init(|| {
            let built = match self {
                Encoding::O200k => tiktoken_rs::o200k_base(),
                Encoding::Cl100k => tiktoken_rs::cl100k_base(),
            };
            built
                .map_err(|e| tracing::error!(encoding = self.name(), error = %e, "cannot build tokenizer"))
                .ok()
        })
        .as_ref()
    }

    /// Tokens in `text` (special-token text counts as ordinary text, as the
    /// API treats it in message content).
    pub fn count(self, text: &str) -> u64 {
        match self.bpe() {
            Some(bpe) => bpe.count_ordinary(text) as u64,
            None => text.len().div_ceil(4) as u64,
        }
    }

    /// Builds the encoding of current models now. `cl100k_base` (gpt-4,
    /// gpt-3.5) is built on its first use: it costs about 25 MB that most
    /// deployments never need.
    pub fn warm_up() {
        Encoding::O200k.bpe();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_names_map_to_encodings() {
        for m in [
            "gpt-4o",
            "gpt-4o-mini",
            "gpt-4.1-nano",
            "gpt-5",
            "o3-mini",
            "o1",
            "openai/gpt-4o",
            "claude-3-5-sonnet",
            "llama-3.1-70b",
        ] {
            assert_eq!(Encoding::for_model(m), Encoding::O200k, "{m}");
        }
        for m in [
            "gpt-4",
            "gpt-4-turbo",
            "gpt-4-0613",
            "gpt-3.5-turbo",
            "openai/gpt-3.5-turbo-16k",
        ] {
            assert_eq!(Encoding::for_model(m), Encoding::Cl100k, "{m}");
        }
    }

    #[test]
    fn counts_known_strings() {
        assert_eq!(Encoding::O200k.count(""), 0);
        assert_eq!(Encoding::O200k.count("hello world"), 2);
        assert_eq!(Encoding::Cl100k.count("hello world"), 2);
    }
}
