//! The `Idempotency-Key` request header.

use http::HeaderMap;

/// The header that carries the client's key.
pub const HEADER: &str = "idempotency-key";
const MAX_LEN: usize = 255;

/// A client-chosen key: 1 to 255 visible ASCII characters.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(String);

/// Why a header value is not a key.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KeyError {
    #[error("the Idempotency-Key header must be 1 to 255 visible ASCII characters")]
    Invalid,
    #[error("the Idempotency-Key header was sent more than once")]
    Repeated,
}

impl IdempotencyKey {
    /// Parses the bare form (`abc`) or the RFC 8941 string form (`"abc"`);
    /// both name the same key.
    pub fn parse(raw: &[u8]) -> Result<Self, KeyError> {
        let text = std::str::from_utf8(raw).map_err(|_| KeyError::Invalid)?;
        let key = match text.strip_prefix('"') {
            Some(quoted) => unquote(quoted).ok_or(KeyError::Invalid)?,
            None => text.to_owned(),
        };
        let visible = key.bytes().all(|b| b.is_ascii_graphic());
        if key.is_empty() || key.len() > MAX_LEN || !visible {
            return Err(KeyError::Invalid);
        }
        Ok(IdempotencyKey(key))
    }

    /// Reads the key from the request headers; `None` when there is none.
    pub fn from_headers(headers: &HeaderMap) -> Result<Option<Self>, KeyError> {
        let mut values = headers.get_all(HEADER).iter();
        let Some(first) = values.next() else {
            return Ok(None);
        };
        if values.next().is_some() {
            return Err(KeyError::Repeated);
        }
        Self::parse(first.as_bytes()).map(Some)
    }

    /// The key as the client chose it (unquoted).
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// The inside of an RFC 8941 sf-string after its opening quote: `\"` and `\\`
/// are the only escapes, and the closing quote must end the value.
fn unquote(rest: &str) -> Option<String> {
    let mut out = String::with_capacity(rest.len());
    let mut chars = rest.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.next()? {
                escaped @ ('"' | '\\') => out.push(escaped),
                _ => return None,
            },
            '"' => return chars.next().is_none().then_some(out),
            c => out.push(c),
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bare_and_quoted_forms_name_the_same_key() {
        assert_eq!(
            IdempotencyKey::parse(b"order-42").unwrap(),
            IdempotencyKey::parse(b"\"order-42\"").unwrap()
        );
        assert_eq!(
            IdempotencyKey::parse(br#""a\"b""#).unwrap().as_str(),
            "a\"b"
        );
    }

    #[test]
    fn keys_outside_the_visible_ascii_range_are_refused() {
        for bad in [
            &b""[..],
            b"\"\"",
            b"has space",
            b"tab\t",
            "caf\u{e9}".as_bytes(),
            b"\"unterminated",
            b"\"x\"trailing",
            b"\"bad\\escape\"",
        ] {
            assert_eq!(
                IdempotencyKey::parse(bad),
                Err(KeyError::Invalid),
                "{bad:?}"
            );
        }
        assert!(IdempotencyKey::parse("k".repeat(255).as_bytes()).is_ok());
        assert!(IdempotencyKey::parse("k".repeat(256).as_bytes()).is_err());
    }
}
