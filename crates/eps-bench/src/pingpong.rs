//! The latency references of a small round: a 64-byte TCP ping-pong on
//! loopback (`TCP_NODELAY`), once with both ends polling non-blocking
//! sockets in a loop and once with both ends sleeping in blocking reads. A
//! round of EPS is a request and an answer too; on these machines the
//! difference between the two figures is the cost of the wake-ups.

use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Instant;

/// Bytes each way.
pub const MESSAGE: usize = 64;

/// How the receiving ends wait.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wait {
    /// Non-blocking reads in a loop.
    Poll,
    /// Blocking reads (the thread sleeps until data comes).
    Block,
}

/// Round-trip times of one run, microseconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PingPong {
    /// Median.
    pub p50_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
}

fn read_all(s: &mut TcpStream, buf: &mut [u8], wait: Wait) -> std::io::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        match s.read(&mut buf[got..]) {
            Ok(0) => return Err(ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == ErrorKind::WouldBlock && wait == Wait::Poll => std::hint::spin_loop(),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn prepare(s: &TcpStream, wait: Wait) -> std::io::Result<()> {
    s.set_nodelay(true)?;
    s.set_nonblocking(wait == Wait::Poll)
}

/// `rounds` ping-pongs of [`MESSAGE`] bytes between two threads of this
/// process over 127.0.0.1 (after a tenth as many, at least 10, to warm up).
pub fn run(rounds: usize, wait: Wait) -> std::io::Result<PingPong> {
    let warm = (rounds / 10).max(10);
    let l = TcpListener::bind("127.0.0.1:0")?;
    let at = l.local_addr()?;
    let echo = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = l.accept()?;
        prepare(&s, wait)?;
        let mut buf = [0u8; MESSAGE];
        for _ in 0..warm + rounds {
            read_all(&mut s, &mut buf, wait)?;
            s.write_all(&buf)?;
        }
        Ok(())
    });
    let mut s = TcpStream::connect(at)?;
    prepare(&s, wait)?;
    let mut buf = [7u8; MESSAGE];
    let mut us = Vec::with_capacity(rounds);
    for i in 0..warm + rounds {
        let t = Instant::now();
        s.write_all(&buf)?;
        read_all(&mut s, &mut buf, wait)?;
        if i >= warm {
            us.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    echo.join().map_err(|_| std::io::Error::other("the echo thread panicked"))??;
    us.sort_by(|a, b| a.total_cmp(b));
    let at = |q: f64| us[((us.len() - 1) as f64 * q).round() as usize];
    Ok(PingPong { p50_us: at(0.5), p99_us: at(0.99) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_ways_of_waiting_give_ordered_percentiles() {
        for wait in [Wait::Poll, Wait::Block] {
            let p = run(200, wait).expect("loopback ping-pong");
            assert!(p.p50_us > 0.0 && p.p99_us >= p.p50_us, "{wait:?}: {p:?}");
        }
    }
}
