//! A stand-in taking rows in a lost server's place (see `stand_in.rs`): the
//! lost server was the target of a bucket move and had not reported every
//! source's rows taken (`Order::StandIn { take }`).
//!
//! A target reports a source's rows taken only once its backup's copy holds
//! them, and serves nothing that needs the moving buckets (no push of the
//! cutover or later, no pull of their keys) before it has reported every
//! source's. So, for each source not reported, the stand-in's copy holds
//! that source's rows of a table whole (the target took them in and its
//! forward landed before it was lost) or not at all, and the sources keep
//! theirs until the control plane frees them. The stand-in holds the
//! requests the lost server would have held (`still_incoming`), READs each
//! source's rows (`FetchRows` for the lost server: from the source, or from
//! its stand-in if the source was lost too, or from its own memory if it is
//! the source), takes in those of each table its copy lacks, and reports
//! them taken for the lost server (`RowsTaken`; the stand-in's parts have
//! no backup). Once the last source's are in, the requests held go on; the
//! lost server's buckets become the stand-in's own later, as any
//! stand-in's (`merge_stand_in`, which waits for them).

use std::time::Instant;

use eps_fabric::Fabric;
use eps_proto::control::ControlMsg;
use eps_sparse::moves;

use crate::{Server, ServerError};

impl<P: Fabric> Server<P> {
    /// Whether this server stands in for lost server `to` and awaits the
    /// rows server `from` gives it; if not, it says so.
    pub(crate) fn stand_in_awaits(&self, from: u32, to: u32) -> bool {
        let s = self.sparse.stand_in.as_ref().filter(|s| s.from == to && s.merged.is_none());
        let awaited = s.and_then(|s| s.incoming.as_ref()).is_some_and(|i| i.sources().contains(&from));
        if !awaited {
            eps_proto::say!(
                "eps server {}: does not await the rows server {from} gives lost server {to} (here already, or it does not \
                 stand in for it)",
                self.rank
            );
        }
        awaited
    }

    /// The rows server `from` gives the lost server this one stands in for
    /// (`blob`, asked for at `started`) are here: those of each table the
    /// copy lacks are taken in, they are reported, and once the last
    /// source's are, the requests held for them go on.
    pub(crate) fn stand_in_take_rows(&mut self, from: u32, blob: &[u8], started: Instant) -> Result<(), ServerError> {
        let Some(s) = self.sparse.stand_in.as_mut() else { return Ok(()) };
        let to = s.from;
        if !s.incoming.as_ref().is_some_and(|i| i.sources().contains(&from)) {
            return Ok(());
        }
        let bad = |e: String| ServerError::Sparse(format!("the rows server {from} gives lost server {to}: {e}"));
        let strides: Vec<usize> = s.tables.iter().map(|t| t.part.rows().stride()).collect();
        let sections = moves::sections(blob, &strides).map_err(|e| bad(e.to_string()))?;
        let (mut rows, mut had) = (0, 0);
        for sec in sections {
            let part = &mut s.tables[sec.table as usize].part;
            match part.held_of(sec.records, sec.rows) {
                0 => {
                    part.put_rows(sec.records, sec.rows).map_err(|e| bad(e.to_string()))?;
                    rows += sec.rows;
                }
                // It took them in before it was lost: they came with the copy.
                n if n == sec.rows => had += n,
                n => {
                    return Err(bad(format!(
                        "{n} of the {} rows of table {} are in the copy, not none or all",
                        sec.rows, sec.table
                    )));
                }
            }
        }
        let last = s.incoming.as_mut().is_some_and(|i| i.taken(from));
        if last {
            s.incoming = None;
        }
        self.summary.sparse_rows_in += rows;
        eps_proto::say!(
            "eps server {}: {rows} rows ({} bytes) came from server {from} for lost server {to} in {:.1} ms ({had} were in its \
             copy already)",
            self.rank,
            blob.len(),
            started.elapsed().as_secs_f64() * 1e3
        );
        if let Err(why) = self.report(&ControlMsg::RowsTaken { rank: self.rank, from, to })? {
            return Err(ServerError::Sparse(format!(
                "the control plane refused the rows of server {from} for server {to}: {why}"
            )));
        }
        if !last {
            return Ok(());
        }
        self.replay_sparse()?;
        self.merge_stand_in()
    }
}
