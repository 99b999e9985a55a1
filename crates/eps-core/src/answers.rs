//! What a server owes its workers across its shards: the pushes it answered
//! "moved" and the pull WRITEs it has in flight.

use std::collections::{BTreeMap, BTreeSet};

/// The answers of one server.
#[derive(Clone, Debug, Default)]
pub struct Answers {
    /// (worker, shard) whose last push was answered "moved": the pull request
    /// that follows it is answered "pull moved" too, even if the shard arrived
    /// here meanwhile (the worker counts one answer of each kind).
    moved_pushes: BTreeSet<(u32, u32)>,
    /// Pull WRITEs posted and not completed, by (shard, worker, version) (the
    /// same pull may be in flight twice: a read-only pull asked again): the
    /// published copy they read stays in use until they complete.
    pulls_out: BTreeMap<(u32, u32, u64), u32>,
}

impl Answers {
    /// Worker `w`'s push of shard `id` was answered "moved".
    pub fn moved(&mut self, w: u32, id: u32) {
        self.moved_pushes.insert((w, id));
    }

    /// Worker `w`'s pushes of shard `id` are taken again (the shard is held
    /// here and its pushes routed here): a pull request is answered as usual.
    pub fn forget_moved(&mut self, w: u32, id: u32) {
        self.moved_pushes.remove(&(w, id));
    }

    /// A pull request of worker `w` for shard `id` came: whether it follows a
    /// push answered "moved" (then it is answered "pull moved").
    pub fn pull_follows_moved(&mut self, w: u32, id: u32) -> bool {
        self.moved_pushes.remove(&(w, id))
    }

    /// A pull WRITE of version `v` of shard `id` to worker `w` was posted.
    pub fn posted(&mut self, id: u32, w: u32, v: u64) {
        *self.pulls_out.entry((id, w, v)).or_insert(0) += 1;
    }

    /// A pull WRITE completed (or was released): whether it was in flight.
    /// When it was, the shard's `ShardSync::pull_written` follows; when not,
    /// it was released already, when its connection dropped.
    pub fn written(&mut self, id: u32, w: u32, v: u64) -> bool {
        match self.pulls_out.get_mut(&(id, w, v)) {
            Some(n) if *n > 1 => *n -= 1,
            Some(_) => {
                self.pulls_out.remove(&(id, w, v));
            }
            None => return false,
        }
        true
    }

    /// Worker `w`'s connection dropped: its pull WRITEs in flight may never
    /// complete, so each is to be released now ([`Answers::written`]), once
    /// per WRITE.
    pub fn orphaned(&self, w: u32) -> Vec<(u32, u32, u64)> {
        let mine = self.pulls_out.iter().filter(|((_, x, _), _)| *x == w);
        mine.flat_map(|(&k, &n)| std::iter::repeat_n(k, n as usize)).collect()
    }

    /// Pull WRITEs in flight.
    pub fn pulls_in_flight(&self) -> u32 {
        self.pulls_out.values().sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pull_in_flight_twice_is_released_twice_and_once_released_never_again() {
        let mut a = Answers::default();
        a.posted(3, 1, 7);
        a.posted(3, 1, 7);
        a.posted(4, 2, 7);
        assert_eq!(a.orphaned(1), vec![(3, 1, 7), (3, 1, 7)]);
        assert!(a.written(3, 1, 7));
        assert!(a.written(3, 1, 7));
        assert!(!a.written(3, 1, 7), "released already");
        assert_eq!(a.pulls_in_flight(), 1);
    }

    #[test]
    fn the_pull_after_a_moved_push_is_moved_once() {
        let mut a = Answers::default();
        a.moved(0, 5);
        assert!(a.pull_follows_moved(0, 5));
        assert!(!a.pull_follows_moved(0, 5));
        a.moved(0, 5);
        a.forget_moved(0, 5);
        assert!(!a.pull_follows_moved(0, 5));
    }
}
