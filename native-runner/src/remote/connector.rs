//! The HTTP client under every store: `object_store`'s own `reqwest` client, with the error
//! statuses worth retrying (5xx, 408, 429) turned into a typed [`HttpStatus`] error, so that the
//! retry loop (`retry`) reads the status from a type, never from the message.
//!
//! Redirects are followed by `reqwest`'s default policy (at most 10, across origins: HF Hub and
//! presigned URLs need them); it drops `Authorization` (and cookies) when a redirect leaves the
//! origin, so credentials are never sent to another host or port. A redirect loop ends as an error.
//!
//! Queries (presigned URLs, Azure SAS): `object_store`'s HTTP store builds each request's URL from
//! the store's root and the object's path, so a query of the URL given would be lost. The
//! connector puts it back: each file's query is keyed by the exact URL the store requests for it
//! (`scheme://host:port/path`, [`request_url`]) and set on every request to that URL (`HEAD`,
//! `GET`, ranges, retries, resumes), as given. Redirects are followed inside `reqwest`, below this
//! layer: the `Location` is used as the server sent it, so a query never goes to another origin.

use std::collections::HashMap;
use std::sync::Arc;

use async_trait::async_trait;
use object_store::ClientOptions;
use object_store::client::{
    HttpClient, HttpConnector, HttpError, HttpErrorKind, HttpRequest, HttpResponse, HttpService,
    ReqwestConnector,
};

/// An error status from the server, as a type (the retry loop downcasts to it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct HttpStatus(pub(super) u16);

impl std::fmt::Display for HttpStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HTTP {}", self.0)
    }
}

impl std::error::Error for HttpStatus {}

/// Queries by the URL (without query) an HTTP store requests: see the module's note.
pub(super) type Queries = Arc<HashMap<String, String>>;

/// The URL `object_store`'s HTTP store requests for `location` under `store_url` (its root):
/// the root's path extended by the location's segments, as `HttpStore` builds it.
pub(super) fn request_url(store_url: &str, location: &object_store::path::Path) -> Option<String> {
    let mut url = url::Url::parse(store_url).ok()?;
    url.path_segments_mut().ok()?.extend(location.parts());
    Some(url.to_string())
}

/// Builds [`TypedStatus`] clients over `object_store`'s `reqwest` client.
#[derive(Default)]
pub(super) struct Connector {
    pub(super) queries: Queries,
}

/// Never the queries (signatures).
impl std::fmt::Debug for Connector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connector")
            .field("queries", &self.queries.len())
            .finish()
    }
}

impl HttpConnector for Connector {
    fn connect(&self, options: &ClientOptions) -> object_store::Result<HttpClient> {
        install_crypto_provider();
        let inner = ReqwestConnector::default().connect(options)?;
        Ok(HttpClient::new(TypedStatus {
            inner,
            queries: Arc::clone(&self.queries),
        }))
    }
}

/// `ring` as rustls's process-wide provider, before the first client is built (`reqwest` is built
/// without one, see Cargo.toml). Installing fails only when a provider is already set (by us, or by
/// a host process embedding this crate); either way one is there, which is all `reqwest` needs.
fn install_crypto_provider() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

struct TypedStatus {
    inner: HttpClient,
    queries: Queries,
}

impl std::fmt::Debug for TypedStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TypedStatus").finish_non_exhaustive()
    }
}

/// `req` with its file's query (from `queries`, by the URL it asks for) when it has none.
fn with_query(queries: &Queries, req: HttpRequest) -> Result<HttpRequest, HttpError> {
    if queries.is_empty() || req.uri().query().is_some() {
        return Ok(req);
    }
    let Some(query) = queries.get(&req.uri().to_string()) else {
        return Ok(req);
    };
    let (mut parts, body) = req.into_parts();
    parts.uri = format!("{}?{query}", parts.uri).parse().map_err(|e| {
        HttpError::new(
            HttpErrorKind::Request,
            std::io::Error::other(format!("the URL's query is not valid in a request: {e}")),
        )
    })?;
    Ok(HttpRequest::from_parts(parts, body))
}

#[async_trait]
impl HttpService for TypedStatus {
    async fn call(&self, req: HttpRequest) -> Result<HttpResponse, HttpError> {
        let req = with_query(&self.queries, req)?;
        let response = self.inner.execute(req).await?;
        let code = response.status().as_u16();
        if code >= 500 || code == 408 || code == 429 {
            return Err(HttpError::new(HttpErrorKind::Unknown, HttpStatus(code)));
        }
        Ok(response)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queries_go_to_their_file_only() {
        let location = object_store::path::Path::from("ck/a b.pt");
        let key = request_url("http://127.0.0.1:8080/", &location).unwrap();
        assert_eq!(key, "http://127.0.0.1:8080/ck/a%20b.pt");
        let queries: Queries = Arc::new(HashMap::from([(key.clone(), "sig=x%2Fy&v=1".to_owned())]));
        let get = |uri: &str| {
            let req = http::Request::builder()
                .uri(uri)
                .body(object_store::client::HttpRequestBody::empty())
                .unwrap();
            with_query(&queries, req).unwrap().uri().to_string()
        };
        assert_eq!(get(&key), format!("{key}?sig=x%2Fy&v=1"), "kept as given");
        // Another file, another host or port: no query.
        for other in [
            "http://127.0.0.1:8080/ck/b.pt",
            "http://127.0.0.1:8081/ck/a%20b.pt",
            "http://example.com/ck/a%20b.pt",
        ] {
            assert_eq!(get(other), other);
        }
    }
}
