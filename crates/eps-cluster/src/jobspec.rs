//! The job spec a command builds: a file, or a built-in job, with the
//! command line's overrides applied to its fields.

use std::path::{Path, PathBuf};

use eps_proto::JobSpec;

mod preset;
pub use preset::{CTR_TABLE, PRESETS, TaskSection, expand};

/// A spec's text, its preset expanded (see [`expand`]), parsed and checked:
/// the spec, and the text to hand on (what the control plane keeps and
/// every process reads).
pub fn parse(text: &str) -> Result<(JobSpec, String), eps_proto::SpecError> {
    let table = table_of(text)?;
    if table.get("model").and_then(|m| m.get("preset")).is_none() {
        return Ok((JobSpec::from_toml(text)?, text.to_string()));
    }
    finish(table)
}

/// A spec's text as a TOML table.
fn table_of(text: &str) -> Result<toml::Table, eps_proto::SpecError> {
    text.parse().map_err(|e: toml::de::Error| eps_proto::SpecError::Toml(e.to_string().trim().replace('\n', " ")))
}

/// A spec's table with its preset expanded, as the text handed on and the
/// spec it makes.
fn finish(mut table: toml::Table) -> Result<(JobSpec, String), eps_proto::SpecError> {
    expand(&mut table)?;
    let text = toml::to_string(&table).expect("a TOML table serializes");
    Ok((JobSpec::from_toml(&text)?, text))
}

/// The job `eps train` runs when no spec file is given.
pub const DEFAULT_SPEC: &str = r#"
[job]
name = "synthetic"
workers = 2
servers = 2
steps = 700
consistency = "bsp"
dtype = "f32"
batch = 512
seed = 1
shard_bytes = 4194304

[model]
preset = "synthetic"
buckets = 2621440
dense_dim = 64
classes = 4
sparse_per_sample = 8
vocab = 2000

[optimizer]
kind = "adam"
lr = 0.01

[lr_schedule]
warmup_steps = 20
decay = "cosine"
min_lr = 0.001
"#;

/// The job `eps train --model ctr` runs when no spec file is given: a
/// click-through model, embedding bags in a sparse table and an MLP.
pub const CTR_SPEC: &str = r#"
[job]
name = "ctr"
workers = 2
servers = 2
steps = 1500
consistency = "bsp"
batch = 512
seed = 1

[model]
preset = "ctr"
fields = 4
vocab = 1000
max_bag = 3
zipf = 1.05
embed_dim = 8
dense_dim = 8
hidden = 16

[[model.tables]]
name = "ctr.ids"
dim = 8
optimizer = "adagrad"
lr = 0.3
init_scale = 0.05
max_keys = 8192

[optimizer]
kind = "adam"
lr = 0.01
"#;

/// The built-in jobs of `eps train --model`.
pub fn default_spec(model: &str) -> Result<&'static str, String> {
    match model {
        "synthetic" => Ok(DEFAULT_SPEC),
        "ctr" => Ok(CTR_SPEC),
        m => Err(format!("--model {m:?}: the built-in models are synthetic and ctr")),
    }
}

/// Command-line overrides of spec fields.
#[derive(Clone, Debug, Default)]
pub struct Overrides {
    /// `job.workers`.
    pub workers: Option<u32>,
    /// `job.servers`.
    pub servers: Option<u32>,
    /// `job.steps`.
    pub steps: Option<u64>,
    /// `job.consistency`.
    pub consistency: Option<String>,
    /// `optimizer.kind`.
    pub optimizer: Option<String>,
    /// `job.dtype`.
    pub dtype: Option<String>,
    /// `optimizer.lr`.
    pub lr: Option<f64>,
    /// `job.batch`.
    pub batch: Option<u32>,
    /// `job.max_workers`.
    pub max_workers: Option<u32>,
    /// `job.checkpoint_every`.
    pub checkpoint_every: Option<u64>,
    /// `job.checkpoint_dir`.
    pub checkpoint_dir: Option<String>,
    /// `job.checkpoint_keep`.
    pub checkpoint_keep: Option<u32>,
    /// `job.replicas`.
    pub replicas: Option<u32>,
    /// `model.init`.
    pub init: Option<String>,
}

/// A spec file that could not be read.
#[derive(Debug, thiserror::Error)]
#[error("cannot read job spec {path}")]
pub struct ReadSpecError {
    /// The file.
    pub path: PathBuf,
    /// Cause.
    #[source]
    pub source: std::io::Error,
}

/// Why a spec could not be built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SpecFileError {
    /// The file could not be read.
    #[error(transparent)]
    Read(#[from] ReadSpecError),
    /// The spec is invalid.
    #[error(transparent)]
    Spec(#[from] eps_proto::SpecError),
}

/// Builds the spec text: a file (or the default job) with overrides applied.
pub fn build_spec(path: Option<&Path>, o: &Overrides) -> Result<(JobSpec, String), SpecFileError> {
    build_model_spec(path, DEFAULT_SPEC, o)
}

/// As [`build_spec`], with `default` the job without a file.
pub fn build_model_spec(path: Option<&Path>, default: &str, o: &Overrides) -> Result<(JobSpec, String), SpecFileError> {
    let (spec, text) = build_spec_or(path, default, o)?;
    if TaskSection::of(&spec)?.is_none() {
        return Err(eps_proto::SpecError::Field {
            field: "model.preset",
            reason: "`eps train` runs a built-in task; set preset = \"synthetic\" or \"ctr\"".into(),
        }
        .into());
    }
    Ok((spec, text))
}

/// The spec text of a file, or of `default` without one, with overrides applied.
pub fn build_spec_or(path: Option<&Path>, default: &str, o: &Overrides) -> Result<(JobSpec, String), SpecFileError> {
    let text = match path {
        Some(p) => std::fs::read_to_string(p).map_err(|source| ReadSpecError { path: p.to_path_buf(), source })?,
        None => default.to_string(),
    };
    let mut table = table_of(&text)?;
    fn set(t: &mut toml::Table, section: &str, key: &str, v: toml::Value) {
        let sec = t.entry(section).or_insert_with(|| toml::Value::Table(toml::Table::new()));
        if let toml::Value::Table(s) = sec {
            s.insert(key.to_string(), v);
        }
    }
    use toml::Value as V;
    if let Some(v) = o.workers {
        set(&mut table, "job", "workers", V::Integer(v.into()));
    }
    if let Some(v) = o.servers {
        set(&mut table, "job", "servers", V::Integer(v.into()));
    }
    // (TOML integers are i64: a larger count is refused, never cut down.)
    let int = |v: u64, field: &'static str| {
        i64::try_from(v)
            .map(V::Integer)
            .map_err(|_| eps_proto::SpecError::Field { field, reason: format!("{v}: at most 2^63 - 1") })
    };
    if let Some(v) = o.steps {
        set(&mut table, "job", "steps", int(v, "job.steps")?);
    }
    if let Some(v) = &o.consistency {
        set(&mut table, "job", "consistency", V::String(v.clone()));
    }
    if let Some(v) = &o.dtype {
        set(&mut table, "job", "dtype", V::String(v.clone()));
    }
    if let Some(v) = o.batch {
        set(&mut table, "job", "batch", V::Integer(v.into()));
    }
    if let Some(v) = o.max_workers {
        set(&mut table, "job", "max_workers", V::Integer(v.into()));
    }
    if let Some(v) = o.replicas {
        set(&mut table, "job", "replicas", V::Integer(v.into()));
    }
    if let Some(v) = o.checkpoint_every {
        set(&mut table, "job", "checkpoint_every", int(v, "job.checkpoint_every")?);
    }
    if let Some(v) = &o.checkpoint_dir {
        set(&mut table, "job", "checkpoint_dir", V::String(v.clone()));
    }
    if let Some(v) = o.checkpoint_keep {
        set(&mut table, "job", "checkpoint_keep", V::Integer(v.into()));
    }
    if let Some(v) = &o.optimizer {
        set(&mut table, "optimizer", "kind", V::String(v.clone()));
    }
    if let Some(v) = o.lr {
        set(&mut table, "optimizer", "lr", V::Float(v));
    }
    if let Some(v) = &o.init {
        set(&mut table, "model", "init", V::String(v.clone()));
    }
    Ok(finish(table)?)
}
