//! Name patterns with captures (`layers.{L}.attention.wq.weight`) and integer expressions over a
//! model config (`num_attention_heads*head_dim`), the two small languages of a mapping file.

use std::collections::BTreeMap;

use super::MappingError;

/// Captured values of a pattern match, by capture name.
pub type Captures = BTreeMap<String, String>;

/// One piece of a name pattern.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Piece {
    Lit(String),
    /// `{L}`: a word (ASCII letters, digits, `_`; no dot).
    Digits(String),
    /// `{K*}`: any non-empty text (the longest that lets the rest match).
    Any(String),
}

/// A name pattern: literal text with `{NAME}` (a word: letters, digits, `_`) and `{NAME*}` (any
/// text) captures.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pattern {
    text: String,
    pieces: Vec<Piece>,
}

impl Pattern {
    pub fn parse(text: &str) -> Result<Self, MappingError> {
        let bad = |what: &str| MappingError::Spec(format!("pattern `{text}`: {what}"));
        let mut pieces = Vec::new();
        let mut rest = text;
        while !rest.is_empty() {
            match rest.find('{') {
                Some(0) => {
                    let close = rest.find('}').ok_or_else(|| bad("`{` without `}`"))?;
                    let name = &rest[1..close];
                    let (name, any) = match name.strip_suffix('*') {
                        Some(n) => (n, true),
                        None => (name, false),
                    };
                    if name.is_empty()
                        || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                    {
                        return Err(bad("a capture is named by letters, digits and `_`"));
                    }
                    if matches!(pieces.last(), Some(Piece::Any(_) | Piece::Digits(_))) {
                        return Err(bad("two captures must be separated by literal text"));
                    }
                    pieces.push(if any {
                        Piece::Any(name.to_owned())
                    } else {
                        Piece::Digits(name.to_owned())
                    });
                    rest = &rest[close + 1..];
                }
                Some(i) => {
                    pieces.push(Piece::Lit(rest[..i].to_owned()));
                    rest = &rest[i..];
                }
                None => {
                    pieces.push(Piece::Lit(rest.to_owned()));
                    rest = "";
                }
            }
            if let Some(Piece::Lit(l)) = pieces.last()
                && l.contains('}')
            {
                return Err(bad("`}` without `{`"));
            }
        }
        Ok(Self {
            text: text.to_owned(),
            pieces,
        })
    }

    pub fn text(&self) -> &str {
        &self.text
    }

    /// The names of the captures, in order.
    pub fn captures(&self) -> impl Iterator<Item = &str> {
        self.pieces.iter().filter_map(|p| match p {
            Piece::Digits(n) | Piece::Any(n) => Some(n.as_str()),
            Piece::Lit(_) => None,
        })
    }

    /// The captures when `name` matches the whole pattern.
    pub fn matches(&self, name: &str) -> Option<Captures> {
        let mut caps = Captures::new();
        match_from(&self.pieces, name, &mut caps).then_some(caps)
    }

    /// The name with every capture filled in from `caps`.
    pub fn fill(&self, caps: &Captures) -> Result<String, MappingError> {
        let mut out = String::new();
        for p in &self.pieces {
            match p {
                Piece::Lit(l) => out.push_str(l),
                Piece::Digits(n) | Piece::Any(n) => out.push_str(caps.get(n).ok_or_else(|| {
                    MappingError::Spec(format!(
                        "pattern `{}`: the capture `{{{n}}}` is not captured by the other side of its rule",
                        self.text
                    ))
                })?),
            }
        }
        Ok(out)
    }
}

fn match_from(pieces: &[Piece], name: &str, caps: &mut Captures) -> bool {
    let Some((first, rest)) = pieces.split_first() else {
        return name.is_empty();
    };
    match first {
        Piece::Lit(l) => name
            .strip_prefix(l.as_str())
            .is_some_and(|r| match_from(rest, r, caps)),
        Piece::Digits(n) => {
            // A word: letters, digits and `_`, the longest that lets the rest match.
            let len = name
                .bytes()
                .take_while(|b| b.is_ascii_alphanumeric() || *b == b'_')
                .count();
            for end in (1..=len).rev() {
                if match_from(rest, &name[end..], caps) {
                    caps.insert(n.clone(), name[..end].to_owned());
                    return true;
                }
            }
            false
        }
        Piece::Any(n) => {
            for end in (1..=name.len()).rev() {
                if name.is_char_boundary(end) && match_from(rest, &name[end..], caps) {
                    caps.insert(n.clone(), name[..end].to_owned());
                    return true;
                }
            }
            false
        }
    }
}

/// A model config's integer and boolean fields, with a mapping's defaults for absent ones.
#[derive(Debug, Clone, Default)]
pub struct Config {
    values: BTreeMap<String, serde_json::Value>,
    defaults: BTreeMap<String, String>,
}

impl Config {
    /// `config` must be a JSON object (a Hugging Face `config.json`).
    pub fn new(
        config: &serde_json::Value,
        defaults: &BTreeMap<String, String>,
    ) -> Result<Self, MappingError> {
        let obj = config
            .as_object()
            .ok_or_else(|| MappingError::Config("the config is not a JSON object".to_owned()))?;
        Ok(Self {
            values: obj.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
            defaults: defaults.clone(),
        })
    }

    pub fn raw(&self, field: &str) -> Option<&serde_json::Value> {
        self.values.get(field)
    }

    /// A boolean field (absent: `default`).
    pub fn flag(&self, field: &str, default: bool) -> Result<bool, MappingError> {
        match self.values.get(field) {
            None | Some(serde_json::Value::Null) => Ok(default),
            Some(serde_json::Value::Bool(b)) => Ok(*b),
            Some(other) => Err(MappingError::Config(format!(
                "`{field}` is {other}, not true or false"
            ))),
        }
    }

    /// An integer field: the config's value, or the mapping's default expression for it.
    pub fn int(&self, field: &str) -> Result<u64, MappingError> {
        self.int_depth(field, 0)
    }

    fn int_depth(&self, field: &str, depth: u32) -> Result<u64, MappingError> {
        match self.values.get(field) {
            Some(serde_json::Value::Number(n)) => n.as_u64().ok_or_else(|| {
                MappingError::Config(format!("`{field}` is {n}, not a non-negative integer"))
            }),
            Some(v) if !v.is_null() => Err(MappingError::Config(format!(
                "`{field}` is {v}, not a non-negative integer"
            ))),
            _ => match self.defaults.get(field) {
                Some(expr) if depth < 8 => self.eval_depth(expr, depth + 1),
                _ => Err(MappingError::Config(format!("the config has no `{field}`"))),
            },
        }
    }

    /// An expression: integers and config fields joined by `+`, `-`, `*` and `/` (exact integer
    /// division; `*` and `/` before `+` and `-`, left to right).
    pub fn eval(&self, expr: &str) -> Result<u64, MappingError> {
        self.eval_depth(expr, 0)
    }

    fn eval_depth(&self, expr: &str, depth: u32) -> Result<u64, MappingError> {
        let overflow = || MappingError::Config(format!("`{expr}` overflows"));
        let mut total: u64 = 0;
        let mut sign_minus = false;
        for (i, term) in split_keep(expr, &['+', '-']).into_iter().enumerate() {
            let (op, term) = term;
            if i > 0 {
                sign_minus = op == '-';
            }
            let mut value: Option<u64> = None;
            for (op, factor) in split_keep(term, &['*', '/']) {
                let factor = factor.trim();
                let v = if factor.bytes().all(|b| b.is_ascii_digit()) && !factor.is_empty() {
                    factor.parse::<u64>().map_err(|_| overflow())?
                } else {
                    self.int_depth(factor, depth)?
                };
                value = Some(match (value, op) {
                    (None, _) => v,
                    (Some(a), '*') => a.checked_mul(v).ok_or_else(overflow)?,
                    (Some(a), _) => {
                        if v == 0 || a % v != 0 {
                            return Err(MappingError::Config(format!(
                                "`{expr}`: {a} is not a multiple of `{factor}` = {v}"
                            )));
                        }
                        a / v
                    }
                });
            }
            let v = value.ok_or_else(|| MappingError::Spec(format!("`{expr}` is empty")))?;
            total = if sign_minus {
                total
                    .checked_sub(v)
                    .ok_or_else(|| MappingError::Config(format!("`{expr}` is negative")))?
            } else {
                total.checked_add(v).ok_or_else(overflow)?
            };
        }
        Ok(total)
    }
}

/// Splits `s` at any of `ops`, each part with the operator before it (`+` for the first).
fn split_keep<'s>(s: &'s str, ops: &[char]) -> Vec<(char, &'s str)> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut op = '+';
    for (i, c) in s.char_indices() {
        if ops.contains(&c) {
            out.push((op, &s[start..i]));
            op = c;
            start = i + c.len_utf8();
        }
    }
    out.push((op, &s[start..]));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_capture_digits_and_text() {
        let p = Pattern::parse("layers.{L}.moe.experts.w{N}").unwrap();
        let caps = p.matches("layers.12.moe.experts.w3").unwrap();
        assert_eq!(caps["L"], "12");
        assert_eq!(caps["N"], "3");
        assert!(p.matches("layers.x.y.moe.experts.w3").is_none());
        let part = Pattern::parse("mlp.{P}_proj.weight").unwrap();
        assert_eq!(
            part.matches("mlp.gate_up_proj.weight").unwrap()["P"],
            "gate_up"
        );
        assert!(p.matches("layers.1.moe.experts.w3.bias").is_none());
        let any = Pattern::parse("model.{K*}").unwrap();
        assert_eq!(any.matches("model.a.b").unwrap()["K"], "a.b");
        assert!(any.matches("model.").is_none());
        assert_eq!(
            Pattern::parse("x.{L}.y").unwrap().fill(&caps).unwrap(),
            "x.12.y"
        );
        assert!(Pattern::parse("x.{Q}.y").unwrap().fill(&caps).is_err());
        assert!(Pattern::parse("x.{L}{N}").is_err());
        assert!(Pattern::parse("x.{L").is_err());
        assert!(Pattern::parse("x.L}").is_err());
    }

    #[test]
    fn expressions_over_the_config() {
        let cfg = serde_json::json!({"hidden_size": 64, "num_attention_heads": 4, "flag": true});
        let defaults = BTreeMap::from([(
            "head_dim".to_owned(),
            "hidden_size/num_attention_heads".to_owned(),
        )]);
        let c = Config::new(&cfg, &defaults).unwrap();
        assert_eq!(c.eval("num_attention_heads*head_dim").unwrap(), 64);
        assert_eq!(c.eval("2*hidden_size+8-num_attention_heads").unwrap(), 132);
        assert!(
            c.eval("hidden_size/3")
                .unwrap_err()
                .to_string()
                .contains("not a multiple")
        );
        assert!(
            c.eval("vocab_size")
                .unwrap_err()
                .to_string()
                .contains("no `vocab_size`")
        );
        assert!(c.eval("4-8").is_err());
        assert!(c.flag("flag", false).unwrap());
        assert!(!c.flag("absent", false).unwrap());
    }
}
