//! Tests of the per-shard consistency state machine.

use super::*;

const ALL: &[u32] = &[0, 1, 2];

#[test]
fn bsp_aggregates_when_all_are_in_and_serves_waiting_pulls() {
    let mut s = ShardSync::new(Consistency::Bsp, 3);
    assert_eq!(s.on_pull(0, 0), Ok(Some(0)));
    s.pull_written(0);
    assert_eq!(s.on_push(0, 0, ALL), Ok(PushOutcome::Wait));
    assert_eq!(s.on_pull(0, 1), Ok(None));
    assert_eq!(s.on_push(0, 0, ALL), Err(SyncError::SlotBusy { worker: 0, iteration: 0 }));
    assert_eq!(s.on_push(2, 0, ALL), Ok(PushOutcome::Wait));
    assert_eq!(s.on_push(1, 1, ALL), Err(SyncError::StaleIteration { worker: 1, iteration: 1, expected: 0 }));
    assert_eq!(s.on_push(1, 0, ALL), Ok(PushOutcome::AggregateAll { iteration: 0 }));
    assert!(s.can_publish());
    assert_eq!(s.published(None), 1);
    let mut out = vec![];
    s.ready_pulls(&mut out);
    assert_eq!(out, vec![(0, 1)]);
    assert_eq!(s.on_pull(1, 1), Ok(Some(1)));
    assert_eq!(s.on_push(9, 1, ALL), Err(SyncError::UnknownWorker { worker: 9 }));
}

#[test]
fn a_buffer_with_pulls_in_flight_is_not_overwritten() {
    let mut s = ShardSync::new(Consistency::Bsp, 1);
    assert_eq!(s.on_pull(0, 0), Ok(Some(0))); // reading buffer 0
    assert_eq!(s.on_push(0, 0, &[0]), Ok(PushOutcome::AggregateAll { iteration: 0 }));
    assert!(s.can_publish()); // version 1 goes to buffer 1
    s.published(None);
    assert_eq!(s.on_pull(0, 1), Ok(Some(1)));
    assert_eq!(s.on_push(0, 1, &[0]), Ok(PushOutcome::AggregateAll { iteration: 1 }));
    assert!(!s.can_publish(), "version 2 would overwrite buffer 0 while version 0 is being written");
    s.pull_written(0);
    assert!(s.can_publish());
}

#[test]
fn ssp_bounds_the_lead_of_the_fastest_worker() {
    let staleness = 2;
    let mut s = ShardSync::new(Consistency::Ssp, 2);
    // Worker 0 runs ahead; worker 1 is stuck at clock 0.
    for t in 0..3u64 {
        assert_eq!(s.on_push(0, t, ALL), Ok(PushOutcome::ApplyOne { worker: 0, iteration: t }));
        s.published(Some(0));
        // Next iteration t+1 may proceed if the slowest clock >= t+1-staleness.
        let need = (t + 1).saturating_sub(staleness);
        let got = s.on_pull(0, need).unwrap();
        if t < staleness {
            assert!(got.is_some(), "t={t}");
            s.pull_written(got.unwrap());
        } else {
            assert_eq!(got, None, "t={t}: must wait for worker 1");
        }
    }
    assert_eq!(s.on_push(1, 0, ALL), Ok(PushOutcome::ApplyOne { worker: 1, iteration: 0 }));
    s.published(Some(1));
    let mut out = vec![];
    s.ready_pulls(&mut out);
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].0, 0);
}

/// Contributor sets that change from iteration to iteration.
mod membership {
    use super::*;

    /// BSP with changing contributor sets: the update waits for exactly that
    /// iteration's contributors; others are refused.
    #[test]
    fn bsp_waits_for_the_iterations_contributors_only() {
        let mut s = ShardSync::new(Consistency::Bsp, 4);
        let first: &[u32] = &[0, 1];
        assert_eq!(s.on_push(0, 0, first), Ok(PushOutcome::Wait));
        assert_eq!(s.on_push(3, 0, first), Err(SyncError::NotContributor { worker: 3, iteration: 0 }));
        assert_eq!(s.on_push(1, 0, first), Ok(PushOutcome::AggregateAll { iteration: 0 }));
        s.published(None);
        // Worker 3 joins at iteration 1 (its own clock never mattered), worker 0 left.
        let second: &[u32] = &[1, 3];
        assert_eq!(s.on_push(0, 1, second), Err(SyncError::NotContributor { worker: 0, iteration: 1 }));
        assert_eq!(s.on_push(3, 1, second), Ok(PushOutcome::Wait));
        assert_eq!(s.on_push(1, 1, second), Ok(PushOutcome::AggregateAll { iteration: 1 }));
    }

    /// A source cutting over at its own version gives back what it holds.
    #[test]
    fn eviction_returns_held_pushes_and_waiting_pulls() {
        const ALL: &[u32] = &[0, 1, 2];
        let mut s = ShardSync::new(Consistency::Bsp, 3);
        assert_eq!(s.on_push(0, 0, ALL), Ok(PushOutcome::Wait));
        assert_eq!(s.on_push(2, 0, ALL), Ok(PushOutcome::Wait));
        assert_eq!(s.on_pull(0, 1), Ok(None));
        assert_eq!(s.evict(), (vec![0, 2], vec![0]));
        assert!(!s.has_pushed(0) && s.complete(ALL).is_none());
        assert_eq!(s.version(), 0);
    }

    #[test]
    fn an_expired_worker_is_dropped_only_where_its_push_is_missing() {
        let mut m = Membership::new(vec![0, 1, 2]).unwrap();
        m.schedule(5, 4, vec![0, 2]).unwrap();
        let lost = [(1, 5)];
        let mut s = ShardSync::new(Consistency::Bsp, 3);
        assert_eq!(&*s.contributors(&m, &[], 4), &[0, 1, 2]);
        assert_eq!(&*s.contributors(&m, &lost, 4), &[0, 2]);
        s.on_push_unsettled(1, 0).unwrap();
        assert_eq!(&*s.contributors(&m, &lost, 4), &[0, 1, 2], "its push arrived: it counts");
        assert_eq!(&*s.contributors(&m, &lost, 5), &[0, 2]);
    }

    /// While a membership change is voted on, pushes are recorded but complete
    /// nothing; once settled, `complete` decides with the settled set.
    #[test]
    fn unsettled_pushes_wait_for_the_settled_set() {
        let mut s = ShardSync::new(Consistency::Bsp, 3);
        assert_eq!(s.on_push_unsettled(0, 0), Ok(()));
        assert_eq!(s.on_push_unsettled(1, 0), Ok(()));
        assert!(s.has_pushed(1) && !s.has_pushed(2));
        assert_eq!(s.on_push_unsettled(1, 0), Err(SyncError::SlotBusy { worker: 1, iteration: 0 }));
        // Settled to {0, 1, 2}: worker 2 is still missing.
        assert_eq!(s.complete(&[0, 1, 2]), None);
        // Settled to {0, 1} instead (worker 2 left at 0): complete.
        assert_eq!(s.complete(&[0, 1]), Some(0));
        s.published(None);
        assert!(!s.has_pushed(0));
    }

    #[test]
    fn a_migration_target_holds_pushes_until_forwards_reach_the_cutover() {
        // Snapshot at version 5; the cutover is iteration 7: forwards make 6 and 7.
        const ALL: &[u32] = &[0, 1, 2];
        let mut s = ShardSync::incoming(Consistency::Bsp, 3, 5);
        assert_eq!(s.on_push(0, 7, ALL), Ok(PushOutcome::Wait));
        assert_eq!(s.on_pull(0, 8), Ok(None));
        // Pushes of another iteration are refused while held ones wait.
        assert!(matches!(s.on_push(1, 8, ALL), Err(SyncError::StaleIteration { expected: 7, .. })));
        assert_eq!(s.on_push(1, 7, ALL), Ok(PushOutcome::Wait));
        assert_eq!(s.on_push(2, 7, ALL), Ok(PushOutcome::Wait), "all in, but the version is behind");
        assert_eq!(s.complete(ALL), None);
        assert_eq!(s.forwarded(), 6);
        assert_eq!(s.complete(ALL), None);
        assert!(!s.serves(4) && s.serves(5), "a target serves its snapshot's version and later ones");
        assert_eq!(s.forwarded(), 7);
        assert_eq!(s.complete(ALL), Some(7));
        assert_eq!(s.published(None), 8);
        let mut ready = Vec::new();
        s.ready_pulls(&mut ready);
        assert_eq!(ready, vec![(0, 8)]);
        // Back to plain BSP: the next iteration only.
        assert!(matches!(s.on_push(1, 9, ALL), Err(SyncError::StaleIteration { .. })));
        assert_eq!(s.on_push(1, 8, ALL), Ok(PushOutcome::Wait));
        // A target whose pushes arrive after the forwards aggregates at once.
        let mut s = ShardSync::incoming(Consistency::Bsp, 3, 0);
        // Pulls asked before the snapshot of version 2 landed: one of version 1 is
        // handed back (the source serves it), one of version 2 is served from the
        // snapshot, one of version 3 once the forward made it.
        assert_eq!(s.on_pull(2, 1), Ok(None));
        assert_eq!(s.on_pull(1, 2), Ok(None));
        assert_eq!(s.on_pull(0, 3), Ok(None));
        assert_eq!(s.snapshot_landed(2), vec![2]);
        let mut ready = Vec::new();
        s.ready_pulls(&mut ready);
        assert_eq!(ready, vec![(1, 2)]);
        assert_eq!(s.forwarded(), 3);
        ready.clear();
        s.ready_pulls(&mut ready);
        assert_eq!(ready, vec![(0, 3)]);
        let mut s = ShardSync::incoming(Consistency::Bsp, 1, 2);
        assert_eq!(s.forwarded(), 3);
        assert_eq!(s.on_push(0, 3, &[0]), Ok(PushOutcome::AggregateAll { iteration: 3 }));
    }

    #[test]
    fn a_forward_frees_the_slots_of_the_iteration_it_applied() {
        // A backup at version 4 whose owner was cut off: workers routing by
        // the map that promotes it push iteration 4 here again, then the
        // owner's last forward (iteration 4's update) lands.
        const ALL: &[u32] = &[0, 1];
        let mut s = ShardSync::backup(Consistency::Bsp, 2, 4);
        assert_eq!(s.on_push(0, 4, ALL), Ok(PushOutcome::Wait));
        assert_eq!(s.on_pull(0, 5), Ok(None));
        assert_eq!(s.forwarded(), 5);
        let mut ready = Vec::new();
        s.ready_pulls(&mut ready);
        assert_eq!(ready, vec![(0, 5)], "the pull is answered by the forwarded version");
        // Promoted, it aggregates iteration 5 from empty slots.
        s.caught_up();
        assert_eq!(s.on_push(0, 5, ALL), Ok(PushOutcome::Wait));
        assert_eq!(s.on_push(1, 5, ALL), Ok(PushOutcome::AggregateAll { iteration: 5 }));
    }
}
