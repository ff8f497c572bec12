//! Tokenizer encodings. Each is built once per process (building o200k_base
//! takes a noticeable fraction of a second) and shared by every request;
//! the server builds o200k_base at start-up so no request pays for it.

use std::sync::OnceLock;

use serde::{Deserialize, Serialize};
use tiktoken_rs::CoreBPE;

use super::bpe::{self, Bpe};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Encoding {
    #[serde(rename = "o200k_base")]
    O200k,
    #[serde(rename = "cl100k_base")]
    Cl100k,
}

/// An encoding's counter: the compact one, or tiktoken's own when that
/// could not be built from it (not expected).
pub enum Counter {
    Compact(Box<Bpe>),
    Core(CoreBPE),
}

impl Counter {
    fn count(&self, text: &str) -> usize {
        match self {
            Counter::Compact(b) => b.count(text),
            Counter::Core(c) => c.count_ordinary(text),
        }
    }
}

static O200K: OnceLock<Option<Counter>> = OnceLock::new();
static CL100K: OnceLock<Option<Counter>> = OnceLock::new();

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

    /// The counter, built on first use; None if it could not be built (the
    /// data is compiled in, so this is not expected; callers then fall back
    /// to a byte-based estimate rather than fail the request). tiktoken's
    /// tables are read into the compact counter and dropped.
    pub fn counter(self) -> Option<&'static Counter> {
        let cell = match self {
            Encoding::O200k => &O200K,
            Encoding::Cl100k => &CL100K,
        };
        cell.get_or_init(|| {
            let (build, split): (fn() -> _, _) = match self {
                Encoding::O200k => (tiktoken_rs::o200k_base, &bpe::O200K),
                Encoding::Cl100k => (tiktoken_rs::cl100k_base, &bpe::CL100K),
            };
            let read = read_apart(|| {
                let core = build().map_err(|e| e.to_string())?;
                bpe::Vocabulary::from_core(&core).map_err(|e| e.to_string())
            });
            let compact = match read {
                Some(read) => read.and_then(|v| Bpe::new(v, split).map_err(|e| e.to_string())),
                None => {
                    tracing::error!(encoding = self.name(), "building the tokenizer panicked");
                    return None;
                }
            };
            match compact {
                Ok(b) => Some(Counter::Compact(Box::new(b))),
                Err(e) => {
                    tracing::warn!(encoding = self.name(), error = %e, "cannot build the compact counter; counting with tiktoken's tables");
                    build()
                        .map_err(|e| tracing::error!(encoding = self.name(), error = %e, "cannot build tokenizer"))
                        .ok()
                        .map(Counter::Core)
                }
            }
        })
        .as_ref()
    }

    /// Tokens in `text` (special-token text counts as ordinary text, as the
    /// API treats it in message content).
    pub fn count(self, text: &str) -> u64 {
        match self.counter() {
            Some(c) => c.count(text) as u64,
            None => text.len().div_ceil(4) as u64,
        }
    }

    /// Builds the encoding of current models now. `cl100k_base` (gpt-4,
    /// gpt-3.5) is built on its first use: building it costs time (and a
    /// passing 25 MB of tiktoken's tables) that most deployments never
    /// need.
    pub fn warm_up() {
        Encoding::O200k.counter();
    }
}

/// What `read` returns, made on a thread of its own and copied out of it;
/// None when that thread panicked. tiktoken's tables are 600,000 small
/// allocations: made on the calling thread, they would share its memory
/// with everything else, and most of it would stay with the process after
/// they are dropped. On a thread of their own they take memory of their
/// own from the allocator, which that thread hands back once everything
/// made there is dropped.
fn read_apart<T: Clone + Send>(read: impl FnOnce() -> T + Send) -> Option<T> {
    std::thread::scope(|s| {
        let (send, made) = std::sync::mpsc::channel();
        let (give_back, copied) = std::sync::mpsc::channel::<T>();
        let reader = s.spawn(move || {
            let _ = send.send(read());
            drop(copied.recv());
            release_freed();
        });
        let copy = made.recv().ok().map(|original| {
            let copy = original.clone();
            let _ = give_back.send(original);
            copy
        });
        drop(give_back);
        reader.join().ok().and(copy)
    })
}

/// Has the allocator give back what the calling thread's allocations just
/// freed: glibc keeps freed small chunks aside (fastbins) until a larger
/// request gathers them, and only then returns the end of the heap to the
/// system.
fn release_freed() {
    let gather: Vec<u8> = Vec::with_capacity(4096);
    drop(std::hint::black_box(gather));
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
