//! Thin wrappers over the syscalls the `shm` provider uses: abstract-namespace
//! `SOCK_SEQPACKET` Unix sockets, descriptor passing (`SCM_RIGHTS`), peer
//! credentials, mappings of a peer's memfd, and cross-process copies.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

/// Largest control message on a QP's socket.
pub(crate) const MSG_MAX: usize = 64;
/// Most descriptors one control message carries.
pub(crate) const MAX_FDS: usize = 3;

fn check(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 { Err(io::Error::last_os_error()) } else { Ok(r) }
}

/// An abstract-namespace socket address (`\0` + name): it lives in the network
/// namespace, not the filesystem, and vanishes with its socket.
fn abstract_addr(name: &str) -> io::Result<(libc::sockaddr_un, libc::socklen_t)> {
    // SAFETY: sockaddr_un is plain old data; all-zero is valid.
    let mut a: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    a.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let b = name.as_bytes();
    if b.len() + 1 > a.sun_path.len() {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "socket name too long"));
    }
    for (d, &s) in a.sun_path[1..].iter_mut().zip(b) {
        *d = s as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sa_family_t>() + 1 + b.len();
    Ok((a, len as libc::socklen_t))
}

fn seqpacket() -> io::Result<OwnedFd> {
    // SAFETY: socket has no memory preconditions; the result is checked.
    let fd = check(unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0) })?;
    // SAFETY: a fresh descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Binds and listens on the abstract name `name` (nonblocking accepts).
pub(crate) fn listen(name: &str) -> io::Result<OwnedFd> {
    let fd = seqpacket()?;
    let (a, len) = abstract_addr(name)?;
    // SAFETY: `a` is a valid sockaddr_un of `len` bytes; fd is ours.
    check(unsafe { libc::bind(fd.as_raw_fd(), (&a as *const libc::sockaddr_un).cast(), len) })?;
    // SAFETY: as above.
    check(unsafe { libc::listen(fd.as_raw_fd(), 128) })?;
    set_nonblocking(fd.as_raw_fd(), true)?;
    Ok(fd)
}

/// Connects to the abstract name `name` (blocking socket).
pub(crate) fn connect(name: &str) -> io::Result<OwnedFd> {
    let fd = seqpacket()?;
    let (a, len) = abstract_addr(name)?;
    // SAFETY: `a` is a valid sockaddr_un of `len` bytes; fd is ours.
    check(unsafe { libc::connect(fd.as_raw_fd(), (&a as *const libc::sockaddr_un).cast(), len) })?;
    Ok(fd)
}

/// Accepts one connection if one is waiting.
pub(crate) fn accept(listener: RawFd) -> io::Result<Option<OwnedFd>> {
    // SAFETY: null address out-parameters are allowed; the result is checked.
    let r = unsafe { libc::accept4(listener, std::ptr::null_mut(), std::ptr::null_mut(), libc::SOCK_CLOEXEC) };
    if r < 0 {
        let e = io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::EAGAIN) | Some(libc::EINTR) | Some(libc::ECONNABORTED) => Ok(None),
            _ => Err(e),
        };
    }
    // SAFETY: a fresh descriptor nothing else owns.
    Ok(Some(unsafe { OwnedFd::from_raw_fd(r) }))
}

pub(crate) fn set_nonblocking(fd: RawFd, on: bool) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor the caller owns; results are checked.
    let flags = check(unsafe { libc::fcntl(fd, libc::F_GETFL) })?;
    let flags = if on { flags | libc::O_NONBLOCK } else { flags & !libc::O_NONBLOCK };
    // SAFETY: as above.
    check(unsafe { libc::fcntl(fd, libc::F_SETFL, flags) }).map(drop)
}

/// Receive and send timeouts of a blocking socket.
pub(crate) fn set_timeouts(fd: RawFd, t: Duration) -> io::Result<()> {
    let tv = libc::timeval { tv_sec: t.as_secs() as libc::time_t, tv_usec: t.subsec_micros() as libc::suseconds_t };
    for opt in [libc::SO_RCVTIMEO, libc::SO_SNDTIMEO] {
        // SAFETY: the option value is a timeval living across the call.
        check(unsafe {
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                opt,
                (&tv as *const libc::timeval).cast(),
                std::mem::size_of::<libc::timeval>() as libc::socklen_t,
            )
        })?;
    }
    Ok(())
}

/// The process id and user id at the other end of a Unix socket, as the kernel
/// recorded them at connect time.
pub(crate) fn peer_cred(fd: RawFd) -> io::Result<(u32, u32)> {
    // SAFETY: ucred is plain old data.
    let mut c: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: the out-parameters name `c` and `len`, sized for the option.
    check(unsafe { libc::getsockopt(fd, libc::SOL_SOCKET, libc::SO_PEERCRED, (&mut c as *mut libc::ucred).cast(), &mut len) })?;
    Ok((c.pid as u32, c.uid))
}

/// This process's user id.
pub(crate) fn my_uid() -> u32 {
    // SAFETY: getuid cannot fail.
    unsafe { libc::getuid() }
}

/// Sends one control message with up to [`MAX_FDS`] descriptors.
pub(crate) fn send_msg(fd: RawFd, msg: &[u8], fds: &[RawFd]) -> io::Result<()> {
    assert!(fds.len() <= MAX_FDS && msg.len() <= MSG_MAX);
    let mut iov = libc::iovec { iov_base: msg.as_ptr() as *mut _, iov_len: msg.len() };
    let mut cbuf = [0u64; 8]; // aligned room for one SCM_RIGHTS header and MAX_FDS ints
    // SAFETY: msghdr is plain old data.
    let mut m: libc::msghdr = unsafe { std::mem::zeroed() };
    m.msg_iov = &mut iov;
    m.msg_iovlen = 1;
    if !fds.is_empty() {
        let bytes = std::mem::size_of_val(fds) as u32;
        // SAFETY: CMSG_SPACE is a pure computation.
        m.msg_controllen = unsafe { libc::CMSG_SPACE(bytes) } as _;
        m.msg_control = cbuf.as_mut_ptr().cast();
        // SAFETY: the control buffer is 64 bytes, more than CMSG_SPACE of 3 ints;
        // CMSG_FIRSTHDR of a msghdr with a control buffer is non-null.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&m);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(bytes) as _;
            std::ptr::copy_nonoverlapping(fds.as_ptr(), libc::CMSG_DATA(c).cast::<RawFd>(), fds.len());
        }
    }
    loop {
        // SAFETY: the msghdr names `msg` and the control buffer, both alive across the call.
        let r = unsafe { libc::sendmsg(fd, &m, libc::MSG_NOSIGNAL) };
        if r == msg.len() as isize {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if r < 0 && e.kind() == io::ErrorKind::Interrupted {
            continue;
        }
        return Err(if r < 0 { e } else { io::Error::new(io::ErrorKind::WriteZero, "short control message") });
    }
}

/// What one `recv_msg` got.
pub(crate) enum Got {
    /// A whole message (its bytes, its length) and the descriptors it carried.
    Msg([u8; MSG_MAX], usize, Vec<OwnedFd>),
    /// Nothing waiting (nonblocking).
    Empty,
    /// The peer closed its end.
    Closed,
}

/// Receives one control message. `nonblocking`: return [`Got::Empty`] at once
/// when none is waiting. A message larger than [`MSG_MAX`] is an error.
pub(crate) fn recv_msg(fd: RawFd, nonblocking: bool) -> io::Result<Got> {
    let mut msg = [0u8; MSG_MAX];
    let mut iov = libc::iovec { iov_base: msg.as_mut_ptr().cast(), iov_len: MSG_MAX };
    let mut cbuf = [0u64; 8];
    // SAFETY: msghdr is plain old data.
    let mut m: libc::msghdr = unsafe { std::mem::zeroed() };
    m.msg_iov = &mut iov;
    m.msg_iovlen = 1;
    m.msg_control = cbuf.as_mut_ptr().cast();
    m.msg_controllen = std::mem::size_of_val(&cbuf) as _;
    let flags = libc::MSG_CMSG_CLOEXEC | if nonblocking { libc::MSG_DONTWAIT } else { 0 };
    let r = loop {
        // SAFETY: the msghdr names `msg` and `cbuf`, both alive across the call.
        let r = unsafe { libc::recvmsg(fd, &mut m, flags) };
        if r < 0 {
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EINTR) => continue,
                Some(libc::EAGAIN) if nonblocking => return Ok(Got::Empty),
                _ => return Err(e),
            }
        }
        break r as usize;
    };
    // Take ownership of every descriptor that came, even with a bad message.
    let mut fds = Vec::new();
    // SAFETY: the kernel filled the control buffer; CMSG_* walk it within
    // msg_controllen, and each SCM_RIGHTS payload holds whole ints.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&m);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let n = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize) / std::mem::size_of::<RawFd>();
                let p = libc::CMSG_DATA(c).cast::<RawFd>();
                for i in 0..n {
                    fds.push(OwnedFd::from_raw_fd(p.add(i).read_unaligned()));
                }
            }
            c = libc::CMSG_NXTHDR(&m, c);
        }
    }
    if r == 0 {
        return Ok(Got::Closed);
    }
    if m.msg_flags & (libc::MSG_TRUNC | libc::MSG_CTRUNC) != 0 {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "malformed control message"));
    }
    Ok(Got::Msg(msg, r, fds))
}

/// A peer's memfd mapped here, read-write and shared.
#[derive(Debug)]
pub(crate) struct PeerMap {
    pub(crate) ptr: *mut u8,
    pub(crate) len: usize,
}

// SAFETY: the mapping is plain shared memory owned by this value; it is only
// reached through raw copies whose callers check bounds.
unsafe impl Send for PeerMap {}
// SAFETY: as above.
unsafe impl Sync for PeerMap {}

impl PeerMap {
    /// Maps the whole of a peer's memfd after checking that its size is sealed
    /// (so the peer cannot shrink it under the mapping and fault this process),
    /// and that it holds at least `min_len` bytes.
    pub(crate) fn new(fd: &OwnedFd, min_len: usize) -> io::Result<Self> {
        let raw = fd.as_raw_fd();
        // SAFETY: fcntl on a descriptor we own.
        let seals = check(unsafe { libc::fcntl(raw, libc::F_GET_SEALS) })?;
        if seals & libc::F_SEAL_SHRINK == 0 {
            return Err(io::Error::new(io::ErrorKind::PermissionDenied, "the peer's memory is not sealed against shrinking"));
        }
        // SAFETY: stat is plain old data; fstat fills it.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: the out-parameter names `st`.
        check(unsafe { libc::fstat(raw, &mut st) })?;
        let len = st.st_size as usize;
        if len < min_len.max(1) {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "the peer's memory is smaller than it says"));
        }
        // SAFETY: a shared mapping of a sealed memfd with no address hint; checked.
        let ptr = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, raw, 0) };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Self { ptr: ptr.cast(), len })
    }
}

impl Drop for PeerMap {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, which nothing refers to any more.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// Copies `len` bytes between this process (`local`) and `pid`'s address space
/// (`remote`): from the peer when `from_peer`, else into it.
///
/// # Safety
/// `local` must name `len` bytes of this process valid for the direction (writable
/// when `from_peer`, readable otherwise) that no Rust reference aliases.
pub(crate) unsafe fn vm_copy(pid: u32, local: *mut u8, remote: u64, len: usize, from_peer: bool) -> io::Result<()> {
    let mut done = 0;
    while done < len {
        let l = libc::iovec { iov_base: local.wrapping_add(done).cast(), iov_len: len - done };
        let r = libc::iovec { iov_base: (remote as usize + done) as *mut _, iov_len: len - done };
        // SAFETY: the local iovec is the caller's; a bad remote address only fails the call.
        let n = unsafe {
            if from_peer {
                libc::process_vm_readv(pid as libc::pid_t, &l, 1, &r, 1, 0)
            } else {
                libc::process_vm_writev(pid as libc::pid_t, &l, 1, &r, 1, 0)
            }
        };
        if n <= 0 {
            return Err(if n < 0 { io::Error::last_os_error() } else { io::Error::from(io::ErrorKind::UnexpectedEof) });
        }
        done += n as usize;
    }
    Ok(())
}

/// Writes 1 to an eventfd (nonblocking; a full counter already means "wake").
pub(crate) fn signal(fd: &OwnedFd) {
    let one: u64 = 1;
    // SAFETY: writes 8 bytes from a local to a descriptor we own.
    unsafe { libc::write(fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
}

/// Lets processes of this user reach this one's memory with `process_vm_readv`
/// and `writev` where Yama restricts that to descendants (`ptrace_scope` 1): its
/// shm peers copy to and from memory registered in place. Where Yama is absent or
/// off nothing changes; the kernel's same-user check always applies. Once per
/// process, said once.
pub(crate) fn allow_same_user_peers() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if std::path::Path::new("/proc/sys/kernel/yama/ptrace_scope").exists() {
            // SAFETY: prctl with integer arguments only.
            let r = unsafe { libc::prctl(libc::PR_SET_PTRACER, libc::PR_SET_PTRACER_ANY, 0, 0, 0) };
            if r == 0 {
                crate::stats::warn(
                    "eps-fabric: shm: memory registered in place is copied by peers of this user with process_vm_readv/writev; \
                     this process lets them (PR_SET_PTRACER_ANY, Yama)",
                );
            }
        }
    });
}

/// Raises this process's soft limit on open descriptors to its hard limit, once:
/// every shm region holds its memfd open for as long as it is registered (to hand
/// it to the peers that will copy from it), so a server with many shards needs
/// more than the usual 1024.
pub(crate) fn raise_fd_limit() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: rlimit is plain old data; getrlimit fills it.
        let mut r: libc::rlimit = unsafe { std::mem::zeroed() };
        // SAFETY: the out-parameter names `r`.
        if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } == 0 && r.rlim_cur < r.rlim_max {
            r.rlim_cur = r.rlim_max;
            // SAFETY: sets the limit from a valid rlimit; a refusal changes nothing.
            unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &r) };
        }
    });
}
