//! Request parameters, decoded from JSON or from a form, before validation.
//!
//! Both encodings become one map of JSON values so that each resource
//! validates its parameters once. A form gives only strings (and
//! `metadata[key]=value` gives an object of strings); JSON gives typed values.
//! The encoding is kept, because a string is a fine amount in a form and a
//! type error in JSON.

use serde_json::{Map, Value};

/// How the body was encoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Encoding {
    Json,
    Form,
}

/// A parameter that is missing, unknown or invalid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ParamError {
    /// Stable machine-readable code, e.g. `parameter_missing`.
    pub code: &'static str,
    /// The parameter at fault, e.g. `amount` or `metadata[order]`.
    pub param: String,
    pub message: String,
}

impl ParamError {
    pub fn new(code: &'static str, param: impl Into<String>, message: impl Into<String>) -> Self {
        ParamError {
            code,
            param: param.into(),
            message: message.into(),
        }
    }
}

/// Why a body could not be decoded at all.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("the body is not valid JSON: {0}")]
    Json(String),
    #[error("the body must be a JSON object")]
    NotAnObject,
    #[error(transparent)]
    Param(#[from] ParamError),
}

/// Decoded parameters with their encoding.
#[derive(Debug)]
pub struct Params {
    pub encoding: Encoding,
    fields: Map<String, Value>,
}

impl Params {
    /// Decodes a JSON object body.
    pub fn from_json(body: &[u8]) -> Result<Self, DecodeError> {
        match serde_json::from_slice::<Value>(body) {
            Ok(Value::Object(fields)) => {
                for (name, value) in &fields {
                    refuse_nul(name, value)?;
                }
                Ok(Params {
                    encoding: Encoding::Json,
                    fields,
                })
            }
            Ok(_) => Err(DecodeError::NotAnObject),
            Err(e) => Err(DecodeError::Json(e.to_string())),
        }
    }

    /// Decodes an `application/x-www-form-urlencoded` body, Stripe style:
    /// `metadata[order]=42` sets one metadata entry. A repeated parameter is
    /// refused rather than silently resolved.
    pub fn from_form(body: &[u8]) -> Result<Self, DecodeError> {
        let mut fields = Map::new();
        for (name, value) in form_urlencoded::parse(body) {
            let (name, value) = (name.into_owned(), value.into_owned());
            refuse_nul(&name, &Value::String(value.clone()))?;
            let (slot, param) = match name.split_once('[') {
                Some((outer, rest)) => {
                    let inner = rest
                        .strip_suffix(']')
                        .filter(|inner| !inner.contains(['[', ']']));
                    let Some(inner) = inner else {
                        return Err(ParamError::new(
                            "parameter_unknown",
                            name.clone(),
                            format!("Received unknown parameter: {name}"),
                        )
                        .into());
                    };
                    let object = fields
                        .entry(outer.to_owned())
                        .or_insert_with(|| Value::Object(Map::new()));
                    let Value::Object(object) = object else {
                        return Err(duplicate(outer));
                    };
                    (object.entry(inner.to_owned()), name.clone())
                }
                None => (fields.entry(name.clone()), name.clone()),
            };
            match slot {
                serde_json::map::Entry::Vacant(slot) => {
                    slot.insert(Value::String(value));
                }
                serde_json::map::Entry::Occupied(_) => return Err(duplicate(&param)),
            }
        }
        Ok(Params {
            encoding: Encoding::Form,
            fields,
        })
    }

    /// Takes a parameter out; `null` counts as absent.
    pub fn take(&mut self, name: &str) -> Option<Value> {
        self.fields.remove(name).filter(|v| !v.is_null())
    }

    /// Refuses whatever parameters are left, as Stripe does.
    pub fn reject_unknown(&self) -> Result<(), ParamError> {
        match self.fields.keys().next() {
            Some(name) => Err(ParamError::new(
                "parameter_unknown",
                name.clone(),
                format!("Received unknown parameter: {name}"),
            )),
            None => Ok(()),
        }
    }
}

/// Postgres text cannot hold U+0000, and no parameter needs it: refuse it
/// here, as a client error, rather than fail in the database.
fn refuse_nul(name: &str, value: &Value) -> Result<(), ParamError> {
    let invalid = |param: &str| {
        ParamError::new(
            "parameter_invalid_string",
            param,
            format!("{param} must not contain the NUL character"),
        )
    };
    if name.contains('\0') {
        return Err(invalid(&name.replace('\0', "\\u0000")));
    }
    match value {
        Value::String(s) if s.contains('\0') => Err(invalid(name)),
        Value::Object(entries) => {
            for (key, inner) in entries {
                let param = format!("{name}[{}]", key.replace('\0', "\\u0000"));
                let bad_value = matches!(inner, Value::String(s) if s.contains('\0'));
                if key.contains('\0') || bad_value {
                    return Err(invalid(&param));
                }
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

fn duplicate(param: &str) -> DecodeError {
    ParamError::new(
        "parameter_duplicate",
        param,
        format!("The parameter {param} was given more than once"),
    )
    .into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn form_metadata_brackets_become_an_object() {
        let mut p = Params::from_form(b"amount=2000&metadata%5Border%5D=42&metadata[k]=v").unwrap();
        assert_eq!(p.take("amount"), Some(json!("2000")));
        assert_eq!(p.take("metadata"), Some(json!({"order": "42", "k": "v"})));
        assert!(p.reject_unknown().is_ok());
    }

    #[test]
    fn repeated_form_parameters_are_refused() {
        for body in [
            &b"amount=1&amount=2"[..],
            b"metadata[a]=1&metadata[a]=2",
            b"metadata=x&metadata[a]=1",
        ] {
            assert!(matches!(
                Params::from_form(body),
                Err(DecodeError::Param(ParamError {
                    code: "parameter_duplicate",
                    ..
                }))
            ));
        }
    }

    #[test]
    fn nested_brackets_are_unknown_parameters() {
        assert!(matches!(
            Params::from_form(b"metadata[a][b]=1"),
            Err(DecodeError::Param(ParamError {
                code: "parameter_unknown",
                ..
            }))
        ));
    }

    #[test]
    fn nul_characters_are_refused_in_names_values_and_metadata() {
        for body in [
            &br#"{"description": "a\u0000b"}"#[..],
            br#"{"metadata": {"k": "\u0000"}}"#,
            br#"{"metadata": {"\u0000": "v"}}"#,
            br#"{"a\u0000": 1}"#,
        ] {
            assert!(
                matches!(
                    Params::from_json(body),
                    Err(DecodeError::Param(ParamError {
                        code: "parameter_invalid_string",
                        ..
                    }))
                ),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
        assert!(Params::from_form(b"description=a%00b").is_err());
        assert!(Params::from_form(b"metadata[k%00]=v").is_err());
    }

    #[test]
    fn json_must_be_an_object() {
        assert!(matches!(
            Params::from_json(b"[1]"),
            Err(DecodeError::NotAnObject)
        ));
        assert!(matches!(Params::from_json(b"{"), Err(DecodeError::Json(_))));
    }
}
