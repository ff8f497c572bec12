//! Connections over the cap: answered and closed in the background,
//! bounded in time and in number. Their request head is read first, so a
//! liveness probe still gets its 200 from a process that is only busy, a
//! readiness probe its 503, and anything else a 503 in the shape of the
//! API it asked for.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::metrics::Metrics;

/// Time a refused connection gets to read its 503.
const REFUSE_TIME: Duration = Duration::from_secs(1);

/// Answers a connection over the cap and closes it (in the background,
/// bounded in time and in number). Its request head is read first, so that
/// a liveness probe still gets its 200 from a process that is only busy,
/// and a readiness probe its 503; anything else gets a 503 in the shape of
/// the API it asked for.
pub(super) fn refuse(
    tcp: TcpStream,
    refusing: &Arc<AtomicUsize>,
    max: usize,
    metrics: &Arc<Metrics>,
) {
    if refusing.fetch_add(1, Ordering::AcqRel) >= max {
        refusing.fetch_sub(1, Ordering::AcqRel);
        count_refused(metrics);
        return;
    }
    let (refusing, metrics) = (refusing.clone(), metrics.clone());
    tokio::spawn(async move {
        let _ = tokio::time::timeout(REFUSE_TIME, refusal(tcp, &metrics)).await;
        refusing.fetch_sub(1, Ordering::AcqRel);
    });
}

fn count_refused(metrics: &Metrics) {
    metrics
        .connections_closed_total
        .with_label_values(&["refused"])
        .inc();
    metrics
        .proxy_errors_total
        .with_label_values(&["overloaded"])
        .inc();
}

/// The request head a refused connection may send before its answer, and
/// the time it has to send it.
const REFUSED_HEAD: usize = 8 * 1024;
const REFUSED_HEAD_TIME: Duration = Duration::from_millis(250);

async fn refusal(mut tcp: TcpStream, metrics: &Metrics) -> std::io::Result<()> {
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    // A client that sends nothing (yet) is answered as an API client.
    let _ = tokio::time::timeout(REFUSED_HEAD_TIME, async {
        while head.len() < REFUSED_HEAD && memchr::memmem::find(&head, b"\r\n\r\n").is_none() {
            match tcp.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => head.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    let (status, content_type, body) = match refused_route(&head) {
        Refused::Live => ("200 OK", "text/plain; charset=utf-8", "ok".to_string()),
        Refused::Ready => (
            "503 Service Unavailable",
            "text/plain; charset=utf-8",
            "saturated".to_string(),
        ),
        Refused::Api(format) => {
            count_refused(metrics);
            let resp = crate::error::ProxyError::Overloaded("too many open connections")
                .response_for(format);
            let body = axum::body::to_bytes(resp.into_body(), REFUSED_HEAD)
                .await
                .map_err(std::io::Error::other)?;
            (
                "503 Service Unavailable",
                "application/json",
                String::from_utf8_lossy(&body).into_owned(),
            )
        }
    };
    let head = format!(
        "HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n",
        body.len()
    );
    tcp.write_all(head.as_bytes()).await?;
    tcp.write_all(body.as_bytes()).await?;
    tcp.shutdown().await?;
    // Read what the client sent until it closes, so that the close is not
    // a reset that discards the answer before it is read.
    let mut sink = [0u8; 4096];
    while tcp.read(&mut sink).await? > 0 {}
    Ok(())
}

/// What a refused connection asked for.
#[derive(Debug, PartialEq)]
enum Refused {
    /// `GET /healthz` (or `HEAD`).
    Live,
    /// `GET /readyz`.
    Ready,
    /// Anything else, answered in this API's shape.
    Api(crate::wire::Format),
}

/// Reads the request line (and the headers, for Anthropic's) of what a
/// refused connection sent; a head that is not HTTP/1 is answered as the
/// OpenAI API would be.
fn refused_route(head: &[u8]) -> Refused {
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut req = httparse::Request::new(&mut headers);
    // A partial head still names its method and path.
    let _ = req.parse(head);
    let path = req.path.unwrap_or("");
    let path = path.split('?').next().unwrap_or(path);
    match (req.method, path) {
        (Some("GET" | "HEAD"), "/healthz") => Refused::Live,
        (Some("GET" | "HEAD"), "/readyz") => Refused::Ready,
        _ => {
            let mut map = http::HeaderMap::new();
            for h in req.headers.iter().filter(|h| !h.name.is_empty()) {
                if let (Ok(name), Ok(value)) = (
                    http::HeaderName::from_bytes(h.name.as_bytes()),
                    http::HeaderValue::from_bytes(h.value),
                ) {
                    map.append(name, value);
                }
            }
            Refused::Api(crate::wire::api_of(path, &map))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::Provider;

    /// Whose error shape a refused request is answered in.
    fn shape(head: &[u8]) -> Option<Provider> {
        match refused_route(head) {
            Refused::Api(format) => Some(format.api().provider()),
            _ => None,
        }
    }

    #[test]
    fn a_refused_connection_is_answered_by_what_it_asked_for() {
        assert_eq!(
            refused_route(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"),
            Refused::Live
        );
        assert_eq!(
            refused_route(b"HEAD /healthz?x=1 HTTP/1.1\r\n"),
            Refused::Live
        );
        assert_eq!(
            refused_route(b"GET /readyz HTTP/1.1\r\n\r\n"),
            Refused::Ready
        );
        assert_eq!(
            shape(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\n\r\n"),
            Some(Provider::Anthropic)
        );
        assert_eq!(
            shape(b"POST /v1/files HTTP/1.1\r\nanthropic-version: 2023-06-01\r\n\r\n"),
            Some(Provider::Anthropic)
        );
        assert_eq!(
            shape(b"POST /v1/chat/completions HTTP/1.1\r\n\r\n"),
            Some(Provider::OpenAi)
        );
        assert_eq!(shape(b"\x16\x03\x01garbage"), Some(Provider::OpenAi));
        assert_eq!(shape(b""), Some(Provider::OpenAi));
        // POST /healthz is not a probe.
        assert_eq!(
            shape(b"POST /healthz HTTP/1.1\r\n\r\n"),
            Some(Provider::OpenAi)
        );
    }
}
