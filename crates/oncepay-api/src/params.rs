//! Request parameters, decoded from JSON or from a form, before validation.
//!
//! Both encodings become one map of JSON values so that each resource
//! validates its parameters once. A form gives only strings (and
//! `metadata[key]=value` gives an object of strings); JSON gives typed values.
//! The encoding is kept, because a string is a fine amount in a form and a
//! type error in JSON.
//!
//! Neither encoding resolves a repeated parameter silently: a form that
//! repeats a name, or a JSON object (at any depth) that repeats a key, is
//! refused with `parameter_duplicate`. Nor does either decode bytes that are
//! not UTF-8 into U+FFFD: JSON refuses them as malformed, and a form names
//! the parameter they are in (`parameter_invalid_string`), so that two
//! different bodies never decode to one set of parameters.

use std::borrow::Cow;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};

use crate::problem::ProblemCode;

pub use crate::problem::{MAX_ECHOED_CHARS, MAX_PARAM_CHARS, shorten, shorten_to};

/// How the body was encoded.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Encoding {
    #[default]
    Json,
    Form,
}

/// A parameter that is missing, unknown or invalid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ParamError {
    /// Stable machine-readable code, e.g. `parameter_missing`.
    pub code: ProblemCode,
    /// The parameter at fault, e.g. `amount` or `metadata[order]`.
    pub param: String,
    pub message: String,
}

impl ParamError {
    /// A `param` or `message` that echoes a client's name or value should
    /// [shorten] it; `param` is cut to [`MAX_PARAM_CHARS`] in any case.
    pub fn new(code: ProblemCode, param: impl Into<String>, message: impl Into<String>) -> Self {
        let param = param.into();
        ParamError {
            code,
            param: shorten_to(&param, MAX_PARAM_CHARS).into_owned(),
            message: message.into(),
        }
    }

    /// `parameter_unknown` for `name`.
    pub fn unknown(name: &str) -> Self {
        let name = shorten(name);
        ParamError::new(
            ProblemCode::ParameterUnknown,
            name.as_ref(),
            format!("Received unknown parameter: {name}"),
        )
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

/// Decoded parameters with their encoding; by default none, as JSON.
#[derive(Debug, Default)]
pub struct Params {
    pub encoding: Encoding,
    fields: Map<String, Value>,
}

impl Params {
    /// Decodes a JSON object body. An object that repeats a key, at any
    /// depth, is refused (`parameter_duplicate`): which of two amounts was
    /// meant is not for the server to guess.
    pub fn from_json(body: &[u8]) -> Result<Self, DecodeError> {
        match strict_json(body) {
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
            Err(e) => Err(e),
        }
    }

    /// Decodes an `application/x-www-form-urlencoded` body, Stripe style:
    /// `metadata[order]=42` sets one metadata entry, and brackets nest
    /// (`shipping[address][line1]=...`). A repeated parameter is refused
    /// rather than silently resolved, except `list[]=a&list[]=b`, which is
    /// how a form sends a list: an array, `["a", "b"]`. A name or value that
    /// is not UTF-8 is refused ([`form_pairs`]).
    pub fn from_form(body: &[u8]) -> Result<Self, DecodeError> {
        let mut fields = Map::new();
        for pair in form_pairs(body) {
            let (name, value) = pair?;
            refuse_nul(&name, &Value::String(value.clone().into_owned()))?;
            insert_form_pair(&mut fields, &name, value.into_owned())?;
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

    /// Takes `metadata` for a new object: [`MetadataUpdate`]'s rules applied
    /// to no metadata (a key given `""` is left out); none is an empty map.
    pub fn take_metadata(&mut self) -> Result<BTreeMap<String, String>, ParamError> {
        match self.take_metadata_update()? {
            Some(update) => update.apply(&BTreeMap::new()),
            None => Ok(BTreeMap::new()),
        }
    }

    /// Takes `metadata` as an update of an object's ([`MetadataUpdate`]).
    pub fn take_metadata_update(&mut self) -> Result<Option<MetadataUpdate>, ParamError> {
        self.take("metadata").map(MetadataUpdate::parse).transpose()
    }

    /// Takes Stripe's `expand` parameter and refuses every property it names:
    /// every object oncepay renders is already whole (a refund's `charge` is
    /// an id, and stays one), so there is nothing to expand. `expand[]=x`,
    /// `expand[0]=x` (how the SDKs send it) and a JSON array are accepted;
    /// an empty list is no request at all.
    pub fn refuse_expand(&mut self) -> Result<(), ParamError> {
        let paths: Vec<Value> = match self.take("expand") {
            None => return Ok(()),
            Some(Value::Array(paths)) => paths,
            // A form: `expand[]` and `expand[N]`, any other bracket unknown.
            Some(Value::Object(entries)) => {
                if let Some(name) = entries
                    .keys()
                    .find(|k| !(k.is_empty() || k.bytes().all(|b| b.is_ascii_digit())))
                {
                    return Err(ParamError::unknown(&format!("expand[{name}]")));
                }
                entries.into_iter().map(|(_, v)| v).collect()
            }
            Some(_) => {
                return Err(ParamError::new(
                    ProblemCode::ParameterInvalidType,
                    "expand",
                    "expand must be a list of property paths, e.g. expand[]=charge",
                ));
            }
        };
        match paths.first() {
            None => Ok(()),
            Some(path) => {
                let path = match path {
                    Value::String(p) => shorten(p).into_owned(),
                    other => shorten(&other.to_string()).into_owned(),
                };
                Err(ParamError::new(
                    ProblemCode::PropertyNotExpandable,
                    "expand",
                    format!("This property cannot be expanded ({path})."),
                ))
            }
        }
    }

    /// Refuses whatever parameters are left, as Stripe does.
    pub fn reject_unknown(&self) -> Result<(), ParamError> {
        match self.fields.keys().next() {
            Some(name) => Err(ParamError::unknown(name)),
            None => Ok(()),
        }
    }
}

/// The name and value pairs of an `application/x-www-form-urlencoded` body
/// or query string, split and decoded as `form_urlencoded::parse` does
/// (`&` between pairs, empty ones skipped, `=` after the name, `+` for a
/// space, `%XX` for a byte), except that the decoded bytes must be UTF-8:
/// where a lossy decoding would make `%FF`, `%FE` and `%EF%BF%BD` one value
/// (U+FFFD), and so one fingerprint, a pair that is not UTF-8 is refused
/// with `parameter_invalid_string`, naming its parameter.
pub fn form_pairs(
    body: &[u8],
) -> impl Iterator<Item = Result<(Cow<'_, str>, Cow<'_, str>), ParamError>> {
    body.split(|&b| b == b'&')
        .filter(|pair| !pair.is_empty())
        .map(|pair| {
            let (name, value) = match pair.iter().position(|&b| b == b'=') {
                Some(at) => (&pair[..at], &pair[at + 1..]),
                None => (pair, &pair[pair.len()..]),
            };
            let Some(name_text) = decode_form_text(name) else {
                let lossy = percent_decode_form(name);
                return Err(not_utf8(&String::from_utf8_lossy(&lossy)));
            };
            match decode_form_text(value) {
                Some(value) => Ok((name_text, value)),
                None => Err(not_utf8(&name_text)),
            }
        })
}

/// Puts one form pair into `fields`: `a[b][c]=v` sets `c` in the object
/// `b` of the object `a`, `a[]=v` appends to the list `a`. Malformed
/// brackets are an unknown parameter; a name that meets a value of another
/// shape, or is given twice, is a duplicate.
fn insert_form_pair(
    fields: &mut Map<String, Value>,
    name: &str,
    value: String,
) -> Result<(), DecodeError> {
    let Some(segments) = form_segments(name) else {
        return Err(ParamError::unknown(name).into());
    };
    let (path, append) = match segments.split_last() {
        Some((&"", path)) if !path.is_empty() => (path, true),
        _ => (&segments[..], false),
    };
    if path.iter().skip(1).any(|segment| segment.is_empty()) {
        return Err(ParamError::unknown(name).into());
    }
    let joined = |to: usize| {
        let (outer, inner) = path[..to].split_first().expect("a name has an outer part");
        inner
            .iter()
            .fold(outer.to_string(), |name, s| format!("{name}[{s}]"))
    };
    let (key, parents) = path.split_last().expect("a name has an outer part");
    let mut object = fields;
    for (depth, segment) in parents.iter().enumerate() {
        let slot = object
            .entry(segment.to_string())
            .or_insert_with(|| Value::Object(Map::new()));
        let Value::Object(inner) = slot else {
            return Err(duplicate(&joined(depth + 1)));
        };
        object = inner;
    }
    if append {
        let list = object
            .entry(key.to_string())
            .or_insert_with(|| Value::Array(Vec::new()));
        let Value::Array(list) = list else {
            return Err(duplicate(&joined(path.len())));
        };
        list.push(Value::String(value));
        return Ok(());
    }
    match object.entry(key.to_string()) {
        serde_json::map::Entry::Vacant(slot) => {
            slot.insert(Value::String(value));
            Ok(())
        }
        serde_json::map::Entry::Occupied(_) => Err(duplicate(name)),
    }
}

/// The parts of a form name: `shipping[address][line1]` is `shipping`,
/// `address`, `line1`; `list[]` ends with an empty part. `None` when a
/// bracket is left open or text follows a closing one.
fn form_segments(name: &str) -> Option<Vec<&str>> {
    let (outer, mut rest) = name.split_at(name.find('[').unwrap_or(name.len()));
    let mut segments = vec![outer];
    while !rest.is_empty() {
        let (inner, after) = rest.strip_prefix('[')?.split_once(']')?;
        if inner.contains('[') {
            return None;
        }
        segments.push(inner);
        rest = after;
    }
    Some(segments)
}

/// The bytes a form's name or value stands for: `+` a space, `%XX` a byte.
fn percent_decode_form(raw: &[u8]) -> Cow<'_, [u8]> {
    if raw.contains(&b'+') {
        let spaced: Vec<u8> = raw
            .iter()
            .map(|&b| if b == b'+' { b' ' } else { b })
            .collect();
        Cow::Owned(percent_encoding::percent_decode(&spaced).collect())
    } else {
        percent_encoding::percent_decode(raw).into()
    }
}

/// A form's name or value as text; `None` when its bytes are not UTF-8.
fn decode_form_text(raw: &[u8]) -> Option<Cow<'_, str>> {
    match percent_decode_form(raw) {
        Cow::Borrowed(bytes) => std::str::from_utf8(bytes).ok().map(Cow::Borrowed),
        Cow::Owned(bytes) => String::from_utf8(bytes).ok().map(Cow::Owned),
    }
}

fn not_utf8(param: &str) -> ParamError {
    let param = shorten(param);
    ParamError::new(
        ProblemCode::ParameterInvalidString,
        param.as_ref(),
        format!(
            "{param} is not UTF-8 text: percent-encode the UTF-8 bytes of each character (é is %C3%A9)"
        ),
    )
}

/// Postgres text cannot hold U+0000, and no parameter needs it: refuse it
/// here, as a client error, rather than fail in the database. Nested
/// objects and lists are searched too, each named as a form names it.
fn refuse_nul(name: &str, value: &Value) -> Result<(), ParamError> {
    if name.contains('\0') {
        let param = name.replace('\0', "\\u0000");
        return Err(nul_in(&param));
    }
    match value {
        Value::String(s) if s.contains('\0') => Err(nul_in(name)),
        Value::Object(entries) => entries
            .iter()
            .try_for_each(|(key, inner)| refuse_nul(&format!("{name}[{key}]"), inner)),
        Value::Array(items) => items
            .iter()
            .enumerate()
            .try_for_each(|(n, inner)| refuse_nul(&format!("{name}[{n}]"), inner)),
        _ => Ok(()),
    }
}

fn nul_in(param: &str) -> ParamError {
    let param = shorten(param);
    ParamError::new(
        ProblemCode::ParameterInvalidString,
        param.as_ref(),
        format!("{param} must not contain the NUL character"),
    )
}

fn duplicate(param: &str) -> DecodeError {
    let param = shorten(param);
    ParamError::new(
        ProblemCode::ParameterDuplicate,
        param.as_ref(),
        format!("The parameter {param} was given more than once"),
    )
    .into()
}

/// Parses a JSON document like `serde_json::from_slice::<Value>`, except
/// that an object repeating a key is an error (serde_json's `Value` keeps
/// the last one).
fn strict_json(body: &[u8]) -> Result<Value, DecodeError> {
    let repeated = RefCell::new(None);
    let path = RefCell::new(Vec::new());
    let mut deserializer = serde_json::Deserializer::from_slice(body);
    let seed = StrictValue {
        path: &path,
        repeated: &repeated,
    };
    let value = seed
        .deserialize(&mut deserializer)
        .and_then(|value| deserializer.end().map(|()| value));
    match (value, repeated.into_inner()) {
        (_, Some(param)) => Err(duplicate(&param)),
        (Ok(value), None) => Ok(value),
        (Err(e), None) => Err(DecodeError::Json(e.to_string())),
    }
}

/// One JSON value, at the position `path` holds: the names (or indices) of
/// the members that lead to it, pushed and popped as the parse goes in and
/// out, so that no value pays for the length of its ancestors' names. On a
/// repeated key it records that key's form-style path (`amount`,
/// `metadata[order]`) in `repeated` and stops the parse.
#[derive(Clone, Copy)]
struct StrictValue<'a> {
    path: &'a RefCell<Vec<String>>,
    repeated: &'a RefCell<Option<String>>,
}

impl StrictValue<'_> {
    /// The form-style name of member `name` of the current value.
    fn path_of(&self, name: &str) -> String {
        let path = self.path.borrow();
        let mut segments = path.iter().map(String::as_str).chain([name]);
        let mut joined = segments.next().unwrap_or_default().to_owned();
        for segment in segments {
            joined.push('[');
            joined.push_str(segment);
            joined.push(']');
        }
        joined
    }

    /// Parses the next member's value with `name` on the path.
    fn nested<T>(&self, name: String, parse: impl FnOnce(Self) -> T) -> T {
        self.path.borrow_mut().push(name);
        let parsed = parse(*self);
        self.path.borrow_mut().pop();
        parsed
    }
}

impl<'de> DeserializeSeed<'de> for StrictValue<'_> {
    type Value = Value;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for StrictValue<'_> {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        // JSON has no NaN or infinity, so this is always a number.
        Ok(Number::from_f64(v).map_or(Value::Null, Value::Number))
    }

    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }

    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = self.nested(items.len().to_string(), |value| {
            seq.next_element_seed(value)
        })? {
            items.push(item);
        }
        Ok(Value::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut object = Map::new();
        while let Some(name) = map.next_key::<String>()? {
            if object.contains_key(&name) {
                *self.repeated.borrow_mut() = Some(self.path_of(&name));
                return Err(de::Error::custom("a repeated key"));
            }
            let value = self.nested(name.clone(), |value| map.next_value_seed(value))?;
            object.insert(name, value);
        }
        Ok(Value::Object(object))
    }
}

// Helpers shared by every resource's parameters and objects.

const MAX_METADATA_KEYS: usize = 50;
const MAX_METADATA_KEY_CHARS: usize = 40;
const MAX_METADATA_VALUE_CHARS: usize = 500;

/// Takes a parameter that must be there.
pub fn required(params: &mut Params, name: &str) -> Result<Value, ParamError> {
    params.take(name).ok_or_else(|| {
        ParamError::new(
            ProblemCode::ParameterMissing,
            name,
            format!("Missing required param: {name}"),
        )
    })
}

/// `value`, unless longer than `max` characters (`parameter_too_long`).
pub fn at_most(value: String, name: &str, max: usize) -> Result<String, ParamError> {
    if value.chars().count() > max {
        return Err(ParamError::new(
            ProblemCode::ParameterTooLong,
            name,
            format!("{name} must be at most {max} characters"),
        ));
    }
    Ok(value)
}

/// A parameter that must be a string.
pub fn string(value: Value, name: &str) -> Result<String, ParamError> {
    match value {
        Value::String(s) => Ok(s),
        _ => Err(ParamError::new(
            ProblemCode::ParameterInvalidType,
            name,
            format!("{name} must be a string"),
        )),
    }
}

/// A parameter that must be a boolean: `true` or `false`, in JSON or as
/// a form's text.
pub fn boolean(value: Value, name: &str) -> Result<bool, ParamError> {
    match value {
        Value::Bool(b) => Ok(b),
        Value::String(s) if s == "true" => Ok(true),
        Value::String(s) if s == "false" => Ok(false),
        _ => Err(ParamError::new(
            ProblemCode::ParameterInvalidType,
            name,
            format!("Invalid boolean: {name} must be true or false"),
        )),
    }
}

/// `metadata` as a request gives it, validated: keys of 1 to 40
/// characters, string values of up to 500. Stripe's rules, written once for
/// every object that has metadata, on create and on update alike: the keys
/// given are merged into the metadata the object has, a key given `""` is
/// removed, and `metadata=""` removes them all (then sets those given with
/// it, none in practice). The result may have up to 50 keys ([`Self::apply`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MetadataUpdate {
    /// `metadata=""`: remove every key first.
    clear: bool,
    /// The keys to set, and to remove (given `""`).
    entries: BTreeMap<String, String>,
}

impl MetadataUpdate {
    /// Validates a `metadata` parameter: `""`, or an object of strings.
    pub fn parse(value: Value) -> Result<Self, ParamError> {
        let entries = match value {
            Value::String(s) if s.is_empty() => {
                return Ok(MetadataUpdate {
                    clear: true,
                    entries: BTreeMap::new(),
                });
            }
            Value::Object(entries) => entries,
            _ => {
                return Err(metadata_invalid(
                    "metadata".into(),
                    "metadata must be an object of string keys and string values, or \"\" to remove every key".into(),
                ));
            }
        };
        let entries = entries
            .into_iter()
            .map(|(key, value)| metadata_entry(key, value))
            .collect::<Result<_, _>>()?;
        Ok(MetadataUpdate {
            clear: false,
            entries,
        })
    }

    /// The metadata an object with `current` has once this update applies;
    /// `metadata_invalid` if it would have more than 50 keys.
    pub fn apply(
        &self,
        current: &BTreeMap<String, String>,
    ) -> Result<BTreeMap<String, String>, ParamError> {
        let mut merged = if self.clear {
            BTreeMap::new()
        } else {
            current.clone()
        };
        for (key, value) in &self.entries {
            if value.is_empty() {
                merged.remove(key);
            } else {
                merged.insert(key.clone(), value.clone());
            }
        }
        if merged.len() > MAX_METADATA_KEYS {
            return Err(metadata_invalid(
                "metadata".into(),
                format!("metadata can have at most {MAX_METADATA_KEYS} keys"),
            ));
        }
        Ok(merged)
    }

    /// The update in a canonical form, for a request's fingerprint.
    pub fn canonical(&self) -> Value {
        serde_json::json!([self.clear, self.entries])
    }
}

/// One metadata key and value, validated.
fn metadata_entry(key: String, value: Value) -> Result<(String, String), ParamError> {
    let param = format!("metadata[{}]", shorten(&key));
    let key_chars = key.chars().count();
    if key_chars == 0 || key_chars > MAX_METADATA_KEY_CHARS {
        return Err(metadata_invalid(
            param,
            format!("metadata keys must be 1 to {MAX_METADATA_KEY_CHARS} characters"),
        ));
    }
    let Value::String(value) = value else {
        return Err(metadata_invalid(
            param,
            "metadata values must be strings".into(),
        ));
    };
    if value.chars().count() > MAX_METADATA_VALUE_CHARS {
        return Err(metadata_invalid(
            param,
            format!("metadata values must be at most {MAX_METADATA_VALUE_CHARS} characters"),
        ));
    }
    Ok((key, value))
}

fn metadata_invalid(param: String, message: String) -> ParamError {
    ParamError::new(ProblemCode::MetadataInvalid, param, message)
}

/// A new id: `prefix`, `_` and 24 random letters and digits.
pub fn new_id(prefix: &str) -> String {
    use rand::Rng;
    let random: String = rand::rng()
        .sample_iter(&rand::distr::Alphanumeric)
        .take(24)
        .map(char::from)
        .collect();
    format!("{prefix}_{random}")
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
                    code: ProblemCode::ParameterDuplicate,
                    ..
                }))
            ));
        }
    }

    #[test]
    fn nested_brackets_make_nested_objects_and_malformed_ones_are_unknown() {
        let mut p = Params::from_form(
            b"shipping[name]=Jo&shipping[address][line1]=1+Main&shipping[address][city]=X&a[b][]=1&a[b][]=2",
        )
        .unwrap();
        assert_eq!(
            p.take("shipping"),
            Some(json!({"name": "Jo", "address": {"line1": "1 Main", "city": "X"}}))
        );
        assert_eq!(p.take("a"), Some(json!({"b": ["1", "2"]})));
        for malformed in [
            &b"metadata[a"[..],
            b"metadata[a]b",
            b"a[][b]=1",
            b"a[b[c]]=1",
        ] {
            assert!(
                matches!(
                    Params::from_form(malformed),
                    Err(DecodeError::Param(ParamError {
                        code: ProblemCode::ParameterUnknown,
                        ..
                    }))
                ),
                "{}",
                String::from_utf8_lossy(malformed)
            );
        }
        for clash in [
            &b"s[a]=1&s[a][b]=2"[..],
            b"s[a][b]=1&s[a]=2",
            b"s[a][b]=1&s[a][b]=2",
        ] {
            assert!(matches!(
                Params::from_form(clash),
                Err(DecodeError::Param(ParamError {
                    code: ProblemCode::ParameterDuplicate,
                    ..
                }))
            ));
        }
    }

    fn update(value: Value) -> MetadataUpdate {
        MetadataUpdate::parse(value).unwrap()
    }

    #[test]
    fn metadata_keys_merge_an_empty_value_removes_one_and_an_empty_string_clears_all() {
        let current: BTreeMap<String, String> =
            [("a".into(), "1".into()), ("b".into(), "2".into())].into();
        let merged = update(json!({"b": "", "c": "3"})).apply(&current).unwrap();
        assert_eq!(
            merged,
            [("a".into(), "1".into()), ("c".into(), "3".into())].into()
        );
        assert!(update(json!("")).apply(&current).unwrap().is_empty());
        // A new object's metadata is an update of none: "" keys are left out.
        assert_eq!(
            update(json!({"x": ""})).apply(&BTreeMap::new()).unwrap(),
            BTreeMap::new()
        );
    }

    #[test]
    fn metadata_may_hold_fifty_keys_once_merged() {
        let current: BTreeMap<String, String> =
            (0..40).map(|n| (format!("k{n}"), "v".into())).collect();
        let ten: Map<String, Value> = (0..10).map(|n| (format!("n{n}"), json!("v"))).collect();
        assert_eq!(
            update(Value::Object(ten.clone()))
                .apply(&current)
                .unwrap()
                .len(),
            50
        );
        let mut eleven = ten;
        eleven.insert("n10".into(), json!("v"));
        let err = update(Value::Object(eleven)).apply(&current).unwrap_err();
        assert_eq!(
            (err.code, err.param.as_str()),
            (ProblemCode::MetadataInvalid, "metadata")
        );
        for bad in [json!("x"), json!(["a"]), json!({"k": 1}), json!({"": "v"})] {
            let err = MetadataUpdate::parse(bad.clone()).unwrap_err();
            assert_eq!(err.code, ProblemCode::MetadataInvalid, "{bad}");
        }
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
                        code: ProblemCode::ParameterInvalidString,
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
    fn form_bytes_that_are_not_utf8_are_refused_naming_the_parameter() {
        let refused = |body: &[u8]| match Params::from_form(body) {
            Err(DecodeError::Param(e)) => (e.code, e.param),
            other => panic!("{:?}: {other:?}", String::from_utf8_lossy(body)),
        };
        let invalid = ProblemCode::ParameterInvalidString;
        assert_eq!(
            refused(b"amount=1&description=%FF"),
            (invalid, "description".into())
        );
        assert_eq!(
            refused(b"description=a%C3"),
            (invalid, "description".into())
        );
        assert_eq!(refused(b"metadata[k]=%FE"), (invalid, "metadata[k]".into()));
        assert_eq!(
            refused(b"metadata[%FF]=v"),
            (invalid, "metadata[\u{FFFD}]".into())
        );
        assert_eq!(refused(b"%C3%28=v"), (invalid, "\u{FFFD}(".into()));
        assert_eq!(
            refused(b"description=\xff"),
            (invalid, "description".into())
        );
        // U+FFFD itself is text like any other, and `+` and `%2B` still decode.
        let mut params =
            Params::from_form(b"description=%EF%BF%BD+caf%C3%A9%2B&metadata[k]=&empty&&").unwrap();
        assert_eq!(params.take("description"), Some(json!("\u{FFFD} café+")));
        assert_eq!(params.take("metadata"), Some(json!({"k": ""})));
        assert_eq!(params.take("empty"), Some(json!("")));
        params.reject_unknown().unwrap();
    }

    #[test]
    fn form_pairs_split_and_decode_as_form_urlencoded_does_for_utf8() {
        for body in [
            &b"a=1&b=2"[..],
            b"a+b=c+d&%41=%42",
            b"&&a&=x&b==c&",
            b"x=%zz&y=%4",
            "k=caf\u{e9}".as_bytes(),
        ] {
            let ours: Vec<(String, String)> = form_pairs(body)
                .map(|pair| pair.map(|(n, v)| (n.into_owned(), v.into_owned())).unwrap())
                .collect();
            let theirs: Vec<(String, String)> = form_urlencoded::parse(body)
                .map(|(n, v)| (n.into_owned(), v.into_owned()))
                .collect();
            assert_eq!(ours, theirs, "{}", String::from_utf8_lossy(body));
        }
    }

    #[track_caller]
    fn assert_duplicate(body: &str, param: &str) {
        match Params::from_json(body.as_bytes()) {
            Err(DecodeError::Param(e)) => {
                assert_eq!(
                    (e.code, e.param.as_str()),
                    (ProblemCode::ParameterDuplicate, param),
                    "{body}"
                );
                assert!(e.message.contains(param), "{}", e.message);
            }
            other => panic!("{body}: {other:?}"),
        }
    }

    #[test]
    fn repeated_json_keys_are_refused_at_any_depth() {
        assert_duplicate(r#"{"amount":100,"amount":100000}"#, "amount");
        assert_duplicate(r#"{"amount":100,"amount":100}"#, "amount");
        assert_duplicate(
            r#"{"amount":100,"metadata":{"order":"1","order":"2"}}"#,
            "metadata[order]",
        );
        assert_duplicate(r#"{"x":[1,{"k":1,"k":2}]}"#, "x[1][k]");
        // Escapes name the same key.
        assert_duplicate(r#"{"amount":1,"\u0061mount":2}"#, "amount");
        // The same key in two different objects is no repeat.
        let mut p = Params::from_json(br#"{"a":{"k":1},"b":{"k":2}}"#).unwrap();
        assert_eq!(p.take("b"), Some(json!({"k": 2})));
    }

    #[test]
    fn strict_json_decodes_what_serde_json_decodes() {
        let body = br#"{"s":"caf\u00e9 \"q\"","i":-5,"u":18446744073709551615,"f":1.5e3,
            "t":true,"n":null,"a":[1,[2,{}]],"o":{"k":{"z":[]}}}"#;
        assert_eq!(
            strict_json(body).unwrap(),
            serde_json::from_slice::<Value>(body).unwrap()
        );
        for bad in [&b"{} x"[..], b"{\"a\":}", b"", b"{\"a\":1,}"] {
            assert!(matches!(strict_json(bad), Err(DecodeError::Json(_))));
        }
    }

    #[test]
    fn long_names_are_shortened_in_errors() {
        let name = "a".repeat(60 * 1024);
        let e = Params::from_json(format!(r#"{{"{name}": 1}}"#).as_bytes())
            .unwrap()
            .reject_unknown()
            .unwrap_err();
        assert_eq!(e.param, format!("{}…", "a".repeat(MAX_ECHOED_CHARS)));
        assert!(e.message.len() < 200, "{}", e.message);
        assert!(e.message.ends_with(&e.param), "{}", e.message);
        assert_eq!(shorten("é".repeat(100).as_str()), "é".repeat(100));
        assert_eq!(shorten(&"é".repeat(101)), format!("{}…", "é".repeat(100)));
    }

    #[test]
    fn a_form_list_is_an_array_and_mixing_its_spellings_is_a_duplicate() {
        let mut params = Params::from_form(b"list[]=a&list[]=b").unwrap();
        assert_eq!(params.take("list"), Some(serde_json::json!(["a", "b"])));
        for mixed in [
            &b"list[]=a&list[0]=b"[..],
            b"list[0]=a&list[]=b",
            b"list=a&list[]=b",
        ] {
            let err = Params::from_form(mixed).unwrap_err();
            assert!(
                matches!(&err, DecodeError::Param(e) if e.code == ProblemCode::ParameterDuplicate),
                "{err:?}"
            );
        }
    }

    #[test]
    fn expand_is_taken_in_every_spelling_and_refuses_what_it_names() {
        let refused = |mut params: Params| {
            let err = params.refuse_expand().unwrap_err();
            assert_eq!(
                (err.code, err.param.as_str()),
                (ProblemCode::PropertyNotExpandable, "expand")
            );
            err.message
        };
        for form in ["expand[]=charge", "expand[0]=charge&expand[1]=customer"] {
            let message = refused(Params::from_form(form.as_bytes()).unwrap());
            assert_eq!(message, "This property cannot be expanded (charge).");
        }
        refused(Params::from_json(br#"{"expand": ["charge"]}"#).unwrap());
        for empty in [&br#"{"expand": []}"#[..], br#"{"expand": null}"#, b"{}"] {
            let mut params = Params::from_json(empty).unwrap();
            params.refuse_expand().unwrap();
            params.reject_unknown().unwrap();
        }
        let mut odd = Params::from_form(b"expand[a]=charge").unwrap();
        assert_eq!(
            odd.refuse_expand().unwrap_err().code,
            ProblemCode::ParameterUnknown
        );
        let mut scalar = Params::from_json(br#"{"expand": "charge"}"#).unwrap();
        assert_eq!(
            scalar.refuse_expand().unwrap_err().code,
            ProblemCode::ParameterInvalidType
        );
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
