//! The fastest way from a YAML document to Services and EndpointSlices:
//! the plain block style that kubectl and generators write (`key: value`
//! lines, `- ` items, one-line scalars), rewritten line by line into JSON
//! text, which serde_json reads straight into the objects.
//!
//! libyaml ([`super::direct`]) spends most of its time on the general
//! grammar and on an allocation per token; this is one pass over the
//! text into one reused buffer (at 10,000 Services x 10 endpoints, 16 MB
//! of YAML, it takes a fraction of libyaml's time). Anything outside that
//! style (anchors, tags, flow collections other than `{}` and `[]`,
//! multi-line or block scalars, a plain scalar that YAML could read as
//! something other than a string, a repeated key, tabs) gives `None`, and
//! the document takes libyaml's path: what this path accepts it reads as
//! the general path ([`super::parse`]) does, and the rest is theirs.

use std::{cell::RefCell, fmt::Write as _};

use super::parse::FileObjects;

/// The objects in one YAML document (one of
/// [`super::parse::yaml_documents`]), or `None` for libyaml's path.
pub fn objects(text: &str) -> Option<FileObjects> {
    thread_local! {
        /// The JSON text of the last document: its room is reused.
        static JSON: RefCell<String> = const { RefCell::new(String::new()) };
    }
    JSON.with_borrow_mut(|json| {
        json.clear();
        to_json(text, json)?;
        super::direct::objects_from_json(json)
    })
}

/// Whether a line opened a mapping or a sequence.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Map,
    Seq,
}

/// A mapping or a sequence not closed yet.
struct Open<'a> {
    kind: Kind,
    /// The column of its keys (or of its `-`).
    indent: usize,
    /// Nothing written in it yet (no comma before the next entry).
    empty: bool,
    /// A mapping's keys so far: a repeated key is refused, as the general
    /// path refuses it.
    keys: Vec<&'a str>,
}

/// What waits for the next line: the value of a `key:` or of a `-` that
/// had none on its line. A line indented deeper gives it; else it is null.
#[derive(Clone, Copy)]
struct Pending {
    /// The column of the key or the `-` (`None`: the document's root).
    indent: Option<usize>,
    /// A key's value may be a sequence at the key's own column
    /// (`ports:` then `- port: 80` under it, as kubectl writes it).
    of_key: bool,
}

/// The JSON of `text`, appended to `json`; `None` where `text` is not
/// in the style this reads.
fn to_json(text: &str, json: &mut String) -> Option<()> {
    let mut writer = Writer {
        json,
        open: Vec::new(),
        pending: Some(Pending {
            indent: None,
            of_key: false,
        }),
    };
    for (number, line) in text.lines().enumerate() {
        // A tab, or a carriage return `lines` left (not before a newline).
        if line.contains(['\t', '\r']) {
            return None;
        }
        let content = line.trim_start_matches(' ');
        if content.is_empty() || content.starts_with('#') {
            continue;
        }
        if number == 0
            && let Some(rest) = content.strip_prefix("---")
        {
            // The document's own marker, with nothing after it.
            if !strip_comment(rest).is_empty() {
                return None;
            }
            continue;
        }
        writer.line(line.len() - content.len(), content)?;
    }
    writer.finish()
}

struct Writer<'j, 'a> {
    json: &'j mut String,
    open: Vec<Open<'a>>,
    pending: Option<Pending>,
}

impl<'a> Writer<'_, 'a> {
    /// One line with content, `content` starting at column `indent`.
    fn line(&mut self, indent: usize, content: &'a str) -> Option<()> {
        if let Some(item) = sequence_item(content) {
            self.item(indent, item)
        } else {
            self.entry(indent, content)
        }
    }

    /// A `-` at column `indent`, followed by `rest`.
    fn item(&mut self, indent: usize, rest: &'a str) -> Option<()> {
        self.enter(indent, Kind::Seq)?;
        self.comma();
        let value = rest.trim_start_matches(' ');
        if sequence_item(value).is_some() {
            return None; // `- - x`: not written by the tools this serves
        }
        if split_key(value).is_some() {
            // `- key: value`: a mapping whose keys are at that column.
            let column = indent + 1 + content_offset(rest);
            self.open(Kind::Map, column);
            return self.entry(column, value);
        }
        self.value(indent, value, false)
    }

    /// A `key: value` line at column `indent`.
    fn entry(&mut self, indent: usize, content: &'a str) -> Option<()> {
        let (key, rest) = split_key(content)?;
        self.enter(indent, Kind::Map)?;
        let map = self.open.last_mut()?;
        let name = key_text(key)?;
        if map.keys.contains(&name) {
            return None;
        }
        map.keys.push(name);
        self.comma();
        write_string(self.json, name);
        self.json.push(':');
        self.value(indent, rest.trim_start_matches(' '), true)
    }

    /// Where a line at `indent` with an entry of a `kind` goes: the
    /// pending value it opens, or the open one of that kind at `indent`.
    fn enter(&mut self, indent: usize, kind: Kind) -> Option<()> {
        if self.takes_pending(indent, kind) {
            self.open(kind, indent);
            Some(())
        } else {
            self.close_to(indent, kind)
        }
    }

    /// The value after a key or a `-` at `indent`: on its line, or (none
    /// there) pending.
    fn value(&mut self, indent: usize, value: &str, of_key: bool) -> Option<()> {
        if value.is_empty() || value.starts_with('#') {
            self.pending = Some(Pending {
                indent: Some(indent),
                of_key,
            });
            return Some(());
        }
        self.scalar(value)
    }

    /// Whether a line at `indent` opening a `kind` is the pending value;
    /// a pending value the line is not is null.
    fn takes_pending(&mut self, indent: usize, kind: Kind) -> bool {
        let Some(pending) = self.pending.take() else {
            return false;
        };
        let deeper = pending
            .indent
            .is_none_or(|at| indent > at || (indent == at && kind == Kind::Seq && pending.of_key));
        if !deeper {
            self.json.push_str("null");
        }
        deeper
    }

    fn open(&mut self, kind: Kind, indent: usize) {
        self.json.push(if kind == Kind::Map { '{' } else { '[' });
        self.open.push(Open {
            kind,
            indent,
            empty: true,
            keys: Vec::new(),
        });
    }

    /// Closes what is indented deeper than `indent` (and a sequence at
    /// `indent` under a key, for a key line); the innermost open one must
    /// then be a `kind` at `indent`.
    fn close_to(&mut self, indent: usize, kind: Kind) -> Option<()> {
        while let Some(top) = self.open.last() {
            let inside = top.indent > indent || (top.indent == indent && top.kind != kind);
            if !inside {
                break;
            }
            self.close();
        }
        let top = self.open.last()?;
        (top.indent == indent && top.kind == kind).then_some(())
    }

    fn close(&mut self) {
        if let Some(top) = self.open.pop() {
            self.json.push(if top.kind == Kind::Map { '}' } else { ']' });
        }
    }

    /// A comma before every entry but the first of the innermost one.
    fn comma(&mut self) {
        if let Some(top) = self.open.last_mut() {
            if !top.empty {
                self.json.push(',');
            }
            top.empty = false;
        }
    }

    /// A value on the line of its key or `-`.
    fn scalar(&mut self, value: &str) -> Option<()> {
        match value.as_bytes()[0] {
            b'"' => {
                let (quoted, rest) = double_quoted(value)?;
                ends_line(rest).then(|| self.json.push_str(quoted))
            }
            b'\'' => {
                let (text, rest) = single_quoted(value)?;
                ends_line(rest).then(|| write_string(self.json, &text))
            }
            _ => {
                let plain = strip_comment(value);
                match plain {
                    "{}" | "[]" => self.json.push_str(plain),
                    _ => self.plain(plain)?,
                }
                Some(())
            }
        }
    }

    /// A plain scalar, as the core schema reads it: null, a boolean, a
    /// decimal integer or a string. Any other number (or what YAML might
    /// read as one) is refused, so that no string here is a number there.
    fn plain(&mut self, plain: &str) -> Option<()> {
        if plain.starts_with([
            '-', '?', ':', ',', '[', ']', '{', '}', '#', '&', '*', '!', '|', '>', '%', '@', '`',
        ]) && !is_decimal(plain)
        {
            return None;
        }
        if plain.contains(": ") || plain.ends_with(':') {
            return None;
        }
        match plain {
            "null" | "Null" | "NULL" | "~" => self.json.push_str("null"),
            "true" | "True" | "TRUE" => self.json.push_str("true"),
            "false" | "False" | "FALSE" => self.json.push_str("false"),
            _ if is_decimal(plain) => self.json.push_str(plain),
            _ if may_be_number(plain) => return None,
            _ => write_string(self.json, plain),
        }
        Some(())
    }

    fn finish(mut self) -> Option<()> {
        if let Some(pending) = self.pending.take() {
            // Nothing at all, or a last `key:` without a value.
            pending.indent?;
            self.json.push_str("null");
        }
        while !self.open.is_empty() {
            self.close();
        }
        Some(())
    }
}

/// The rest of a line that starts a sequence item (`-` then a space or
/// the end of the line).
fn sequence_item(content: &str) -> Option<&str> {
    let rest = content.strip_prefix('-')?;
    (rest.is_empty() || rest.starts_with(' ')).then_some(rest)
}

/// How many spaces `rest` starts with.
fn content_offset(rest: &str) -> usize {
    rest.len() - rest.trim_start_matches(' ').len()
}

/// A `key: rest` or `key:` line: the key's text as written and what
/// follows the colon.
fn split_key(content: &str) -> Option<(&str, &str)> {
    let end = if content.starts_with('"') {
        let (quoted, _) = double_quoted(content)?;
        quoted.len()
    } else {
        content.find(':')?
    };
    let rest = content[end..].strip_prefix(':')?;
    (rest.is_empty() || rest.starts_with(' ')).then_some((&content[..end], rest))
}

/// A key's text: a plain key that YAML reads as a string (a name, a
/// label or annotation key), or a double-quoted one without escapes.
fn key_text(key: &str) -> Option<&str> {
    if let Some(quoted) = key.strip_prefix('"') {
        let inner = quoted.strip_suffix('"')?;
        return (!inner.contains('\\')).then_some(inner);
    }
    let first = key.chars().next()?;
    let fits = (first.is_ascii_alphabetic() || first == '_')
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'/' | b'-' | b'_'));
    let special = matches!(
        key,
        "null" | "Null" | "NULL" | "true" | "True" | "TRUE" | "false" | "False" | "FALSE"
    );
    (fits && !special).then_some(key)
}

/// A double-quoted scalar at the start of `text` (quotes included) whose
/// escapes mean the same in JSON, so it is copied as it is; and what
/// follows it on the line.
fn double_quoted(text: &str) -> Option<(&str, &str)> {
    let bytes = text.as_bytes();
    let mut i = 1;
    while i < bytes.len() {
        match bytes[i] {
            b'"' => return Some((&text[..=i], &text[i + 1..])),
            b'\\' => {
                match bytes.get(i + 1)? {
                    b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => i += 2,
                    b'u' => {
                        let hex = text.get(i + 2..i + 6)?;
                        if !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
                            return None;
                        }
                        i += 6;
                    }
                    _ => return None,
                }
                continue;
            }
            control if control < 0x20 => return None,
            _ => {}
        }
        i += 1;
    }
    None // continued on the next line
}

/// A single-quoted scalar at the start of `text`, unquoted (`''` is a
/// quote); and what follows it on the line.
fn single_quoted(text: &str) -> Option<(String, &str)> {
    let mut value = String::new();
    let mut rest = &text[1..];
    loop {
        let end = rest.find('\'')?;
        value.push_str(&rest[..end]);
        rest = &rest[end + 1..];
        match rest.strip_prefix('\'') {
            Some(after) => {
                value.push('\'');
                rest = after;
            }
            None => return Some((value, rest)),
        }
    }
}

/// `text` without a trailing comment (a `#` after a space) and spaces.
fn strip_comment(text: &str) -> &str {
    let text = match text.find(" #") {
        Some(at) => &text[..at],
        None => text,
    };
    text.trim_end_matches(' ')
}

/// Whether what follows a quoted scalar on its line is nothing, spaces
/// or a comment.
fn ends_line(rest: &str) -> bool {
    rest.is_empty() || (rest.starts_with(' ') && strip_comment(rest).is_empty())
}

/// An integer as JSON writes it: `0`, or digits without a leading zero,
/// optionally negative, small enough for any integer field.
fn is_decimal(text: &str) -> bool {
    let digits = text.strip_prefix('-').unwrap_or(text);
    !digits.is_empty()
        && digits.len() <= 18
        && digits.bytes().all(|b| b.is_ascii_digit())
        && (digits == "0" || !digits.starts_with('0'))
}

/// Whether some reader of YAML might take the plain scalar `text` for
/// anything but a string: a float (as Rust reads one: infinities and
/// not-a-number included), a hex, octal or binary integer, digits with a
/// leading zero, underscores or colons (YAML 1.1's forms), anything
/// starting with `+` or `.`, or one of YAML 1.1's booleans. An address
/// (`10.96.0.1`) or a name is none of these.
fn may_be_number(text: &str) -> bool {
    let unsigned = text.strip_prefix(['+', '-']).unwrap_or(text);
    text.starts_with(['+', '.'])
        || unsigned.starts_with('.')
        || text.parse::<f64>().is_ok()
        || ["0x", "0o", "0b"].iter().any(|radix| unsigned.starts_with(radix))
        || (unsigned.starts_with(|c: char| c.is_ascii_digit())
            && unsigned.bytes().all(|b| b.is_ascii_digit() || b == b'_' || b == b':'))
        || ["y", "n", "yes", "no", "on", "off"]
            .iter()
            .any(|word| text.eq_ignore_ascii_case(word))
}

/// `text` as a JSON string.
fn write_string(json: &mut String, text: &str) {
    json.push('"');
    let mut start = 0;
    for (at, c) in text.char_indices() {
        let escape = match c {
            '"' => "\\\"",
            '\\' => "\\\\",
            c if u32::from(c) < 0x20 => {
                json.push_str(&text[start..at]);
                let _ = write!(json, "\\u{:04x}", u32::from(c));
                start = at + 1;
                continue;
            }
            _ => continue,
        };
        json.push_str(&text[start..at]);
        json.push_str(escape);
        start = at + 1;
    }
    json.push_str(&text[start..]);
    json.push('"');
}

#[cfg(test)]
mod tests;
