//! The inputs' `data` values cut out of a KServe v2 JSON request before serde_json reads the
//! rest (kserve.rs). serde_json skips a value it keeps raw by reading every number in it, as
//! long as a parse takes; here an array's end is found by searching for brackets and quotes
//! only, many bytes at a time (memchr), and serde_json reads a frame whose `data` values are
//! each replaced by its index (`"data": 3`): a few kilobytes however many candidates.
//!
//! Only the structure serde_json will read is followed: the request object, its `inputs`
//! array, each input's keys; every other value is skipped whole. A body this does not follow
//! (a key with an escape, a `data` that is not an array, text that is not JSON) is not cut,
//! and the caller reads it whole. Valid JSON is cut where serde_json would find the values,
//! and where the frame and every cut value read without error, the whole body does too.

use memchr::{memchr2, memchr3};

/// A request body with its inputs' `data` values cut out.
#[derive(Debug, PartialEq)]
pub struct Cut<'a> {
    /// The body with each `data` value replaced by its index in `data`.
    pub frame: Vec<u8>,
    /// The `data` values' text, in the body's order.
    pub data: Vec<&'a str>,
}

/// Cuts `body` (JSON text) as the module docs say, or `None` where it does not follow it.
pub fn cut(body: &[u8]) -> Option<Cut<'_>> {
    let mut w = Walk {
        bytes: body,
        at: 0,
        spans: Vec::new(),
    };
    w.space();
    w.object(|w, key| match key {
        b"inputs" => w.inputs(),
        _ => w.skip_value(),
    })?;
    let mut frame =
        Vec::with_capacity(body.len() - w.spans.iter().map(|(s, e)| e - s).sum::<usize>());
    let mut data = Vec::with_capacity(w.spans.len());
    let mut copied = 0;
    for (i, &(start, end)) in w.spans.iter().enumerate() {
        frame.extend_from_slice(&body[copied..start]);
        frame.extend_from_slice(i.to_string().as_bytes());
        data.push(std::str::from_utf8(&body[start..end]).ok()?);
        copied = end;
    }
    frame.extend_from_slice(&body[copied..]);
    Some(Cut { frame, data })
}

/// A cursor over the body, and the `data` spans found so far.
struct Walk<'a> {
    bytes: &'a [u8],
    at: usize,
    spans: Vec<(usize, usize)>,
}

impl<'a> Walk<'a> {
    fn peek(&self) -> Option<u8> {
        self.bytes.get(self.at).copied()
    }

    fn space(&mut self) {
        while let Some(b' ' | b'\n' | b'\r' | b'\t') = self.peek() {
            self.at += 1;
        }
    }

    fn eat(&mut self, byte: u8) -> Option<()> {
        self.space();
        (self.peek()? == byte).then(|| self.at += 1)
    }

    /// An object, each member's value handed to `value` with its key.
    fn object(&mut self, mut value: impl FnMut(&mut Self, &[u8]) -> Option<()>) -> Option<()> {
        self.eat(b'{')?;
        self.space();
        if self.peek()? == b'}' {
            self.at += 1;
            return Some(());
        }
        loop {
            self.space();
            let key = self.key()?;
            self.eat(b':')?;
            self.space();
            value(self, key)?;
            self.space();
            match self.peek()? {
                b',' => self.at += 1,
                b'}' => break,
                _ => return None,
            }
        }
        self.at += 1;
        Some(())
    }

    /// A key's text, without its quotes; one with an escape is not followed.
    fn key(&mut self) -> Option<&'a [u8]> {
        if self.peek()? != b'"' {
            return None;
        }
        let start = self.at + 1;
        let end = start + memchr2(b'"', b'\\', &self.bytes[start..])?;
        if self.bytes[end] != b'"' {
            return None;
        }
        self.at = end + 1;
        Some(&self.bytes[start..end])
    }

    /// The `inputs` array: each input's `data` cut, its other members skipped.
    fn inputs(&mut self) -> Option<()> {
        self.eat(b'[')?;
        self.space();
        if self.peek()? == b']' {
            self.at += 1;
            return Some(());
        }
        loop {
            self.object(|w, key| match key {
                b"data" => w.data(),
                _ => w.skip_value(),
            })?;
            self.space();
            match self.peek()? {
                b',' => self.at += 1,
                b']' => break,
                _ => return None,
            }
        }
        self.at += 1;
        Some(())
    }

    /// A `data` array, its span kept.
    fn data(&mut self) -> Option<()> {
        if self.peek()? != b'[' {
            return None;
        }
        let start = self.at;
        self.skip_array()?;
        self.spans.push((start, self.at));
        Some(())
    }

    /// An array, to its matching bracket: only brackets and quotes are looked for.
    fn skip_array(&mut self) -> Option<()> {
        let mut depth = 0usize;
        loop {
            self.at += memchr3(b'[', b']', b'"', &self.bytes[self.at..])?;
            match self.bytes[self.at] {
                b'[' => depth += 1,
                b']' => depth -= 1,
                _ => {
                    self.skip_string()?;
                    continue;
                }
            }
            self.at += 1;
            if depth == 0 {
                return Some(());
            }
        }
    }

    /// A string, from its opening quote to past its closing one.
    fn skip_string(&mut self) -> Option<()> {
        self.at += 1;
        loop {
            self.at += memchr2(b'"', b'\\', self.bytes.get(self.at..)?)?;
            if self.bytes[self.at] == b'"' {
                self.at += 1;
                return Some(());
            }
            self.at += 2; // an escape and the character it escapes
        }
    }

    /// Any value: a string, a container to its matching close, or a scalar to its end.
    fn skip_value(&mut self) -> Option<()> {
        match self.peek()? {
            b'"' => self.skip_string(),
            b'[' | b'{' => {
                let mut depth = 0usize;
                loop {
                    match self.peek()? {
                        b'"' => {
                            self.skip_string()?;
                            continue;
                        }
                        b'[' | b'{' => depth += 1,
                        b']' | b'}' => depth = depth.checked_sub(1)?,
                        _ => {}
                    }
                    self.at += 1;
                    if depth == 0 {
                        return Some(());
                    }
                }
            }
            _ => {
                let start = self.at;
                while let Some(b) = self.peek() {
                    if matches!(b, b',' | b']' | b'}' | b' ' | b'\n' | b'\r' | b'\t') {
                        break;
                    }
                    self.at += 1;
                }
                (self.at > start).then_some(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_values_are_cut_and_indexed() {
        let body = br#" {"id": "a\"[", "inputs": [{"name": "x", "data": [[1, 2], [3, "]"]], "shape": [2, 2]},
            {"data" : [], "parameters": {"data": [9]}}], "parameters": {"inputs": [{"data": [5]}]}} "#;
        let cut = cut(body).unwrap();
        assert_eq!(cut.data, vec![r#"[[1, 2], [3, "]"]]"#, "[]"]);
        let frame = std::str::from_utf8(&cut.frame).unwrap();
        assert!(frame.contains(r#""data": 0, "shape""#), "{frame}");
        assert!(
            frame.contains(r#""data" : 1, "parameters": {"data": [9]}"#),
            "{frame}"
        );
        assert!(
            frame.ends_with(r#""parameters": {"inputs": [{"data": [5]}]}} "#),
            "{frame}"
        );
    }

    #[test]
    fn what_it_does_not_follow_is_not_cut() {
        for body in [
            r#"{"inputs": [{"d\u0061ta": [1]}]}"#,
            r#"{"inputs": [{"data": 5}]}"#,
            r#"{"inputs": {"data": [1]}}"#,
            r#"[{"inputs": []}]"#,
            r#"{"inputs": [{"data": [1]]"#,
            r#"{"inputs": [{"data": ["#,
            r#"{"id": "#,
            r#"{"id": "\"#,
            r#"{"id": "a\"#,
            "",
        ] {
            assert_eq!(cut(body.as_bytes()), None, "{body}");
        }
    }
}
