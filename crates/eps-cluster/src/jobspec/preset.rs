//! The built-in tasks of `eps train` (`model.preset = "synthetic" | "ctr"`),
//! expanded by the command before a spec goes anywhere: the preset's tensors
//! become explicit `model.tensors`, and its parameters a `[task]` section
//! that only the task's workers read. The control plane, the servers and
//! `libeps` see an ordinary spec.

use eps_proto::SpecError;
use eps_proto::spec::TensorSpec;
use serde::{Deserialize, Serialize};

/// The presets there are.
pub const PRESETS: [&str; 2] = ["synthetic", "ctr"];

/// The table of the ctr task's embedding bags.
pub const CTR_TABLE: &str = "ctr.ids";

/// The `[model]` fields a preset takes (moved into `[task]`).
const FIELDS: [&str; 10] =
    ["buckets", "dense_dim", "classes", "sparse_per_sample", "vocab", "fields", "max_bag", "zipf", "embed_dim", "hidden"];

/// `[task]`: a built-in task's parameters.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TaskSection {
    /// `synthetic` (a linear classifier with a hashed embedding) or `ctr`
    /// (click-through: embedding bags in a sparse table and an MLP).
    pub kind: String,
    /// Synthetic: hashed sparse-feature buckets (embedding rows).
    #[serde(default = "default_buckets")]
    pub buckets: u64,
    /// Dense input features.
    #[serde(default = "default_dense_dim")]
    pub dense_dim: u64,
    /// Synthetic: classes.
    #[serde(default = "default_classes")]
    pub classes: u64,
    /// Synthetic: active sparse features per sample.
    #[serde(default = "default_sparse_per_sample")]
    pub sparse_per_sample: u32,
    /// Synthetic: distinct raw sparse ids before hashing; ctr: ids per field.
    #[serde(default = "default_vocab")]
    pub vocab: u64,
    /// Ctr: categorical fields per sample (each an embedding bag).
    #[serde(default = "default_fields")]
    pub fields: u32,
    /// Ctr: ids per bag, 1 to this many.
    #[serde(default = "default_max_bag")]
    pub max_bag: u32,
    /// Ctr: zipf exponent of the ids.
    #[serde(default = "default_zipf")]
    pub zipf: f64,
    /// Ctr: values of an embedding row (the table `ctr.ids` has this dim).
    #[serde(default = "default_embed_dim")]
    pub embed_dim: u32,
    /// Ctr: units of the MLP's hidden layer.
    #[serde(default = "default_hidden")]
    pub hidden: u32,
}

fn default_buckets() -> u64 {
    2_621_440
}
fn default_dense_dim() -> u64 {
    64
}
fn default_classes() -> u64 {
    4
}
fn default_sparse_per_sample() -> u32 {
    8
}
fn default_vocab() -> u64 {
    2000
}
fn default_fields() -> u32 {
    4
}
fn default_max_bag() -> u32 {
    3
}
fn default_zipf() -> f64 {
    1.05
}
fn default_embed_dim() -> u32 {
    8
}
fn default_hidden() -> u32 {
    16
}

fn bad(field: &'static str, reason: impl Into<String>) -> SpecError {
    SpecError::Field { field, reason: reason.into() }
}

impl TaskSection {
    /// The task `kind` with every parameter at its default.
    pub fn defaults(kind: &str) -> Self {
        let mut t = toml::Table::new();
        t.insert("kind".into(), toml::Value::String(kind.into()));
        toml::Value::Table(t).try_into().expect("every task parameter has a default")
    }

    /// The task of a spec, if it runs a built-in one.
    pub fn of(spec: &eps_proto::JobSpec) -> Result<Option<Self>, SpecError> {
        let Some(t) = &spec.task else { return Ok(None) };
        let task: Self = toml::Value::Table(t.clone()).try_into().map_err(|e: toml::de::Error| bad("task", e.to_string()))?;
        task.validate()?;
        Ok(Some(task))
    }

    fn validate(&self) -> Result<(), SpecError> {
        let within = |v: u64, hi: u64| (1..=hi).contains(&v);
        let checks: &[(bool, &'static str, &str)] = match self.kind.as_str() {
            "synthetic" => &[
                ((2..=1000).contains(&self.classes), "model.classes", "must be between 2 and 1000"),
                (within(self.dense_dim, 1 << 16), "model.dense_dim", "must be between 1 and 65536"),
                (within(self.buckets, 1 << 28), "model.buckets", "must be between 1 and 2^28"),
                (self.vocab > 0, "model.vocab", "must be at least 1"),
                (self.sparse_per_sample <= 1024, "model.sparse_per_sample", "must be at most 1024"),
            ],
            "ctr" => &[
                (within(self.fields.into(), 64), "model.fields", "must be between 1 and 64"),
                (within(self.max_bag.into(), 64), "model.max_bag", "must be between 1 and 64"),
                (within(self.embed_dim.into(), 1024), "model.embed_dim", "must be between 1 and 1024"),
                (within(self.hidden.into(), 1024), "model.hidden", "must be between 1 and 1024"),
                (within(self.dense_dim, 1024), "model.dense_dim", "must be between 1 and 1024"),
                (within(self.vocab, 1 << 40), "model.vocab", "must be between 1 and 2^40"),
                (self.zipf.is_finite() && self.zipf > 0.0, "model.zipf", "must be a positive number"),
            ],
            p => return Err(bad("model.preset", format!("unknown preset {p:?} (known: {})", PRESETS.join(", ")))),
        };
        match checks.iter().find(|c| !c.0) {
            Some((_, field, why)) => Err(bad(field, *why)),
            None => Ok(()),
        }
    }

    /// The task's tensors, in layout order.
    pub fn tensors(&self) -> Vec<TensorSpec> {
        let t = |name: &str, elements| TensorSpec { name: name.into(), elements };
        if self.kind == "ctr" {
            let (h, input) = (u64::from(self.hidden), u64::from(self.fields * self.embed_dim) + self.dense_dim);
            vec![t("mlp.w1", h * input), t("mlp.b1", h), t("mlp.w2", h), t("mlp.b2", 1)]
        } else {
            vec![
                t("dense.weight", self.classes * self.dense_dim),
                t("dense.bias", self.classes),
                t("sparse.embedding", self.buckets * self.classes),
            ]
        }
    }
}

/// The spec text `table` with its `model.preset` (if any) expanded: the
/// preset's fields leave `[model]` for `[task]` (defaults written out), and
/// `model.tensors` lists the preset's tensors. A spec without a preset is
/// left as it is.
pub fn expand(table: &mut toml::Table) -> Result<(), SpecError> {
    let Some(toml::Value::Table(model)) = table.get_mut("model") else { return Ok(()) };
    let Some(preset) = model.remove("preset") else { return Ok(()) };
    let toml::Value::String(kind) = preset else { return Err(bad("model.preset", "must be a string")) };
    if model.get("declare").is_some_and(|d| d.as_bool() == Some(true)) {
        return Err(bad("model.declare", "workers declare the tensors: give no preset and no tensors with it"));
    }
    if model.contains_key("tensors") {
        return Err(bad("model.tensors", format!("the preset {kind:?} makes the tensors: give no tensors with it")));
    }
    let mut raw = toml::Table::new();
    raw.insert("kind".into(), toml::Value::String(kind));
    for f in FIELDS {
        if let Some(v) = model.remove(f) {
            raw.insert(f.into(), v);
        }
    }
    let task: TaskSection =
        toml::Value::Table(raw).try_into().map_err(|e: toml::de::Error| bad("model", e.to_string().trim().replace('\n', " ")))?;
    task.validate()?;
    if task.kind == "ctr" {
        let dim = model.get("tables").and_then(|t| t.as_array()).and_then(|ts| {
            ts.iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some(CTR_TABLE))
                .map(|t| t.get("dim").and_then(|d| d.as_integer()))
        });
        match dim {
            Some(Some(d)) if d == i64::from(task.embed_dim) => {}
            Some(d) => {
                let d = d.map_or("no".to_string(), |d| d.to_string());
                return Err(bad(
                    "model.tables.dim",
                    format!("table {CTR_TABLE:?} has dim {d}; model.embed_dim is {}", task.embed_dim),
                ));
            }
            None => {
                return Err(bad(
                    "model.tables",
                    format!("the ctr preset's embeddings live in a table named {CTR_TABLE:?}: declare it"),
                ));
            }
        }
    }
    let tensors = task
        .tensors()
        .into_iter()
        .map(|t| {
            let elements = i64::try_from(t.elements).map_err(|_| bad("model.tensors.elements", "past 2^63"))?;
            let mut e = toml::Table::new();
            e.insert("name".into(), toml::Value::String(t.name));
            e.insert("elements".into(), toml::Value::Integer(elements));
            Ok(toml::Value::Table(e))
        })
        .collect::<Result<Vec<_>, SpecError>>()?;
    model.insert("tensors".into(), toml::Value::Array(tensors));
    let task = toml::Value::try_from(&task).map_err(|e| bad("task", e.to_string()))?;
    table.insert("task".into(), task);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::jobspec::{CTR_SPEC, DEFAULT_SPEC, parse};

    fn names(spec: &eps_proto::JobSpec) -> Vec<(String, u64)> {
        spec.model.tensors.iter().map(|t| (t.name.clone(), t.elements)).collect()
    }

    #[test]
    fn a_preset_becomes_explicit_tensors_and_a_task_only_its_workers_read() {
        let (spec, text) = parse(DEFAULT_SPEC).unwrap();
        let n = 2_621_440 * 4;
        assert_eq!(names(&spec), [("dense.weight".into(), 256), ("dense.bias".into(), 4), ("sparse.embedding".into(), n)]);
        let task = TaskSection::of(&spec).unwrap().unwrap();
        assert_eq!((task.kind.as_str(), task.buckets, task.classes, task.dense_dim), ("synthetic", 2_621_440, 4, 64));
        assert!(!text.contains("preset"), "{text}");
        // The expanded text is a spec like any other, and expands to itself.
        assert_eq!(eps_proto::JobSpec::from_toml(&text).unwrap(), spec);
        assert_eq!(parse(&text).unwrap(), (spec, text.clone()));
        // Defaults are written out, so a worker reads the values the command chose.
        let (spec, _) = parse("[job]\n[model]\npreset = \"synthetic\"\nbuckets = 100\n").unwrap();
        let task = spec.task.unwrap();
        assert_eq!((task["buckets"].as_integer(), task["vocab"].as_integer()), (Some(100), Some(2000)));
        let (spec, _) = parse(CTR_SPEC).unwrap();
        let t = TaskSection::of(&spec).unwrap().unwrap();
        let w1 = u64::from(t.hidden) * (u64::from(t.fields * t.embed_dim) + t.dense_dim);
        assert_eq!(names(&spec), [("mlp.w1".into(), w1), ("mlp.b1".into(), 16), ("mlp.w2".into(), 16), ("mlp.b2".into(), 1)]);
    }

    #[test]
    fn a_spec_without_a_preset_is_left_as_it_is() {
        let text = "[job]\n[model]\ntensors = [{ name = \"w\", elements = 8 }]\n";
        let (spec, out) = parse(text).unwrap();
        assert_eq!((out.as_str(), spec.task), (text, None));
    }

    #[test]
    fn bad_presets_name_the_field() {
        let ctr = "[job]\n[model]\npreset = \"ctr\"\n";
        let table = "[[model.tables]]\nname = \"ctr.ids\"\n";
        let cases = [
            ("[job]\n[model]\npreset = \"resnet\"\n".to_string(), "model.preset"),
            ("[job]\n[model]\npreset = 3\n".into(), "model.preset"),
            ("[job]\n[model]\npreset = \"synthetic\"\ntensors = [{ name = \"w\", elements = 8 }]\n".into(), "model.tensors"),
            ("[job]\n[model]\npreset = \"synthetic\"\ndeclare = true\n".into(), "model.declare"),
            ("[job]\n[model]\npreset = \"synthetic\"\nclasses = 1\n".into(), "model.classes"),
            ("[job]\n[model]\npreset = \"synthetic\"\nbuckets = 0\n".into(), "model.buckets"),
            ("[job]\n[model]\npreset = \"synthetic\"\nbuckets = \"many\"\n".into(), "buckets"),
            ("[job]\n[model]\nbuckets = 10\ntensors = [{ name = \"w\", elements = 8 }]\n".into(), "buckets"),
            (ctr.into(), "model.tables"),
            (format!("{ctr}{table}dim = 4\n"), "model.embed_dim is 8"),
            (format!("{ctr}zipf = 0.0\n{table}dim = 8\n"), "model.zipf"),
        ];
        for (text, field) in cases {
            let e = parse(&text).unwrap_err().to_string();
            assert!(e.contains(field), "{text:?}: {e}");
        }
        assert!(parse(&format!("{ctr}{table}dim = 8\n")).is_ok());
    }
}
