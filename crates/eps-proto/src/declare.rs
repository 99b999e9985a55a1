//! Tensors declared by workers at join (`[model] declare = true`).
//!
//! A framework knows its tensors only at run time. The first worker to join
//! declares them (name, elements, dtype, in the order of the flat parameter
//! space); the control plane then fixes the job's layout by rewriting its spec
//! with those tensors, and every later declaration must be the same: the
//! first difference is named in the error.

use eps_agg::DType;

use crate::spec::{JobSpec, SpecError, TensorSpec};

/// Longest tensor name accepted in a declaration, in bytes.
pub const MAX_NAME_BYTES: usize = 256;
/// Most tensors in one declaration.
pub const MAX_TENSORS: usize = 65_536;

/// One tensor as a worker declares it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorDecl {
    /// Name, unique in the model.
    pub name: String,
    /// Number of elements.
    pub elements: u64,
    /// Element type (a job has one wire dtype: every tensor must have it).
    pub dtype: DType,
}

/// Checks a declaration on its own: at least one tensor, names non-empty,
/// unique and short, no empty tensor, one dtype for all.
pub fn validate(decl: &[TensorDecl]) -> Result<(), String> {
    if decl.is_empty() {
        return Err("the declaration names no tensor".into());
    }
    if decl.len() > MAX_TENSORS {
        return Err(format!("{} tensors declared: at most {MAX_TENSORS}", decl.len()));
    }
    let mut names = std::collections::HashSet::new();
    for (i, t) in decl.iter().enumerate() {
        if t.name.is_empty() || t.name.len() > MAX_NAME_BYTES {
            return Err(format!("tensor {i}: a name must have 1 to {MAX_NAME_BYTES} bytes"));
        }
        if t.name.chars().any(char::is_control) {
            return Err(format!("tensor {i} ({:?}): control characters in the name", t.name));
        }
        if t.elements == 0 {
            return Err(format!("tensor {i} ({:?}) has no elements", t.name));
        }
        if !names.insert(t.name.as_str()) {
            return Err(format!("tensor {i}: the name {:?} is declared twice", t.name));
        }
        if t.dtype != decl[0].dtype {
            return Err(format!(
                "tensor {i} ({:?}) is {} but tensor 0 ({:?}) is {}: a job's tensors share one dtype",
                t.name,
                t.dtype.name(),
                decl[0].name,
                decl[0].dtype.name()
            ));
        }
    }
    if crate::layout::total_elements(decl.iter().map(|t| &t.elements)).is_none() {
        return Err(format!(
            "the {} tensors' elements add up past {} (2^40), the most a job may have",
            decl.len(),
            crate::layout::MAX_ELEMENTS
        ));
    }
    Ok(())
}

/// The first difference between a declaration and the job's fixed tensors
/// (`None` when they are the same), in words.
pub fn first_difference(job: &[TensorSpec], dtype: DType, decl: &[TensorDecl]) -> Option<String> {
    for (i, (j, d)) in job.iter().zip(decl).enumerate() {
        if j.name != d.name {
            return Some(format!("tensor {i} is {:?} in the job but {:?} in this declaration", j.name, d.name));
        }
        if j.elements != d.elements {
            return Some(format!(
                "tensor {i} ({:?}) has {} elements in the job but {} in this declaration",
                j.name, j.elements, d.elements
            ));
        }
        if dtype != d.dtype {
            return Some(format!(
                "tensor {i} ({:?}) is {} in the job but {} in this declaration",
                j.name,
                dtype.name(),
                d.dtype.name()
            ));
        }
    }
    match job.len().cmp(&decl.len()) {
        std::cmp::Ordering::Equal => None,
        std::cmp::Ordering::Greater => Some(format!(
            "the job has {} tensors, this declaration {} (tensor {:?} is missing)",
            job.len(),
            decl.len(),
            job[decl.len()].name
        )),
        std::cmp::Ordering::Less => Some(format!(
            "the job has {} tensors, this declaration {} (tensor {:?} is extra)",
            job.len(),
            decl.len(),
            decl[job.len()].name
        )),
    }
}

/// The spec text of a job whose workers declare their tensors, with `decl`
/// fixed in it: `model.tensors` set, `model.declare` removed, `job.dtype` the
/// declaration's. Everything else is kept as written.
pub fn fix(spec_text: &str, decl: &[TensorDecl]) -> Result<String, SpecError> {
    validate(decl).map_err(|reason| SpecError::Field { field: "model.tensors", reason })?;
    // Where the first parameters come from is decided by the job as declared
    // (see `JobSpec::seeded_by_worker`), and stays so once it names its tensors.
    let init = if JobSpec::from_toml(spec_text)?.seeded_by_worker() { "worker" } else { "servers" };
    let mut doc: toml::Table = toml::from_str(spec_text).map_err(|e| SpecError::Toml(e.to_string()))?;
    let job = doc.entry("job").or_insert_with(|| toml::Value::Table(toml::Table::new()));
    let toml::Value::Table(job) = job else {
        return Err(SpecError::Toml("`job` is not a table".into()));
    };
    job.insert("dtype".into(), toml::Value::String(decl[0].dtype.name().into()));
    let model = doc.entry("model").or_insert_with(|| toml::Value::Table(toml::Table::new()));
    let toml::Value::Table(model) = model else {
        return Err(SpecError::Toml("`model` is not a table".into()));
    };
    model.remove("declare");
    model.entry("init").or_insert_with(|| toml::Value::String(init.into()));
    let tensors = decl
        .iter()
        .map(|t| {
            let mut e = toml::Table::new();
            e.insert("name".into(), toml::Value::String(t.name.clone()));
            let n = i64::try_from(t.elements).map_err(|_| SpecError::Field {
                field: "model.tensors.elements",
                reason: format!("{} is too large", t.elements),
            })?;
            e.insert("elements".into(), toml::Value::Integer(n));
            Ok(toml::Value::Table(e))
        })
        .collect::<Result<Vec<_>, SpecError>>()?;
    model.insert("tensors".into(), toml::Value::Array(tensors));
    let text = doc.to_string();
    // The result must be a valid spec with a layout.
    JobSpec::from_toml(&text)?.layout()?;
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(name: &str, elements: u64, dtype: DType) -> TensorDecl {
        TensorDecl { name: name.into(), elements, dtype }
    }

    const SPEC: &str = "[job]\nworkers = 2\nservers = 2\n[model]\ndeclare = true\n[optimizer]\nkind = \"none\"\n";

    #[test]
    fn the_first_declaration_fixes_the_layout() {
        let spec = JobSpec::from_toml(SPEC).unwrap();
        assert!(spec.awaits_declaration());
        assert!(spec.layout().is_err(), "no layout before the declaration");
        let decl = [d("fc1.weight", 64 * 100, DType::Bf16), d("fc1.bias", 100, DType::Bf16)];
        let text = fix(SPEC, &decl).unwrap();
        let fixed = JobSpec::from_toml(&text).unwrap();
        assert!(!fixed.awaits_declaration());
        assert_eq!(fixed.dtype().unwrap(), DType::Bf16);
        assert_eq!((fixed.job.workers, fixed.job.servers), (2, 2));
        assert_eq!(fixed.optimizer.kind, "none");
        let l = fixed.layout().unwrap();
        assert_eq!(l.total, 6500);
        assert_eq!(first_difference(&fixed.tensors(), DType::Bf16, &decl), None);
    }

    #[test]
    fn differences_are_named() {
        let job = [TensorSpec { name: "a".into(), elements: 10 }, TensorSpec { name: "b".into(), elements: 5 }];
        let f32 = DType::F32;
        let cases = [
            (vec![d("a", 10, f32), d("c", 5, f32)], "tensor 1 is \"b\" in the job but \"c\""),
            (vec![d("a", 11, f32), d("b", 5, f32)], "tensor 0 (\"a\") has 10 elements in the job but 11"),
            (vec![d("a", 10, DType::F16), d("b", 5, DType::F16)], "is f32 in the job but f16"),
            (vec![d("a", 10, f32)], "tensor \"b\" is missing"),
            (vec![d("a", 10, f32), d("b", 5, f32), d("z", 1, f32)], "tensor \"z\" is extra"),
        ];
        for (decl, want) in cases {
            let e = first_difference(&job, f32, &decl).unwrap();
            assert!(e.contains(want), "{e}");
        }
    }

    #[test]
    fn bad_declarations_are_refused() {
        let f32 = DType::F32;
        let cases = [
            (vec![], "names no tensor"),
            (vec![d("", 1, f32)], "name must have"),
            (vec![d("a", 0, f32)], "has no elements"),
            (vec![d("a", 1, f32), d("a", 2, f32)], "declared twice"),
            (vec![d("a", 1, f32), d("b", 2, DType::Bf16)], "share one dtype"),
            (vec![d("a\n", 1, f32)], "control characters"),
            // 2^63 + 2^63 wraps to 0, and 2^64 - 8 + 16 to 8: refused, not wrapped.
            (vec![d("a", 1 << 63, f32), d("b", 1 << 63, f32)], "add up past"),
            (vec![d("a", u64::MAX - 7, f32), d("b", 16, f32)], "add up past"),
        ];
        for (decl, want) in cases {
            let e = validate(&decl).unwrap_err();
            assert!(e.contains(want), "{e}");
            assert!(fix(SPEC, &decl).is_err());
        }
    }
}
