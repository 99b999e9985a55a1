//! The click-through task of `eps train --model ctr`: a synthetic click log
//! with a known teacher, and a student of embedding bags (a sparse table)
//! and an MLP (dense tensors).
//!
//! A sample has `fields` categorical fields, each a bag of 1 to `max_bag`
//! ids drawn zipf(`zipf`) from `vocab` ids, and `dense_dim` dense features
//! (unit variance). The teacher gives each (field, id) a weight and each
//! dense feature one; its click probability is the sigmoid of the bags'
//! mean weights plus the dense part plus a bias, and the label is drawn from
//! it. The student pools each bag's embedding rows (mean), concatenates them
//! with the dense features and scores them with an MLP of one hidden ReLU
//! layer; the reachable AUC is the teacher's own on the same samples. All of
//! it is a pure function of the job's seed and the sample's index.

use eps_cluster::jobspec::TaskSection;
use eps_proto::init::{mix, unit};
use eps_sparse::zipf::Zipf;

/// Bias of the teacher's logit (a click rate near 0.4).
const TEACHER_BIAS: f32 = -0.4;
/// Scale of the teacher's id weights.
const ID_SCALE: f32 = 1.5;
/// Scale of the teacher's dense weights.
const DENSE_SCALE: f32 = 0.4;

/// One sample.
#[derive(Clone, Debug, Default)]
pub struct Click {
    /// Dense features.
    pub dense: Vec<f32>,
    /// Per field, the bag's ids.
    pub bags: Vec<Vec<u64>>,
    /// Clicked.
    pub label: bool,
    /// The teacher's click probability.
    pub p: f32,
}

/// The task's shape and seed.
#[derive(Clone, Debug)]
pub struct Ctr {
    /// Fields per sample.
    pub fields: usize,
    /// Ids per field.
    pub vocab: u64,
    /// Most ids of a bag.
    pub max_bag: u64,
    /// Zipf exponent of ids.
    pub zipf: f64,
    /// Embedding row values.
    pub embed: usize,
    /// Dense features.
    pub dense: usize,
    /// Hidden units.
    pub hidden: usize,
    seed: u64,
}

/// The key of `id` of field `field` in the table.
pub fn key(field: usize, id: u64) -> u64 {
    ((field as u64) << 40) | id
}

impl Ctr {
    /// The task of a `preset = "ctr"` model.
    pub fn new(m: &TaskSection, seed: u64) -> Self {
        Self {
            fields: m.fields as usize,
            vocab: m.vocab,
            max_bag: m.max_bag.into(),
            zipf: m.zipf,
            embed: m.embed_dim as usize,
            dense: m.dense_dim as usize,
            hidden: m.hidden as usize,
            seed,
        }
    }

    /// Inputs of the MLP: the pooled bags, then the dense features.
    pub fn input(&self) -> usize {
        self.fields * self.embed + self.dense
    }

    /// Sample `i`.
    pub fn sample(&self, i: u64, s: &mut Click) {
        let h = mix(self.seed ^ mix(i ^ 0xc1c4));
        s.dense.resize(self.dense, 0.0);
        let mut logit = TEACHER_BIAS;
        for (j, x) in s.dense.iter_mut().enumerate() {
            *x = unit(mix(h ^ j as u64)) * 3f32.sqrt();
            logit += DENSE_SCALE * unit(mix(self.seed ^ 0xd0 ^ (j as u64) << 8)) * *x;
        }
        s.bags.resize_with(self.fields, Vec::new);
        for (f, bag) in s.bags.iter_mut().enumerate() {
            let hf = mix(h ^ (f as u64 + 1) << 32);
            let mut ids = Zipf::new(self.vocab, self.zipf, hf).expect("a validated ctr spec");
            bag.clear();
            bag.extend((0..1 + hf % self.max_bag).map(|_| ids.next_id()));
            let w: f32 = bag.iter().map(|&id| self.teacher_weight(f, id)).sum();
            logit += w / bag.len() as f32;
        }
        s.p = sigmoid(logit);
        s.label = ((mix(h ^ 0x1abe1) >> 40) as f32 / (1u64 << 24) as f32) < s.p;
    }

    /// The teacher's weight of `id` in field `field`.
    fn teacher_weight(&self, field: usize, id: u64) -> f32 {
        ID_SCALE * unit(mix(self.seed ^ mix(key(field, id) ^ 0x7eac)))
    }

    /// The student's logit for inputs `x`; `h` gets the hidden activations.
    /// `p` is the flat parameter vector: w1 (hidden x input), b1, w2, b2.
    pub fn forward(&self, p: &[f32], x: &[f32], h: &mut [f32]) -> f32 {
        let (n, hid) = (self.input(), self.hidden);
        let (w1, rest) = p.split_at(hid * n);
        let (b1, rest) = rest.split_at(hid);
        let (w2, b2) = rest.split_at(hid);
        let mut z = b2[0];
        for (k, hk) in h.iter_mut().enumerate() {
            let a = b1[k] + w1[k * n..(k + 1) * n].iter().zip(x).map(|(w, v)| w * v).sum::<f32>();
            *hk = a.max(0.0);
            z += w2[k] * *hk;
        }
        z
    }

    /// Adds `scale` times the gradient of the log loss at logit `z` (label
    /// `y`) to `g`, and writes the gradient with respect to `x` into `dx`.
    #[allow(clippy::too_many_arguments)]
    pub fn backward(&self, p: &[f32], x: &[f32], h: &[f32], z: f32, y: bool, scale: f32, g: &mut [f32], dx: &mut [f32]) {
        let (n, hid) = (self.input(), self.hidden);
        let dz = (sigmoid(z) - if y { 1.0 } else { 0.0 }) * scale;
        let w2 = &p[hid * n + hid..hid * n + 2 * hid];
        dx.fill(0.0);
        let (gw1, rest) = g.split_at_mut(hid * n);
        let (gb1, rest) = rest.split_at_mut(hid);
        let (gw2, gb2) = rest.split_at_mut(hid);
        gb2[0] += dz;
        for k in 0..hid {
            gw2[k] += dz * h[k];
            if h[k] <= 0.0 {
                continue;
            }
            let da = dz * w2[k];
            gb1[k] += da;
            let w1 = &p[k * n..(k + 1) * n];
            for ((gw, d), (w, v)) in gw1[k * n..(k + 1) * n].iter_mut().zip(dx.iter_mut()).zip(w1.iter().zip(x)) {
                *gw += da * v;
                *d += da * w;
            }
        }
    }
}

/// The logistic function.
pub fn sigmoid(z: f32) -> f32 {
    1.0 / (1.0 + (-z).exp())
}

/// The log loss of logit `z` for label `y`.
pub fn log_loss(z: f32, y: bool) -> f32 {
    // log(1 + e^-|z|) + max(z, 0) - y z, stable for any z.
    (-z.abs()).exp().ln_1p() + z.max(0.0) - if y { z } else { 0.0 }
}

/// The area under the ROC curve of `scores` (score, clicked): the chance a
/// clicked sample scores above an unclicked one, ties counting a half.
pub fn auc(scores: &mut [(f32, bool)]) -> f64 {
    scores.sort_by(|a, b| a.0.total_cmp(&b.0));
    let (mut rank_sum, mut pos) = (0f64, 0u64);
    let mut i = 0;
    while i < scores.len() {
        let mut j = i;
        while j < scores.len() && scores[j].0 == scores[i].0 {
            j += 1;
        }
        // Ranks i+1..=j share their mean.
        let mean = (i + 1 + j) as f64 / 2.0;
        for s in &scores[i..j] {
            if s.1 {
                rank_sum += mean;
                pos += 1;
            }
        }
        i = j;
    }
    let neg = scores.len() as u64 - pos;
    if pos == 0 || neg == 0 {
        return 0.5;
    }
    (rank_sum - (pos * (pos + 1)) as f64 / 2.0) / (pos * neg) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task() -> Ctr {
        let m = TaskSection { fields: 3, vocab: 100, dense_dim: 4, embed_dim: 2, hidden: 5, ..TaskSection::defaults("ctr") };
        Ctr::new(&m, 9)
    }

    #[test]
    fn auc_counts_ordered_pairs_and_ties() {
        assert_eq!(auc(&mut [(0.1, false), (0.4, true), (0.35, false), (0.8, true)]), 1.0);
        assert_eq!(auc(&mut [(0.9, false), (0.1, true)]), 0.0);
        assert_eq!(auc(&mut [(0.5, false), (0.5, true)]), 0.5);
        assert_eq!(auc(&mut [(0.2, true), (0.3, false), (0.4, true)]), 0.5);
    }

    #[test]
    fn samples_are_deterministic_and_follow_the_teacher() {
        let t = task();
        let (mut a, mut b) = (Click::default(), Click::default());
        t.sample(7, &mut a);
        t.sample(7, &mut b);
        assert_eq!((a.dense.clone(), a.bags.clone(), a.label), (b.dense, b.bags, b.label));
        assert_eq!(a.bags.len(), 3);
        assert!(a.bags.iter().all(|bag| (1..=3).contains(&bag.len()) && bag.iter().all(|&id| id < 100)));
        let (mut clicks, mut p) = (0.0, 0.0);
        for i in 0..20_000 {
            t.sample(i, &mut a);
            clicks += f64::from(u8::from(a.label));
            p += f64::from(a.p);
        }
        assert!((clicks - p).abs() / 20_000.0 < 0.01, "labels follow the teacher: {clicks} clicks, {p:.0} expected");
    }

    #[test]
    fn the_gradient_matches_finite_differences() {
        let t = task();
        let n = t.input() * t.hidden + 2 * t.hidden + 1;
        let p: Vec<f32> = (0..n as u64).map(|i| 0.5 * unit(mix(i))).collect();
        let x: Vec<f32> = (0..t.input() as u64).map(|i| unit(mix(i ^ 99))).collect();
        let mut h = vec![0f32; t.hidden];
        let z = t.forward(&p, &x, &mut h);
        let (mut g, mut dx) = (vec![0f32; n], vec![0f32; t.input()]);
        t.backward(&p, &x, &h, z, true, 1.0, &mut g, &mut dx);
        let loss = |p: &[f32], x: &[f32]| {
            let mut h = vec![0f32; t.hidden];
            f64::from(log_loss(t.forward(p, x, &mut h), true))
        };
        for i in [0, 7, n - t.hidden - 2, n - 1] {
            let (mut hi, mut lo) = (p.clone(), p.clone());
            hi[i] += 1e-2;
            lo[i] -= 1e-2;
            let num = (loss(&hi, &x) - loss(&lo, &x)) / 2e-2;
            assert!((num - f64::from(g[i])).abs() < 2e-3, "parameter {i}: {num} vs {}", g[i]);
        }
        for i in [0, t.input() - 1] {
            let (mut hi, mut lo) = (x.clone(), x.clone());
            hi[i] += 1e-2;
            lo[i] -= 1e-2;
            let num = (loss(&p, &hi) - loss(&p, &lo)) / 2e-2;
            assert!((num - f64::from(dx[i])).abs() < 2e-3, "input {i}: {num} vs {}", dx[i]);
        }
    }
}
