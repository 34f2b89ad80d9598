//! One `object_store` client per URL's store. Its own retries are off: `fetch` retries and resumes
//! (typed faults, backoff, `--io-timeout`), the same way for every request. The HTTP client is
//! `object_store`'s, under [`Connector`] (error statuses as types).
//!
//! Plain HTTP(S) URLs are read without credentials, but for `HF_TOKEN`: sent as a bearer token to
//! the Hugging Face endpoint only (`HF_ENDPOINT`, by default `https://huggingface.co`: same scheme,
//! host and port), never to another origin, redirects included.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use object_store::{BackoffConfig, ClientOptions, ObjectStore, RetryConfig};

use super::connector::{Connector, Queries};
use super::retry::Settings;
use super::url::{RemoteUrl, Scheme};

/// No retries inside `object_store`: ours (`fetch`) resume a cut body where it stopped and type
/// every fault.
fn retry_config() -> RetryConfig {
    RetryConfig {
        backoff: BackoffConfig {
            init_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(5),
            base: 2.0,
        },
        max_retries: 0,
        retry_timeout: Duration::from_mins(2),
    }
}

/// `scheme://host:port` of a URL, default ports spelled out (`None`: not a URL with a host).
fn origin(url: &str) -> Option<(String, String, u16)> {
    let u = url::Url::parse(url).ok()?;
    Some((
        u.scheme().to_owned(),
        u.host_str()?.to_ascii_lowercase(),
        u.port_or_known_default()?,
    ))
}

/// `Authorization: Bearer $HF_TOKEN` when `store_url` is the Hugging Face endpoint's origin.
fn hf_token_headers(store_url: &str) -> Option<http::HeaderMap> {
    let token = std::env::var("HF_TOKEN")
        .ok()
        .filter(|t| !t.trim().is_empty())?;
    let endpoint =
        std::env::var("HF_ENDPOINT").unwrap_or_else(|_| "https://huggingface.co".to_owned());
    if origin(&endpoint)? != origin(store_url)? {
        return None;
    }
    let mut value = http::HeaderValue::from_str(&format!("Bearer {}", token.trim())).ok()?;
    value.set_sensitive(true);
    let mut headers = http::HeaderMap::new();
    headers.insert(http::header::AUTHORIZATION, value);
    Some(headers)
}

fn http_options(url: &RemoteUrl) -> ClientOptions {
    // No whole-request timeout (a large range may take long); `fetch` times each wait for a byte.
    let mut options = ClientOptions::new()
        .with_allow_http(true)
        .with_timeout_disabled()
        .with_connect_timeout(Settings::get().io_timeout);
    if let Some(headers) = hf_token_headers(&url.store_url) {
        options = options.with_default_headers(headers);
    }
    options
}

/// The store of `url`'s origin or bucket; `queries`: the query of each file by the URL requested
/// (HTTP only, [`Connector`]).
pub(super) fn build_store(
    url: &RemoteUrl,
    queries: Queries,
) -> anyhow::Result<Arc<dyn ObjectStore>> {
    let what = || format!("cannot set up access to {}", url.folder_url());
    Ok(match url.scheme {
        Scheme::Http => Arc::new(
            object_store::http::HttpBuilder::new()
                .with_url(url.store_url.clone())
                .with_retry(retry_config())
                .with_http_connector(Connector { queries })
                .with_client_options(http_options(url))
                .build()
                .with_context(what)?,
        ),
        Scheme::S3 => Arc::new(
            object_store::aws::AmazonS3Builder::from_env()
                .with_url(url.store_url.clone())
                .with_retry(retry_config())
                .with_http_connector(Connector::default())
                .build()
                .with_context(what)?,
        ),
        Scheme::Gcs => Arc::new(
            object_store::gcp::GoogleCloudStorageBuilder::from_env()
                .with_url(url.store_url.clone())
                .with_retry(retry_config())
                .with_http_connector(Connector::default())
                .build()
                .with_context(what)?,
        ),
        Scheme::Azure => Arc::new(
            object_store::azure::MicrosoftAzureBuilder::from_env()
                .with_url(url.store_url.clone())
                .with_retry(retry_config())
                .with_http_connector(Connector::default())
                .build()
                .with_context(what)?,
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn origins_compare_scheme_host_and_port() {
        assert_eq!(
            origin("https://huggingface.co"),
            origin("https://HuggingFace.co:443/")
        );
        assert_ne!(
            origin("https://huggingface.co/"),
            origin("http://huggingface.co/")
        );
        assert_ne!(
            origin("http://127.0.0.1:8000/"),
            origin("http://127.0.0.1:8001/")
        );
        assert_eq!(origin("not a url"), None);
    }
}
