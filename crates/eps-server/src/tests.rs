//! Unit tests of the server's connection handling.

use super::*;
use eps_fabric::soft::SoftDevice;

#[test]
fn a_post_on_a_closed_connection_completes_flushed() {
    let pd = SoftDevice::open().unwrap().alloc_pd();
    let hello = crate::serve::hello_buffer(&pd).unwrap();
    let conn: Conn<SoftPd> = Conn { qp: None, qp_num: 7, peer: Peer::Target(3), alive: false, hello };
    let remote = RemoteAddr { addr: 0, rkey: 0 };
    let mut flushed = Vec::new();
    // `post` refuses (a bug where the caller checked the connection)...
    let wr = SendWr { wr_id: 42, op: SendOp::WriteImm(remote, 1), sg: &[], signaled: true };
    assert!(conn.post(&wr).is_err());
    // ...`post_or_flush` completes it flushed, as a queue pair in the error state.
    conn.post_or_flush(&wr, &mut flushed).unwrap();
    let read = SendWr { wr_id: 43, op: SendOp::Read(remote), sg: &[], signaled: false };
    conn.post_or_flush(&read, &mut flushed).unwrap();
    assert_eq!(flushed.len(), 2);
    assert_eq!((flushed[0].wr_id, flushed[0].opcode, flushed[0].status), (42, WcOpcode::Write, WcStatus::WrFlush));
    assert_eq!((flushed[1].wr_id, flushed[1].opcode), (43, WcOpcode::Read));
    assert!(flushed.iter().all(|c| c.qp_num == 7 && !c.status.is_ok()));
}
