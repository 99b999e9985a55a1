//! The flat JSON objects the benchmarks print, built field by field in
//! order, written by serde_json.

use serde_json::{Map, Value};

/// A JSON object built field by field, in order.
#[derive(Debug, Default)]
pub struct Json(Map<String, Value>);

impl Json {
    /// An empty object.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a string field.
    pub fn str(mut self, k: &str, v: &str) -> Self {
        self.0.insert(k.into(), Value::String(v.into()));
        self
    }

    /// Adds a field whose value is JSON already (an array or object; text
    /// that does not parse is kept as a string).
    pub fn raw(mut self, k: &str, json: &str) -> Self {
        let v = serde_json::from_str(json).unwrap_or_else(|_| Value::String(json.into()));
        self.0.insert(k.into(), v);
        self
    }

    /// Adds an integer field.
    pub fn int(mut self, k: &str, v: u64) -> Self {
        self.0.insert(k.into(), v.into());
        self
    }

    /// Adds a float field, to 4 decimals (non-finite values become null).
    pub fn num(mut self, k: &str, v: f64) -> Self {
        let v = serde_json::Number::from_f64((v * 1e4).round() / 1e4).map_or(Value::Null, Value::Number);
        self.0.insert(k.into(), v);
        self
    }

    /// The finished object, on one line.
    pub fn finish(self) -> String {
        Value::Object(self.0).to_string()
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn writes_objects_in_order() {
        let j = super::Json::new().str("op", "wr\"ite").int("n", 3).num("x", 1.23456).num("y", f64::NAN);
        let j = j.raw("a", "[1,{\"b\":2}]").finish();
        assert_eq!(j, r#"{"op":"wr\"ite","n":3,"x":1.2346,"y":null,"a":[1,{"b":2}]}"#);
        assert_eq!(super::Json::new().finish(), "{}");
    }
}
