//! How the upstream client fails. An error is a chain of causes whose first
//! link alone says little ("cannot connect to the upstream"), so what
//! reaches a log or a client is the whole chain, [`describe`]d.

use super::trust::TrustError;

/// Why an [`Upstream`](super::Upstream) cannot be made from the configuration.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    #[error("cannot set up TLS for the upstream: {0}")]
    Tls(#[from] rustls::Error),
    #[error(transparent)]
    Trust(#[from] TrustError),
    #[error("invalid upstream.base_url: {0}")]
    BaseUrl(#[from] url::ParseError),
    #[error("invalid upstream.base_url: {0}")]
    BaseUri(#[from] http::uri::InvalidUri),
}

/// Why a request got no answer from the upstream. The proxy answers its
/// client for these (502, 504); it never rewraps what the upstream said.
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    /// No connection within the connect timeout, or no response headers
    /// within the first-byte timeout: that timeout, in seconds.
    #[error("the upstream did not answer within {0} seconds")]
    Timeout(f64),
    /// The request could not be sent, [`describe`]d (never with the URL:
    /// it may carry credentials, and this reaches the client).
    #[error("the upstream could not be reached: {0}")]
    Unreachable(String),
}

/// Why a connection could not be had.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    #[error("the upstream URL has no host")]
    NoHost,
    #[error("cannot connect to the upstream")]
    Connect(#[source] BoxError),
    #[error("the HTTP handshake with the upstream failed")]
    Handshake(#[source] hyper::Error),
}

/// A client path that maps to no URL under the upstream's base URL; the
/// reason ends the sentence "the request path ...".
#[derive(Debug, thiserror::Error)]
#[error("the request path {0}")]
pub struct InvalidPath(pub &'static str);

/// An error of the client, or of a body on its way.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// `e` and its sources, outermost first.
pub(super) fn causes<'a>(
    e: &'a (dyn std::error::Error + 'static),
) -> impl Iterator<Item = &'a (dyn std::error::Error + 'static)> {
    std::iter::successors(Some(e), |cause| cause.source())
}

/// Whether connecting timed out (the connector's timeout, or the system's).
pub(super) fn timed_out(e: &(dyn std::error::Error + 'static)) -> bool {
    causes(e).any(|cause| {
        cause
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::TimedOut)
    })
}

/// A one-line description of a client error with its causes, such as
/// "cannot connect to the upstream: tcp connect error: Connection refused
/// (os error 111)" (an error's own Display stops at its first part: the
/// pool's "cannot connect to the upstream").
pub fn describe(e: &(dyn std::error::Error + 'static)) -> String {
    causes(e)
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(": ")
}
