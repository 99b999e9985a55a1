//! The shared segment of one `shm` queue pair: for each direction a ring of
//! request slots (requester to responder), a ring of responses (back), and
//! the flags that say who sleeps.
//!
//! Direction 0 carries the dialer's requests, direction 1 the listener's. Each
//! ring is single-producer, single-consumer: the requester writes slot `i`, then
//! publishes `req_tail = i + 1` (release); the responder executes in order and
//! publishes `resp_tail` the same way. The responder's read position and the
//! requester's reaped position are private to each. Everything read from the
//! segment is the peer's word and is checked before use: a tail that runs more
//! than a ring ahead, a slot that does not decode, or a response that does not
//! match the request it answers ends the QP, never this process.

use std::sync::atomic::{AtomicU32, AtomicU64};

use crate::mem::RegionBuf;
use crate::wire::{REQ_LEN, RESP_LEN, Request};

use super::sys::PeerMap;
use crate::soft::MAX_SGE;

/// Bytes of one request slot: the request header, then up to MAX_SGE SGEs.
pub(crate) const SLOT: usize = 256;
const SGE_LEN: usize = 24;
// The SGEs start after the header and 8 bytes (the count, then reserved).
const _: () = assert!(REQ_LEN + 8 + MAX_SGE * SGE_LEN <= SLOT);
const LINE: usize = 64;
/// Control lines at the start of each direction: req_tail, resp_tail, flags.
const CTL: usize = 3 * LINE;
/// Largest ring (slots per direction).
pub(crate) const MAX_RING: u32 = 4096;

/// One SGE of the requester's memory, as the responder is told of it: a region
/// the requester announced (by its unique id), an offset in it and a length.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct PeerSge {
    pub(crate) uid: u64,
    pub(crate) len: u32,
    pub(crate) off: u64,
}

/// A request slot, decoded.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Slot {
    pub(crate) req: Request,
    pub(crate) nsg: usize,
    pub(crate) sg: [PeerSge; MAX_SGE],
}

impl Slot {
    pub(crate) fn encode(&self) -> [u8; SLOT] {
        let mut b = [0u8; SLOT];
        b[..REQ_LEN].copy_from_slice(&self.req.encode());
        b[REQ_LEN] = self.nsg as u8;
        for (i, s) in self.sg[..self.nsg].iter().enumerate() {
            let o = REQ_LEN + 8 + i * SGE_LEN;
            b[o..o + 8].copy_from_slice(&s.uid.to_le_bytes());
            b[o + 8..o + 16].copy_from_slice(&s.off.to_le_bytes());
            b[o + 16..o + 20].copy_from_slice(&s.len.to_le_bytes());
        }
        b
    }

    /// Decodes a slot the peer wrote; `None` if it is malformed.
    pub(crate) fn decode(b: &[u8; SLOT]) -> Option<Slot> {
        let req = Request::decode(&b[..REQ_LEN]).ok()?;
        let nsg = b[REQ_LEN] as usize;
        if nsg > MAX_SGE || REQ_LEN + 8 + nsg * SGE_LEN > SLOT {
            return None;
        }
        let mut sg = [PeerSge::default(); MAX_SGE];
        let mut total = 0u64;
        for (i, s) in sg[..nsg].iter_mut().enumerate() {
            let o = REQ_LEN + 8 + i * SGE_LEN;
            let word = |r: std::ops::Range<usize>| b[r].iter().rev().fold(0u64, |a, &x| (a << 8) | x as u64);
            if word(o + 20..o + 24) != 0 {
                return None;
            }
            *s = PeerSge { uid: word(o..o + 8), off: word(o + 8..o + 16), len: word(o + 16..o + 20) as u32 };
            total += s.len as u64;
        }
        // The SGEs carry exactly the request's bytes.
        (total == req.len as u64).then_some(Slot { req, nsg, sg })
    }
}

/// What backs the segment: the dialer made it, the listener maps the dialer's memfd.
#[derive(Debug)]
enum Backing {
    Own(RegionBuf),
    Peer(PeerMap),
}

/// The shared segment of one QP.
#[derive(Debug)]
pub(crate) struct Segment {
    backing: Backing,
    ring: [u32; 2],
}

fn dir_bytes(r: u32) -> usize {
    CTL + r as usize * (SLOT + RESP_LEN)
}

/// Bytes of a segment with rings of `ring[0]` and `ring[1]` slots.
pub(crate) fn segment_bytes(ring: [u32; 2]) -> usize {
    dir_bytes(ring[0]) + dir_bytes(ring[1])
}

/// Ring slots for a send queue of `depth`: the next power of two.
pub(crate) fn ring_for(depth: u32) -> u32 {
    depth.max(1).next_power_of_two()
}

impl Segment {
    /// A fresh, zeroed segment (the dialer's).
    pub(crate) fn create(ring: [u32; 2]) -> Result<Self, crate::FabricError> {
        let buf = RegionBuf::shared(segment_bytes(ring))?;
        Ok(Self { backing: Backing::Own(buf), ring })
    }

    /// The peer's segment, already mapped and checked to be large enough.
    pub(crate) fn from_peer(map: PeerMap, ring: [u32; 2]) -> Option<Self> {
        let ok = ring.iter().all(|&r| r.is_power_of_two() && r <= MAX_RING) && map.len >= segment_bytes(ring);
        ok.then_some(Self { backing: Backing::Peer(map), ring })
    }

    /// The memfd to hand to the listener (the dialer's segment only).
    pub(crate) fn fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        match &self.backing {
            Backing::Own(b) => b.shared_fd(),
            Backing::Peer(_) => None,
        }
    }

    fn base(&self, dir: usize) -> *mut u8 {
        let p = match &self.backing {
            Backing::Own(b) => b.as_ptr(),
            Backing::Peer(m) => m.ptr,
        };
        p.wrapping_add(if dir == 0 { 0 } else { dir_bytes(self.ring[0]) })
    }

    /// Slots of the ring of direction `dir`.
    pub(crate) fn ring(&self, dir: usize) -> u32 {
        self.ring[dir]
    }

    fn atomic64(&self, dir: usize, line: usize) -> &AtomicU64 {
        // SAFETY: the control lines lie inside the mapping (checked at construction),
        // are 64-byte aligned (the mapping is page-aligned), and live as long as self.
        // Both processes only touch them atomically.
        unsafe { &*self.base(dir).add(line * LINE).cast::<AtomicU64>() }
    }

    fn atomic32(&self, dir: usize, at: usize) -> &AtomicU32 {
        // SAFETY: as in atomic64, for the flag words of line 2.
        unsafe { &*self.base(dir).add(2 * LINE + at * 4).cast::<AtomicU32>() }
    }

    /// Requests published by the requester of `dir`.
    pub(crate) fn req_tail(&self, dir: usize) -> &AtomicU64 {
        self.atomic64(dir, 0)
    }

    /// Responses published by the responder of `dir`.
    pub(crate) fn resp_tail(&self, dir: usize) -> &AtomicU64 {
        self.atomic64(dir, 1)
    }

    /// Set while the responder of `dir` sleeps (the requester must ring its eventfd).
    pub(crate) fn resp_sleep(&self, dir: usize) -> &AtomicU32 {
        self.atomic32(dir, 0)
    }

    /// Set while the requester of `dir` sleeps on its CQ (the responder must ring it).
    pub(crate) fn req_sleep(&self, dir: usize) -> &AtomicU32 {
        self.atomic32(dir, 1)
    }

    fn slot_ptr(&self, dir: usize, idx: u64) -> *mut u8 {
        let i = (idx % self.ring[dir] as u64) as usize;
        self.base(dir).wrapping_add(CTL + i * SLOT)
    }

    fn resp_ptr(&self, dir: usize, idx: u64) -> *mut u8 {
        let i = (idx % self.ring[dir] as u64) as usize;
        self.base(dir).wrapping_add(CTL + self.ring[dir] as usize * SLOT + i * RESP_LEN)
    }

    pub(crate) fn write_slot(&self, dir: usize, idx: u64, b: &[u8; SLOT]) {
        // SAFETY: the slot lies inside the mapping; the peer reads it only after the
        // release store of req_tail that follows, so the bytes are not raced by a
        // well-behaved peer (a hostile one can only hurt its own view of them).
        unsafe { std::ptr::write_volatile(self.slot_ptr(dir, idx).cast::<[u8; SLOT]>(), *b) }
    }

    pub(crate) fn read_slot(&self, dir: usize, idx: u64) -> [u8; SLOT] {
        // SAFETY: as in write_slot; the copy is taken once, then checked.
        unsafe { std::ptr::read_volatile(self.slot_ptr(dir, idx).cast::<[u8; SLOT]>()) }
    }

    pub(crate) fn write_resp(&self, dir: usize, idx: u64, b: &[u8; RESP_LEN]) {
        // SAFETY: as in write_slot, for the response ring and resp_tail.
        unsafe { std::ptr::write_volatile(self.resp_ptr(dir, idx).cast::<[u8; RESP_LEN]>(), *b) }
    }

    pub(crate) fn read_resp(&self, dir: usize, idx: u64) -> [u8; RESP_LEN] {
        // SAFETY: as in read_slot.
        unsafe { std::ptr::read_volatile(self.resp_ptr(dir, idx).cast::<[u8; RESP_LEN]>()) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::WireOp;

    #[test]
    fn slots_round_trip_and_refuse_lies() {
        let req = Request { op: WireOp::Write, seq: 9, len: 30, rkey: 0x102, addr: 0x7000, imm: 5 };
        let mut sg = [PeerSge::default(); MAX_SGE];
        sg[0] = PeerSge { uid: 0x201, len: 10, off: 4096 };
        sg[1] = PeerSge { uid: 0x301, len: 20, off: 0 };
        let s = Slot { req, nsg: 2, sg };
        let d = Slot::decode(&s.encode()).unwrap();
        assert_eq!((d.req, d.nsg, d.sg), (req, 2, sg));
        // SGEs that do not add up to the length, too many SGEs, a bad header.
        let mut b = s.encode();
        b[REQ_LEN + 8 + 16] = 11;
        assert!(Slot::decode(&b).is_none());
        let mut b = s.encode();
        b[REQ_LEN] = MAX_SGE as u8 + 1;
        assert!(Slot::decode(&b).is_none());
        let mut b = s.encode();
        b[0] ^= 0xff;
        assert!(Slot::decode(&b).is_none());
    }

    #[test]
    fn a_segment_is_shared_through_its_memfd() {
        let a = Segment::create([4, 8]).unwrap();
        let fd = a.fd().unwrap().try_clone_to_owned().unwrap();
        let b = Segment::from_peer(PeerMap::new(&fd, segment_bytes([4, 8])).unwrap(), [4, 8]).unwrap();
        let slot = [7u8; SLOT];
        a.write_slot(1, 13, &slot);
        a.req_tail(1).store(14, std::sync::atomic::Ordering::Release);
        assert_eq!(b.req_tail(1).load(std::sync::atomic::Ordering::Acquire), 14);
        assert_eq!(b.read_slot(1, 13), slot);
        b.write_resp(0, 3, &[1; RESP_LEN]);
        assert_eq!(a.read_resp(0, 3), [1; RESP_LEN]);
        // A ring larger than the memory, or not a power of two, is refused.
        assert!(Segment::from_peer(PeerMap::new(&fd, 1).unwrap(), [4, 16]).is_none());
        assert!(Segment::from_peer(PeerMap::new(&fd, 1).unwrap(), [3, 4]).is_none());
    }
}
