//! Checkpoints on a server: every shard is saved when it publishes a checkpoint
//! version (a multiple of `job.checkpoint_every`, or a version the control plane
//! ordered). The event loop copies the shard's master values and optimizer state
//! between two updates (the only pause training sees); a thread of its own
//! writes the piece and reports it to the control plane, which writes the
//! manifest once the pieces cover the parameters. At start, a resumed job's
//! shards are filled from the checkpoint's pieces, whatever shards they were
//! cut into when it was taken.

use std::path::{Path, PathBuf};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::thread::JoinHandle;

use eps_control_client::ControlClient;
use eps_control_client::checkpoint::{read_piece, write_piece};
use eps_fabric::Fabric;
use eps_proto::checkpoint::{Manifest, PieceHeader, dir_name, piece_name};
use eps_proto::control::ControlMsg;

use crate::rows_checkpoint::{RowsPiece, RowsSaves, Written, write_rows};
use crate::{Server, ServerConfig, ServerError};

/// Copies waiting for the writer at most (training waits beyond that).
const QUEUE: usize = 4;

/// One shard's copy on its way to disk, or a miss to report.
pub(crate) struct Piece {
    pub(crate) version: u64,
    /// SSP/ASP: the updates the shard had applied (0 in BSP).
    pub(crate) updates: u64,
    pub(crate) shard: u32,
    pub(crate) start: u64,
    pub(crate) len: u64,
    pub(crate) state_k: u32,
    pub(crate) dir: PathBuf,
    /// Master values then state; `None`: the shard had passed `version`.
    pub(crate) values: Option<Vec<f32>>,
}

/// What the writer thread writes.
pub(crate) enum Save {
    Shard(Piece),
    Rows(RowsPiece),
}

/// The checkpoints a server saves, and its writer thread.
pub(crate) struct Saver {
    /// `job.checkpoint_every` and `job.checkpoint_dir`.
    periodic: Option<(u64, PathBuf)>,
    steps: u64,
    /// Versions the control plane ordered, with their directories.
    pub(crate) ordered: Vec<(u64, PathBuf)>,
    /// SSP/ASP cuts (`cut.rs`): the iteration the job resumed at.
    pub(crate) start: u64,
    /// SSP/ASP, by shard: the last cut saved or passed.
    pub(crate) cuts: std::collections::HashMap<u32, u64>,
    /// SSP/ASP, by shard: contributions (worker, iteration) of the cut's
    /// iteration or later, held back until the shard is saved.
    pub(crate) held: std::collections::HashMap<u32, Vec<(u32, u64)>>,
    /// What the saves of sparse tables remember.
    pub(crate) rows: RowsSaves,
    tx: Option<SyncSender<Save>>,
    writer: Option<JoinHandle<()>>,
}

impl Saver {
    /// Starts the writer thread (with its own control-plane connection).
    pub(crate) fn start(cfg: &ServerConfig, rank: u32, spec: &eps_proto::JobSpec) -> Result<Self, ServerError> {
        let periodic = match (spec.job.checkpoint_every, &spec.job.checkpoint_dir) {
            (n, Some(d)) if n > 0 => Some((n, PathBuf::from(d))),
            _ => None,
        };
        let ctl = ControlClient::connect(cfg.control.clone(), &cfg.secret, cfg.accept_timeout)?;
        let (tx, rx) = sync_channel(QUEUE);
        let rows = RowsSaves::default();
        let written = rows.written.clone();
        let writer = std::thread::Builder::new()
            .name("eps-checkpoint".into())
            .spawn(move || write_pieces(rank, rx, ctl, written))
            .map_err(|_| ServerError::Unexpected)?;
        Ok(Self {
            periodic,
            steps: spec.job.steps,
            ordered: Vec::new(),
            start: spec.resume.as_ref().map_or(0, |r| r.iteration),
            cuts: Default::default(),
            held: Default::default(),
            rows,
            tx: Some(tx),
            writer: Some(writer),
        })
    }

    /// SSP/ASP: the first checkpoint iteration after `after`.
    pub(crate) fn next_cut(&self, after: u64) -> Option<u64> {
        let periodic = self.periodic.as_ref().map(|(n, _)| (after / n + 1) * n).filter(|&t| t < self.steps);
        let ordered = self.ordered.iter().map(|(t, _)| *t).filter(|&t| t > after).min();
        periodic.into_iter().chain(ordered).min()
    }

    /// The directories version `v` is saved into.
    pub(crate) fn due(&self, v: u64) -> Vec<PathBuf> {
        let mut dirs: Vec<PathBuf> = self.ordered.iter().filter(|(o, _)| *o == v).map(|(_, d)| d.clone()).collect();
        if let Some((n, d)) = &self.periodic
            && v % n == 0
            && v < self.steps
            && !dirs.contains(d)
        {
            dirs.push(d.clone());
        }
        dirs
    }

    /// The job's own checkpoint directory (`job.checkpoint_dir`, when it
    /// checkpoints periodically).
    pub(crate) fn own_dir(&self) -> Option<&Path> {
        self.periodic.as_ref().map(|(_, d)| d.as_path())
    }

    pub(crate) fn send(&self, p: Piece) {
        self.queue(Save::Shard(p));
    }

    pub(crate) fn send_rows(&self, p: RowsPiece) {
        self.queue(Save::Rows(p));
    }

    fn queue(&self, s: Save) {
        if let Some(tx) = &self.tx {
            // The writer only stops when the server does.
            let _ = tx.send(s);
        }
    }

    /// Waits until every piece queued is written and reported.
    pub(crate) fn finish(&mut self) {
        self.tx = None;
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
    }
}

impl Drop for Saver {
    fn drop(&mut self) {
        self.finish();
    }
}

fn write_pieces(rank: u32, rx: Receiver<Save>, mut ctl: ControlClient, written: Written) {
    for s in rx {
        let p = match s {
            Save::Shard(p) => p,
            Save::Rows(p) => {
                write_rows(rank, p, &written, &mut ctl);
                continue;
            }
        };
        let path = p.dir.join(dir_name(p.version)).join(piece_name(p.shard, rank));
        let file = path.display().to_string();
        let (sha256, missed) = match &p.values {
            None => (String::new(), true),
            Some(values) => {
                let h = PieceHeader { version: p.version, start: p.start, len: p.len, state_k: p.state_k, updates: p.updates };
                match write_piece(&path, &h, values) {
                    Ok(sha) => (sha, false),
                    Err(e) => {
                        eps_proto::say!("eps server {rank}: checkpoint at iteration {}: {e}", p.version);
                        (e, true)
                    }
                }
            }
        };
        let m = ControlMsg::Saved { version: p.version, shard: p.shard, start: p.start, len: p.len, file, sha256, missed };
        if let Err(e) = ctl.call(&m) {
            eps_proto::say!("eps server {rank}: cannot report a checkpoint piece to the control plane: {e}");
        }
    }
}

impl<P: Fabric> Server<P> {
    /// After shard `id` published `version`: saves it if a checkpoint is due.
    pub(crate) fn save_if_due(&mut self, id: u32, version: u64) -> Result<(), ServerError> {
        if self.mode != eps_proto::Consistency::Bsp {
            // SSP/ASP shards are saved at cuts (`cut.rs`), not at versions.
            return Ok(());
        }
        let dirs = self.saver.due(version);
        if dirs.is_empty() {
            return Ok(());
        }
        // Between updates, with no snapshot WRITE in flight (an update ran).
        let Some(values) = self.mem.copy_state(id)? else { return Ok(()) };
        let Some((start, len)) = self.mem.get(id).map(|b| (b.start, b.len)) else { return Ok(()) };
        let state_k = self.mem.state_k as u32;
        for dir in dirs {
            let values = Some(values.clone());
            self.saver.send(Piece { version, updates: 0, shard: id, start, len, state_k, dir, values });
        }
        self.saver.ordered.retain(|(v, _)| *v + 64 > version);
        Ok(())
    }

    /// The control plane orders a checkpoint at `version` into `dir`: shards
    /// that passed it already are reported missed.
    pub(crate) fn on_checkpoint_order(&mut self, version: u64, dir: &str) -> Result<(), ServerError> {
        if self.mode != eps_proto::Consistency::Bsp {
            return self.on_cut_order(version, dir);
        }
        for id in self.mem.held().collect::<Vec<_>>() {
            let Some(h) = self.shards.get(id as usize).and_then(Option::as_ref) else { continue };
            if h.core.sync.version() >= version {
                self.report_missed(id, version, dir);
            }
        }
        self.saver.ordered.push((version, PathBuf::from(dir)));
        self.rows_order(version, dir)
    }

    /// Reports that shard `id` cannot be in the checkpoint at `version` in
    /// `dir` (it is past it).
    pub(crate) fn report_missed(&self, id: u32, version: u64, dir: &str) {
        if let Some((start, len)) = self.mem.get(id).map(|b| (b.start, b.len)) {
            let (state_k, dir) = (self.mem.state_k as u32, PathBuf::from(dir));
            self.saver.send(Piece { version, updates: 0, shard: id, start, len, state_k, dir, values: None });
        }
    }

    /// Finishes the writes of checkpoints (before the server reports it is done).
    pub(crate) fn finish_checkpoints(&mut self) {
        self.saver.finish();
    }
}

/// A resumed job's checkpoint, read once at start.
pub(crate) struct Restore {
    dir: PathBuf,
    manifest: Manifest,
}

impl Restore {
    /// Reads the manifest `[resume]` names and checks it fits the job.
    pub(crate) fn open(r: &eps_proto::spec::ResumeSection, total: u64, state_k: usize) -> Result<Self, ServerError> {
        let dir = PathBuf::from(&r.from);
        let (dir, manifest) = eps_control_client::checkpoint::latest(&dir).map_err(ServerError::Checkpoint)?;
        if manifest.version != r.iteration || manifest.total != total || manifest.state_k as usize != state_k {
            return Err(ServerError::Checkpoint(format!(
                "{}: iteration {}, {} elements, {} state values each; the job resumes at {} with {total} and {state_k}",
                dir.display(),
                manifest.version,
                manifest.total,
                manifest.state_k,
                r.iteration
            )));
        }
        Ok(Self { dir, manifest })
    }

    /// The version every shard starts at (BSP), the iteration every worker
    /// resumes at.
    pub(crate) fn version(&self) -> u64 {
        self.manifest.version
    }

    /// The updates every shard had applied (SSP/ASP: the learning-rate
    /// schedule's position; BSP: the version). The pieces of a cut agree.
    pub(crate) fn updates(&self) -> Result<u64, ServerError> {
        let mut seen = None;
        for e in &self.manifest.pieces {
            let h = eps_control_client::checkpoint::read_piece_header(&self.dir, e).map_err(ServerError::Checkpoint)?;
            match seen {
                Some((n, f)) if n != h.applied() => {
                    return Err(ServerError::Checkpoint(format!(
                        "{}: piece {} applied {} updates, piece {f} {n}: not one cut",
                        self.dir.display(),
                        e.file,
                        h.applied()
                    )));
                }
                Some(_) => {}
                None => seen = Some((h.applied(), e.file.as_str())),
            }
        }
        Ok(seen.map_or(self.manifest.version, |(n, _)| n))
    }

    /// Fills elements `[start, start + master.len())`: master values, and the
    /// state (`k` per element) from the pieces that hold them.
    pub(crate) fn fill(&self, start: u64, master: &mut [f32], state: &mut [f32], k: usize) -> Result<(), String> {
        let len = master.len() as u64;
        let m = &self.manifest;
        for i in m.overlapping(start, len) {
            let (h, values) = read_piece(&self.dir, &m.pieces[i], m.version, m.state_k)?;
            let lo = h.start.max(start);
            let hi = (h.start + h.len).min(start + len);
            let (src, dst, n) = ((lo - h.start) as usize, (lo - start) as usize, (hi - lo) as usize);
            master[dst..dst + n].copy_from_slice(&values[src..src + n]);
            let st = &values[h.len as usize..];
            state[dst * k..(dst + n) * k].copy_from_slice(&st[src * k..(src + n) * k]);
        }
        Ok(())
    }

    /// The manifest.
    pub(crate) fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// Where it was read from.
    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn saver(periodic: Option<u64>, ordered: &[u64]) -> Saver {
        Saver {
            periodic: periodic.map(|n| (n, PathBuf::from("/ck"))),
            steps: 100,
            ordered: ordered.iter().map(|&t| (t, PathBuf::from("/op"))).collect(),
            start: 0,
            cuts: Default::default(),
            held: Default::default(),
            rows: Default::default(),
            tx: None,
            writer: None,
        }
    }

    #[test]
    fn cuts_come_at_multiples_and_ordered_iterations_before_the_last_step() {
        let s = saver(Some(25), &[31, 10]);
        assert_eq!(s.next_cut(0), Some(10));
        assert_eq!(s.next_cut(10), Some(25));
        assert_eq!(s.next_cut(25), Some(31));
        assert_eq!(s.next_cut(31), Some(50));
        // None at the last step or after it.
        assert_eq!(s.next_cut(75), None);
        assert_eq!(saver(None, &[]).next_cut(0), None);
        // The directories a cut is saved into.
        let both = saver(Some(10), &[20]);
        assert_eq!(both.due(20), vec![PathBuf::from("/op"), PathBuf::from("/ck")]);
        assert_eq!(both.due(30), vec![PathBuf::from("/ck")]);
        assert!(both.due(31).is_empty());
    }
}
