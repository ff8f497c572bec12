//! The failures condense itself produces, each mapped in one place to a
//! status code and the OpenAI error body
//! `{"error":{"message","type","param","code"}}`, so SDKs raise their usual
//! exception types. Errors the upstream returns are never rewrapped: they are
//! relayed unchanged by the proxy.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

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
            ProxyError::Unauthorized => ("invalid_request_error", "invalid_api_key"),
            ProxyError::ShuttingDown => ("api_error", "shutting_down"),
        }
    }

    /// A short label for the `condense_proxy_errors_total{kind}` metric.
    pub fn metric_label(&self) -> &'static str {
        self.kind().1
    }
}

/// The OpenAI error body for a message, type and code.
pub fn openai_error_body(message: &str, kind: &str, code: &str) -> String {
    json!({"error": {"message": message, "type": kind, "param": null, "code": code}}).to_string()
}

impl IntoResponse for ProxyError {
    fn into_response(self) -> Response {
        let (kind, code) = self.kind();
        let body = openai_error_body(&format!("condense: {self}"), kind, code);
        let mut resp = (self.status(), body).into_response();
        resp.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if matches!(self, ProxyError::Unauthorized) {
            resp.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        resp
    }
}
