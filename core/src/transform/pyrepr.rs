//! Python `repr` of the few values PyTorch interpolates into its error messages.

use crate::model::tree::{Node, Tensor};

/// `repr(str)`: single quotes unless the string contains one and no double quote.
pub(crate) fn string(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            '\r' => out.push_str("\\r"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}

/// `repr(list_of_str)`.
pub(crate) fn str_list<S: AsRef<str>>(items: &[S]) -> String {
    let parts: Vec<String> = items.iter().map(|s| string(s.as_ref())).collect();
    format!("[{}]", parts.join(", "))
}

/// `repr(tuple_of_str)` (a one-element tuple has a trailing comma).
pub(crate) fn str_tuple<S: AsRef<str>>(items: &[S]) -> String {
    let parts: Vec<String> = items.iter().map(|s| string(s.as_ref())).collect();
    if parts.len() == 1 {
        format!("({},)", parts[0])
    } else {
        format!("({})", parts.join(", "))
    }
}

/// `repr(float)`: Rust's shortest round-trip form matches Python's for ordinary magnitudes.
pub(crate) fn float(v: f64) -> String {
    if v.is_nan() {
        "nan".to_owned()
    } else if v.is_infinite() {
        if v > 0.0 { "inf" } else { "-inf" }.to_owned()
    } else {
        format!("{v:?}")
    }
}

/// `repr` of a scalar-ish node (tensors are summarised, torch prints their values).
pub(crate) fn node(n: &Node) -> String {
    match n {
        Node::None => "None".to_owned(),
        Node::Bool(b) => if *b { "True" } else { "False" }.to_owned(),
        Node::Int(i) => i.to_string(),
        Node::Float(f) => float(*f),
        Node::Str(s) => string(s),
        Node::Tensor(t) => tensor(t),
        other => format!("<{}>", other.kind_name()),
    }
}

fn tensor(t: &Tensor) -> String {
    match t.scalar_f64() {
        Some(v) if t.dim() == 0 => format!("tensor({})", float(v)),
        _ => format!("tensor(<{} x {:?}>)", t.dtype, t.shape),
    }
}

/// `repr(torch.Size)` contents: `[7, 3]`.
pub(crate) fn shape(s: &[u64]) -> String {
    let parts: Vec<String> = s.iter().map(u64::to_string).collect();
    format!("[{}]", parts.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reprs_match_python() {
        assert_eq!(str_list(&["a", "b.c"]), "['a', 'b.c']");
        assert_eq!(str_tuple(&["a"]), "('a',)");
        assert_eq!(str_tuple(&["a", "b"]), "('a', 'b')");
        assert_eq!(string("it's"), "\"it's\"");
        assert_eq!(float(3.0), "3.0");
        assert_eq!(float(2.74), "2.74");
    }
}
