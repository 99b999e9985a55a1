//! Pages of rows made ready off the critical path. A new page's memory
//! comes from the kernel untouched: the first write to each 4 KiB of it
//! faults, and the kernel zeroes it then, a microsecond or more that a pull
//! creating rows would wait for. A thread of the table's prepares the next
//! pages instead, touching every 4 KiB of each, and hands them over.

use std::sync::mpsc::{Receiver, SyncSender, sync_channel};

/// Pages prepared ahead (besides the one being prepared).
const AHEAD: usize = 1;
/// Values between two touches: one per 4 KiB.
const TOUCH_EVERY: usize = 4096 / 4;

/// The next pages of one table, all of one length (the first call's).
#[derive(Debug, Default)]
pub struct Spare {
    ready: Option<(usize, Receiver<Box<[f32]>>)>,
}

impl Spare {
    /// A page of `len` zeroed values: a prepared one when there is one, else
    /// a new one (and the thread that prepares the next ones starts).
    pub fn take(&mut self, len: usize) -> Box<[f32]> {
        match &self.ready {
            Some((l, rx)) if *l == len => rx.recv().unwrap_or_else(|_| fresh(len)),
            _ => {
                self.ready = start(len).map(|rx| (len, rx));
                fresh(len)
            }
        }
    }
}

/// A page allocated here (its faults come as it is written).
fn fresh(len: usize) -> Box<[f32]> {
    vec![0.0; len].into_boxed_slice()
}

/// Starts the thread that prepares pages of `len` values; `None` if it
/// cannot start (pages are then allocated as they are needed).
fn start(len: usize) -> Option<Receiver<Box<[f32]>>> {
    let (tx, rx) = sync_channel(AHEAD);
    let spawned = std::thread::Builder::new().name("eps-sparse-pages".into()).spawn(move || prepare(len, &tx));
    spawned.ok().map(|_| rx)
}

/// Prepares pages until the table is gone (its receiver dropped).
fn prepare(len: usize, tx: &SyncSender<Box<[f32]>>) {
    loop {
        let mut page = fresh(len);
        // A store the compiler cannot prove zero (so it is not dropped as a
        // store of what zeroed memory holds already).
        for x in page.iter_mut().step_by(TOUCH_EVERY) {
            *x = std::hint::black_box(0.0);
        }
        if tx.send(page).is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_are_zeroed_and_of_the_length_asked() {
        let mut spare = Spare::default();
        for len in [3000usize, 3000, 3000, 10, 10] {
            let p = spare.take(len);
            assert_eq!(p.len(), len);
            assert!(p.iter().all(|&x| x == 0.0));
        }
    }
}
