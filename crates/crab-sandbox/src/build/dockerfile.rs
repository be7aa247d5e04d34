//! Dockerfile parsing: logical lines (parser directives, `\` continuations, comments, heredocs),
//! instructions with their `--flags`, JSON (exec) versus shell forms, and the word lexer with
//! `$VAR` / `${VAR}` / `${VAR:-word}` / `${VAR:+word}` substitution that `ENV`, `ARG`, `LABEL`,
//! `COPY`, `WORKDIR`, `USER`, `EXPOSE` and `FROM` use at build time.
//!
//! A small parser of our own rather than the `dockerfile-parser` crate (0.9): that crate leaves
//! `ADD`, `WORKDIR`, `USER`, `SHELL` and `EXPOSE` unparsed, knows no heredocs, no `# escape=`
//! directive, no JSON form of `COPY`, and does no variable substitution; what it does parse is
//! the easy half of this file. The rules here follow Docker's reference: an instruction is
//! refused at parse time (naming it and its line) when the builder does not support it, so a
//! build fails before any step runs.

use std::collections::BTreeMap;

use crate::error::{Result, SandboxError};

/// One instruction of a Dockerfile.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Instruction {
    /// 1-based line where it starts.
    pub line: usize,
    /// Keyword, upper case (`RUN`, `COPY`, …).
    pub keyword: String,
    /// Leading `--name=value` flags (`--name` alone has an empty value).
    pub flags: Vec<(String, String)>,
    /// The rest, after the flags, continuations joined (heredoc bodies not included).
    pub args: String,
    /// Heredocs the instruction opened, in order.
    pub heredocs: Vec<Heredoc>,
}

/// A heredoc (`<<EOF` … `EOF`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Heredoc {
    /// Its delimiter word.
    pub name: String,
    /// Its lines, each ending in `\n`.
    pub body: String,
    /// Whether variables in it expand (an unquoted delimiter).
    pub expand: bool,
}

/// The instructions this builder runs.
pub const SUPPORTED: &[&str] = &[
    "FROM",
    "RUN",
    "COPY",
    "ADD",
    "ENV",
    "ARG",
    "WORKDIR",
    "USER",
    "ENTRYPOINT",
    "CMD",
    "EXPOSE",
    "LABEL",
    "SHELL",
    "MAINTAINER",
    "STOPSIGNAL",
];

/// Instructions Docker knows that this builder refuses, with why.
const REFUSED: &[(&str, &str)] = &[
    ("HEALTHCHECK", "Crab images carry no health check"),
    ("ONBUILD", "Crab images carry no build triggers"),
    ("VOLUME", "Crab sandboxes have no volumes: their whole root is checkpointed"),
];

fn invalid(line: usize, msg: impl std::fmt::Display) -> SandboxError {
    SandboxError::Invalid(format!("Dockerfile line {line}: {msg}"))
}

/// Parse a Dockerfile into its instructions; unknown or unsupported instructions are refused.
pub fn parse(text: &str) -> Result<Vec<Instruction>> {
    let lines: Vec<&str> = text.lines().collect();
    let mut escape = '\\';
    let mut i = 0;
    // Parser directives: `# key=value` lines at the very top.
    while i < lines.len() {
        let l = lines[i].trim();
        let Some(d) = l.strip_prefix('#') else { break };
        let Some((k, v)) = d.split_once('=') else { break };
        let (k, v) = (k.trim().to_ascii_lowercase(), v.trim());
        if k.contains(' ') {
            break;
        }
        if k == "escape" {
            escape = match v {
                "\\" => '\\',
                "`" => '`',
                other => return Err(invalid(i + 1, format!("escape={other:?}: use \\ or `"))),
            };
        }
        i += 1;
    }
    let mut out = Vec::new();
    while i < lines.len() {
        let start = i;
        let first = lines[i].trim_start();
        i += 1;
        if first.is_empty() || first.starts_with('#') {
            continue;
        }
        // Join continuation lines (comment and empty lines inside are dropped).
        let mut logical = String::new();
        let mut cur = first.to_string();
        loop {
            let t = cur.trim_end();
            if let Some(head) = t.strip_suffix(escape) {
                logical.push_str(head);
                let mut next = None;
                while i < lines.len() {
                    let l = lines[i];
                    i += 1;
                    let lt = l.trim_start();
                    if lt.starts_with('#') || lt.is_empty() {
                        continue;
                    }
                    next = Some(l.to_string());
                    break;
                }
                match next {
                    Some(n) => cur = n,
                    None => break,
                }
            } else {
                logical.push_str(&cur);
                break;
            }
        }
        let (kw, rest) = match logical.split_once(|c: char| c.is_whitespace()) {
            Some((k, r)) => (k, r.trim()),
            None => (logical.as_str(), ""),
        };
        let keyword = kw.to_ascii_uppercase();
        if let Some((_, why)) = REFUSED.iter().find(|(k, _)| *k == keyword) {
            return Err(invalid(
                start + 1,
                format!("{keyword} is not supported ({why}); remove it"),
            ));
        }
        if !SUPPORTED.contains(&keyword.as_str()) {
            return Err(invalid(
                start + 1,
                format!(
                    "unknown or unsupported instruction {kw:?}; supported: {}",
                    SUPPORTED.join(", ")
                ),
            ));
        }
        if rest.is_empty() {
            return Err(invalid(start + 1, format!("{keyword} needs arguments")));
        }
        let (flags, args) = split_flags(rest);
        // Heredocs (RUN, COPY, ADD): bodies follow the instruction's line.
        let mut heredocs = Vec::new();
        if matches!(keyword.as_str(), "RUN" | "COPY" | "ADD") && !args.trim_start().starts_with('[')
        {
            for (name, strip_tabs, expand) in heredoc_markers(&args) {
                let mut body = String::new();
                let mut closed = false;
                while i < lines.len() {
                    let l = lines[i];
                    i += 1;
                    let l = if strip_tabs { l.trim_start_matches('\t') } else { l };
                    if l == name {
                        closed = true;
                        break;
                    }
                    body.push_str(l);
                    body.push('\n');
                }
                if !closed {
                    return Err(invalid(
                        start + 1,
                        format!("heredoc <<{name} is never closed (no line {name:?})"),
                    ));
                }
                heredocs.push(Heredoc { name, body, expand });
            }
        }
        out.push(Instruction { line: start + 1, keyword, flags, args, heredocs });
    }
    if !out.iter().any(|i| i.keyword == "FROM") {
        return Err(SandboxError::Invalid("the Dockerfile has no FROM instruction".into()));
    }
    if let Some(first) = out.iter().find(|i| i.keyword != "ARG") {
        if first.keyword != "FROM" {
            return Err(invalid(
                first.line,
                format!("{} before the first FROM (only ARG may come first)", first.keyword),
            ));
        }
    }
    Ok(out)
}

/// Leading `--flag[=value]` words, and the rest.
fn split_flags(rest: &str) -> (Vec<(String, String)>, String) {
    let mut flags = Vec::new();
    let mut s = rest.trim_start();
    while let Some(f) = s.strip_prefix("--") {
        let end = f.find(char::is_whitespace).unwrap_or(f.len());
        let word = &f[..end];
        if word.is_empty() {
            break;
        }
        match word.split_once('=') {
            Some((k, v)) => flags.push((k.to_ascii_lowercase(), v.to_string())),
            None => flags.push((word.to_ascii_lowercase(), String::new())),
        }
        s = f[end..].trim_start();
    }
    (flags, s.to_string())
}

/// The heredocs a line opens: `<<EOF`, `<<-EOF`, `<<"EOF"`, `<<'EOF'` (name, strip tabs, expand).
fn heredoc_markers(s: &str) -> Vec<(String, bool, bool)> {
    let mut out = Vec::new();
    let b = s.as_bytes();
    let mut i = 0;
    let mut quote: Option<u8> = None;
    while i + 1 < b.len() {
        let c = b[i];
        if let Some(q) = quote {
            if c == q {
                quote = None;
            }
            i += 1;
            continue;
        }
        if c == b'\'' || c == b'"' {
            quote = Some(c);
            i += 1;
            continue;
        }
        if c == b'<' && b[i + 1] == b'<' && b.get(i + 2) != Some(&b'<') {
            let mut j = i + 2;
            let strip = b.get(j) == Some(&b'-');
            if strip {
                j += 1;
            }
            let q = match b.get(j) {
                Some(&x) if x == b'"' || x == b'\'' => {
                    j += 1;
                    Some(x)
                }
                _ => None,
            };
            let st = j;
            while j < b.len() && (b[j].is_ascii_alphanumeric() || b[j] == b'_' || b[j] == b'-') {
                j += 1;
            }
            if j > st {
                let name = s[st..j].to_string();
                if let Some(q) = q {
                    if b.get(j) == Some(&q) {
                        j += 1;
                    }
                }
                out.push((name, strip, q.is_none()));
            }
            i = j;
            continue;
        }
        i += 1;
    }
    out
}

/// The exec form (`["a", "b"]`) of an argument, if it is one.
pub fn json_form(args: &str) -> Option<Vec<String>> {
    let t = args.trim();
    if !t.starts_with('[') {
        return None;
    }
    serde_json::from_str::<Vec<String>>(t).ok()
}

/// Split `s` into words as Docker's shell lexer does (quotes, backslash escapes) and expand
/// variables from `env` (unknown ones are empty).
pub fn words(s: &str, env: &BTreeMap<String, String>) -> Result<Vec<String>> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut have = false;
    let mut it = s.chars().peekable();
    while let Some(c) = it.next() {
        match c {
            c if c.is_whitespace() => {
                if have {
                    out.push(std::mem::take(&mut cur));
                    have = false;
                }
            }
            '\'' => {
                have = true;
                loop {
                    match it.next() {
                        Some('\'') => break,
                        Some(x) => cur.push(x),
                        None => return Err(SandboxError::Invalid(format!("unclosed ' in {s:?}"))),
                    }
                }
            }
            '"' => {
                have = true;
                loop {
                    match it.next() {
                        Some('"') => break,
                        Some('\\') => match it.next() {
                            Some(x @ ('"' | '\\' | '$')) => cur.push(x),
                            Some(x) => {
                                cur.push('\\');
                                cur.push(x);
                            }
                            None => cur.push('\\'),
                        },
                        Some('$') => cur.push_str(&dollar(&mut it, env)?),
                        Some(x) => cur.push(x),
                        None => return Err(SandboxError::Invalid(format!("unclosed \" in {s:?}"))),
                    }
                }
            }
            '\\' => {
                have = true;
                if let Some(x) = it.next() {
                    cur.push(x);
                }
            }
            '$' => {
                have = true;
                cur.push_str(&dollar(&mut it, env)?);
            }
            x => {
                have = true;
                cur.push(x);
            }
        }
    }
    if have {
        out.push(cur);
    }
    Ok(out)
}

/// Expand variables in `s` without splitting or removing quotes (heredoc bodies with an
/// unquoted delimiter).
pub fn expand(s: &str, env: &BTreeMap<String, String>) -> Result<String> {
    let mut out = String::new();
    let mut it = s.chars().peekable();
    while let Some(c) = it.next() {
        match c {
            '\\' if it.peek() == Some(&'$') => {
                it.next();
                out.push('$');
            }
            '$' => out.push_str(&dollar(&mut it, env)?),
            x => out.push(x),
        }
    }
    Ok(out)
}

/// After a `$`: `NAME`, `{NAME}`, `{NAME:-word}`, `{NAME:+word}` (a lone `$` stays).
fn dollar(
    it: &mut std::iter::Peekable<std::str::Chars<'_>>,
    env: &BTreeMap<String, String>,
) -> Result<String> {
    match it.peek() {
        Some('{') => {
            it.next();
            let mut inner = String::new();
            let mut depth = 1;
            for c in it.by_ref() {
                match c {
                    '{' => depth += 1,
                    '}' => {
                        depth -= 1;
                        if depth == 0 {
                            break;
                        }
                    }
                    _ => {}
                }
                inner.push(c);
            }
            if depth != 0 {
                return Err(SandboxError::Invalid(format!("unclosed ${{{inner}")));
            }
            let (name, op, word) = match inner.find(':') {
                Some(p) => (&inner[..p], inner.get(p + 1..p + 2).unwrap_or(""), &inner[p + 2..]),
                None => (inner.as_str(), "", ""),
            };
            let val = env.get(name).filter(|v| !v.is_empty());
            Ok(match op {
                "" => env.get(name).cloned().unwrap_or_default(),
                "-" => match val {
                    Some(v) => v.clone(),
                    None => words(word, env)?.join(" "),
                },
                "+" => match val {
                    Some(_) => words(word, env)?.join(" "),
                    None => String::new(),
                },
                other => {
                    return Err(SandboxError::Invalid(format!(
                        "unsupported substitution ${{{name}:{other}…}}: use :- or :+"
                    )))
                }
            })
        }
        Some(c) if c.is_ascii_alphabetic() || *c == '_' => {
            let mut name = String::new();
            while let Some(&c) = it.peek() {
                if c.is_ascii_alphanumeric() || c == '_' {
                    name.push(c);
                    it.next();
                } else {
                    break;
                }
            }
            Ok(env.get(&name).cloned().unwrap_or_default())
        }
        _ => Ok("$".into()),
    }
}

/// `KEY=VALUE …` pairs (ENV, LABEL, ARG's defaults), or the legacy `KEY VALUE with spaces` form
/// when `legacy` and the first word has no `=`.
pub fn pairs(
    args: &str,
    env: &BTreeMap<String, String>,
    legacy: bool,
) -> Result<Vec<(String, String)>> {
    let first = args.split_whitespace().next().unwrap_or("");
    if legacy && !first.contains('=') {
        let rest = args.trim_start()[first.len()..].trim();
        let value = words(rest, env)?.join(" ");
        return Ok(vec![(first.to_string(), value)]);
    }
    let mut out = Vec::new();
    for w in words(args, env)? {
        match w.split_once('=') {
            Some((k, v)) if !k.is_empty() => out.push((k.to_string(), v.to_string())),
            _ => return Err(SandboxError::Invalid(format!("{w:?} is not KEY=VALUE"))),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn env(kv: &[(&str, &str)]) -> BTreeMap<String, String> {
        kv.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn continuations_comments_flags_and_heredocs() {
        let text = "# syntax=docker/dockerfile:1\nARG BASE=debian\nFROM $BASE AS b\n\
                    RUN apt-get update \\\n  # a comment inside\n  && echo hi\n\
                    COPY --chown=1000:1000 --link a b /dst/\n\
                    RUN <<EOF\necho one\necho two\nEOF\n\
                    COPY <<-'X' /etc/f\n\tliteral $HOME\n\tX\n\
                    CMD [\"python3\", \"-m\", \"http.server\"]\n";
        let v = parse(text).unwrap();
        let kw: Vec<&str> = v.iter().map(|i| i.keyword.as_str()).collect();
        assert_eq!(kw, ["ARG", "FROM", "RUN", "COPY", "RUN", "COPY", "CMD"]);
        assert_eq!(v[2].args, "apt-get update   && echo hi");
        assert_eq!(v[2].line, 4);
        assert_eq!(
            v[3].flags,
            vec![("chown".into(), "1000:1000".into()), ("link".into(), String::new())]
        );
        assert_eq!(v[3].args, "a b /dst/");
        assert_eq!(v[4].heredocs[0].body, "echo one\necho two\n");
        assert_eq!(v[5].heredocs[0].body, "literal $HOME\n");
        assert!(!v[5].heredocs[0].expand);
        assert_eq!(json_form(&v[6].args).unwrap(), ["python3", "-m", "http.server"]);
        assert_eq!(json_form("echo [x]"), None);
    }

    #[test]
    fn unsupported_instructions_are_refused_with_their_line() {
        let e = parse("FROM x\nRUN true\nHEALTHCHECK CMD true\n").unwrap_err().to_string();
        assert!(e.contains("line 3") && e.contains("HEALTHCHECK"), "{e}");
        let e = parse("FROM x\nFROBNICATE a\n").unwrap_err().to_string();
        assert!(e.contains("line 2") && e.contains("FROBNICATE"), "{e}");
        assert!(parse("RUN x\n").is_err());
        assert!(parse("ENV A=1\nFROM x\n").is_err());
    }

    #[test]
    fn escape_directive() {
        let v = parse("# escape=`\nFROM x\nRUN echo a `\n  b\n").unwrap();
        assert_eq!(v[1].args, "echo a   b");
    }

    #[test]
    fn words_and_substitution() {
        let e = env(&[("A", "1"), ("E", "")]);
        assert_eq!(words("x$A \"y $A\" 'z $A' \\$A", &e).unwrap(), ["x1", "y 1", "z $A", "$A"]);
        assert_eq!(
            words("${A} ${B:-dflt} ${A:+set} ${E:-e}", &e).unwrap(),
            ["1", "dflt", "set", "e"]
        );
        assert_eq!(
            pairs("K=\"a b\" L=$A", &e, true).unwrap(),
            vec![("K".into(), "a b".into()), ("L".into(), "1".into())]
        );
        assert_eq!(pairs("K a  b", &e, true).unwrap(), vec![("K".into(), "a b".into())]);
        assert!(pairs("K", &e, false).is_err());
        assert_eq!(expand("a $A \\$A", &e).unwrap(), "a 1 $A");
    }
}
