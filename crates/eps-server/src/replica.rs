//! Replicas (`job.replicas = 2`, BSP): every shard has a backup on the next
//! server, kept in step by the migration's forwarding made permanent. After
//! each update the owner forwards the averaged gradient to the backup, which
//! applies it with the same element-wise code (so it holds the owner's bits),
//! and the owner serves the new version to pulls only once the backup
//! acknowledged it. So when the owner dies, its backup holds at least every
//! version any worker has pulled: the control plane promotes it, workers push
//! their current iteration again there, and nothing is lost. A push of an
//! iteration the promoted backup already applied (the owner applied it, the
//! worker had not pulled it yet) is ignored and its pull answered.

use eps_fabric::prelude::*;
use eps_proto::control::{ControlMsg, MigrationKeys};
use eps_proto::imm::{Imm, ImmKind};

use crate::{Pending, Server, ServerError, WR_OTHER};

/// Work-request ids of forwards to a backup: shard in the low bits.
pub(crate) const WR_REPLICA: u64 = WR_OTHER | (1 << 41);

/// An update applied whose version waits for the backup's acknowledgement.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Deferred {
    pub(crate) p: Pending,
    pub(crate) version: u64,
    pub(crate) carry: bool,
    pub(crate) one: Option<u32>,
}

/// A shard's part in replication.
#[derive(Debug)]
pub(crate) enum Replica {
    /// This server keeps the backup; forwards come from the owner `primary`.
    Backup {
        /// The owner's server rank.
        primary: u32,
    },
    /// This server owns the shard and forwards each update to its backup.
    Primary {
        /// The connection to the backup's server.
        ci: usize,
        /// Where the backup receives forwarded gradients.
        keys: MigrationKeys,
        /// A forward is in flight: the update is applied, its version not yet
        /// served.
        waiting: Option<Deferred>,
    },
    /// A backup promoted to owner: pushes of iterations before its version,
    /// sent again after the loss, were applied already.
    Promoted,
}

impl<P: Fabric> Server<P> {
    /// The control plane orders shard `id`'s forwards to its backup on `to`.
    pub(crate) fn on_replicate(&mut self, id: u32, to: u32, addr: &str, keys: MigrationKeys) -> Result<(), ServerError> {
        if self.held_mut(id).is_none() {
            return Err(ServerError::Migration(format!("ordered to replicate shard {id}, which is not here")));
        }
        let ci = self.target_conn(to, addr)?;
        self.mem.add_forward_buffer(id)?;
        if let Some(h) = self.held_mut(id) {
            h.replica = Some(Replica::Primary { ci, keys, waiting: None });
        }
        eprintln!("eps server {}: shard {id} is replicated on server {to}", self.rank);
        Ok(())
    }

    /// Whether shard `id` waits for its backup's acknowledgement.
    pub(crate) fn replica_busy(&self, id: u32) -> bool {
        let h = self.shards.get(id as usize).and_then(Option::as_ref);
        matches!(h.and_then(|h| h.replica.as_ref()), Some(Replica::Primary { waiting: Some(_), .. }))
    }

    /// After an update of a replicated shard: forwards the averaged gradient
    /// (none for an iteration without contributions) and defers the version.
    /// Returns false when the shard has no backup (finish the update now).
    pub(crate) fn forward_to_backup(&mut self, id: u32, d: Deferred) -> Result<bool, ServerError> {
        let Some(Some(Replica::Primary { ci, keys, .. })) =
            self.shards.get(id as usize).and_then(Option::as_ref).map(|h| h.replica.as_ref())
        else {
            return Ok(false);
        };
        let (ci, keys) = (*ci, *keys);
        if !self.conns[ci].alive {
            return Ok(false);
        }
        let b = self.mem.get(id).ok_or_else(|| ServerError::Migration("shard memory vanished".into()))?;
        let g = b.grad.as_ref().ok_or_else(|| ServerError::Migration("no forward buffer".into()))?;
        let imm = Imm { kind: ImmKind::Forward, shard: id, seq: d.version as u16 }.encode();
        let remote = RemoteAddr { addr: keys.grad_addr, rkey: keys.grad_rkey };
        let whole = [Sge::whole(g)];
        let sg: &[Sge<'_, P::Mr>] = if d.carry { &[] } else { &whole };
        let wr = SendWr { wr_id: WR_REPLICA | u64::from(id), op: SendOp::WriteImm(remote, imm), sg, signaled: true };
        if self.conns[ci].post(&wr).is_err() {
            return Ok(false);
        }
        if let Some(Replica::Primary { waiting, .. }) = self.held_mut(id).and_then(|h| h.replica.as_mut()) {
            *waiting = Some(d);
        }
        Ok(true)
    }

    /// The backup acknowledged shard `id`'s forward: its version is served.
    pub(crate) fn replica_acked(&mut self, id: u32) -> Result<(), ServerError> {
        let d = match self.held_mut(id).and_then(|h| h.replica.as_mut()) {
            Some(Replica::Primary { waiting, .. }) => waiting.take(),
            _ => None,
        };
        if let Some(d) = d {
            self.finish_update(id, d)?;
        }
        self.drain(id)
    }

    /// The connection `ci` failed: shards replicated over it lost their
    /// backup; they go on alone (what waited for an acknowledgement is served).
    pub(crate) fn replica_conn_lost(&mut self, ci: usize) -> Result<(), ServerError> {
        let ids: Vec<u32> = (0..self.shards.len() as u32)
            .filter(|&id| matches!(self.shards[id as usize].as_ref().and_then(|h| h.replica.as_ref()), Some(Replica::Primary { ci: c, .. }) if *c == ci))
            .collect();
        for id in ids {
            eprintln!("eps server {}: the backup of shard {id} is gone; the shard goes on without one", self.rank);
            let d = match self.held_mut(id).map(|h| h.replica.take()) {
                Some(Some(Replica::Primary { waiting, .. })) => waiting,
                _ => None,
            };
            self.mem.drop_forward_buffer(id);
            if let Some(d) = d {
                self.finish_update(id, d)?;
            }
            self.drain(id)?;
        }
        Ok(())
    }

    /// A server said hello: the backups whose owner it is take their forwards
    /// from this connection.
    pub(crate) fn bind_backups(&mut self, ci: usize, from: u32) {
        for h in self.shards.iter_mut().flatten() {
            if matches!(h.replica, Some(Replica::Backup { primary }) if primary == from) {
                h.incoming = Some((from, Some(ci)));
            }
        }
    }

    /// The owner of shard `id` is lost: this backup owns it from now on.
    pub(crate) fn on_promote(&mut self, id: u32) -> Result<(), ServerError> {
        let rank = self.rank;
        let Some(h) = self.held_mut(id) else {
            return Err(ServerError::Migration(format!("promoted for shard {id}, which has no backup here")));
        };
        let at = h.sync.version();
        h.sync.caught_up();
        h.incoming = None;
        h.replica = Some(Replica::Promoted);
        eprintln!("eps server {rank}: shard {id} is served here from version {at} on (its owner was lost)");
        self.try_complete(id)
    }

    /// Whether a push of `iteration` to shard `id` was applied already (a
    /// worker pushing again after the owner was lost): it is ignored.
    pub(crate) fn applied_before_promotion(&self, id: u32, iteration: u64) -> bool {
        let h = self.shards.get(id as usize).and_then(Option::as_ref);
        h.is_some_and(|h| matches!(h.replica, Some(Replica::Promoted)) && iteration < h.sync.version())
    }

    /// Tells the control plane about the backups held here.
    pub(crate) fn report_backups(&mut self) -> Result<(), ServerError> {
        let ids: Vec<u32> = (0..self.shards.len() as u32)
            .filter(|&id| {
                matches!(self.shards[id as usize].as_ref().and_then(|h| h.replica.as_ref()), Some(Replica::Backup { .. }))
            })
            .collect();
        for id in ids {
            let b = self.mem.get(id).ok_or_else(|| ServerError::Migration("shard memory vanished".into()))?;
            let grad = b.grad.as_ref().ok_or_else(|| ServerError::Migration("no gradient buffer".into()))?;
            let keys = MigrationKeys {
                state_addr: b.state.addr(),
                state_rkey: b.state.rkey(),
                grad_addr: grad.addr(),
                grad_rkey: grad.rkey(),
            };
            let endpoint = self.endpoint(id).ok_or_else(|| ServerError::Migration("shard memory vanished".into()))?;
            self.ctl.call(&ControlMsg::BackupReady { endpoint, keys })?;
        }
        Ok(())
    }
}
