//! How findings write shapes, key lists, shell arguments and file names.

use std::fmt::Write as _;

pub(super) fn shape_text(s: &[u64]) -> String {
    format!(
        "[{}]",
        s.iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    )
}

pub(super) fn list(keys: &[String]) -> String {
    const SHOWN: usize = 4;
    let mut text = keys
        .iter()
        .take(SHOWN)
        .map(|k| format!("`{k}`"))
        .collect::<Vec<_>>()
        .join(", ");
    if keys.len() > SHOWN {
        let _ = write!(text, " and {} more", keys.len() - SHOWN);
    }
    text
}

pub(super) fn quote(path: &str) -> String {
    if !path.is_empty()
        && path
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "/._-+=:@%,".contains(c))
    {
        path.to_owned()
    } else {
        format!("'{}'", path.replace('\'', r"'\''"))
    }
}

pub(super) fn ckpt_arg(label: &str) -> String {
    label.split(' ').map(quote).collect::<Vec<_>>().join(" ")
}

pub(super) fn fixed_name(label: &str) -> String {
    let first = label.split(' ').next().unwrap_or(label);
    let base = first.trim_end_matches('/');
    let stem = base
        .rsplit_once('.')
        .filter(|(s, e)| !s.is_empty() && !e.contains('/'))
        .map_or(base, |(s, _)| s);
    format!("{stem}.fixed.pt")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fix_names_and_quotes() {
        assert_eq!(fixed_name("out/ckpt.pt"), "out/ckpt.fixed.pt");
        assert_eq!(fixed_name("ranks/"), "ranks.fixed.pt");
        assert_eq!(quote("a b"), "'a b'");
    }
}
