//! # eps-etcd
//!
//! A small blocking client for etcd v3 through its JSON gateway (`/v3/...` on
//! the client port, etcd 3.4 and later): what EPS's control plane needs of
//! etcd, and no more. Keys and ranges, transactions with compare-and-swap on
//! revisions (the fencing of a deposed leader), and leases (liveness of the
//! elected leader). One kept-alive HTTP/1.1 connection per [`Client`]; a
//! connection that fails moves on to the next endpoint.
//!
//! On it, the control plane's etcd backend: [`store::EtcdStore`] (its log,
//! fenced by leadership) and [`election`] (which of a job's control planes
//! leads). Only the `eps` command links them; servers, workers and `libeps`
//! do not.
//!
//! Why not gRPC: EPS is synchronous, and the gateway speaks the same v3 API
//! without an async runtime or a protobuf compiler in the build.

#![forbid(unsafe_code)]

mod b64;
pub mod election;
mod http;
pub mod store;
#[doc(hidden)]
pub mod testing;

use std::time::Duration;

use serde_json::{Value, json};

/// gRPC's status code NOT_FOUND, which etcd's gateway gives a lease that is
/// gone.
pub const GRPC_NOT_FOUND: i64 = 5;

/// Errors of the etcd client.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EtcdError {
    /// No endpoint answered.
    #[error("cannot reach etcd at {endpoints}: {source}")]
    Unreachable {
        /// The endpoints tried, comma-separated.
        endpoints: String,
        /// The last cause.
        #[source]
        source: std::io::Error,
    },
    /// etcd answered with an error.
    #[error("etcd refused {path}: {message}")]
    Refused {
        /// The API path.
        path: String,
        /// Its gRPC status code (`GRPC_NOT_FOUND`, ...; 0 when the answer
        /// had none): decide by this, not by the message.
        code: i64,
        /// etcd's message.
        message: String,
    },
    /// The answer was not what etcd's API says.
    #[error("etcd's answer to {path} is malformed: {what}")]
    Malformed {
        /// The API path.
        path: String,
        /// What was wrong.
        what: String,
    },
}

/// A key and its value, with etcd's revisions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Kv {
    pub key: Vec<u8>,
    pub value: Vec<u8>,
    /// The revision that created it (0: it does not exist).
    pub create_revision: i64,
    pub mod_revision: i64,
    /// The lease it is attached to (0: none).
    pub lease: i64,
}

/// A condition of a transaction.
#[derive(Clone, Debug)]
pub enum Compare {
    /// The key was created at this revision (0: the key does not exist).
    Created(Vec<u8>, i64),
    /// The key's value is this.
    Value(Vec<u8>, Vec<u8>),
}

/// An operation of a transaction.
#[derive(Clone, Debug)]
pub enum Op {
    /// Puts a value, attached to a lease (0: none).
    Put { key: Vec<u8>, value: Vec<u8>, lease: i64 },
    /// Reads one key.
    Get(Vec<u8>),
}

/// What a transaction did.
#[derive(Clone, Debug, Default)]
pub struct TxnResult {
    /// The conditions held (the success branch ran).
    pub succeeded: bool,
    /// The store's revision after it.
    pub revision: i64,
    /// The keys read by its `Get`s, in order (`None`: absent).
    pub gets: Vec<Option<Kv>>,
}

/// The first key after every key starting with `prefix` (a range's end).
pub fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0] // every key
}

/// A client of one etcd cluster.
#[derive(Debug)]
pub struct Client {
    endpoints: Vec<String>,
    /// The endpoint in use.
    at: usize,
    conn: Option<http::Conn>,
    timeout: Duration,
}

impl Client {
    /// Connects to the first endpoint (`HOST:PORT`) that answers as etcd, each
    /// tried within `timeout`.
    pub fn connect(endpoints: &[String], timeout: Duration) -> Result<Self, EtcdError> {
        let mut c = Self { endpoints: endpoints.to_vec(), at: 0, conn: None, timeout };
        c.post("/v3/maintenance/status", &json!({}))?;
        Ok(c)
    }

    /// The endpoints, comma-separated.
    pub fn endpoints(&self) -> String {
        self.endpoints.join(",")
    }

    /// A second client of the same cluster, on a connection of its own.
    pub fn fresh(&self) -> Result<Self, EtcdError> {
        Self::connect(&self.endpoints, self.timeout)
    }

    /// POSTs `body` to `path`; a connection that fails is made again to the
    /// next endpoint, and the request sent there, until each was tried once.
    /// (A request sent twice may have been applied once: callers of
    /// non-idempotent transactions check.)
    fn post(&mut self, path: &str, body: &Value) -> Result<Value, EtcdError> {
        let bytes = body.to_string().into_bytes();
        let mut last = None;
        for _ in 0..self.endpoints.len().max(1) {
            let conn = match self.conn.as_mut() {
                Some(c) => c,
                None => match self.endpoints.get(self.at).map(|h| http::Conn::open(h, self.timeout)) {
                    Some(Ok(c)) => self.conn.insert(c),
                    Some(Err(e)) => {
                        last = Some(e);
                        self.at = (self.at + 1) % self.endpoints.len();
                        continue;
                    }
                    None => break,
                },
            };
            match conn.post(path, &bytes) {
                Ok((code, body)) => return Self::answer(path, code, &body),
                Err(e) => {
                    self.conn = None;
                    self.at = (self.at + 1) % self.endpoints.len();
                    last = Some(e);
                }
            }
        }
        let source = last.unwrap_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidInput, "no endpoint given"));
        Err(EtcdError::Unreachable { endpoints: self.endpoints(), source })
    }

    fn answer(path: &str, code: u16, body: &[u8]) -> Result<Value, EtcdError> {
        let v: Value = serde_json::from_slice(body)
            .map_err(|e| EtcdError::Malformed { path: path.into(), what: format!("HTTP {code}, not JSON ({e})") })?;
        if code != 200 || v.get("error").is_some() {
            let said = v.get("error").or_else(|| v.get("message")).and_then(Value::as_str);
            let message = said.map_or_else(|| format!("HTTP {code}"), str::to_string);
            let grpc = v.get("code").and_then(Value::as_i64).unwrap_or(0);
            return Err(EtcdError::Refused { path: path.into(), code: grpc, message });
        }
        // A streamed RPC's answer (lease keepalive) comes wrapped in `result`.
        Ok(match v {
            Value::Object(mut m) if m.contains_key("result") => m.remove("result").unwrap_or_default(),
            v => v,
        })
    }

    /// The key's value, if it exists.
    pub fn get(&mut self, key: &[u8]) -> Result<Option<Kv>, EtcdError> {
        let path = "/v3/kv/range";
        let v = self.post(path, &json!({ "key": b64::encode(key) }))?;
        Ok(kvs(path, &v)?.into_iter().next())
    }

    /// Up to `limit` keys in `[from, end)`, in key order, and whether there are more.
    pub fn range(&mut self, from: &[u8], end: &[u8], limit: i64) -> Result<(Vec<Kv>, bool), EtcdError> {
        let path = "/v3/kv/range";
        let v = self.post(path, &json!({ "key": b64::encode(from), "range_end": b64::encode(end), "limit": limit }))?;
        Ok((kvs(path, &v)?, v.get("more").and_then(Value::as_bool).unwrap_or(false)))
    }

    /// Deletes every key starting with `prefix`; returns how many.
    pub fn delete_prefix(&mut self, prefix: &[u8]) -> Result<i64, EtcdError> {
        let body = json!({ "key": b64::encode(prefix), "range_end": b64::encode(&prefix_end(prefix)) });
        let v = self.post("/v3/kv/deleterange", &body)?;
        Ok(num(v.get("deleted")))
    }

    /// Runs `success` if every `compare` holds, else `failure`, atomically.
    pub fn txn(&mut self, compare: &[Compare], success: &[Op], failure: &[Op]) -> Result<TxnResult, EtcdError> {
        let path = "/v3/kv/txn";
        let cmp: Vec<Value> = compare
            .iter()
            .map(|c| match c {
                Compare::Created(k, rev) => {
                    json!({ "key": b64::encode(k), "result": "EQUAL", "target": "CREATE", "create_revision": rev.to_string() })
                }
                Compare::Value(k, val) => {
                    json!({ "key": b64::encode(k), "result": "EQUAL", "target": "VALUE", "value": b64::encode(val) })
                }
            })
            .collect();
        let ops = |ops: &[Op]| -> Vec<Value> {
            ops.iter()
                .map(|o| match o {
                    Op::Put { key, value, lease } => json!({ "request_put": {
                        "key": b64::encode(key), "value": b64::encode(value), "lease": lease.to_string() } }),
                    Op::Get(k) => json!({ "request_range": { "key": b64::encode(k) } }),
                })
                .collect()
        };
        let v = self.post(path, &json!({ "compare": cmp, "success": ops(success), "failure": ops(failure) }))?;
        let mut gets = Vec::new();
        for r in v.get("responses").and_then(Value::as_array).into_iter().flatten() {
            if let Some(range) = r.get("response_range") {
                gets.push(kvs(path, range)?.into_iter().next());
            }
        }
        Ok(TxnResult {
            succeeded: v.get("succeeded").and_then(Value::as_bool).unwrap_or(false),
            revision: num(v.pointer("/header/revision")),
            gets,
        })
    }

    /// A new lease of `ttl` seconds; returns its id and the TTL granted.
    pub fn grant(&mut self, ttl: i64) -> Result<(i64, i64), EtcdError> {
        let path = "/v3/lease/grant";
        let v = self.post(path, &json!({ "TTL": ttl.to_string() }))?;
        let id = num(v.get("ID"));
        if id == 0 {
            return Err(EtcdError::Malformed { path: path.into(), what: "no lease id".into() });
        }
        Ok((id, num(v.get("TTL"))))
    }

    /// Renews a lease; returns its TTL (0: it had expired).
    pub fn keepalive(&mut self, id: i64) -> Result<i64, EtcdError> {
        let v = self.post("/v3/lease/keepalive", &json!({ "ID": id.to_string() }))?;
        Ok(num(v.get("TTL")))
    }

    /// Ends a lease now: the keys attached to it go.
    pub fn revoke(&mut self, id: i64) -> Result<(), EtcdError> {
        match self.post("/v3/lease/revoke", &json!({ "ID": id.to_string() })) {
            // Already gone is as good.
            Err(EtcdError::Refused { code: GRPC_NOT_FOUND, .. }) => Ok(()),
            r => r.map(drop),
        }
    }
}

/// etcd writes 64-bit integers as strings, and leaves zeros out.
fn num(v: Option<&Value>) -> i64 {
    match v {
        Some(Value::String(s)) => s.parse().unwrap_or(0),
        Some(Value::Number(n)) => n.as_i64().unwrap_or(0),
        _ => 0,
    }
}

/// The `kvs` of a range answer.
fn kvs(path: &str, v: &Value) -> Result<Vec<Kv>, EtcdError> {
    let bytes = |kv: &Value, f: &str| -> Result<Vec<u8>, EtcdError> {
        match kv.get(f).and_then(Value::as_str) {
            None => Ok(Vec::new()),
            Some(s) => {
                b64::decode(s).ok_or_else(|| EtcdError::Malformed { path: path.into(), what: format!("{f} is not base64") })
            }
        }
    };
    v.get("kvs")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .map(|kv| {
            Ok(Kv {
                key: bytes(kv, "key")?,
                value: bytes(kv, "value")?,
                create_revision: num(kv.get("create_revision")),
                mod_revision: num(kv.get("mod_revision")),
                lease: num(kv.get("lease")),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests;
