//! A table as the job spec declares it (`[[model.tables]]`), made into what a
//! server holds: its [`TableSpec`], learning rate, key limit and eviction.

use eps_agg::Optimizer;
use eps_proto::JobSpec;
use eps_proto::spec::TableDecl;

use crate::{Init, RowOptimizer, TableSpec};

/// When rows are evicted (see [`crate::RowTable::evict`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Evict {
    /// Rows idle for more steps go.
    pub idle_steps: u64,
    /// Rows touched fewer times in their first `idle_steps` go.
    pub min_touches: u32,
}

/// One declared table.
#[derive(Clone, Debug, PartialEq)]
pub struct Declared {
    /// Its name.
    pub name: String,
    /// Its index among the spec's tables (what the wire names it by).
    pub index: u16,
    /// Rows, optimizer, initializer.
    pub spec: TableSpec,
    /// The learning rate of every step.
    pub lr: f32,
    /// Keys must be below it.
    pub key_limit: Option<u64>,
    /// Eviction, if asked for.
    pub evict: Option<Evict>,
    /// Most keys of one request to one server.
    pub max_keys: usize,
    /// How rows travel (servers keep them as f32).
    pub dtype: eps_agg::DType,
}

impl Declared {
    /// Whether `key` may be used with the table.
    pub fn admits(&self, key: u64) -> bool {
        self.key_limit.is_none_or(|l| key < l)
    }

    /// Bytes of one value on the wire.
    pub fn elem(&self) -> usize {
        self.dtype.size_bytes()
    }

    /// Bytes of one row and its optimizer state.
    pub fn row_state_bytes(&self) -> usize {
        self.spec.dim * (1 + self.spec.opt.state_per_value()) * 4
    }
}

/// The tables of a validated spec, in declaration order.
pub fn tables(spec: &JobSpec) -> Vec<Declared> {
    spec.model.tables.iter().enumerate().map(|(i, d)| declared(spec, i as u16, d)).collect()
}

fn declared(spec: &JobSpec, index: u16, d: &TableDecl) -> Declared {
    let o = &spec.optimizer;
    let wd = o.weight_decay;
    let opt = match d.optimizer_kind(&o.kind) {
        "adagrad" => RowOptimizer::Adagrad { eps: o.eps, initial_accumulator: d.initial_accumulator, weight_decay: wd },
        "momentum" | "nesterov" => RowOptimizer::Dense(Optimizer::Momentum {
            momentum: o.momentum,
            nesterov: d.optimizer_kind(&o.kind) == "nesterov",
            weight_decay: wd,
        }),
        "adam" | "adamw" => RowOptimizer::Dense(Optimizer::Adam {
            beta1: o.beta1,
            beta2: o.beta2,
            eps: o.eps,
            weight_decay: wd,
            decoupled: d.optimizer_kind(&o.kind) == "adamw",
        }),
        // The spec's validation admits only row-wise optimizers: sgd is left.
        _ => RowOptimizer::Dense(Optimizer::Sgd { weight_decay: wd }),
    };
    let init = if d.init == "zeros" { Init::Zeros } else { Init::Uniform { scale: d.init_scale } };
    let max_rows = d.max_rows_per_server.map_or(usize::MAX, |m| usize::try_from(m).unwrap_or(usize::MAX));
    Declared {
        name: d.name.clone(),
        index,
        spec: TableSpec { dim: d.dim as usize, opt, init, seed: d.seed, max_rows },
        lr: d.lr_or(o.lr) as f32,
        key_limit: d.key_limit,
        evict: d.evict_idle_steps.map(|idle_steps| Evict { idle_steps, min_touches: d.evict_min_touches }),
        max_keys: d.max_keys as usize,
        // (Validated with the spec.)
        dtype: eps_agg::DType::parse(&d.dtype).unwrap_or(eps_agg::DType::F32),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_declaration_becomes_a_table_with_the_jobs_defaults() {
        let spec = JobSpec::from_toml(
            "[job]\n[model]\ntensors = [{ name = \"w\", elements = 8 }]\n[optimizer]\nkind = \"adam\"\nlr = 0.02\n\
             [[model.tables]]\nname = \"a\"\ndim = 8\n\
             [[model.tables]]\nname = \"b\"\ndim = 2\noptimizer = \"adagrad\"\nlr = 0.5\ninit = \"zeros\"\nkey_limit = 10\n\
             evict_idle_steps = 4\nevict_min_touches = 2\n",
        )
        .unwrap();
        let t = tables(&spec);
        assert_eq!((t[0].index, t[0].lr, t[0].spec.dim, t[0].evict), (0, 0.02, 8, None));
        assert!(matches!(t[0].spec.opt, RowOptimizer::Dense(Optimizer::Adam { decoupled: false, .. })));
        assert_eq!(t[0].row_state_bytes(), 8 * 3 * 4, "values, then Adam's two moments");
        assert_eq!(t[0].spec.max_rows, usize::MAX);
        assert!(t[0].admits(u64::MAX));
        assert_eq!((t[1].index, t[1].lr, t[1].spec.init), (1, 0.5, Init::Zeros));
        assert!(matches!(t[1].spec.opt, RowOptimizer::Adagrad { initial_accumulator, .. } if initial_accumulator == 0.1));
        assert_eq!(t[1].evict, Some(Evict { idle_steps: 4, min_touches: 2 }));
        assert!(t[1].admits(9) && !t[1].admits(10));
    }
}
