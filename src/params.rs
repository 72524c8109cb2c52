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
            Ok(Value::Object(fields)) => Ok(Params {
                encoding: Encoding::Json,
                fields,
            }),
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
    fn json_must_be_an_object() {
        assert!(matches!(
            Params::from_json(b"[1]"),
            Err(DecodeError::NotAnObject)
        ));
        assert!(matches!(Params::from_json(b"{"), Err(DecodeError::Json(_))));
    }
}
