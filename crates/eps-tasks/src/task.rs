//! The built-in training task: a synthetic classification problem with a known
//! teacher, generated deterministically from the job seed.
//!
//! A sample has `dense_dim` dense features (unit variance) and `sparse_per_sample`
//! sparse ids drawn from `vocab` raw ids. The teacher scores each class with a dense
//! linear map plus a per-id sparse weight; the label is the teacher's argmax, replaced
//! by a uniformly random class with probability [`LABEL_NOISE`]. The student is a
//! linear softmax classifier over the dense features plus a hashed embedding of the
//! sparse ids (`buckets` rows of `classes` weights), so the reachable accuracy is
//! known: the teacher's own accuracy on the noisy labels.

use eps_cluster::jobspec::TaskSection;
use eps_proto::init::{mix, unit};

/// Probability that a label is replaced by a random class.
pub const LABEL_NOISE: f64 = 0.05;
/// Scale of the teacher's sparse weights relative to its dense ones.
const SPARSE_SCALE: f32 = 0.25;
/// Scale of the teacher's dense weights (keeps its logits near unit scale).
const DENSE_SCALE: f32 = 0.33;

/// One sample.
#[derive(Clone, Debug, Default)]
pub struct Sample {
    /// Dense features.
    pub dense: Vec<f32>,
    /// Raw sparse ids.
    pub ids: Vec<u64>,
    /// Label.
    pub label: usize,
}

/// The task's shape and seed.
#[derive(Clone, Debug)]
pub struct Task {
    /// Dense features.
    pub dense_dim: usize,
    /// Classes.
    pub classes: usize,
    /// Embedding rows.
    pub buckets: u64,
    /// Sparse ids per sample.
    pub per_sample: usize,
    /// Raw id vocabulary.
    pub vocab: u64,
    /// Seed.
    pub seed: u64,
    /// The teacher's dense weights, classes x dense_dim.
    teacher: Vec<f32>,
}

/// Offsets of the student's tensors in the flat parameter space.
#[derive(Clone, Copy, Debug)]
pub struct Params {
    /// `dense.weight`: classes x dense_dim, row-major.
    pub w: usize,
    /// `dense.bias`: classes.
    pub b: usize,
    /// `sparse.embedding`: buckets x classes, row-major.
    pub e: usize,
}

impl Task {
    /// From the spec's model section.
    pub fn new(m: &TaskSection, seed: u64) -> Self {
        let (classes, dense_dim) = (m.classes as usize, m.dense_dim as usize);
        let teacher = (0..classes * dense_dim).map(|k| DENSE_SCALE * unit(mix(seed ^ 0x7EAC_0000 ^ mix(k as u64)))).collect();
        Self { dense_dim, classes, buckets: m.buckets, per_sample: m.sparse_per_sample as usize, vocab: m.vocab, seed, teacher }
    }

    /// Layout of the student in the order `JobSpec::tensors` declares.
    pub fn params(&self) -> Params {
        let w = 0;
        let b = self.classes * self.dense_dim;
        Params { w, b, e: b + self.classes }
    }

    fn teacher_sparse(&self, id: u64, c: usize) -> f32 {
        SPARSE_SCALE * unit(mix(self.seed ^ 0x5BA5_0000 ^ mix(id * 1021 + c as u64)))
    }

    /// The embedding row a raw id hashes to.
    pub fn bucket(&self, id: u64) -> usize {
        (mix(id ^ 0x00B0_C4E7) % self.buckets) as usize
    }

    /// Sample `i` (deterministic), written into `s`. Returns the teacher's own
    /// prediction (before label noise).
    pub fn sample(&self, i: u64, s: &mut Sample) -> usize {
        let h = mix(self.seed ^ mix(i ^ 0xDA7A));
        s.dense.resize(self.dense_dim, 0.0);
        for (j, x) in s.dense.iter_mut().enumerate() {
            // Uniform with unit variance.
            *x = 1.732_050_8 * unit(mix(h ^ (j as u64 + 1)));
        }
        s.ids.clear();
        for k in 0..self.per_sample {
            s.ids.push(mix(h ^ (0x1D5 + k as u64)) % self.vocab);
        }
        let mut best = (f32::MIN, 0);
        for c in 0..self.classes {
            let row = &self.teacher[c * self.dense_dim..(c + 1) * self.dense_dim];
            let mut z: f32 = row.iter().zip(&s.dense).map(|(w, x)| w * x).sum();
            z += s.ids.iter().map(|&id| self.teacher_sparse(id, c)).sum::<f32>();
            if z > best.0 {
                best = (z, c);
            }
        }
        let noise = mix(h ^ 0x0415E);
        s.label = if (noise >> 11) as f64 / (1u64 << 53) as f64 <= LABEL_NOISE {
            (mix(noise) % self.classes as u64) as usize
        } else {
            best.1
        };
        best.1
    }

    /// Student logits for `s` under parameters `p`.
    pub fn logits(&self, p: &[f32], s: &Sample, out: &mut [f32]) {
        let o = self.params();
        for (c, z) in out.iter_mut().enumerate().take(self.classes) {
            let row = &p[o.w + c * self.dense_dim..o.w + (c + 1) * self.dense_dim];
            *z = p[o.b + c] + row.iter().zip(&s.dense).map(|(w, x)| w * x).sum::<f32>();
        }
        for &id in &s.ids {
            let r = o.e + self.bucket(id) * self.classes;
            for (z, e) in out.iter_mut().zip(&p[r..r + self.classes]) {
                *z += e;
            }
        }
    }

    /// Adds the cross-entropy gradient of one sample (scaled by `scale`) into `g`;
    /// returns (loss, correct).
    pub fn backward(&self, p: &[f32], s: &Sample, scale: f32, g: &mut [f32], z: &mut [f32]) -> (f32, bool) {
        self.logits(p, s, z);
        let z = &mut z[..self.classes];
        let m = z.iter().copied().fold(f32::MIN, f32::max);
        let mut sum = 0f32;
        for v in z.iter_mut() {
            *v = (*v - m).exp();
            sum += *v;
        }
        let argmax = z.iter().enumerate().fold((0, f32::MIN), |b, (i, &v)| if v > b.1 { (i, v) } else { b }).0;
        let loss = -(z[s.label] / sum).max(1e-30).ln();
        let o = self.params();
        for c in 0..self.classes {
            let d = scale * (z[c] / sum - if c == s.label { 1.0 } else { 0.0 });
            g[o.b + c] += d;
            let row = &mut g[o.w + c * self.dense_dim..o.w + (c + 1) * self.dense_dim];
            for (gw, x) in row.iter_mut().zip(&s.dense) {
                *gw += d * x;
            }
            for &id in &s.ids {
                g[o.e + self.bucket(id) * self.classes + c] += d;
            }
        }
        (loss, argmax == s.label)
    }

    /// Cross-entropy loss of the student on one sample.
    pub fn loss(&self, p: &[f32], s: &Sample, z: &mut [f32]) -> f32 {
        self.logits(p, s, z);
        let z = &z[..self.classes];
        let m = z.iter().copied().fold(f32::MIN, f32::max);
        let lse = m + z.iter().map(|v| (v - m).exp()).sum::<f32>().ln();
        lse - z[s.label]
    }

    /// Accuracy of the student (`p`) and of the teacher on `n` held-out samples
    /// (indices from `first`).
    pub fn evaluate(&self, p: &[f32], first: u64, n: u64) -> (f64, f64) {
        let (mut s, mut z) = (Sample::default(), vec![0f32; self.classes]);
        let (mut student, mut teacher) = (0u64, 0u64);
        for i in first..first + n {
            let t = self.sample(i, &mut s);
            self.logits(p, &s, &mut z);
            let pred = z.iter().enumerate().fold((0, f32::MIN), |b, (i, &v)| if v > b.1 { (i, v) } else { b }).0;
            student += (pred == s.label) as u64;
            teacher += (t == s.label) as u64;
        }
        (student as f64 / n as f64, teacher as f64 / n as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task() -> Task {
        let m = TaskSection { buckets: 4096, dense_dim: 16, classes: 4, vocab: 500, ..TaskSection::defaults("synthetic") };
        Task::new(&m, 3)
    }

    #[test]
    fn samples_are_deterministic_and_teacher_is_near_the_noise_ceiling() {
        let t = task();
        let (mut a, mut b) = (Sample::default(), Sample::default());
        t.sample(42, &mut a);
        t.sample(42, &mut b);
        assert_eq!((a.dense.clone(), a.ids.clone(), a.label), (b.dense, b.ids, b.label));
        let p = vec![0f32; t.params().e + 4096 * 4];
        let (_, teacher) = t.evaluate(&p, 0, 20_000);
        let ceiling = 1.0 - LABEL_NOISE * 3.0 / 4.0;
        assert!((teacher - ceiling).abs() < 0.01, "teacher {teacher} vs {ceiling}");
    }

    #[test]
    fn gradient_matches_finite_differences() {
        let t = task();
        let n = t.params().e + 4096 * 4;
        let p: Vec<f32> = (0..n as u64).map(|i| eps_proto::init::param(9, i) * 10.0).collect();
        let mut s = Sample::default();
        t.sample(7, &mut s);
        let mut g = vec![0f32; n];
        let mut z = vec![0f32; 4];
        t.backward(&p, &s, 1.0, &mut g, &mut z);
        let idx = [t.params().w + 3, t.params().b + 1, t.params().e + t.bucket(s.ids[0]) * 4 + 2];
        for &i in &idx {
            let mut q = p.clone();
            let h = 1e-2;
            q[i] += h;
            let lp = t.backward(&q, &s, 0.0, &mut vec![0f32; n], &mut z).0;
            q[i] -= 2.0 * h;
            let lm = t.backward(&q, &s, 0.0, &mut vec![0f32; n], &mut z).0;
            let fd = (lp - lm) / (2.0 * h);
            assert!((fd - g[i]).abs() < 2e-2, "param {i}: fd {fd} vs {}", g[i]);
        }
    }
}

#[cfg(test)]
mod learnable {
    use super::*;

    /// The task is learnable by the student architecture: a single-process Adam
    /// run on a small instance gets most of the way to the teacher.
    #[test]
    fn a_small_instance_learns_towards_the_teacher() {
        let m = TaskSection { buckets: 1 << 12, dense_dim: 16, classes: 4, vocab: 200, ..TaskSection::defaults("synthetic") };
        let t = Task::new(&m, 1);
        let n = t.params().e + (1 << 12) * t.classes;
        let mut p: Vec<f32> = (0..n as u64).map(|i| eps_proto::init::param(1, i)).collect();
        let opt = eps_agg::Optimizer::Adam { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0, decoupled: false };
        let (mut st, mut g) = (vec![0f32; 2 * n], vec![0f32; n]);
        let (mut s, mut z) = (Sample::default(), vec![0f32; t.classes]);
        let (before, _) = t.evaluate(&p, 1 << 50, 2000);
        let batch = 128u64;
        for step in 0..150u64 {
            g.fill(0.0);
            for b in 0..batch {
                t.sample(step * batch + b, &mut s);
                t.backward(&p, &s, 1.0 / batch as f32, &mut g, &mut z);
            }
            opt.apply(opt.scalars(step, 0.02), &mut p, &g, &mut st);
        }
        let (after, teacher) = t.evaluate(&p, 1 << 50, 2000);
        assert!(before < 0.5, "untrained accuracy {before}");
        assert!(after > 0.85 && after <= teacher + 0.02, "trained {after}, teacher {teacher}");
    }
}
