//! One shard's part in replication (`job.replicas = 2`, BSP): the owner
//! forwards every update to the shard's backup and serves the version only
//! once the backup acknowledged it; a new backup starts from the owner's
//! snapshot; a backup whose owner is lost is promoted, and a promoted copy
//! ignores pushes of iterations it applied already (sent again after the loss).
//!
//! [`Replica`] holds the state and decides its transitions; the caller moves
//! the bytes. `L` is how the owner reaches its backup (a connection, a rank),
//! `D` the update applied whose version waits for the backup's
//! acknowledgement (the caller's record of what to serve then).

/// A shard's part in replication, as [`Replica::role`] shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Role<L, D> {
    /// This server keeps the backup; forwards come from the owner `primary`.
    Backup {
        /// The owner's server rank.
        primary: u32,
        /// A new backup (after a loss): it starts from the owner's snapshot,
        /// whose notice comes first on the owner's connection.
        snapshot: bool,
        /// The last version acknowledged on arrival.
        acked: u64,
    },
    /// This server owns the shard and forwards each update to its backup.
    Primary {
        /// Where the backup is.
        link: L,
        /// A forward is in flight: the update is applied, its version not
        /// served yet.
        waiting: Option<D>,
        /// The snapshot for a new backup is being written: no update may run.
        snapshotting: bool,
        /// A backup promoted after a loss (see [`Role::Promoted`]).
        promoted: bool,
        /// Ordered to stop forwarding: it stops once the forward or the
        /// snapshot in flight is done.
        stopping: bool,
    },
    /// A backup promoted to owner, with no backup of its own now.
    Promoted,
    /// The owner of a shard the job starts with, before the control plane
    /// said where its backup is or that it has none: no update runs, so the
    /// backup's first forward is the first update.
    Awaited,
}

/// What [`Replica::no_backup`] leaves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Alone<D> {
    /// The shard was served alone already: nothing changes.
    Already,
    /// It is served alone from now on; the update whose acknowledgement it
    /// waited for, if any, is served now.
    Now(Option<D>),
}

/// A shard's part in replication: none (the job has no replicas, or this
/// copy lost its backup), or a [`Role`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Replica<L, D> {
    role: Option<Role<L, D>>,
}

impl<L, D> Default for Replica<L, D> {
    fn default() -> Self {
        Self { role: None }
    }
}

impl<L, D> Replica<L, D> {
    /// No replication.
    pub fn none() -> Self {
        Self::default()
    }

    /// The owner of a shard the job starts with, before it hears of its backup.
    pub fn awaited() -> Self {
        Self { role: Some(Role::Awaited) }
    }

    /// A backup of the shard owned by server `primary`; `snapshot` for a new
    /// backup (after a loss), which starts from the owner's snapshot.
    pub fn backup(primary: u32, snapshot: bool) -> Self {
        Self { role: Some(Role::Backup { primary, snapshot, acked: 0 }) }
    }

    /// The role, if any.
    pub fn role(&self) -> Option<&Role<L, D>> {
        self.role.as_ref()
    }

    /// Whether this copy is a backup.
    pub fn is_backup(&self) -> bool {
        matches!(self.role, Some(Role::Backup { .. }))
    }

    /// The owner of the shard this copy backs up.
    pub fn primary(&self) -> Option<u32> {
        match self.role {
            Some(Role::Backup { primary, .. }) => Some(primary),
            _ => None,
        }
    }

    /// A backup whose owner's moves forward from server `primary` from now
    /// on (the shard moved, its new owner forwards here).
    pub fn primary_moved(&mut self, to: u32) {
        if let Some(Role::Backup { primary, .. }) = self.role.as_mut() {
            *primary = to;
        }
    }

    /// Whether this owner waits for the control plane to name its backup.
    pub fn is_awaited(&self) -> bool {
        matches!(self.role, Some(Role::Awaited))
    }

    /// Where the backup is, when this copy owns the shard and forwards.
    pub fn link(&self) -> Option<&L> {
        match &self.role {
            Some(Role::Primary { link, .. }) => Some(link),
            _ => None,
        }
    }

    /// A forward or a new backup's snapshot is in flight.
    pub fn forwarding(&self) -> bool {
        matches!(&self.role, Some(Role::Primary { waiting, snapshotting, .. }) if waiting.is_some() || *snapshotting)
    }

    /// The update waiting for the backup's acknowledgement.
    pub fn waiting(&self) -> Option<&D> {
        match &self.role {
            Some(Role::Primary { waiting, .. }) => waiting.as_ref(),
            _ => None,
        }
    }

    /// No update may run: one is being forwarded, a snapshot written, or the
    /// backup is not named yet.
    pub fn busy(&self) -> bool {
        self.forwarding() || self.is_awaited()
    }

    /// Whether this copy was (or will be) promoted: pushes of iterations it
    /// applied already are ignored.
    pub fn promoted(&self) -> bool {
        matches!(self.role, Some(Role::Backup { .. } | Role::Promoted | Role::Primary { promoted: true, .. }))
    }

    /// Served alone from now on (a promoted copy stays one).
    fn alone(&mut self, promoted: bool) {
        self.role = promoted.then_some(Role::Promoted);
    }

    /// The control plane names this copy's (new) backup. The old role ends:
    /// its update waiting for an acknowledgement, if any, is returned to be
    /// served (the new backup starts from a snapshot that holds it).
    /// Then [`Replica::forward_to`] with where the backup is, or
    /// [`Replica::unreachable`].
    pub fn replace(&mut self) -> (Option<D>, Promotion) {
        let promoted = self.promoted() && !self.is_backup();
        let waiting = match self.role.take() {
            Some(Role::Primary { waiting, .. }) => waiting,
            _ => None,
        };
        (waiting, Promotion(promoted))
    }

    /// Forwards go to `link` from now on, after a snapshot when `snapshot`
    /// (no update runs until [`Replica::snapshot_done`]).
    pub fn forward_to(&mut self, link: L, snapshot: bool, p: Promotion) {
        debug_assert!(self.role.is_none(), "the old role ends first (Replica::replace)");
        self.role = Some(Role::Primary { link, waiting: None, snapshotting: snapshot, promoted: p.0, stopping: false });
    }

    /// The named backup cannot be reached: the shard is served alone.
    pub fn unreachable(&mut self, p: Promotion) {
        self.alone(p.0);
    }

    /// An update was applied and its forward sent: its version is served on
    /// the acknowledgement. Refused (given back) when this copy does not forward.
    pub fn defer(&mut self, d: D) -> Result<(), D> {
        match self.role.as_mut() {
            Some(Role::Primary { waiting, .. }) if waiting.is_none() => {
                *waiting = Some(d);
                Ok(())
            }
            _ => Err(d),
        }
    }

    /// The backup acknowledged the forward in flight: the update to serve now,
    /// and whether forwarding stopped (it was ordered to; report it).
    pub fn acked(&mut self) -> (Option<D>, bool) {
        let Some(Role::Primary { waiting, stopping, promoted, .. }) = self.role.as_mut() else { return (None, false) };
        let (d, stop, promoted) = (waiting.take(), *stopping, *promoted);
        if stop {
            self.alone(promoted);
        }
        (d, stop)
    }

    /// The snapshot for the new backup is written: whether forwarding
    /// stopped (it was ordered to; report it).
    pub fn snapshot_done(&mut self) -> bool {
        let Some(Role::Primary { snapshotting, stopping, promoted, waiting, .. }) = self.role.as_mut() else { return false };
        *snapshotting = false;
        let stop = *stopping && waiting.is_none();
        if stop {
            let p = *promoted;
            self.alone(p);
        }
        stop
    }

    /// Ordered to stop forwarding: true when it stopped now (report it),
    /// false when it stops once the forward or snapshot in flight is done.
    pub fn unreplicate(&mut self) -> bool {
        if self.forwarding() {
            if let Some(Role::Primary { stopping, .. }) = self.role.as_mut() {
                *stopping = true;
            }
            return false;
        }
        self.stop();
        true
    }

    /// Stops forwarding now (an owner whose backup was not named yet has
    /// none): whether it was forwarding.
    pub fn stop(&mut self) -> bool {
        match self.role {
            Some(Role::Awaited) => {
                self.role = None;
                false
            }
            Some(Role::Primary { promoted, .. }) => {
                self.alone(promoted);
                true
            }
            _ => false,
        }
    }

    /// The control plane says the shard has no backup and none can be made.
    /// A backup told so is an error (the caller's order is wrong).
    pub fn no_backup(&mut self) -> Result<Alone<D>, crate::CoreError> {
        match self.role.take() {
            Some(Role::Primary { waiting, promoted, .. }) => {
                self.alone(promoted);
                Ok(Alone::Now(waiting))
            }
            Some(Role::Awaited) => Ok(Alone::Now(None)),
            r @ (Some(Role::Promoted) | None) => {
                self.role = r;
                Ok(Alone::Already)
            }
            r @ Some(Role::Backup { .. }) => {
                self.role = r;
                Err(crate::CoreError::NotOwner)
            }
        }
    }

    /// The backup's server is gone: the shard goes on alone, and the update
    /// waiting for its acknowledgement is served now.
    pub fn link_lost(&mut self) -> Option<D> {
        let Some(Role::Primary { waiting, promoted, .. }) = self.role.take() else { return None };
        self.alone(promoted);
        waiting
    }

    /// The owner was lost and this backup owns the shard now: the owner it
    /// backed up (None if this copy was no backup).
    pub fn promote(&mut self) -> Option<u32> {
        let lost = self.primary();
        self.role = Some(Role::Promoted);
        lost
    }

    /// A backup got a forward of `version` and the shard is `free`: whether
    /// it acknowledges it on arrival (then it is not acknowledged again after
    /// it is applied: see [`Replica::acked_on_arrival`]).
    pub fn ack_on_arrival(&mut self, free: bool, version: u64) -> bool {
        match self.role.as_mut() {
            Some(Role::Backup { acked, .. }) if free => {
                *acked = version;
                true
            }
            _ => false,
        }
    }

    /// Whether the forward of `version` was acknowledged on arrival.
    pub fn acked_on_arrival(&self, version: u64) -> bool {
        matches!(self.role, Some(Role::Backup { acked, .. }) if acked == version)
    }
}

/// Whether a replaced role was a promoted copy's ([`Replica::replace`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[must_use]
pub struct Promotion(bool);

#[cfg(test)]
mod tests {
    use super::*;

    type R = Replica<u32, u64>;

    #[test]
    fn an_owner_serves_an_update_once_its_backup_acknowledged_it() {
        let mut r = R::awaited();
        assert!(r.busy(), "no update before the backup is named");
        let (d, p) = r.replace();
        assert_eq!(d, None);
        r.forward_to(7, false, p);
        assert!(!r.busy());
        assert_eq!(r.defer(3), Ok(()));
        assert_eq!(r.defer(4), Err(4), "one forward at a time");
        assert!(r.busy());
        assert_eq!(r.acked(), (Some(3), false));
        assert!(!r.busy());
    }

    #[test]
    fn an_order_to_stop_waits_for_the_forward_in_flight() {
        let mut r = R::none();
        let (_, p) = r.replace();
        r.forward_to(7, true, p);
        assert!(!r.unreplicate(), "the snapshot is in flight");
        assert!(r.snapshot_done(), "it stops once the snapshot is written");
        assert_eq!(r.role(), None);
        let mut r = R::none();
        let (_, p) = r.replace();
        r.forward_to(7, false, p);
        assert_eq!(r.defer(1), Ok(()));
        assert!(!r.unreplicate());
        assert_eq!(r.acked(), (Some(1), true));
        assert_eq!(r.role(), None);
    }

    #[test]
    fn a_promoted_copy_stays_promoted_whatever_happens_to_its_new_backup() {
        let mut r = R::backup(2, false);
        assert!(r.promoted());
        assert_eq!(r.promote(), Some(2));
        let (_, p) = r.replace();
        r.forward_to(5, true, p);
        assert!(r.promoted());
        assert_eq!(r.link_lost(), None);
        assert_eq!(r.role(), Some(&Role::Promoted));
        let (_, p) = r.replace();
        r.unreachable(p);
        assert!(r.promoted(), "an unreachable new backup keeps it promoted");
        assert_eq!(r.no_backup(), Ok(Alone::Already));
    }

    #[test]
    fn a_backup_told_it_has_no_backup_is_refused_and_unchanged() {
        let mut r = R::backup(2, true);
        assert_eq!(r.no_backup(), Err(crate::CoreError::NotOwner));
        assert!(r.is_backup());
        assert!(r.ack_on_arrival(true, 9));
        assert!(r.acked_on_arrival(9) && !r.acked_on_arrival(8));
        assert!(!r.ack_on_arrival(false, 10), "a busy shard acknowledges after applying");
    }
}
