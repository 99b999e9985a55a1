//! A minimal writer for the flat JSON objects the benchmarks print.

use std::fmt::Write;

/// A flat JSON object built field by field, in order.
#[derive(Debug, Default)]
pub struct Json {
    out: String,
}

impl Json {
    /// An empty object.
    pub fn new() -> Self {
        Self::default()
    }

    fn key(&mut self, k: &str) {
        self.out.push(if self.out.is_empty() { '{' } else { ',' });
        let _ = write!(self.out, "\"{k}\":");
    }

    /// Adds a string field.
    pub fn str(mut self, k: &str, v: &str) -> Self {
        self.key(k);
        self.out.push('"');
        for c in v.chars() {
            match c {
                '"' => self.out.push_str("\\\""),
                '\\' => self.out.push_str("\\\\"),
                c if (c as u32) < 0x20 => {
                    let _ = write!(self.out, "\\u{:04x}", c as u32);
                }
                c => self.out.push(c),
            }
        }
        self.out.push('"');
        self
    }

    /// Adds a field whose value is JSON already (an array or object).
    pub fn raw(mut self, k: &str, json: &str) -> Self {
        self.key(k);
        self.out.push_str(json);
        self
    }

    /// Adds an integer field.
    pub fn int(mut self, k: &str, v: u64) -> Self {
        self.key(k);
        let _ = write!(self.out, "{v}");
        self
    }

    /// Adds a float field (non-finite values become null).
    pub fn num(mut self, k: &str, v: f64) -> Self {
        self.key(k);
        if v.is_finite() {
            let _ = write!(self.out, "{v:.4}");
        } else {
            self.out.push_str("null");
        }
        self
    }

    /// The finished object.
    pub fn finish(mut self) -> String {
        if self.out.is_empty() {
            self.out.push('{');
        }
        self.out.push('}');
        self.out
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn writes_flat_objects() {
        let j = super::Json::new().str("op", "wr\"ite").int("n", 3).num("x", 1.5).num("y", f64::NAN).finish();
        assert_eq!(j, r#"{"op":"wr\"ite","n":3,"x":1.5000,"y":null}"#);
        assert_eq!(super::Json::new().finish(), "{}");
    }
}
