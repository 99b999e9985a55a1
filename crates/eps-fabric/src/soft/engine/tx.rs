//! The responder's send side: responses queued per connection and sent in
//! batches with one `sendmsg` each, a failed request answered before its
//! connection drains.

use super::*;

impl Engine {
    /// Queues a response, then reads the next header unless the ring is full.
    pub(super) fn respond(&mut self, slot: usize, r: RespOut) {
        let c = self.conn(slot);
        c.resp.push_back(r);
        let full = c.resp.len() >= RESP_RING;
        self.kick_tx(slot);
        if full {
            self.conn(slot).st = St::Stalled;
        } else {
            self.post_header(slot);
        }
    }

    /// The request failed at the responder: answer with `status`, move the QP to the
    /// error state, and drain the connection once the answer is out.
    pub(super) fn fail(&mut self, slot: usize, status: WcStatus) {
        let c = self.conn(slot);
        let req = c.land.req.expect("failing request");
        if let Some(w) = c.land.recv.take() {
            c.qp.recv_cq.push(c.qp.recv_completion(w.wr_id, WcStatus::WrFlush, WcOpcode::Recv, 0, None));
        }
        c.land = Landing::default();
        c.qp.set_error(true);
        c.st = St::Failing;
        c.resp.push_back(RespOut { hdr: Response { op: req.op, status, seq: req.seq, len: 0 }.encode(), data: None });
        self.kick_tx(slot);
    }

    pub(super) fn kick_tx(&mut self, slot: usize) {
        let c = self.conn(slot);
        if c.tx_inflight || c.resp.is_empty() {
            return;
        }
        let (mut n, mut skip) = (0, c.tx_off);
        for r in c.resp.iter().take(TX_BATCH) {
            let segs = std::iter::once((r.hdr.as_ptr() as usize, RESP_LEN)).chain(r.data.as_ref().map(|d| (d.1, d.2 as usize)));
            for (base, len) in segs {
                if skip >= len {
                    skip -= len;
                    continue;
                }
                c.tx_iov[n] = libc::iovec { iov_base: (base + skip) as *mut _, iov_len: len - skip };
                skip = 0;
                n += 1;
            }
        }
        c.tx_msg = empty_msghdr();
        c.tx_msg.msg_iov = c.tx_iov.as_mut_ptr();
        c.tx_msg.msg_iovlen = n as _;
        let e = opcode::SendMsg::new(types::Fd(c.fd), &c.tx_msg)
            .flags(libc::MSG_NOSIGNAL as u32)
            .build()
            .user_data(((slot as u64) << 8) | KIND_TX);
        c.tx_inflight = true;
        self.push(e);
    }

    pub(super) fn on_tx(&mut self, slot: usize, res: i32) {
        let c = self.conn(slot);
        c.tx_inflight = false;
        if c.st == St::Dead {
            return self.maybe_close(slot);
        }
        if res == -libc::EINTR || res == -libc::EAGAIN {
            return self.kick_tx(slot);
        }
        if res < 0 {
            return self.kill(slot);
        }
        let mut n = res as usize + c.tx_off;
        while let Some(front) = c.resp.front() {
            if n < front.bytes() {
                break;
            }
            n -= front.bytes();
            c.resp.pop_front();
        }
        c.tx_off = n;
        match c.st {
            St::Stalled if c.resp.len() < RESP_RING => self.post_header(slot),
            St::Failing if c.resp.is_empty() => {
                sys::shutdown(&c.qp.resp_fd, libc::SHUT_WR);
                if !c.rx_inflight {
                    self.post_drain(slot);
                } else {
                    c.st = St::Drain;
                }
            }
            _ => {}
        }
        self.kick_tx(slot);
    }
}
