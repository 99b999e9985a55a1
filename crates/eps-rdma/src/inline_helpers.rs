//! Unit tests of the rdma-sys helpers that stand in for libibverbs' `static
//! inline` functions (rdma-sys ports them to Rust by hand, untested). Each one the
//! data path calls is checked here against a fake device context whose operation
//! table records what it is called with: the helper must call the right
//! operation exactly once, with the caller's arguments unchanged, and return its
//! result. No device is needed.

#![cfg(test)]

use std::cell::RefCell;
use std::ptr;

use rdma_sys as sys;

thread_local! {
    /// (operation, first pointer, second argument as u64, third pointer) of each call.
    static CALLS: RefCell<Vec<(&'static str, usize, u64, usize)>> = const { RefCell::new(Vec::new()) };
}

fn record(op: &'static str, a: usize, b: u64, c: usize) {
    CALLS.with(|v| v.borrow_mut().push((op, a, b, c)));
}

fn take() -> Vec<(&'static str, usize, u64, usize)> {
    CALLS.with(|v| std::mem::take(&mut *v.borrow_mut()))
}

unsafe extern "C" fn fake_poll_cq(cq: *mut sys::ibv_cq, n: libc::c_int, wc: *mut sys::ibv_wc) -> libc::c_int {
    record("poll_cq", cq as usize, n as u64, wc as usize);
    // Fills one completion so the caller sees the fake's output.
    if n > 0 && !wc.is_null() {
        // SAFETY: the test passes a buffer of `n` completions.
        unsafe { (*wc).wr_id = 0xC0FFEE };
    }
    1.min(n)
}

unsafe extern "C" fn fake_req_notify_cq(cq: *mut sys::ibv_cq, solicited: libc::c_int) -> libc::c_int {
    record("req_notify_cq", cq as usize, solicited as u64, 0);
    7
}

unsafe extern "C" fn fake_post_send(
    qp: *mut sys::ibv_qp,
    wr: *mut sys::ibv_send_wr,
    bad: *mut *mut sys::ibv_send_wr,
) -> libc::c_int {
    record("post_send", qp as usize, wr as u64, bad as usize);
    // Reports the first request as the bad one, as a provider does on failure.
    // SAFETY: the test passes a valid out-pointer.
    unsafe { *bad = wr };
    libc::ENOMEM
}

unsafe extern "C" fn fake_post_recv(
    qp: *mut sys::ibv_qp,
    wr: *mut sys::ibv_recv_wr,
    bad: *mut *mut sys::ibv_recv_wr,
) -> libc::c_int {
    record("post_recv", qp as usize, wr as u64, bad as usize);
    0
}

/// A zeroed context whose operation table holds the fakes.
fn fake_context() -> Box<sys::ibv_context> {
    // SAFETY: ibv_context is plain data (pointers, integers, optional function
    // pointers, a pthread mutex); all-zero is a valid value of each field.
    let mut ctx: Box<sys::ibv_context> = Box::new(unsafe { std::mem::zeroed() });
    ctx.ops.poll_cq = Some(fake_poll_cq);
    ctx.ops.req_notify_cq = Some(fake_req_notify_cq);
    ctx.ops.post_send = Some(fake_post_send);
    ctx.ops.post_recv = Some(fake_post_recv);
    ctx
}

#[test]
fn ibv_poll_cq_calls_the_context_op_with_its_arguments() {
    let mut ctx = fake_context();
    // SAFETY: as for the context: plain data, zero is valid.
    let mut cq: sys::ibv_cq = unsafe { std::mem::zeroed() };
    cq.context = &mut *ctx;
    // SAFETY: as above.
    let mut wc: [sys::ibv_wc; 4] = unsafe { std::mem::zeroed() };
    take();
    // SAFETY: `cq` names the fake context; `wc` holds 4 completions.
    let n = unsafe { sys::ibv_poll_cq(&mut cq, 4, wc.as_mut_ptr()) };
    assert_eq!(n, 1);
    assert_eq!(wc[0].wr_id, 0xC0FFEE);
    assert_eq!(take(), vec![("poll_cq", &cq as *const _ as usize, 4, wc.as_ptr() as usize)]);
}

#[test]
fn ibv_req_notify_cq_calls_the_context_op_with_its_arguments() {
    let mut ctx = fake_context();
    // SAFETY: plain data, zero is valid.
    let mut cq: sys::ibv_cq = unsafe { std::mem::zeroed() };
    cq.context = &mut *ctx;
    take();
    // SAFETY: `cq` names the fake context.
    let rc = unsafe { sys::ibv_req_notify_cq(&mut cq, 1) };
    assert_eq!(rc, 7);
    assert_eq!(take(), vec![("req_notify_cq", &cq as *const _ as usize, 1, 0)]);
}

#[test]
fn ibv_post_send_calls_the_context_op_and_passes_bad_wr_through() {
    let mut ctx = fake_context();
    // SAFETY: plain data, zero is valid.
    let mut qp: sys::ibv_qp = unsafe { std::mem::zeroed() };
    qp.context = &mut *ctx;
    // SAFETY: plain data, zero is valid.
    let mut wr: sys::ibv_send_wr = unsafe { std::mem::zeroed() };
    let mut bad: *mut sys::ibv_send_wr = ptr::null_mut();
    take();
    // SAFETY: `qp` names the fake context; `wr` and `bad` are valid.
    let rc = unsafe { sys::ibv_post_send(&mut qp, &mut wr, &mut bad) };
    assert_eq!(rc, libc::ENOMEM);
    assert_eq!(bad, &mut wr as *mut _);
    assert_eq!(take(), vec![("post_send", &qp as *const _ as usize, &wr as *const _ as u64, &bad as *const _ as usize)]);
}

#[test]
fn ibv_post_recv_calls_the_context_op_with_its_arguments() {
    let mut ctx = fake_context();
    // SAFETY: plain data, zero is valid.
    let mut qp: sys::ibv_qp = unsafe { std::mem::zeroed() };
    qp.context = &mut *ctx;
    // SAFETY: plain data, zero is valid.
    let mut wr: sys::ibv_recv_wr = unsafe { std::mem::zeroed() };
    let mut bad: *mut sys::ibv_recv_wr = ptr::null_mut();
    take();
    // SAFETY: `qp` names the fake context; `wr` and `bad` are valid.
    let rc = unsafe { sys::ibv_post_recv(&mut qp, &mut wr, &mut bad) };
    assert_eq!(rc, 0);
    assert!(bad.is_null());
    assert_eq!(take(), vec![("post_recv", &qp as *const _ as usize, &wr as *const _ as u64, &bad as *const _ as usize)]);
}

#[test]
fn rdma_get_peer_addr_names_the_routes_destination() {
    // SAFETY: rdma_cm_id is plain data (pointers, integers, unions of sockaddrs);
    // all-zero is a valid value.
    let mut id: sys::rdma_cm_id = unsafe { std::mem::zeroed() };
    let sin = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 4791u16.to_be(),
        sin_addr: libc::in_addr { s_addr: u32::from(std::net::Ipv4Addr::new(10, 77, 0, 2)).to_be() },
        sin_zero: [0; 8],
    };
    id.route.addr.dst_addr_union.dst_sin = sin;
    // SAFETY: `id` is a valid rdma_cm_id value; the helper only takes a reference into it.
    let sa = unsafe { sys::rdma_get_peer_addr(&id) };
    assert_eq!(sa as *const libc::sockaddr as usize, &raw const id.route.addr.dst_addr_union as usize);
    assert_eq!(sa.sa_family, libc::AF_INET as libc::sa_family_t);
    // SAFETY: an AF_INET address, as written above.
    let got = unsafe { &*(sa as *const libc::sockaddr).cast::<libc::sockaddr_in>() };
    assert_eq!(
        (u16::from_be(got.sin_port), u32::from_be(got.sin_addr.s_addr)),
        (4791, u32::from(std::net::Ipv4Addr::new(10, 77, 0, 2)))
    );
}
