//! Remote inputs named by URL: which store (`http(s)://`, `s3://`, `gs://`, `az://`), the folder
//! inside it and the file, if any.

use anyhow::{Context, bail};
use url::Url;

/// Which kind of store a URL names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Scheme {
    Http,
    S3,
    Gcs,
    Azure,
}

impl Scheme {
    /// Object stores list a prefix; plain HTTP cannot.
    pub(super) fn can_list(self) -> bool {
        !matches!(self, Scheme::Http)
    }
}

/// A parsed remote input: the store's root URL, the folder inside it (`/`-separated, no leading
/// or trailing `/`), and the file named, if any (`None` for a folder URL ending with `/`).
#[derive(Clone, PartialEq, Eq)]
pub(super) struct RemoteUrl {
    pub(super) scheme: Scheme,
    /// `http://host:port/` or `s3://bucket` (what the store is built from).
    pub(super) store_url: String,
    pub(super) folder: String,
    pub(super) file: Option<String>,
    /// The query of an HTTP(S) URL that names one file (a presigned URL's signature, an Azure
    /// SAS): sent as it is on every request for that file, never shown (`?…` in messages).
    pub(super) query: Option<String>,
}

/// Never the query.
impl std::fmt::Debug for RemoteUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("RemoteUrl").field(&self.shown()).finish()
    }
}

impl RemoteUrl {
    /// The URL of `name` inside the folder (for messages).
    pub(super) fn url_of(&self, name: &str) -> String {
        let sep = if self.store_url.ends_with('/') {
            ""
        } else {
            "/"
        };
        if self.folder.is_empty() {
            format!("{}{sep}{name}", self.store_url)
        } else {
            format!("{}{sep}{}/{name}", self.store_url, self.folder)
        }
    }

    /// The folder's URL, with a trailing `/`.
    pub(super) fn folder_url(&self) -> String {
        self.url_of("")
    }

    /// The URL as messages show it: its file's URL, a query as `?…`.
    pub(super) fn shown(&self) -> String {
        let base = self.url_of(self.file.as_deref().unwrap_or(""));
        if self.query.is_some() {
            format!("{base}?…")
        } else {
            base
        }
    }
}

/// `input` (one URL, or a path) as messages show it: the query of a URL (a presigned URL's
/// signature) as `?…`, all of it (to the end, spaces included).
pub fn shown(input: &str) -> String {
    if !is_url(input) {
        return input.to_owned();
    }
    match input.split_once('?') {
        Some((head, _)) => format!("{head}?…"),
        None => input.to_owned(),
    }
}

/// True when an input argument is a URL this module reads (not a local path).
pub fn is_url(input: &str) -> bool {
    ["http://", "https://", "s3://", "gs://", "az://", "abfs://"]
        .iter()
        .any(|p| {
            input
                .get(..p.len())
                .is_some_and(|head| head.eq_ignore_ascii_case(p))
        })
}

/// Splits a URL into store, folder and file. A trailing `/` names a folder.
pub(super) fn parse_url(input: &str) -> anyhow::Result<RemoteUrl> {
    // Never the query in a message: it may carry a signature.
    let shown = shown(input);
    let url = Url::parse(input).map_err(|e| anyhow::anyhow!("{shown} is not a valid URL: {e}"))?;
    let scheme = match url.scheme() {
        "http" | "https" => Scheme::Http,
        "s3" => Scheme::S3,
        "gs" => Scheme::Gcs,
        "az" | "abfs" => Scheme::Azure,
        other => bail!("{shown}: unsupported URL scheme `{other}` (use http, https, s3, gs or az)"),
    };
    let input = shown.as_str();
    if url.fragment().is_some() {
        bail!("{input}: URLs with a fragment (`#…`) are not supported");
    }
    let query = url.query().map(str::to_owned);
    if query.is_some() && scheme != Scheme::Http {
        bail!(
            "{input}: a query is read on http(s) URLs only (a presigned URL is an https URL); \
             {} URLs take their credentials from the environment",
            url.scheme()
        );
    }
    if query.is_some() && (url.path().is_empty() || url.path().ends_with('/')) {
        bail!(
            "{input}: a URL with a query (a presigned URL, an Azure SAS) names one file, not a \
             folder: a signature covers one object\nhint: give the URL of each file \
             (`.metadata` and every `.distcp`, each per-rank `.pt`), each with its own query"
        );
    }
    let host = url
        .host_str()
        .filter(|h| !h.is_empty())
        .with_context(|| format!("{input}: the URL names no host or bucket"))?;
    let store_url = match scheme {
        Scheme::Http => {
            let port = url.port().map_or(String::new(), |p| format!(":{p}"));
            format!("{}://{host}{port}/", url.scheme())
        }
        _ => format!("{}://{host}", url.scheme()),
    };
    // Percent-decoded segments; empty ones (`a//b`) are dropped.
    let path = url.path();
    let is_folder = path.is_empty() || path.ends_with('/');
    let mut segments = Vec::new();
    for seg in path.split('/').filter(|s| !s.is_empty()) {
        let decoded = percent_decode(seg)
            .with_context(|| format!("{input}: bad percent-encoding in `{seg}`"))?;
        if decoded == "." || decoded == ".." || decoded.contains('/') {
            bail!("{input}: the path segment `{seg}` is not allowed");
        }
        segments.push(decoded);
    }
    let file = if is_folder { None } else { segments.pop() };
    Ok(RemoteUrl {
        scheme,
        store_url,
        folder: segments.join("/"),
        file,
        query,
    })
}

fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = s.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_split_into_store_folder_and_file() {
        let u = parse_url("http://127.0.0.1:8080/ckpt/step_10/").unwrap();
        assert_eq!(u.scheme, Scheme::Http);
        assert_eq!(u.store_url, "http://127.0.0.1:8080/");
        assert_eq!(u.folder, "ckpt/step_10");
        assert_eq!(u.file, None);
        assert_eq!(
            u.url_of(".metadata"),
            "http://127.0.0.1:8080/ckpt/step_10/.metadata"
        );

        let u = parse_url("s3://bucket/a/model.safetensors").unwrap();
        assert_eq!(
            (u.scheme, u.store_url.as_str()),
            (Scheme::S3, "s3://bucket")
        );
        assert_eq!(u.folder, "a");
        assert_eq!(u.file.as_deref(), Some("model.safetensors"));
        assert_eq!(u.url_of("x"), "s3://bucket/a/x");

        let u = parse_url("gs://b/").unwrap();
        assert_eq!(
            (u.scheme, u.folder.as_str(), u.file.as_deref()),
            (Scheme::Gcs, "", None)
        );
        assert_eq!(u.url_of(".metadata"), "gs://b/.metadata");
        assert_eq!(parse_url("az://c/x/").unwrap().scheme, Scheme::Azure);
        assert_eq!(
            parse_url("https://h/a%20b/f.pt").unwrap().folder,
            "a b",
            "segments are percent-decoded"
        );
    }

    #[test]
    fn bad_urls_are_refused_with_the_url() {
        for bad in [
            "ftp://h/x",
            "s3:///x",
            "http://h/a/%zz",
            "http://h/x#a",
            "http://h/a/%2fb/x",
        ] {
            let err = parse_url(bad).unwrap_err().to_string();
            assert!(err.contains(bad), "{bad}: {err}");
        }
        // The query is kept exactly; messages show it as `?…`.
        let u = parse_url("https://h/b/k.pt?X-Amz-Signature=ab%2Fc&X-Amz-Date=1").unwrap();
        assert_eq!(
            u.query.as_deref(),
            Some("X-Amz-Signature=ab%2Fc&X-Amz-Date=1")
        );
        assert_eq!((u.folder.as_str(), u.file.as_deref()), ("b", Some("k.pt")));
        assert_eq!(u.shown(), "https://h/b/k.pt?…");
        for bad in [
            "https://h/b/?sig=SECRET",
            "s3://b/k?sig=SECRET",
            "https://h/%zz?sig=SECRET",
        ] {
            let err = parse_url(bad).unwrap_err().to_string();
            assert!(
                !err.contains("SECRET") && err.contains("?…"),
                "{bad}: {err}"
            );
        }
        assert_eq!(shown("https://h/a b.pt?sig=SE CRET"), "https://h/a b.pt?…");
        assert_eq!(
            shown("ckpt/a?b.pt"),
            "ckpt/a?b.pt",
            "a path is shown as it is"
        );
        assert!(!format!("{u:?}").contains("Signature"), "{u:?}");
        let err = parse_url("https://h/ckpt/?sig=SECRET")
            .unwrap_err()
            .to_string();
        assert!(err.contains("names one file, not a folder"), "{err}");
        assert!(is_url("S3://b/x") && is_url("https://h/") && is_url("az://c/"));
        assert!(!is_url("./s3:/x") && !is_url("ckpt/") && !is_url("http:/x"));
    }
}
