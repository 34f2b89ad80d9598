//! One `object_store` client per URL's store, with retries and backoff for transient failures.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use object_store::{BackoffConfig, ObjectStore, RetryConfig};

use super::url::{RemoteUrl, Scheme};

fn retry_config() -> RetryConfig {
    RetryConfig {
        backoff: BackoffConfig {
            init_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(5),
            base: 2.0,
        },
        max_retries: 4,
        retry_timeout: Duration::from_mins(2),
    }
}

pub(super) fn build_store(url: &RemoteUrl) -> anyhow::Result<Arc<dyn ObjectStore>> {
    let what = || format!("cannot set up access to {}", url.folder_url());
    Ok(match url.scheme {
        Scheme::Http => Arc::new(
            object_store::http::HttpBuilder::new()
                .with_url(url.store_url.clone())
                .with_retry(retry_config())
                .with_client_options(
                    object_store::ClientOptions::new()
                        .with_allow_http(true)
                        .with_timeout(Duration::from_mins(1)),
                )
                .build()
                .with_context(what)?,
        ),
        Scheme::S3 => Arc::new(
            object_store::aws::AmazonS3Builder::from_env()
                .with_url(url.store_url.clone())
                .with_retry(retry_config())
                .build()
                .with_context(what)?,
        ),
        Scheme::Gcs => Arc::new(
            object_store::gcp::GoogleCloudStorageBuilder::from_env()
                .with_url(url.store_url.clone())
                .with_retry(retry_config())
                .build()
                .with_context(what)?,
        ),
        Scheme::Azure => Arc::new(
            object_store::azure::MicrosoftAzureBuilder::from_env()
                .with_url(url.store_url.clone())
                .with_retry(retry_config())
                .build()
                .with_context(what)?,
        ),
    })
}
