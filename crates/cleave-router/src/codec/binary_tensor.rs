//! The binary tensor data extension of the KServe v2 REST protocol: a body is a JSON header
//! (`Inference-Header-Content-Length` bytes) followed by the raw bytes of each binary tensor,
//! back to back, in the order the header lists them (each `binary_data_size` long). Nothing
//! here looks at an element: the bytes are cut, checked for length, and kept as they are.

use axum::http::HeaderMap;
use thiserror::Error;

/// The header that gives the length of the JSON part of a request or response body.
pub const HEADER_LENGTH: &str = "inference-header-content-length";

/// What can be wrong with the binary framing of a body (the caller maps these to 400s).
#[derive(Debug, Error, PartialEq, Eq)]
pub enum BinaryError {
    #[error("header {HEADER_LENGTH} is {0:?}, expected a non-negative whole number of bytes")]
    BadHeaderLength(String),
    #[error(
        "header {HEADER_LENGTH} is {header} but the body has only {body} bytes; the JSON \
         header cannot be longer than the body"
    )]
    HeaderBeyondBody { header: usize, body: usize },
    #[error(
        "its binary data ({size} bytes from byte {offset} of the binary part) runs past the \
         end of the body: only {left} bytes are left"
    )]
    Truncated {
        size: usize,
        offset: usize,
        left: usize,
    },
    #[error(
        "the body has {0} bytes after the last binary tensor; the binary_data_size parameters \
         must add up to the bytes after the JSON header"
    )]
    Trailing(usize),
}

/// The `Inference-Header-Content-Length` header, when given.
pub fn header_length(headers: &HeaderMap) -> Result<Option<usize>, BinaryError> {
    let Some(value) = headers.get(HEADER_LENGTH) else {
        return Ok(None);
    };
    let text = value.to_str().unwrap_or("").trim();
    // `parse` alone would take a leading '+'; the protocol says digits.
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(BinaryError::BadHeaderLength(
            String::from_utf8_lossy(value.as_bytes()).into_owned(),
        ));
    }
    text.parse()
        .map(Some)
        .map_err(|_| BinaryError::BadHeaderLength(text.to_string()))
}

/// Splits a body into its JSON header and its binary part.
pub fn split(body: &[u8], header: usize) -> Result<(&[u8], Sections<'_>), BinaryError> {
    if header > body.len() {
        return Err(BinaryError::HeaderBeyondBody {
            header,
            body: body.len(),
        });
    }
    let (json, rest) = body.split_at(header);
    Ok((json, Sections { rest, offset: 0 }))
}

/// The binary part of a body, cut one tensor at a time from the front.
#[derive(Debug)]
pub struct Sections<'a> {
    rest: &'a [u8],
    offset: usize,
}

impl<'a> Sections<'a> {
    /// No binary part (a body without the header).
    pub fn empty() -> Sections<'static> {
        Sections {
            rest: &[],
            offset: 0,
        }
    }

    /// The next `size` bytes.
    pub fn take(&mut self, size: usize) -> Result<&'a [u8], BinaryError> {
        if size > self.rest.len() {
            return Err(BinaryError::Truncated {
                size,
                offset: self.offset,
                left: self.rest.len(),
            });
        }
        let (section, rest) = self.rest.split_at(size);
        self.rest = rest;
        self.offset += size;
        Ok(section)
    }

    /// Every byte must belong to a tensor.
    pub fn finish(self) -> Result<(), BinaryError> {
        match self.rest.len() {
            0 => Ok(()),
            n => Err(BinaryError::Trailing(n)),
        }
    }
}

/// A response body with binary outputs: the JSON header, then each output's bytes in order.
/// Returns the body and the header's length.
pub fn join(json: Vec<u8>, sections: &[&[u8]]) -> (Vec<u8>, usize) {
    let header = json.len();
    let mut body = json;
    body.reserve_exact(sections.iter().map(|s| s.len()).sum());
    for s in sections {
        body.extend_from_slice(s);
    }
    (body, header)
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;
    use proptest::prelude::*;

    #[test]
    fn header_lengths() {
        let mut h = HeaderMap::new();
        assert_eq!(header_length(&h), Ok(None));
        h.insert(HEADER_LENGTH, HeaderValue::from_static("42"));
        assert_eq!(header_length(&h), Ok(Some(42)));
        h.insert(
            "Inference-Header-Content-Length",
            HeaderValue::from_static(" 7 "),
        );
        assert_eq!(header_length(&h), Ok(Some(7)));
        for bad in ["", "-1", "+3", "1e3", "lots", "99999999999999999999999"] {
            h.insert(HEADER_LENGTH, HeaderValue::from_static(bad));
            let e = header_length(&h).unwrap_err();
            assert!(matches!(e, BinaryError::BadHeaderLength(_)), "{bad}");
            assert!(e
                .to_string()
                .contains("expected a non-negative whole number"));
        }
    }

    #[test]
    fn splits_and_cuts() {
        let body = b"{\"a\":1}0123456789";
        let (json, mut s) = split(body, 7).unwrap();
        assert_eq!(json, b"{\"a\":1}");
        assert_eq!(s.take(4).unwrap(), b"0123");
        assert_eq!(s.take(0).unwrap(), b"");
        assert_eq!(s.take(6).unwrap(), b"456789");
        s.finish().unwrap();

        let e = split(body, 18).unwrap_err();
        assert_eq!(
            e,
            BinaryError::HeaderBeyondBody {
                header: 18,
                body: 17
            }
        );
        assert!(e
            .to_string()
            .contains("is 18 but the body has only 17 bytes"));

        let (_, mut s) = split(body, 7).unwrap();
        s.take(8).unwrap();
        let e = s.take(4).unwrap_err();
        assert_eq!(
            e.to_string(),
            "its binary data (4 bytes from byte 8 of the binary part) runs past the end of \
             the body: only 2 bytes are left"
        );
        let (_, mut s) = split(body, 7).unwrap();
        s.take(3).unwrap();
        assert_eq!(s.finish(), Err(BinaryError::Trailing(7)));
    }

    #[test]
    fn joins() {
        let (body, header) = join(b"{}".to_vec(), &[b"ab", b"", b"c"]);
        assert_eq!((body.as_slice(), header), (&b"{}abc"[..], 2));
    }

    proptest! {
        /// Any body, any header length and any sizes: the splitter answers, never panics, and
        /// what it hands out is exactly the body's bytes in order.
        #[test]
        fn splitter_never_panics(
            body in proptest::collection::vec(any::<u8>(), 0..256),
            header in 0usize..300,
            sizes in proptest::collection::vec(0usize..300, 0..8),
        ) {
            match split(&body, header) {
                Err(BinaryError::HeaderBeyondBody { .. }) => prop_assert!(header > body.len()),
                Err(e) => prop_assert!(false, "unexpected {e}"),
                Ok((json, mut sections)) => {
                    prop_assert_eq!(json, &body[..header]);
                    let mut at = header;
                    for size in sizes {
                        match sections.take(size) {
                            Ok(s) => {
                                prop_assert_eq!(s, &body[at..at + size]);
                                at += size;
                            }
                            Err(BinaryError::Truncated { left, .. }) => {
                                prop_assert_eq!(left, body.len() - at);
                                prop_assert!(size > left);
                                break;
                            }
                            Err(e) => prop_assert!(false, "unexpected {e}"),
                        }
                    }
                    let _ = sections.finish();
                }
            }
        }
    }
}
