//! Row-wise optimizers with lazy state: a row is stepped only when a push
//! touches it, and Adam's bias correction follows the row's own step count
//! (as lazy Adam does for embeddings), not the job's. Adagrad is the sparse
//! tables' own; the others are the dense ones, row by row.

use eps_agg::Optimizer;

/// A sparse table's optimizer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RowOptimizer {
    /// One of the dense optimizers (SGD, momentum, Adam, AdamW), stepped row by
    /// row with `eps-agg`'s element-wise code: the same bits as a dense step.
    /// Adam is lazy: its bias correction follows the row's own step count.
    Dense(Optimizer),
    /// Adagrad: the step of each value shrinks with its summed squared gradients.
    Adagrad {
        /// Denominator epsilon.
        eps: f32,
        /// The accumulator's start value.
        initial_accumulator: f32,
        /// L2 penalty added to the gradient.
        weight_decay: f32,
    },
}

impl RowOptimizer {
    /// f32 state values kept per row value.
    pub fn state_per_value(&self) -> usize {
        match self {
            RowOptimizer::Dense(o) => o.state_per_param(),
            RowOptimizer::Adagrad { .. } => 1,
        }
    }

    /// A new row's state.
    pub fn init_state(&self, state: &mut [f32]) {
        let v = match *self {
            RowOptimizer::Adagrad { initial_accumulator, .. } => initial_accumulator,
            RowOptimizer::Dense(_) => 0.0,
        };
        state.fill(v);
    }

    /// Steps `row` (whose state is `state`, interleaved as in
    /// [`Optimizer::apply`]) with `grad`, the row having been stepped `t`
    /// times before.
    pub fn step(&self, lr: f32, t: u64, row: &mut [f32], grad: &[f32], state: &mut [f32]) {
        match *self {
            RowOptimizer::Dense(o) => o.apply(o.scalars(t, lr.into()), row, grad, state),
            RowOptimizer::Adagrad { eps, weight_decay: wd, .. } => {
                for ((p, g), a) in row.iter_mut().zip(grad).zip(state.iter_mut()) {
                    let g = *g + wd * *p;
                    *a += g * g;
                    *p -= lr * g / (a.sqrt() + eps);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adagrad_steps_shrink_with_the_squared_gradients() {
        let o = RowOptimizer::Adagrad { eps: 0.0, initial_accumulator: 0.0, weight_decay: 0.0 };
        let (mut p, mut s) = ([1.0f32, 1.0], [0.0f32; 2]);
        o.init_state(&mut s);
        o.step(0.5, 0, &mut p, &[2.0, -1.0], &mut s);
        // acc = g^2: each first step moves by lr * sign(g).
        assert_eq!((p, s), ([0.5, 1.5], [4.0, 1.0]));
        o.step(0.5, 1, &mut p, &[2.0, 0.0], &mut s);
        assert_eq!(s, [8.0, 1.0]);
        assert_eq!(p[0], 0.5 - 0.5 * 2.0 / 8f32.sqrt());
        assert_eq!(p[1], 1.5, "no gradient, no step");
    }

    #[test]
    fn lazy_adam_corrects_with_the_rows_own_count() {
        let dense = Optimizer::Adam { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0, decoupled: false };
        let o = RowOptimizer::Dense(dense);
        // A row's first step moves it by about lr whatever the job's step:
        // its bias correction is that of step 1.
        let (mut p, mut s) = ([0.0f32], [0.0f32; 2]);
        o.step(0.01, 0, &mut p, &[3.0], &mut s);
        assert!((p[0] + 0.01).abs() < 1e-6, "{p:?}");
        let (mut q, mut r) = ([0.0f32], [0.0f32; 2]);
        dense.apply(dense.scalars(0, 0.01), &mut q, &[3.0], &mut r);
        assert_eq!((p, s), (q, r), "the same bits as the dense step");
    }
}
