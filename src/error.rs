//! The failures condense itself produces, each mapped in one place to a
//! status code and the OpenAI error body
//! `{"error":{"message","type","param","code"}}`, so SDKs raise their usual
//! exception types. Errors the upstream returns are never rewrapped: they are
//! relayed unchanged by the proxy.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

use crate::wire::{Failure, Format};

#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("the upstream could not be reached: {0}")]
    UpstreamUnreachable(String),
    #[error("the upstream did not answer within {0} seconds")]
    UpstreamTimeout(f64),
    #[error("request body is larger than the {0} bytes this proxy accepts")]
    BodyTooLarge(u64),
    #[error("the request body could not be read: {0}")]
    BadRequestBody(String),
    #[error("the request body did not arrive within {0} seconds")]
    BodyTimeout(f64),
    #[error("the request path {0}")]
    InvalidPath(&'static str),
    #[error("method {0} is not forwarded")]
    MethodNotAllowed(http::Method),
    #[error("condense is overloaded ({0}); try again shortly")]
    Overloaded(&'static str),
    #[error("missing or incorrect API key for this proxy")]
    Unauthorized,
    #[error("condense is shutting down")]
    ShuttingDown,
}

impl ProxyError {
    pub fn status(&self) -> StatusCode {
        match self {
            ProxyError::UpstreamUnreachable(_) => StatusCode::BAD_GATEWAY,
            ProxyError::UpstreamTimeout(_) => StatusCode::GATEWAY_TIMEOUT,
            ProxyError::BodyTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ProxyError::BadRequestBody(_) => StatusCode::BAD_REQUEST,
            ProxyError::BodyTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            ProxyError::InvalidPath(_) => StatusCode::BAD_REQUEST,
            ProxyError::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
            ProxyError::Overloaded(_) => StatusCode::SERVICE_UNAVAILABLE,
            ProxyError::Unauthorized => StatusCode::UNAUTHORIZED,
            ProxyError::ShuttingDown => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    fn kind(&self) -> (&'static str, &'static str) {
        match self {
            ProxyError::UpstreamUnreachable(_) => ("api_error", "upstream_unreachable"),
            ProxyError::UpstreamTimeout(_) => ("api_error", "upstream_timeout"),
            ProxyError::BodyTooLarge(_) => ("invalid_request_error", "request_too_large"),
            ProxyError::BadRequestBody(_) => ("invalid_request_error", "invalid_body"),
            ProxyError::BodyTimeout(_) => ("invalid_request_error", "request_timeout"),
            ProxyError::InvalidPath(_) => ("invalid_request_error", "invalid_path"),
            ProxyError::MethodNotAllowed(_) => ("invalid_request_error", "method_not_allowed"),
            ProxyError::Overloaded(_) => ("api_error", "overloaded"),
            ProxyError::Unauthorized => ("invalid_request_error", "invalid_api_key"),
            ProxyError::ShuttingDown => ("api_error", "shutting_down"),
        }
    }

    /// A short label for the `condense_proxy_errors_total{kind}` metric, one
    /// of [`crate::metrics::labels::PROXY_ERROR_KINDS`].
    pub fn metric_label(&self) -> &'static str {
        self.kind().1
    }
}

impl ProxyError {
    /// Anthropic's error type for this failure.
    fn anthropic_kind(&self) -> &'static str {
        match self {
            ProxyError::UpstreamUnreachable(_) | ProxyError::ShuttingDown => "api_error",
            ProxyError::UpstreamTimeout(_) => "timeout_error",
            ProxyError::BodyTooLarge(_) => "request_too_large",
            ProxyError::Overloaded(_) => "overloaded_error",
            ProxyError::Unauthorized => "authentication_error",
            ProxyError::BadRequestBody(_)
            | ProxyError::BodyTimeout(_)
            | ProxyError::InvalidPath(_)
            | ProxyError::MethodNotAllowed(_) => "invalid_request_error",
        }
    }

    /// The response in the shape of the API the client speaks, so its SDK
    /// raises its usual exception: Anthropic's
    /// `{"type":"error","error":{"type","message"}}` for Messages, OpenAI's
    /// otherwise.
    pub fn response_for(self, format: Format) -> Response {
        let message = format!("condense: {self}");
        let (kind, code) = self.kind();
        let body = format.api().error_body(&Failure {
            kind,
            anthropic_kind: self.anthropic_kind(),
            code,
            message: &message,
        });
        self.finish(body)
    }

    fn finish(self, body: String) -> Response {
        let mut resp = (self.status(), body).into_response();
        resp.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        match self {
            ProxyError::Unauthorized => {
                resp.headers_mut()
                    .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            }
            ProxyError::Overloaded(_) => {
                resp.headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            }
            ProxyError::BodyTimeout(_) => {
                resp.headers_mut()
                    .insert(header::CONNECTION, HeaderValue::from_static("close"));
            }
            _ => {}
        }
        resp
    }
}

impl IntoResponse for ProxyError {
    fn into_response(self) -> Response {
        let (kind, code) = self.kind();
        let body = crate::wire::chat::error_body(&format!("condense: {self}"), kind, code);
        self.finish(body)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::labels::PROXY_ERROR_KINDS;

    #[test]
    fn every_kind_is_listed() {
        for e in [
            ProxyError::UpstreamUnreachable(String::new()),
            ProxyError::UpstreamTimeout(1.0),
            ProxyError::BodyTooLarge(1),
            ProxyError::BadRequestBody(String::new()),
            ProxyError::BodyTimeout(1.0),
            ProxyError::InvalidPath("x"),
            ProxyError::MethodNotAllowed(http::Method::CONNECT),
            ProxyError::Overloaded("x"),
            ProxyError::Unauthorized,
            ProxyError::ShuttingDown,
        ] {
            assert!(PROXY_ERROR_KINDS.contains(&e.metric_label()), "{e}");
        }
        assert_eq!(PROXY_ERROR_KINDS.len(), 10);
    }
}
