//! Checkpoint URLs as the page takes them: several at once, `{r}` patterns with a rank count, and
//! queries (presigned S3/GCS URLs, Azure SAS) that are sent as they are but never shown.
//! The spelling follows the command line (`--ranks N` there, `&ranks=N` in the page URL).

/// The most ranks a `{r}` pattern expands to (as `shardscope --ranks`).
pub const MAX_RANKS: u64 = 1 << 16;

/// `url` as messages show it: its query (a presigned URL's signature) as `?…`, all of it (to the
/// end, fragment included).
pub fn shown(url: &str) -> String {
    match url.split_once('?') {
        Some((head, _)) => format!("{head}?…"),
        None => url.to_owned(),
    }
}

/// `url` without its fragment, split into the part before the query and the query as written
/// (not re-encoded: it is sent exactly as given). An empty query (`…?`) counts as none.
pub fn split_query(url: &str) -> (&str, Option<&str>) {
    let url = url.trim();
    let url = url.split_once('#').map_or(url, |(u, _)| u);
    match url.split_once('?') {
        Some((head, q)) if !q.is_empty() => (head, Some(q)),
        Some((head, _)) => (head, None),
        None => (url, None),
    }
}

/// `text` with the query of every URL in it replaced by `?…` (a last guard for what the page
/// shows: statuses and errors).
pub fn hide_queries(text: &str) -> String {
    shardscope_core::source::hide_url_queries(text)
}

/// Expands `{r}` patterns (also percent-encoded, `%7Br%7D`) into the URLs of ranks 0 to N-1,
/// the query kept for each. `ranks` is the page's `ranks` parameter (empty: none given).
pub fn expand_ranks(urls: &[String], ranks: &str) -> Result<Vec<String>, String> {
    let urls: Vec<String> = urls
        .iter()
        .map(|u| u.trim().replace("%7Br%7D", "{r}").replace("%7br%7d", "{r}"))
        .filter(|u| !u.is_empty())
        .collect();
    let has = |u: &String| u.contains("{r}");
    let ranks = ranks.trim();
    if ranks.is_empty() {
        if let Some(u) = urls.iter().find(|u| has(u)) {
            return Err(format!(
                "{}: `{{r}}` stands for the rank: give the number of ranks (`&ranks=N` in the \
                 page URL, or the ranks field)",
                shown(u)
            ));
        }
        return Ok(urls);
    }
    let n = ranks
        .parse::<u64>()
        .ok()
        .filter(|n| (1..=MAX_RANKS).contains(n))
        .ok_or_else(|| format!("ranks={ranks}: give 1 to {MAX_RANKS} ranks"))?;
    if !urls.iter().any(has) {
        return Err(format!(
            "ranks={n}: no URL holds a `{{r}}` pattern (`https://h/ckpt/model_rank{{r}}.pt`)"
        ));
    }
    let mut out = Vec::new();
    for u in urls {
        if has(&u) {
            out.extend((0..n).map(|r| u.replace("{r}", &r.to_string())));
        } else {
            out.push(u);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SIGNED: &str =
        "https://b.s3.amazonaws.com/run/rank{r}.pt?X-Amz-Algorithm=AWS4&X-Amz-Signature=SECRET";

    #[test]
    fn queries_are_never_shown() {
        assert_eq!(shown(SIGNED), "https://b.s3.amazonaws.com/run/rank{r}.pt?…");
        assert_eq!(shown("https://h/a.pt"), "https://h/a.pt");
        let text = format!("cannot read `{SIGNED}`: HTTP 403 (also {SIGNED})");
        let hidden = hide_queries(&text);
        assert!(!hidden.contains("SECRET"), "{hidden}");
        // Idempotent: what `shown` wrote keeps its punctuation.
        let again = "error: https://h/a.pt?…: HTTP 403";
        assert_eq!(hide_queries(again), again);
        assert_eq!(
            hidden,
            "cannot read `https://b.s3.amazonaws.com/run/rank{r}.pt?…`: HTTP 403 (also \
             https://b.s3.amazonaws.com/run/rank{r}.pt?…)"
        );
    }

    #[test]
    fn the_query_is_kept_as_written() {
        let q = "sv=2024&sig=a%2Fb%3D&x=+";
        assert_eq!(
            split_query(&format!("https://h/c/m.pt?{q}#frag")),
            ("https://h/c/m.pt", Some(q))
        );
        assert_eq!(split_query("https://h/c/"), ("https://h/c/", None));
        assert_eq!(split_query("https://h/c/m.pt?"), ("https://h/c/m.pt", None));
    }

    #[test]
    fn rank_patterns_expand_like_the_command_line() {
        let urls = expand_ranks(&[SIGNED.to_owned()], "3").unwrap();
        assert_eq!(urls.len(), 3);
        for (r, u) in urls.iter().enumerate() {
            assert_eq!(
                u,
                &format!(
                    "https://b.s3.amazonaws.com/run/rank{r}.pt?X-Amz-Algorithm=AWS4&X-Amz-Signature=SECRET"
                )
            );
        }
        // Encoded braces, and URLs without a pattern kept as they are.
        let urls = expand_ranks(
            &[
                "https://h/m%7Br%7D.pt".to_owned(),
                "https://h/.metadata".to_owned(),
            ],
            "2",
        )
        .unwrap();
        assert_eq!(
            urls,
            ["https://h/m0.pt", "https://h/m1.pt", "https://h/.metadata"]
        );
        // A pattern needs a count (and the message hides the query); a count needs a pattern.
        let e = expand_ranks(&[SIGNED.to_owned()], "").unwrap_err();
        assert!(e.contains("ranks=N") && !e.contains("SECRET"), "{e}");
        let e = expand_ranks(&["https://h/a.pt".to_owned()], "2").unwrap_err();
        assert!(e.contains("no URL holds"), "{e}");
        for bad in ["0", "x", "65537", "-1"] {
            assert!(expand_ranks(&[SIGNED.to_owned()], bad).is_err(), "{bad}");
        }
        assert_eq!(
            expand_ranks(&["https://h/a.pt".to_owned(), " ".to_owned()], "").unwrap(),
            ["https://h/a.pt"]
        );
    }
}
