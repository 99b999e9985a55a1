//! What a worker decides from the shard map (`JobMap`), free of I/O:
//! which servers it still needs, when it may report routing with a map's
//! epoch (which lets drained servers retire), which servers a newer map
//! declares lost, whether it leaves before a version, which version a push
//! asks for, and where a pull answered "pull moved" goes again.
//! `eps-worker` carries these out on the fabric; the simulation's workers
//! decide by the very same functions.

use eps_proto::Consistency;
use eps_proto::control::JobMap;
use eps_proto::membership::Membership;

/// Whether a worker at iteration `t` still needs server `rank`: it owns a
/// shard routed at `t`, or owned one whose cutover is after `t`.
pub fn routes_to(map: &JobMap, t: u64, rank: u32) -> bool {
    map.routes
        .iter()
        .filter(|r| r.until > t)
        .any(|r| r.owner.owner == rank || r.previous.as_ref().is_some_and(|(p, at)| p.owner == rank && t < *at))
}

/// Whether a worker at iteration `t` routes by `map` alone: no shard's route
/// at `t` is a previous owner before its cutover, and the last bucket map's
/// cutover is reached. Only then may it report routing with the map's epoch
/// (a server scaled away retires once every worker reported its draining
/// epoch, so it never leaves while a worker still talks to it).
pub fn settled(map: &JobMap, t: u64) -> bool {
    let buckets_cut = map.buckets.last().is_none_or(|(at, _)| t >= *at);
    buckets_cut && map.routes.iter().all(|r| r.previous.as_ref().is_none_or(|(_, at)| t >= *at))
}

/// The servers `old` routes to that `newer` leaves out: with replicas,
/// declared lost (their shards' backups were promoted).
pub fn left_out(old: &JobMap, newer: &JobMap) -> Vec<u32> {
    old.servers.iter().map(|(r, _)| *r).filter(|r| !newer.servers.iter().any(|(s, _)| s == r)).collect()
}

/// Whether worker `rank` does not contribute to iteration `t` by `map`'s
/// membership (it leaves at or before `t`, and does not use version `t`).
pub fn leaves_at(map: &JobMap, rank: u32, t: u64) -> bool {
    Membership::from_epochs(map.membership.clone()).is_some_and(|m| !m.contributors(t).contains(&rank))
}

/// The version a push of iteration `t` asks for: the next (BSP), the oldest
/// the staleness bound allows (SSP), any (ASP).
pub fn need_after_push(mode: Consistency, staleness: u64, t: u64) -> u64 {
    match mode {
        Consistency::Bsp => t + 1,
        Consistency::Ssp => (t + 1).saturating_sub(staleness),
        Consistency::Asp => 0,
    }
}

/// Where a pull of shard `sid` at version `need`, answered "pull moved",
/// goes again ([`pull_again`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PullAgain {
    /// The worker leaves at `need`: it does not use that version.
    Unused,
    /// The owner that refused is still the map's: wait for a newer map, then
    /// decide again (with `refused_by` None).
    NewerMap,
    /// Ask these shards: the shard's owner by the map, or the parts of a
    /// shard split meanwhile.
    Ask(Vec<usize>),
}

/// Decides where worker `rank`'s pull of shard `sid` at `need`, refused by
/// server `refused_by` (None once the map was refreshed after it), goes.
pub fn pull_again(map: &JobMap, rank: u32, sid: usize, need: u64, refused_by: Option<u32>) -> PullAgain {
    if leaves_at(map, rank, need) {
        return PullAgain::Unused;
    }
    let cover = map.covering(sid, need);
    let owner = map.routes.get(sid).map(|r| r.owner.owner);
    if cover == [sid] && refused_by.is_some() && owner == refused_by {
        return PullAgain::NewerMap;
    }
    PullAgain::Ask(cover)
}

#[cfg(test)]
mod tests {
    use super::*;
    use eps_proto::control::{Route, ShardEndpoint};

    fn ep(owner: u32) -> ShardEndpoint {
        ShardEndpoint { owner, shard: 0, landing: Vec::new(), published_addr: 0, published_rkey: 0 }
    }

    fn map(routes: Vec<Route>) -> JobMap {
        JobMap {
            epoch: 2,
            servers: vec![(0, "a".into()), (1, "b".into())],
            routes,
            membership: vec![(0, vec![0, 1]), (5, vec![0])],
            proposal: 0,
            tables: Vec::new(),
            buckets: Vec::new(),
            heirs: Vec::new(),
        }
    }

    #[test]
    fn a_previous_owner_is_needed_until_its_cutover_and_the_map_settles_there() {
        let r = Route { start: 0, len: 4, from: 0, until: u64::MAX, owner: ep(1), previous: Some((ep(0), 3)) };
        let m = map(vec![r]);
        assert!(routes_to(&m, 2, 0) && routes_to(&m, 2, 1));
        assert!(!routes_to(&m, 3, 0), "past the cutover");
        assert!(!settled(&m, 2) && settled(&m, 3));
        let mut newer = m.clone();
        newer.servers.retain(|s| s.0 != 0);
        assert_eq!(left_out(&m, &newer), vec![0]);
    }

    #[test]
    fn a_refused_pull_goes_to_the_new_owner_or_waits_for_a_newer_map() {
        let r = Route { start: 0, len: 4, from: 0, until: u64::MAX, owner: ep(1), previous: None };
        let m = map(vec![r]);
        assert_eq!(pull_again(&m, 1, 0, 6, Some(0)), PullAgain::Unused, "worker 1 leaves at 5");
        assert_eq!(pull_again(&m, 0, 0, 6, Some(0)), PullAgain::Ask(vec![0]));
        assert_eq!(pull_again(&m, 0, 0, 6, Some(1)), PullAgain::NewerMap);
        assert_eq!(pull_again(&m, 0, 0, 6, None), PullAgain::Ask(vec![0]));
        assert_eq!(need_after_push(Consistency::Ssp, 2, 5), 4);
        assert_eq!(need_after_push(Consistency::Bsp, 2, 5), 6);
    }
}
