//! condense's own failures as each API renders them: the JSON error body
//! of a response, and the error event that ends a stream.

/// One of condense's own failures, as each API renders it.
#[derive(Debug, Clone, Copy)]
pub struct Failure<'a> {
    /// OpenAI's error `type`.
    pub kind: &'a str,
    /// Anthropic's error `type`.
    pub anthropic_kind: &'a str,
    /// The `code` (OpenAI) condense names it by.
    pub code: &'a str,
    pub message: &'a str,
}

/// How an API renders a [`Failure`].
pub trait Errors: Sync {
    /// condense's own error as this API's JSON error body.
    fn error_body(&self, failure: &Failure) -> String;

    /// condense's own error as this API's stream error event (whole, with
    /// its blank line).
    fn stream_error(&self, failure: &Failure) -> String;
}
