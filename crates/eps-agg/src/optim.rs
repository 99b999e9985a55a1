//! Optimizers applied on the server, and learning-rate schedules.
//!
//! Every update is element-wise with scalars computed once per step, so it is the
//! same bit pattern for an element whichever shard, thread or server holds it.

/// Learning-rate decay after warm-up.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Decay {
    /// The base rate throughout.
    Constant,
    /// Multiply by `gamma` every `every` steps.
    Step {
        /// Steps between decays.
        every: u64,
        /// Factor per decay.
        gamma: f64,
    },
    /// Cosine from the base rate down to `min_lr` at `total_steps`.
    Cosine {
        /// Step at which the minimum is reached.
        total_steps: u64,
        /// Floor.
        min_lr: f64,
    },
}

/// A learning-rate schedule: linear warm-up, then a decay.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LrSchedule {
    /// Base learning rate.
    pub base: f64,
    /// Linear warm-up steps (0: none).
    pub warmup_steps: u64,
    /// Decay after warm-up.
    pub decay: Decay,
}

impl LrSchedule {
    /// A constant rate.
    pub fn constant(base: f64) -> Self {
        Self { base, warmup_steps: 0, decay: Decay::Constant }
    }

    /// The rate at `step` (0-based).
    pub fn at(&self, step: u64) -> f64 {
        let warm =
            if self.warmup_steps > 0 && step < self.warmup_steps { (step + 1) as f64 / self.warmup_steps as f64 } else { 1.0 };
        let decayed = match self.decay {
            Decay::Constant => self.base,
            Decay::Step { every, gamma } => self.base * gamma.powi((step / every.max(1)) as i32),
            Decay::Cosine { total_steps, min_lr } => {
                let t = (step.min(total_steps) as f64) / (total_steps.max(1) as f64);
                min_lr + 0.5 * (self.base - min_lr) * (1.0 + (std::f64::consts::PI * t).cos())
            }
        };
        decayed * warm
    }
}

/// Optimizer kind and hyper-parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Optimizer {
    /// No optimizer on the server (`kind = "none"`): a step replaces the shard's
    /// values with the averaged gradient, so what workers pull is that average
    /// and their framework applies its own optimizer.
    Average,
    /// Plain SGD with L2 weight decay.
    Sgd {
        /// L2 penalty added to the gradient.
        weight_decay: f32,
    },
    /// SGD with (optionally Nesterov) momentum.
    Momentum {
        /// Momentum factor.
        momentum: f32,
        /// Nesterov's variant.
        nesterov: bool,
        /// L2 penalty added to the gradient.
        weight_decay: f32,
    },
    /// Adam (L2 weight decay added to the gradient) or AdamW (decoupled decay).
    Adam {
        /// First-moment decay.
        beta1: f32,
        /// Second-moment decay.
        beta2: f32,
        /// Denominator epsilon.
        eps: f32,
        /// Weight decay.
        weight_decay: f32,
        /// Decoupled (AdamW) instead of L2.
        decoupled: bool,
    },
}

impl Optimizer {
    /// f32 state values kept per parameter.
    pub fn state_per_param(&self) -> usize {
        match self {
            Optimizer::Average | Optimizer::Sgd { .. } => 0,
            Optimizer::Momentum { .. } => 1,
            Optimizer::Adam { .. } => 2,
        }
    }

    /// Short name.
    pub fn name(&self) -> &'static str {
        match self {
            Optimizer::Average => "none",
            Optimizer::Sgd { .. } => "sgd",
            Optimizer::Momentum { nesterov: false, .. } => "momentum",
            Optimizer::Momentum { nesterov: true, .. } => "nesterov",
            Optimizer::Adam { decoupled: false, .. } => "adam",
            Optimizer::Adam { decoupled: true, .. } => "adamw",
        }
    }

    /// Scalars of one step (0-based `step`, learning rate `lr`).
    pub fn scalars(&self, step: u64, lr: f64) -> StepScalars {
        let t = (step + 1) as i32;
        let (bc1, bc2) = match self {
            Optimizer::Adam { beta1, beta2, .. } => (1.0 - (*beta1 as f64).powi(t), 1.0 - (*beta2 as f64).powi(t)),
            _ => (1.0, 1.0),
        };
        StepScalars { lr: lr as f32, bc1: bc1 as f32, bc2_sqrt: bc2.sqrt() as f32 }
    }

    /// Applies one step to `params` given the averaged gradient `grad`; `state` holds
    /// [`Optimizer::state_per_param`] values per parameter, interleaved
    /// (`state[k*i..k*i+k]` belongs to parameter `i`), so any sub-range of
    /// parameters has a contiguous sub-range of state and can be stepped on its own.
    pub fn apply(&self, s: StepScalars, params: &mut [f32], grad: &[f32], state: &mut [f32]) {
        let n = params.len();
        assert_eq!(grad.len(), n, "gradient length");
        assert_eq!(state.len(), n * self.state_per_param(), "optimizer state length");
        let lr = s.lr;
        match *self {
            Optimizer::Average => params.copy_from_slice(grad),
            Optimizer::Sgd { weight_decay: wd } => {
                for (p, g) in params.iter_mut().zip(grad) {
                    let g = *g + wd * *p;
                    *p -= lr * g;
                }
            }
            Optimizer::Momentum { momentum: mu, nesterov, weight_decay: wd } => {
                for ((p, g), b) in params.iter_mut().zip(grad).zip(state.iter_mut()) {
                    let g = *g + wd * *p;
                    *b = mu * *b + g;
                    let upd = if nesterov { g + mu * *b } else { *b };
                    *p -= lr * upd;
                }
            }
            Optimizer::Adam { beta1, beta2, eps, weight_decay: wd, decoupled } => {
                // Bias corrections folded into the step size and epsilon:
                // p -= lr * (m / bc1) / (sqrt(v) / sqrt(bc2) + eps)
                let step = lr / s.bc1;
                let (one_b1, one_b2) = (1.0 - beta1, 1.0 - beta2);
                let decay = 1.0 - lr * wd;
                for ((p, g), mv) in params.iter_mut().zip(grad).zip(state.chunks_exact_mut(2)) {
                    let g = if decoupled { *g } else { *g + wd * *p };
                    if decoupled {
                        *p *= decay;
                    }
                    let m = beta1 * mv[0] + one_b1 * g;
                    let v = beta2 * mv[1] + one_b2 * g * g;
                    mv[0] = m;
                    mv[1] = v;
                    *p -= step * m / (v.sqrt() / s.bc2_sqrt + eps);
                }
            }
        }
    }
}

/// Per-step scalars shared by every element of every shard.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepScalars {
    /// Learning rate of the step.
    pub lr: f32,
    /// Adam: 1 - beta1^t.
    pub bc1: f32,
    /// Adam: sqrt(1 - beta2^t).
    pub bc2_sqrt: f32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedules() {
        let c = LrSchedule::constant(0.1);
        assert_eq!(c.at(0), 0.1);
        let w = LrSchedule { base: 1.0, warmup_steps: 4, decay: Decay::Constant };
        assert_eq!([w.at(0), w.at(1), w.at(3), w.at(10)], [0.25, 0.5, 1.0, 1.0]);
        let s = LrSchedule { base: 1.0, warmup_steps: 0, decay: Decay::Step { every: 10, gamma: 0.5 } };
        assert_eq!([s.at(9), s.at(10), s.at(25)], [1.0, 0.5, 0.25]);
        let k = LrSchedule { base: 1.0, warmup_steps: 0, decay: Decay::Cosine { total_steps: 100, min_lr: 0.0 } };
        assert!(
            (k.at(0) - 1.0).abs() < 1e-12 && (k.at(50) - 0.5).abs() < 1e-12 && k.at(100).abs() < 1e-12 && k.at(500).abs() < 1e-12
        );
    }

    /// Each optimizer against a straightforward f64 transcription of its textbook
    /// definition, over several steps.
    #[test]
    fn optimizers_match_f64_definitions() {
        let opts = [
            Optimizer::Average,
            Optimizer::Sgd { weight_decay: 0.01 },
            Optimizer::Momentum { momentum: 0.9, nesterov: false, weight_decay: 0.01 },
            Optimizer::Momentum { momentum: 0.9, nesterov: true, weight_decay: 0.0 },
            Optimizer::Adam { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01, decoupled: false },
            Optimizer::Adam { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.1, decoupled: true },
        ];
        for o in opts {
            let n = 33;
            let mut p: Vec<f32> = (0..n).map(|i| (i as f32 - 16.0) / 10.0).collect();
            let mut st = vec![0f32; n * o.state_per_param()];
            let mut rp: Vec<f64> = p.iter().map(|&x| x as f64).collect();
            let (mut m, mut v) = (vec![0f64; n], vec![0f64; n]);
            let lr = 0.05;
            for step in 0..5u64 {
                let g: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37 + step as f32).sin()).collect();
                o.apply(o.scalars(step, lr), &mut p, &g, &mut st);
                for i in 0..n {
                    let gi = g[i] as f64;
                    match o {
                        Optimizer::Average => rp[i] = gi,
                        Optimizer::Sgd { weight_decay: wd } => rp[i] -= lr * (gi + wd as f64 * rp[i]),
                        Optimizer::Momentum { momentum: mu, nesterov, weight_decay: wd } => {
                            let gg = gi + wd as f64 * rp[i];
                            m[i] = mu as f64 * m[i] + gg;
                            rp[i] -= lr * if nesterov { gg + mu as f64 * m[i] } else { m[i] };
                        }
                        Optimizer::Adam { beta1, beta2, eps, weight_decay: wd, decoupled } => {
                            let (b1, b2) = (beta1 as f64, beta2 as f64);
                            let gg = if decoupled { gi } else { gi + wd as f64 * rp[i] };
                            if decoupled {
                                rp[i] *= 1.0 - lr * wd as f64;
                            }
                            m[i] = b1 * m[i] + (1.0 - b1) * gg;
                            v[i] = b2 * v[i] + (1.0 - b2) * gg * gg;
                            let t = step as i32 + 1;
                            let (mh, vh) = (m[i] / (1.0 - b1.powi(t)), v[i] / (1.0 - b2.powi(t)));
                            rp[i] -= lr * mh / (vh.sqrt() + eps as f64);
                        }
                    }
                }
            }
            for i in 0..n {
                let err = (p[i] as f64 - rp[i]).abs() / rp[i].abs().max(1e-3);
                assert!(err < 1e-4, "{} element {i}: {} vs {}", o.name(), p[i], rp[i]);
            }
        }
    }
}
