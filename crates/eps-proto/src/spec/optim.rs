//! The job's optimizer and learning-rate schedule: their sections of the
//! spec, and what they become.

use eps_agg::{Decay, LrSchedule, Optimizer};
use serde::Deserialize;

use super::{JobSpec, SpecError, bad};

impl JobSpec {
    /// The optimizer.
    pub fn optimizer(&self) -> Result<Optimizer, SpecError> {
        let o = &self.optimizer;
        if !(o.lr.is_finite() && o.lr > 0.0) {
            return Err(bad("optimizer.lr", "must be a positive number"));
        }
        if !(0.0..1.0).contains(&o.momentum) {
            return Err(bad("optimizer.momentum", "must be in [0, 1)"));
        }
        if !(0.0..1.0).contains(&o.beta1) || !(0.0..1.0).contains(&o.beta2) {
            return Err(bad("optimizer.beta1", "beta1 and beta2 must be in [0, 1)"));
        }
        if o.eps.is_nan() || o.eps <= 0.0 {
            return Err(bad("optimizer.eps", "must be positive"));
        }
        if !(o.weight_decay >= 0.0 && o.weight_decay.is_finite()) {
            return Err(bad("optimizer.weight_decay", "must be a non-negative number"));
        }
        let wd = o.weight_decay;
        Ok(match o.kind.as_str() {
            "none" => Optimizer::Average,
            "sgd" => Optimizer::Sgd { weight_decay: wd },
            "momentum" => Optimizer::Momentum { momentum: o.momentum, nesterov: false, weight_decay: wd },
            "nesterov" => Optimizer::Momentum { momentum: o.momentum, nesterov: true, weight_decay: wd },
            "adam" | "adamw" => {
                Optimizer::Adam { beta1: o.beta1, beta2: o.beta2, eps: o.eps, weight_decay: wd, decoupled: o.kind == "adamw" }
            }
            k => {
                return Err(bad(
                    "optimizer.kind",
                    format!("unknown optimizer {k:?} (none, sgd, momentum, nesterov, adam, adamw)"),
                ));
            }
        })
    }

    /// The learning-rate schedule.
    pub fn schedule(&self) -> Result<LrSchedule, SpecError> {
        let s = &self.lr_schedule;
        let decay = match s.decay.as_str() {
            "constant" => Decay::Constant,
            "step" => {
                if s.step_every == 0 {
                    return Err(bad("lr_schedule.step_every", "must be at least 1"));
                }
                if !(s.gamma > 0.0 && s.gamma <= 1.0) {
                    return Err(bad("lr_schedule.gamma", "must be in (0, 1]"));
                }
                Decay::Step { every: s.step_every, gamma: s.gamma }
            }
            "cosine" => {
                if !(s.min_lr >= 0.0 && s.min_lr <= self.optimizer.lr) {
                    return Err(bad("lr_schedule.min_lr", "must be between 0 and optimizer.lr"));
                }
                Decay::Cosine { total_steps: self.job.steps, min_lr: s.min_lr }
            }
            d => return Err(bad("lr_schedule.decay", format!("unknown decay {d:?} (constant, step, cosine)"))),
        };
        Ok(LrSchedule { base: self.optimizer.lr, warmup_steps: s.warmup_steps, decay })
    }
}

/// `[optimizer]`.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OptimizerSection {
    /// `sgd`, `momentum`, `nesterov`, `adam`, `adamw`, or `none` (servers
    /// average the contributions and publish the average gradient; the
    /// framework applies its own optimizer).
    #[serde(default = "default_opt")]
    pub kind: String,
    /// Base learning rate.
    #[serde(default = "default_lr")]
    pub lr: f64,
    /// Momentum factor.
    #[serde(default = "default_momentum")]
    pub momentum: f32,
    /// Adam beta1.
    #[serde(default = "default_beta1")]
    pub beta1: f32,
    /// Adam beta2.
    #[serde(default = "default_beta2")]
    pub beta2: f32,
    /// Adam epsilon.
    #[serde(default = "default_eps")]
    pub eps: f32,
    /// Weight decay (L2 for sgd/momentum/adam, decoupled for adamw).
    #[serde(default)]
    pub weight_decay: f32,
}

/// `[lr_schedule]`.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScheduleSection {
    /// Linear warm-up steps.
    #[serde(default)]
    pub warmup_steps: u64,
    /// `constant`, `step` or `cosine`.
    #[serde(default = "default_decay")]
    pub decay: String,
    /// `step`: steps between decays.
    #[serde(default = "default_every")]
    pub step_every: u64,
    /// `step`: factor per decay.
    #[serde(default = "default_gamma")]
    pub gamma: f64,
    /// `cosine`: floor of the rate.
    #[serde(default)]
    pub min_lr: f64,
}

fn default_opt() -> String {
    "adam".into()
}
fn default_lr() -> f64 {
    0.01
}
fn default_momentum() -> f32 {
    0.9
}
fn default_beta1() -> f32 {
    0.9
}
fn default_beta2() -> f32 {
    0.999
}
fn default_eps() -> f32 {
    1e-8
}
fn default_decay() -> String {
    "constant".into()
}
fn default_every() -> u64 {
    100
}
fn default_gamma() -> f64 {
    0.5
}

impl Default for OptimizerSection {
    fn default() -> Self {
        toml::from_str("").expect("all optimizer fields have defaults")
    }
}

impl Default for ScheduleSection {
    fn default() -> Self {
        toml::from_str("").expect("all schedule fields have defaults")
    }
}
