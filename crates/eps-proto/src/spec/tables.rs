//! `[[model.tables]]`: sparse embedding tables, rows by u64 key (see the
//! `eps-sparse` crate for how servers hold them). A table is declared by its
//! row dimension, optimizer and initializer; its rows exist once a key is
//! first pulled or pushed.

use serde::Deserialize;

use super::{SpecError, bad};

/// The largest row dimension of a table.
pub const MAX_TABLE_DIM: u32 = 1 << 16;
/// The most keys of one request.
pub const MAX_KEYS: u32 = 1 << 22;
/// Most tables a job may declare (each has an id of the immediates').
pub const MAX_TABLES: usize = crate::layout::TABLE_IDS as usize;

/// Row-wise optimizers a table may use (the dense ones, stepped row by row
/// with lazy state, and Adagrad).
pub const TABLE_OPTIMIZERS: &[&str] = &["sgd", "momentum", "nesterov", "adam", "adamw", "adagrad"];

/// One `[[model.tables]]` entry.
#[derive(Clone, Debug, PartialEq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct TableDecl {
    /// Name, unique among the model's tables and tensors.
    pub name: String,
    /// Values per row.
    pub dim: u32,
    /// How rows travel between workers and servers: `f32`, `bf16` or `f16`
    /// (servers keep f32 rows and state, as they keep dense shards' masters).
    #[serde(default = "default_dtype")]
    pub dtype: String,
    /// The row-wise optimizer (one of [`TABLE_OPTIMIZERS`]); by default the
    /// job's `optimizer.kind` (which must then be one of them).
    #[serde(default)]
    pub optimizer: Option<String>,
    /// The learning rate; by default `optimizer.lr` (the table's rows follow
    /// no schedule: each row's step count is its own).
    #[serde(default)]
    pub lr: Option<f64>,
    /// Adagrad's starting accumulator.
    #[serde(default = "default_accumulator")]
    pub initial_accumulator: f32,
    /// How a row starts: `zeros`, or `uniform` in `[-init_scale, init_scale)`.
    #[serde(default = "default_init")]
    pub init: String,
    /// Bound of `uniform`.
    #[serde(default = "default_scale")]
    pub init_scale: f32,
    /// The initializer's seed; a row depends on it and on its key alone.
    #[serde(default)]
    pub seed: u64,
    /// Keys must be below this (ids not hashed by the user); any u64 if unset.
    #[serde(default)]
    pub key_limit: Option<u64>,
    /// Rows one server may hold; new keys past it are refused.
    #[serde(default)]
    pub max_rows_per_server: Option<u64>,
    /// Evict rows not touched for this many steps (with `evict_min_touches`,
    /// also rows touched fewer times in their first this many steps).
    #[serde(default)]
    pub evict_idle_steps: Option<u64>,
    /// See `evict_idle_steps`.
    #[serde(default)]
    pub evict_min_touches: u32,
    /// Most distinct keys one worker sends one server in one pull or push
    /// (each server keeps a landing region of that size per worker).
    #[serde(default = "default_max_keys")]
    pub max_keys: u32,
}

fn default_max_keys() -> u32 {
    65536
}

fn default_dtype() -> String {
    "f32".into()
}

fn default_accumulator() -> f32 {
    0.1
}
fn default_init() -> String {
    "uniform".into()
}
fn default_scale() -> f32 {
    0.01
}

impl TableDecl {
    /// The row-wise optimizer's name: the table's, else the job's.
    pub fn optimizer_kind<'a>(&'a self, job_kind: &'a str) -> &'a str {
        self.optimizer.as_deref().unwrap_or(job_kind)
    }

    /// The learning rate: the table's, else the job's.
    pub fn lr_or(&self, job_lr: f64) -> f64 {
        self.lr.unwrap_or(job_lr)
    }

    /// Checks one table against the job's optimizer kind.
    fn validate(&self, job_kind: &str) -> Result<(), SpecError> {
        let who = &self.name;
        if self.name.is_empty() {
            return Err(bad("model.tables.name", "a table needs a name"));
        }
        if self.dim == 0 || self.dim > MAX_TABLE_DIM {
            return Err(bad("model.tables.dim", format!("table {who:?}: must be between 1 and {MAX_TABLE_DIM}")));
        }
        if eps_agg::DType::parse(&self.dtype).is_none() {
            return Err(bad("model.tables.dtype", format!("table {who:?}: {:?} is not f32, bf16 or f16", self.dtype)));
        }
        let kind = self.optimizer_kind(job_kind);
        if !TABLE_OPTIMIZERS.contains(&kind) {
            let field = if self.optimizer.is_some() { "model.tables.optimizer" } else { "optimizer.kind" };
            return Err(bad(
                field,
                format!("table {who:?}: {kind:?} is not a row-wise optimizer (use one of {})", TABLE_OPTIMIZERS.join(", ")),
            ));
        }
        if let Some(lr) = self.lr
            && !(lr.is_finite() && lr > 0.0)
        {
            return Err(bad("model.tables.lr", format!("table {who:?}: must be a positive number")));
        }
        if !(self.initial_accumulator.is_finite() && self.initial_accumulator >= 0.0) {
            return Err(bad("model.tables.initial_accumulator", format!("table {who:?}: must be a non-negative number")));
        }
        match self.init.as_str() {
            "zeros" => {}
            "uniform" if self.init_scale.is_finite() && self.init_scale > 0.0 => {}
            "uniform" => return Err(bad("model.tables.init_scale", format!("table {who:?}: must be a positive number"))),
            i => return Err(bad("model.tables.init", format!("table {who:?}: unknown initializer {i:?} (zeros, uniform)"))),
        }
        if self.max_keys == 0 || self.max_keys > MAX_KEYS {
            return Err(bad("model.tables.max_keys", format!("table {who:?}: must be between 1 and {MAX_KEYS}")));
        }
        if self.key_limit == Some(0) {
            return Err(bad("model.tables.key_limit", format!("table {who:?}: a limit of 0 admits no key")));
        }
        if self.max_rows_per_server == Some(0) {
            return Err(bad("model.tables.max_rows_per_server", format!("table {who:?}: must be at least 1")));
        }
        if self.evict_idle_steps == Some(0) {
            return Err(bad("model.tables.evict_idle_steps", format!("table {who:?}: must be at least 1")));
        }
        if self.evict_min_touches > 0 && self.evict_idle_steps.is_none() {
            return Err(bad(
                "model.tables.evict_min_touches",
                format!("table {who:?}: give evict_idle_steps too (the window a row has to be touched in)"),
            ));
        }
        Ok(())
    }

    /// Whether `key` may be used with this table.
    pub fn admits(&self, key: u64) -> bool {
        self.key_limit.is_none_or(|l| key < l)
    }
}

/// Checks a model's tables: each one, their number, and names unique among
/// tables and `tensors`.
pub fn validate<'a>(tables: &[TableDecl], tensors: impl Iterator<Item = &'a str>, job: &super::JobSpec) -> Result<(), SpecError> {
    if tables.is_empty() {
        return Ok(());
    }
    if tables.len() > MAX_TABLES {
        return Err(bad("model.tables", format!("{} tables: at most {MAX_TABLES}", tables.len())));
    }
    let job_kind = job.optimizer.kind.as_str();
    let mut names: std::collections::HashSet<&str> = tensors.collect();
    for t in tables {
        t.validate(job_kind)?;
        if !names.insert(&t.name) {
            return Err(bad("model.tables.name", format!("{:?} names another table or tensor", t.name)));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::JobSpec;

    const BASE: &str = "[job]\n[model]\ntensors = [{ name = \"w\", elements = 8 }]\n";

    #[test]
    fn a_table_parses_with_defaults_from_the_job() {
        let s = JobSpec::from_toml(&format!("{BASE}[[model.tables]]\nname = \"ids\"\ndim = 16\n")).unwrap();
        let t = &s.model.tables[0];
        assert_eq!((t.name.as_str(), t.dim, t.optimizer_kind("adam"), t.lr_or(0.01)), ("ids", 16, "adam", 0.01));
        assert_eq!((t.init.as_str(), t.init_scale, t.key_limit), ("uniform", 0.01, None));
        assert!(t.admits(u64::MAX));
        let s = JobSpec::from_toml(&format!(
            "{BASE}[[model.tables]]\nname = \"a\"\ndim = 4\noptimizer = \"adagrad\"\nlr = 0.5\nkey_limit = 100\n\
             [[model.tables]]\nname = \"b\"\ndim = 2\ninit = \"zeros\"\nevict_idle_steps = 10\nevict_min_touches = 2\n"
        ))
        .unwrap();
        assert_eq!(s.model.tables.len(), 2);
        assert!(s.model.tables[0].admits(99) && !s.model.tables[0].admits(100));
    }

    #[test]
    fn tables_take_replicas_and_checkpoints() {
        let t = "[[model.tables]]\nname = \"t\"\ndim = 4\n";
        let two = BASE.replace("[job]\n", "[job]\nreplicas = 2\nservers = 2\n") + t;
        assert!(JobSpec::from_toml(&two).is_ok(), "tables have backups");
        let ckpt = BASE.replace("[job]\n", "[job]\ncheckpoint_every = 5\ncheckpoint_dir = \"/tmp/x\"\n") + t;
        assert!(JobSpec::from_toml(&ckpt).is_ok(), "tables are checkpointed");
    }

    #[test]
    fn bad_tables_name_their_field_and_table() {
        let cases = [
            ("name = \"t\"\ndim = 0", "model.tables.dim"),
            ("name = \"t\"\ndim = 70000", "model.tables.dim"),
            ("name = \"t\"\ndim = 4\noptimizer = \"lamb\"", "model.tables.optimizer"),
            ("name = \"t\"\ndim = 4\ndtype = \"f64\"", "model.tables.dtype"),
            ("name = \"t\"\ndim = 4\nlr = 0.0", "model.tables.lr"),
            ("name = \"t\"\ndim = 4\ninit = \"normal\"", "model.tables.init"),
            ("name = \"t\"\ndim = 4\ninit_scale = -1.0", "model.tables.init_scale"),
            ("name = \"t\"\ndim = 4\nkey_limit = 0", "model.tables.key_limit"),
            ("name = \"t\"\ndim = 4\nmax_keys = 0", "model.tables.max_keys"),
            ("name = \"t\"\ndim = 4\nevict_min_touches = 3", "model.tables.evict_min_touches"),
            ("name = \"w\"\ndim = 4", "model.tables.name"),
            ("name = \"t\"\ndim = 4\nrows = 9", "rows"),
        ];
        for (table, field) in cases {
            let e = JobSpec::from_toml(&format!("{BASE}[[model.tables]]\n{table}\n")).unwrap_err().to_string();
            assert!(e.contains(field), "{table:?}: {e}");
        }
        let e = JobSpec::from_toml(&format!("{BASE}[optimizer]\nkind = \"none\"\n[[model.tables]]\nname = \"t\"\ndim = 4\n"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("optimizer.kind") && e.contains("\"t\""), "{e}");
    }
}
