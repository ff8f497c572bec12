//! The bodies that go to the upstream and come back from it.

use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};

use super::error::BoxError;

/// A response body from the upstream.
pub type ResponseBody = UnsyncBoxBody<Bytes, BoxError>;

/// A response from the upstream, its body still to come.
pub type UpstreamResponse = http::Response<ResponseBody>;

/// A request body for the upstream.
pub enum Outgoing {
    Empty,
    /// A body condense holds whole (its length is sent).
    Whole(Bytes),
    /// A body relayed as it comes.
    Streamed(UnsyncBoxBody<Bytes, BoxError>),
}

/// A request body as the connections send it: one condense holds whole, or
/// one relayed as it comes.
pub type RequestBody = http_body_util::Either<Full<Bytes>, UnsyncBoxBody<Bytes, BoxError>>;

/// A body condense holds whole, as a response body.
pub fn whole_body(bytes: Bytes) -> ResponseBody {
    Full::new(bytes)
        .map_err(|never| match never {})
        .boxed_unsync()
}

/// The length a response's headers announce for its body, if any.
pub fn content_length(resp: &UpstreamResponse) -> Option<u64> {
    http_body::Body::size_hint(resp.body()).exact()
}
