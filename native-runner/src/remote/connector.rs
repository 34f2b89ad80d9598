//! The HTTP client under every store: `object_store`'s own `reqwest` client, with the error
//! statuses worth retrying (5xx, 408, 429) turned into a typed [`HttpStatus`] error, so that the
//! retry loop (`retry`) reads the status from a type, never from the message.
//!
//! Redirects are followed by `reqwest`'s default policy (at most 10, across origins: HF Hub and
//! presigned URLs need them); it drops `Authorization` (and cookies) when a redirect leaves the
//! origin, so credentials are never sent to another host or port. A redirect loop ends as an error.

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

/// Builds [`TypedStatus`] clients over `object_store`'s `reqwest` client.
#[derive(Debug, Default)]
pub(super) struct Connector;

impl HttpConnector for Connector {
    fn connect(&self, options: &ClientOptions) -> object_store::Result<HttpClient> {
        let inner = ReqwestConnector::default().connect(options)?;
        Ok(HttpClient::new(TypedStatus { inner }))
    }
}

#[derive(Debug)]
struct TypedStatus {
    inner: HttpClient,
}

#[async_trait]
impl HttpService for TypedStatus {
    async fn call(&self, req: HttpRequest) -> Result<HttpResponse, HttpError> {
        let response = self.inner.execute(req).await?;
        let code = response.status().as_u16();
        if code >= 500 || code == 408 || code == 429 {
            return Err(HttpError::new(HttpErrorKind::Unknown, HttpStatus(code)));
        }
        Ok(response)
    }
}
