//! The JSON scanner: single passes over JSON text without serde and without recursion.
//!
//! * [`plain_object`]: walks a *plain* object (members whose values are strings without
//!   escapes, integers, booleans or null), the shape nearly every upload and trace line has,
//!   so decoding those skips serde; anything else is left to serde_json.
//! * `scan_json`: the checks serde_json does not make when it captures `attributes` as raw
//!   text (SEMANTICS §2): nesting depth (at most `ATTRIBUTES_MAX_DEPTH` levels), `\u`
//!   surrogates that pair up, numbers within a double's range.

/// `PLAIN_STRING_BYTE[b]`: byte `b` may stand in a JSON string as itself (not a control
/// character, `"` or `\`). One table load per byte where three compares were (the string
/// scans of [`plain_object`] and of the ready record's encoder).
pub(crate) const PLAIN_STRING_BYTE: [bool; 256] = {
    let mut t = [true; 256];
    let mut b = 0;
    while b < 0x20 {
        t[b] = false;
        b += 1;
    }
    t[b'"' as usize] = false;
    t[b'\\' as usize] = false;
    t
};

/// One member value of a plain JSON object ([`plain_object`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PlainValue<'a> {
    /// A string without escapes (its contents).
    Str(&'a str),
    /// An integer: `-?(0|[1-9][0-9]*)` (its text).
    Int(&'a str),
    /// `true` or `false`.
    Bool(bool),
    /// `null`.
    Null,
}

impl PlainValue<'_> {
    /// An [`PlainValue::Int`]'s value; `None` for any other value and for an integer beyond
    /// i64's range, as `str::parse::<i64>` answers for the same text. A digit loop: the text
    /// was checked by [`plain_object`] (an optional `-`, then 1 to 19 digits), and `parse`'s
    /// general path cost about 150 instructions for a 13-digit `ts` (callgrind).
    pub fn as_i64(&self) -> Option<i64> {
        let PlainValue::Int(text) = *self else {
            return None;
        };
        let (negative, digits) = match text.strip_prefix('-') {
            Some(digits) => (true, digits),
            None => (false, text),
        };
        if digits.is_empty() || digits.len() > 19 {
            return None;
        }
        // At most 19 digits: below 10^19, within u64.
        let mut v: u64 = 0;
        for b in digits.bytes() {
            let d = b.wrapping_sub(b'0');
            if d > 9 {
                return None;
            }
            v = v * 10 + u64::from(d);
        }
        if negative {
            0i64.checked_sub_unsigned(v)
        } else {
            i64::try_from(v).ok()
        }
    }
}

/// Walks a *plain* JSON object, the shape nearly every upload and trace line has, without
/// serde: `{`, members separated by commas, `}`, with JSON whitespace anywhere between
/// tokens and nothing after; each member a name and a value that is a string without
/// escapes or control characters, an integer (no fraction, exponent or leading zero, at
/// most 19 digits), `true`, `false` or `null`. Calls `member(name, value)` for each member in order; it
/// returns `false` to give up. Returns `false` when the text is not of that shape or
/// `member` gave up: the caller then parses it with serde_json, which also says what is
/// wrong. A text of that shape is valid JSON, and serde_json reads the same members from it.
pub fn plain_object<'a>(
    text: &'a str,
    mut member: impl FnMut(&'a str, PlainValue<'a>) -> bool,
) -> bool {
    let b = text.as_bytes();
    let mut i = 0;
    let ws = |i: &mut usize| {
        while b
            .get(*i)
            .is_some_and(|c| matches!(c, b' ' | b'\t' | b'\n' | b'\r'))
        {
            *i += 1;
        }
    };
    // A string without escapes or control characters at `*i`: its contents. (The text is
    // UTF-8 and `"` is ASCII, so the contents are whole characters.)
    let string = |i: &mut usize| -> Option<&'a str> {
        if b.get(*i) != Some(&b'"') {
            return None;
        }
        let start = *i + 1;
        let len = b[start..]
            .iter()
            .position(|&c| !PLAIN_STRING_BYTE[usize::from(c)])?;
        if b[start + len] != b'"' {
            return None;
        }
        *i = start + len + 1;
        Some(&text[start..start + len])
    };
    ws(&mut i);
    if b.get(i) != Some(&b'{') {
        return false;
    }
    i += 1;
    ws(&mut i);
    if b.get(i) == Some(&b'}') {
        i += 1;
    } else {
        loop {
            ws(&mut i);
            let Some(name) = string(&mut i) else {
                return false;
            };
            ws(&mut i);
            if b.get(i) != Some(&b':') {
                return false;
            }
            i += 1;
            ws(&mut i);
            let value = match b.get(i) {
                Some(b'"') => match string(&mut i) {
                    Some(v) => PlainValue::Str(v),
                    None => return false,
                },
                Some(b'-' | b'0'..=b'9') => {
                    let start = i;
                    i += usize::from(b[i] == b'-');
                    let digits = b[i..].iter().take_while(|c| c.is_ascii_digit()).count();
                    // (More than 19 digits: left to serde_json, which reads a huge integer
                    // as a double and refuses one beyond its range.)
                    if digits == 0 || digits > 19 || (digits > 1 && b[i] == b'0') {
                        return false;
                    }
                    i += digits;
                    if matches!(b.get(i), Some(b'.' | b'e' | b'E')) {
                        return false;
                    }
                    PlainValue::Int(&text[start..i])
                }
                _ => {
                    let rest = &b[i..];
                    let (v, n) = if rest.starts_with(b"true") {
                        (PlainValue::Bool(true), 4)
                    } else if rest.starts_with(b"false") {
                        (PlainValue::Bool(false), 5)
                    } else if rest.starts_with(b"null") {
                        (PlainValue::Null, 4)
                    } else {
                        return false;
                    };
                    i += n;
                    v
                }
            };
            if !member(name, value) {
                return false;
            }
            ws(&mut i);
            match b.get(i) {
                Some(b',') => i += 1,
                Some(b'}') => {
                    i += 1;
                    break;
                }
                _ => return false,
            }
        }
    }
    ws(&mut i);
    i == b.len()
}

/// Whether JSON text nests objects and arrays deeper than `limit` levels, found in one pass
/// without recursion, so any depth is safe to check. String contents are skipped by their
/// quotes and escapes. (The parser skips and captures values without recursing, so a payload
/// is read whatever its depth before this check.)
#[cfg(test)]
fn too_deep(text: &str, limit: usize) -> bool {
    matches!(scan_json(text, limit), Err(Scan::TooDeep))
}

/// What [`scan_json`] found wrong.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Scan {
    /// Nested deeper than the limit.
    TooDeep,
    /// A `\uXXXX` escape of a UTF-16 surrogate without its other half (the code unit).
    /// serde_json and other strict parsers reject such text; it names no character.
    LoneSurrogate(u16),
    /// A number beyond the range of a double (`1e400`, or an integer of more than 308
    /// digits): serde_json refuses to parse it into a value ("number out of range").
    NumberOutOfRange(String),
}

/// One pass over JSON text already known to be well-formed apart from escapes (captured by
/// serde_json as a raw value, which does not check that `\u` surrogates pair up): the
/// nesting depth against `limit`, every `\u` escape, and that every number fits a double
/// (found by fuzzing: `{"a":5e308}` was accepted and emitted, and serde_json consumers cannot
/// parse the ready record). No recursion.
pub(super) fn scan_json(text: &str, limit: usize) -> Result<(), Scan> {
    let b = text.as_bytes();
    let hex = |at: usize| -> Option<u16> {
        let digits = b.get(at..at + 4)?;
        u16::from_str_radix(std::str::from_utf8(digits).ok()?, 16).ok()
    };
    let (mut depth, mut in_string, mut i) = (0_usize, false, 0);
    while i < b.len() {
        let c = b[i];
        i += 1;
        if in_string {
            match c {
                b'"' => in_string = false,
                b'\\' if b.get(i) == Some(&b'u') => {
                    let unit = hex(i + 1).unwrap_or(0);
                    i += 5;
                    match unit {
                        0xD800..=0xDBFF => {
                            let low = (b.get(i) == Some(&b'\\') && b.get(i + 1) == Some(&b'u'))
                                .then(|| hex(i + 2))
                                .flatten();
                            match low {
                                Some(0xDC00..=0xDFFF) => i += 6,
                                _ => return Err(Scan::LoneSurrogate(unit)),
                            }
                        }
                        0xDC00..=0xDFFF => return Err(Scan::LoneSurrogate(unit)),
                        _ => {}
                    }
                }
                b'\\' => i += 1,
                _ => {}
            }
            continue;
        }
        match c {
            b'"' => in_string = true,
            b'{' | b'[' => {
                depth += 1;
                if depth > limit {
                    return Err(Scan::TooDeep);
                }
            }
            b'}' | b']' => depth = depth.saturating_sub(1),
            b'-' | b'0'..=b'9' => {
                let start = i - 1;
                while i < b.len() && matches!(b[i], b'0'..=b'9' | b'.' | b'e' | b'E' | b'+' | b'-')
                {
                    i += 1;
                }
                let number = &text[start..i];
                // Only an exponent or a very long literal can leave a double's range.
                let suspect = number.len() > 300 || number.bytes().any(|c| c == b'e' || c == b'E');
                if suspect && !number.parse::<f64>().is_ok_and(f64::is_finite) {
                    let shown: String = number.chars().take(40).collect();
                    return Err(Scan::NumberOutOfRange(shown));
                }
            }
            _ => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `plain_object` hands out for the number `text` (`None`: not a plain integer).
    fn scanned_int(text: &str) -> Option<PlainValue<'_>> {
        let mut got = None;
        let line = format!("{{\"n\":{text}}}");
        let _ = plain_object(&line, |_, v| {
            got = Some(matches!(v, PlainValue::Int(_)));
            true
        });
        got.filter(|&int| int).map(|_| PlainValue::Int(text))
    }

    #[test]
    fn plain_integers_read_as_str_parse_reads_them() {
        for text in [
            "0",
            "-0",
            "7",
            "1767225600001",
            "9223372036854775807",
            "9223372036854775808",
            "-9223372036854775808",
            "-9223372036854775809",
            "9999999999999999999",
        ] {
            let v = scanned_int(text).expect("a plain integer");
            assert_eq!(v.as_i64(), text.parse::<i64>().ok(), "{text}");
        }
        assert_eq!(PlainValue::Str("12").as_i64(), None);
        assert_eq!(PlainValue::Int("1x").as_i64(), None);
        assert_eq!(PlainValue::Int("").as_i64(), None);
        assert_eq!(PlainValue::Int("-").as_i64(), None);
    }

    proptest::proptest! {
        #[test]
        fn any_i64_reads_back(n in proptest::prelude::any::<i64>()) {
            let text = n.to_string();
            let v = scanned_int(&text).expect("a plain integer");
            proptest::prop_assert_eq!(v.as_i64(), Some(n));
        }
    }

    #[test]
    fn depth_is_counted_outside_strings() {
        assert_eq!(
            scan_json(r#"{"a":"\ud83d\ude00 \\ud800 \u00e9"}"#, 4),
            Ok(())
        );
        assert_eq!(
            scan_json(r#"{"a":"\ud800"}"#, 4),
            Err(Scan::LoneSurrogate(0xD800))
        );
        assert_eq!(
            scan_json(r#"{"a":"x\udc00y"}"#, 4),
            Err(Scan::LoneSurrogate(0xDC00))
        );
        assert_eq!(
            scan_json(r#"{"a":"\ud83d\u0041"}"#, 4),
            Err(Scan::LoneSurrogate(0xD83D))
        );
        assert_eq!(scan_json(r#"{"a":[1e308,-1.5E-400,-0,12]}"#, 4), Ok(()));
        assert_eq!(
            scan_json(r#"{"a":5e308}"#, 4),
            Err(Scan::NumberOutOfRange("5e308".into()))
        );
        assert_eq!(
            scan_json(r#"{"a":-1E+309}"#, 4),
            Err(Scan::NumberOutOfRange("-1E+309".into()))
        );
        assert_eq!(scan_json(r#"{"a":"5e308"}"#, 4), Ok(()), "inside a string");
        let huge = format!(r#"{{"a":{}}}"#, "9".repeat(400));
        assert!(matches!(
            scan_json(&huge, 4),
            Err(Scan::NumberOutOfRange(_))
        ));
        assert!(!too_deep("{}", 1));
        assert!(too_deep("{}", 0));
        assert!(too_deep(r#"{"a":{"b":1}}"#, 1));
        assert!(!too_deep(r#"{"x":"{{{[[","y":"\"{{"}"#, 1));
        assert!(too_deep(r#"[[1]]"#, 1));
        assert!(!too_deep(r#"[1],[2],{"a":3}"#, 1));
    }
}
