//! `--metrics ADDR`: `/metrics` (the registry in the Prometheus text format)
//! and `/healthz` (200 and "ok", or 503 and why) over HTTP/1.1 on a thread
//! of its own. One request per connection; nothing else is served.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Duration;

/// The role's health: `Ok(detail)` when it serves, `Err(why)` when not.
pub type Health = Arc<dyn Fn() -> Result<String, String> + Send + Sync>;

/// A running endpoint.
#[derive(Debug)]
pub struct Endpoint {
    addr: SocketAddr,
}

impl Endpoint {
    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

/// Serves the process's registry and `health` on `addr` (port 0: any) until
/// the process exits.
pub fn serve(addr: SocketAddr, health: Health) -> std::io::Result<Endpoint> {
    let l = TcpListener::bind(addr)?;
    let addr = l.local_addr()?;
    std::thread::Builder::new().name("eps-metrics".into()).spawn(move || {
        for c in l.incoming().flatten() {
            // A slow client waits alone; scrapes are rare.
            let _ = answer(c, &health);
        }
    })?;
    Ok(Endpoint { addr })
}

fn answer(c: TcpStream, health: &Health) -> std::io::Result<()> {
    c.set_read_timeout(Some(Duration::from_secs(5)))?;
    c.set_write_timeout(Some(Duration::from_secs(5)))?;
    let mut r = BufReader::new(c.try_clone()?);
    let mut first = String::new();
    r.read_line(&mut first)?;
    // The headers, up to the blank line.
    let mut line = String::new();
    while r.read_line(&mut line)? > 2 {
        line.clear();
    }
    let mut parts = first.split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let (status, ctype, body) = match (method, path.split('?').next().unwrap_or("")) {
        ("GET", "/metrics") => ("200 OK", "text/plain; version=0.0.4; charset=utf-8", crate::global().render()),
        ("GET", "/healthz") => match health() {
            Ok(d) => ("200 OK", "text/plain; charset=utf-8", format!("ok {d}\n")),
            Err(e) => ("503 Service Unavailable", "text/plain; charset=utf-8", format!("unhealthy: {e}\n")),
        },
        ("GET", _) => ("404 Not Found", "text/plain; charset=utf-8", "try /metrics or /healthz\n".into()),
        _ => ("405 Method Not Allowed", "text/plain; charset=utf-8", "GET only\n".into()),
    };
    let mut w = c;
    write!(w, "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", body.len())?;
    w.write_all(body.as_bytes())?;
    w.flush()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    fn get(addr: SocketAddr, path: &str) -> String {
        let mut c = TcpStream::connect(addr).unwrap();
        write!(c, "GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        let mut s = String::new();
        c.read_to_string(&mut s).unwrap();
        s
    }

    #[test]
    fn metrics_and_health_are_served() {
        crate::global().counter("eps_test_http_total", "A test counter.", &[]).add(5);
        let up = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let u = up.clone();
        let health: Health =
            Arc::new(
                move || {
                    if u.load(std::sync::atomic::Ordering::Relaxed) { Ok("serving".into()) } else { Err("stopped".into()) }
                },
            );
        let e = serve("127.0.0.1:0".parse().unwrap(), health).unwrap();
        let m = get(e.addr(), "/metrics");
        assert!(m.starts_with("HTTP/1.1 200 OK\r\n") && m.contains("version=0.0.4"), "{m}");
        assert!(m.contains("\r\n\r\n") && m.contains("eps_test_http_total 5\n"), "{m}");
        assert!(get(e.addr(), "/healthz").ends_with("\r\n\r\nok serving\n"));
        up.store(false, std::sync::atomic::Ordering::Relaxed);
        let h = get(e.addr(), "/healthz");
        assert!(h.starts_with("HTTP/1.1 503") && h.ends_with("unhealthy: stopped\n"), "{h}");
        assert!(get(e.addr(), "/x").starts_with("HTTP/1.1 404"));
    }
}
