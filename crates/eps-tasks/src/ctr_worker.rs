//! The training loop of an `eps worker` process on the click-through task
//! (see `ctr.rs`): each step pulls the rows of its batch's ids from the
//! sparse table, pools the bags, runs the MLP forward and backward, pushes
//! a gradient row per id looked up and the dense gradients. The lowest
//! ranked contributor of the last step evaluates the result on held-out
//! samples: AUC against the teacher's.

use std::time::Instant;

use eps_cluster::jobspec::{CTR_TABLE, TaskSection};
use eps_worker::Worker;

use crate::ctr::{Click, Ctr, auc, key, log_loss};
use crate::worker::{HELD_OUT, HELD_OUT_FIRST, Pace, TrainWorkerError, checksum, done, membership_text, report_progress};
use eps_cluster::report::{self, Report};

/// Held-out samples evaluated per pull.
const EVAL_CHUNK: u64 = 1024;
/// Ids per field whose rows make the table's checksum.
const CHECKED_IDS: u64 = 512;

/// A batch's samples, their table keys (bag by bag, sample by sample) and
/// the MLP's inputs.
struct Batch {
    clicks: Vec<Click>,
    keys: Vec<u64>,
    x: Vec<f32>,
}

impl Batch {
    fn new() -> Self {
        Self { clicks: Vec::new(), keys: Vec::new(), x: Vec::new() }
    }

    /// Samples `range` and their keys.
    fn fill(&mut self, task: &Ctr, range: std::ops::Range<u64>) {
        self.clicks.resize_with((range.end - range.start) as usize, Click::default);
        self.keys.clear();
        for (c, i) in self.clicks.iter_mut().zip(range) {
            task.sample(i, c);
            for (f, bag) in c.bags.iter().enumerate() {
                self.keys.extend(bag.iter().map(|&id| key(f, id)));
            }
        }
    }

    /// Pulls the keys' rows and pools each bag (mean) into the inputs, the
    /// dense features after the bags.
    fn pool<P: eps_fabric::Fabric>(&mut self, w: &mut Worker<P>, table: u16, task: &Ctr) -> Result<(), TrainWorkerError> {
        let (n, k) = (task.input(), task.embed);
        self.x.resize(self.clicks.len() * n, 0.0);
        let rows = w.sparse_pull_rows(table, &self.keys)?;
        let mut at = rows.index.iter();
        for (c, x) in self.clicks.iter().zip(self.x.chunks_exact_mut(n)) {
            for (bag, xf) in c.bags.iter().zip(x.chunks_exact_mut(k)) {
                xf.fill(0.0);
                for _ in bag {
                    let r = rows.row(*at.next().expect("a key per id"));
                    xf.iter_mut().zip(r).for_each(|(a, b)| *a += b);
                }
                xf.iter_mut().for_each(|a| *a /= bag.len() as f32);
            }
            x[task.fields * k..].copy_from_slice(&c.dense);
        }
        Ok(())
    }
}

/// Trains the ctr task; prints `Progress` and `Done` reports as the
/// built-in task does, the evaluating rank's `Done` adding
/// `final_auc`, `teacher_auc` and `sparse_checksum`.
pub fn run<P: eps_fabric::Fabric>(mut w: Worker<P>, pace: Pace) -> Result<(), TrainWorkerError> {
    let spec = w.spec().clone();
    let Some(t) = TaskSection::of(&spec)? else { return Err(TrainWorkerError::NoTask) };
    let task = Ctr::new(&t, spec.job.seed);
    let table = w.table(CTR_TABLE)?;
    let (rank, batch, every) = (w.rank(), spec.job.batch as u64, pace.every.max(1));
    let (n, k) = (task.input(), task.embed);
    let total = w.layout().total as usize;
    let (mut p, mut g) = (vec![0f32; total], vec![0f32; total]);
    let (mut h, mut dx) = (vec![0f32; task.hidden], vec![0f32; n]);
    let mut b = Batch::new();
    let mut sparse_grads = Vec::new();
    let scale = 1.0 / batch as f32;
    let (start, first_step) = (Instant::now(), w.iteration());
    let (mut loss_sum, mut correct, mut seen, mut trained) = (0f64, 0u64, 0u64, 0u64);
    let mut left = false;
    while w.iteration() < spec.job.steps {
        if !w.begin()? {
            left = true;
            break;
        }
        let step = w.iteration();
        let samples = w.samples(batch).ok_or(TrainWorkerError::NoSamples(step))?;
        trained += samples.end - samples.start;
        b.fill(&task, samples);
        b.pool(&mut w, table, &task)?;
        w.read_params(&mut p)?;
        g.fill(0.0);
        sparse_grads.resize(b.keys.len() * k, 0.0);
        let mut at = sparse_grads.chunks_exact_mut(k);
        for (c, x) in b.clicks.iter().zip(b.x.chunks_exact(n)) {
            let z = task.forward(&p, x, &mut h);
            loss_sum += f64::from(log_loss(z, c.label));
            correct += u64::from((z > 0.0) == c.label);
            seen += 1;
            task.backward(&p, x, &h, z, c.label, scale, &mut g, &mut dx);
            // Each id of a bag gets the bag's input gradient over its size.
            for (bag, d) in c.bags.iter().zip(dx.chunks_exact(k)) {
                for _ in bag {
                    let row = at.next().expect("a row per key");
                    row.iter_mut().zip(d).for_each(|(r, v)| *r = v / bag.len() as f32);
                }
            }
        }
        w.write_grads(&g)?;
        w.sparse_push(table, &b.keys, &sparse_grads)?;
        w.push_pull()?;
        if report_progress(&w, step, every, batch, (loss_sum, correct, seen), start) {
            (loss_sum, correct, seen) = (0.0, 0, 0);
        }
    }
    let mut d = done(&w, first_step, left, trained, start.elapsed().as_secs_f64());
    let last = w.iteration().saturating_sub(1);
    if !left && w.membership().contributors(last).first() == Some(&rank) {
        let mut r = evaluate(&mut w, table, &task)?;
        if pace.chunk_digests {
            r.chunk_digests = Some(crate::worker::chunk_digests(&w.params_copy(), spec.job.shard_bytes as usize));
        }
        d.result = Some(r);
    }
    Report::Done(Box::new(d)).print();
    w.finish()?;
    Ok(())
}

/// The held-out figures and checksums.
fn evaluate<P: eps_fabric::Fabric>(w: &mut Worker<P>, table: u16, task: &Ctr) -> Result<report::Evaluation, TrainWorkerError> {
    let mut p = vec![0f32; w.layout().total as usize];
    w.read_params(&mut p)?;
    let (mut student, mut teacher) = (Vec::new(), Vec::new());
    let (mut loss, mut correct, mut teacher_correct) = (0f64, 0u64, 0u64);
    let mut h = vec![0f32; task.hidden];
    let mut b = Batch::new();
    for first in (HELD_OUT_FIRST..HELD_OUT_FIRST + HELD_OUT).step_by(EVAL_CHUNK as usize) {
        b.fill(task, first..first + EVAL_CHUNK);
        b.pool(w, table, task)?;
        for (c, x) in b.clicks.iter().zip(b.x.chunks_exact(task.input())) {
            let z = task.forward(&p, x, &mut h);
            loss += f64::from(log_loss(z, c.label));
            correct += u64::from((z > 0.0) == c.label);
            teacher_correct += u64::from((c.p > 0.5) == c.label);
            student.push((z, c.label));
            teacher.push((c.p, c.label));
        }
    }
    let n = student.len() as f64;
    // The rows of the first ids of every field, as the servers hold them.
    let keys: Vec<u64> = (0..task.fields).flat_map(|f| (0..CHECKED_IDS.min(task.vocab)).map(move |id| key(f, id))).collect();
    let mut rows = vec![0f32; keys.len() * task.embed];
    w.sparse_pull(table, &keys, &mut rows)?;
    Ok(report::Evaluation {
        membership: membership_text(w.membership()),
        final_loss: loss / n,
        final_accuracy: correct as f64 / n,
        teacher_accuracy: teacher_correct as f64 / n,
        final_auc: Some(auc(&mut student)),
        teacher_auc: Some(auc(&mut teacher)),
        params_checksum: checksum(&w.params_copy()),
        sparse_checksum: Some(checksum(bytemuck::cast_slice(&rows))),
        chunk_digests: None,
    })
}
