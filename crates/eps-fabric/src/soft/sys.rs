//! Thin wrappers over the socket and eventfd syscalls the `soft` provider uses.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// Payloads from this size on are received with a raised SO_RCVLOWAT.
pub(crate) const LOWAT_MIN: usize = 64 * 1024;
/// The largest SO_RCVLOWAT used.
pub(crate) const LOWAT_MAX: usize = 256 * 1024;

/// Result of a nonblocking transfer.
pub(crate) enum Xfer {
    /// Bytes moved (never 0 for a receive: that is `Eof`).
    Done(usize),
    /// Nothing could move now.
    WouldBlock,
    /// The peer closed its sending side.
    Eof,
}

fn classify(r: isize, is_recv: bool) -> io::Result<Xfer> {
    if r < 0 {
        let e = io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::EAGAIN) | Some(libc::EINTR) => Ok(Xfer::WouldBlock),
            _ => Err(e),
        };
    }
    if r == 0 && is_recv {
        return Ok(Xfer::Eof);
    }
    Ok(Xfer::Done(r as usize))
}

fn msghdr(iov: &[libc::iovec]) -> libc::msghdr {
    // SAFETY: msghdr is plain old data; all-zero is a valid empty header.
    let mut m: libc::msghdr = unsafe { std::mem::zeroed() };
    m.msg_iov = iov.as_ptr() as *mut libc::iovec;
    m.msg_iovlen = iov.len() as _;
    m
}

/// Nonblocking gather-send.
///
/// # Safety
/// Every iovec must name memory readable for its whole length for the duration of the call.
pub(crate) unsafe fn send_iov(fd: RawFd, iov: &[libc::iovec]) -> io::Result<Xfer> {
    let m = msghdr(iov);
    // SAFETY: the caller guarantees the iovecs; the msghdr lives across the call.
    let r = unsafe { libc::sendmsg(fd, &m, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
    classify(r, false)
}

/// Nonblocking scatter-receive.
///
/// # Safety
/// Every iovec must name memory writable for its whole length for the duration of the
/// call, and nothing in this process may hold a Rust reference to it.
pub(crate) unsafe fn recv_iov(fd: RawFd, iov: &[libc::iovec]) -> io::Result<Xfer> {
    let mut m = msghdr(iov);
    // SAFETY: the caller guarantees the iovecs; the msghdr lives across the call.
    let r = unsafe { libc::recvmsg(fd, &mut m, libc::MSG_DONTWAIT) };
    classify(r, true)
}

/// `shutdown(2)`, ignoring "not connected".
pub(crate) fn shutdown(fd: &OwnedFd, how: libc::c_int) {
    // SAFETY: fd is a valid open descriptor owned by the caller's Arc.
    unsafe {
        libc::shutdown(fd.as_raw_fd(), how);
    }
}

/// Creates a nonblocking eventfd.
pub(crate) fn eventfd() -> io::Result<OwnedFd> {
    // SAFETY: eventfd has no memory preconditions; the result is checked.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Adds 1 to an eventfd's counter (wakes a reader).
pub(crate) fn eventfd_signal(fd: &OwnedFd) {
    let one: u64 = 1;
    // SAFETY: writes 8 bytes from a live local to a valid eventfd.
    unsafe {
        libc::write(fd.as_raw_fd(), (&one as *const u64).cast(), 8);
    }
}

/// Waits until `fd` is readable or `timeout_ms` passes; true if readable.
pub(crate) fn wait_readable(fd: RawFd, timeout_ms: i32) -> io::Result<bool> {
    let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd on the stack.
    let r = unsafe { libc::poll(&mut p, 1, timeout_ms) };
    if r < 0 {
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::Interrupted {
            return Ok(false);
        }
        return Err(e);
    }
    Ok(r > 0)
}

/// Sets TCP_NODELAY and nonblocking mode on a connected stream.
pub(crate) fn prepare_stream(s: &std::net::TcpStream) -> io::Result<()> {
    s.set_nodelay(true)?;
    s.set_read_timeout(None)?;
    s.set_write_timeout(None)?;
    s.set_nonblocking(true)
}

/// True if a `send` on `fd` would make progress now (POLLOUT, or an error to report).
pub(crate) fn writable(fd: RawFd) -> bool {
    let mut p = libc::pollfd { fd, events: libc::POLLOUT, revents: 0 };
    // SAFETY: one valid pollfd on the stack; zero timeout.
    let r = unsafe { libc::poll(&mut p, 1, 0) };
    r != 0
}

/// Sets SO_RCVLOWAT: readiness (and io_uring wake-ups) only once `bytes` are queued.
pub(crate) fn set_rcvlowat(fd: RawFd, bytes: usize) {
    let v = bytes.min(i32::MAX as usize) as libc::c_int;
    // SAFETY: passes a pointer to a live c_int and its size.
    unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_RCVLOWAT,
            (&v as *const libc::c_int).cast(),
            size_of::<libc::c_int>() as libc::socklen_t,
        );
    }
}

/// True if `fd` is readable now (honours SO_RCVLOWAT), or has an error or EOF to report.
pub(crate) fn readable(fd: RawFd) -> bool {
    let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd on the stack; zero timeout.
    let r = unsafe { libc::poll(&mut p, 1, 0) };
    r != 0
}

/// Empties an eventfd's counter.
pub(crate) fn eventfd_drain(fd: &OwnedFd) {
    let mut v: u64 = 0;
    // SAFETY: reads 8 bytes into a live local from a valid nonblocking eventfd.
    unsafe {
        libc::read(fd.as_raw_fd(), (&mut v as *mut u64).cast(), 8);
    }
}

/// poll(2) over `fds` for up to `timeout_ms`.
pub(crate) fn poll_fds(fds: &mut [libc::pollfd], timeout_ms: i32) {
    // SAFETY: the pointer and length describe a live, writable slice of pollfds.
    unsafe {
        libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout_ms);
    }
}
