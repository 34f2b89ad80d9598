//! Store errors in words a user can act on: not found, access denied (and where credentials come
//! from), no credentials, short bodies, connection failures, timeouts.

use super::url::Scheme;

/// What went wrong, in words a user can act on (`scheme`: which credentials to check). The kind
/// comes from the error's variant; transport faults (statuses, resets, stalls, connections) are
/// typed by `retry::Fault` before they get here. Object stores' own error codes in an answer
/// (`NoSuchBucket`) and failures of their credential providers (the instance metadata endpoint)
/// are the only things read from the text: `object_store` gives them no type.
pub(super) fn describe_error(scheme: Scheme, err: &object_store::Error) -> String {
    match err {
        object_store::Error::NotFound { .. } => "not found (HTTP 404)".into(),
        object_store::Error::Precondition { .. } => {
            "the file changed on the server while it was read (its ETag no longer matches)".into()
        }
        object_store::Error::PermissionDenied { .. }
        | object_store::Error::Unauthenticated { .. }
            if scheme == Scheme::Http =>
        {
            format!(
                "access denied ({}): the server refuses this URL (HTTP(S) URLs are read without \
                 credentials, but for HF_TOKEN on the HF_ENDPOINT host)",
                hide_queries(&error_chain(err))
            )
        }
        object_store::Error::PermissionDenied { .. }
        | object_store::Error::Unauthenticated { .. } => {
            format!(
                "access denied ({}): check credentials ({})",
                error_chain(err),
                credential_hint(scheme)
            )
        }
        other => {
            let chain = hide_queries(&error_chain(other));
            if scheme != Scheme::Http && chain.contains("NoSuchBucket") {
                format!("not found: the bucket does not exist ({chain})")
            } else if is_credential_error(scheme, other) {
                format!(
                    "no credentials ({chain}): check credentials ({})",
                    credential_hint(scheme)
                )
            } else {
                chain
            }
        }
    }
}

/// `text` with the query of every URL in it replaced by `?…` (presigned URLs carry secrets there).
pub(super) fn hide_queries(text: &str) -> String {
    shardscope_core::source::hide_url_queries(text)
}

/// Where credentials for `scheme` come from.
fn credential_hint(scheme: Scheme) -> &'static str {
    match scheme {
        Scheme::S3 => {
            "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY/AWS_SESSION_TOKEN for s3://, or \
             AWS_SKIP_SIGNATURE=true for a public bucket"
        }
        Scheme::Gcs => "GOOGLE_SERVICE_ACCOUNT or GOOGLE_APPLICATION_CREDENTIALS for gs://",
        Scheme::Azure => "AZURE_STORAGE_ACCOUNT_NAME/AZURE_STORAGE_ACCOUNT_KEY for az://",
        Scheme::Http => "HTTP(S) URLs are read without credentials",
    }
}

/// An error from fetching credentials rather than the object (object stores only): with none in
/// the environment, they ask the cloud's instance metadata endpoint, which off the cloud refuses
/// or does not answer. `object_store` gives these errors no type of their own.
pub(super) fn is_credential_error(scheme: Scheme, err: &object_store::Error) -> bool {
    if scheme == Scheme::Http {
        return false;
    }
    let lower = error_chain(err).to_ascii_lowercase();
    [
        "169.254.169.254",
        "/latest/api/token",
        "/latest/meta-data",
        "metadata.google.internal",
        "/metadata/identity/oauth2",
        "credential",
    ]
    .iter()
    .any(|m| lower.contains(m))
}

pub(super) fn error_chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut next = err.source();
    while let Some(e) = next {
        let s = e.to_string();
        if !text.contains(&s) {
            text.push_str(": ");
            text.push_str(&s);
        }
        next = e.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_say_what_to_do() {
        let nf = object_store::Error::NotFound {
            path: "x".into(),
            source: "404".into(),
        };
        assert_eq!(describe_error(Scheme::S3, &nf), "not found (HTTP 404)");
        let denied = object_store::Error::PermissionDenied {
            path: "x".into(),
            source: "403 Forbidden".into(),
        };
        let text = describe_error(Scheme::S3, &denied);
        assert!(
            text.contains("check credentials") && text.contains("AWS_ACCESS_KEY_ID"),
            "{text}"
        );
        let unauth = object_store::Error::Unauthenticated {
            path: "x".into(),
            source: "401".into(),
        };
        assert!(describe_error(Scheme::S3, &unauth).contains("check credentials"));
        let http = describe_error(Scheme::Http, &unauth);
        assert!(
            http.contains("access denied") && !http.contains("AWS_"),
            "{http}"
        );
        let other = object_store::Error::Generic {
            store: "HTTP",
            source: "connection reset".into(),
        };
        assert!(describe_error(Scheme::S3, &other).contains("connection reset"));
        // No credentials anywhere: the instance metadata endpoint refused.
        let imds = object_store::Error::Generic {
            store: "S3",
            source: "Error performing PUT http://169.254.169.254/latest/api/token in 2ms - \
                     Server returned non-2xx status code: 403 Forbidden"
                .into(),
        };
        let text = describe_error(Scheme::S3, &imds);
        assert!(
            text.starts_with("no credentials") && text.contains("AWS_ACCESS_KEY_ID"),
            "{text}"
        );
        let bucket = object_store::Error::Generic {
            store: "S3",
            source: "404 Not Found: <Error><Code>NoSuchBucket</Code></Error>".into(),
        };
        let text = describe_error(Scheme::S3, &bucket);
        assert!(text.contains("bucket does not exist"), "{text}");
        // Transport faults are typed elsewhere (`retry::Fault`): a message that merely says
        // "timeout" or "connection refused" is shown as it is, not relabelled.
        let text = object_store::Error::Generic {
            store: "HTTP",
            source: "retry_timeout: 120s".into(),
        };
        assert_eq!(
            describe_error(Scheme::Http, &text),
            "Generic HTTP error: retry_timeout: 120s"
        );
    }

    #[test]
    fn queries_are_hidden() {
        assert_eq!(
            hide_queries("GET https://h/x.bin?X-Amz-Signature=abc in 2s (http://a/b)"),
            "GET https://h/x.bin?… in 2s (http://a/b)"
        );
        assert_eq!(hide_queries("no url? here"), "no url? here");
    }
}
