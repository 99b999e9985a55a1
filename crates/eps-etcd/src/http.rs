//! Just enough HTTP/1.1 for etcd's JSON gateway: a POST with a JSON body on a
//! kept-alive connection; the answer's body by `Content-Length` or chunked.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

/// The largest answer read (a page of a range is far smaller).
const MAX_BODY: usize = 64 << 20;

/// One connection to one endpoint.
#[derive(Debug)]
pub struct Conn {
    host: String,
    r: BufReader<TcpStream>,
}

impl Conn {
    /// Connects to `host` (`HOST:PORT`) within `timeout`; reads and writes
    /// time out after `timeout` too.
    pub fn open(host: &str, timeout: Duration) -> std::io::Result<Self> {
        let mut last = None;
        for addr in host.to_socket_addrs()? {
            match TcpStream::connect_timeout(&addr, timeout) {
                Ok(s) => {
                    s.set_nodelay(true)?;
                    s.set_read_timeout(Some(timeout))?;
                    s.set_write_timeout(Some(timeout))?;
                    return Ok(Self { host: host.to_string(), r: BufReader::new(s) });
                }
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| std::io::Error::new(std::io::ErrorKind::NotFound, "the name resolves to no address")))
    }

    /// POSTs `body` to `path`; returns the status code and the answer's body.
    pub fn post(&mut self, path: &str, body: &[u8]) -> std::io::Result<(u16, Vec<u8>)> {
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            self.host,
            body.len()
        );
        let s = self.r.get_mut();
        s.write_all(head.as_bytes())?;
        s.write_all(body)?;
        let status = self.line()?;
        let code = status
            .strip_prefix("HTTP/1.")
            .and_then(|r| r.get(2..5))
            .and_then(|c| c.parse::<u16>().ok())
            .ok_or_else(|| bad(format!("not an HTTP answer: {:?}", status.chars().take(60).collect::<String>())))?;
        let (mut length, mut chunked) = (None, false);
        loop {
            let h = self.line()?;
            if h.is_empty() {
                break;
            }
            let Some((name, value)) = h.split_once(':') else { continue };
            let value = value.trim();
            if name.eq_ignore_ascii_case("content-length") {
                length = Some(value.parse::<usize>().map_err(|_| bad("a bad Content-Length".into()))?);
            } else if name.eq_ignore_ascii_case("transfer-encoding") && value.eq_ignore_ascii_case("chunked") {
                chunked = true;
            }
        }
        let body = match (chunked, length) {
            (true, _) => self.chunked()?,
            (false, Some(n)) if n <= MAX_BODY => {
                let mut b = vec![0; n];
                self.r.read_exact(&mut b)?;
                b
            }
            (false, Some(n)) => return Err(bad(format!("an answer of {n} bytes"))),
            (false, None) => return Err(bad("an answer with neither a length nor chunks".into())),
        };
        Ok((code, body))
    }

    fn chunked(&mut self) -> std::io::Result<Vec<u8>> {
        let mut body = Vec::new();
        loop {
            let size = self.line()?;
            let size = usize::from_str_radix(size.split(';').next().unwrap_or("").trim(), 16)
                .map_err(|_| bad(format!("a bad chunk size {size:?}")))?;
            if size == 0 {
                // Trailers, up to the empty line.
                while !self.line()?.is_empty() {}
                return Ok(body);
            }
            if body.len() + size > MAX_BODY {
                return Err(bad("an answer too large".into()));
            }
            let at = body.len();
            body.resize(at + size, 0);
            self.r.read_exact(&mut body[at..])?;
            if !self.line()?.is_empty() {
                return Err(bad("a chunk longer than it said".into()));
            }
        }
    }

    /// One header line, without its CRLF; the connection closing is an error.
    fn line(&mut self) -> std::io::Result<String> {
        let mut l = String::new();
        if self.r.by_ref().take(16 << 10).read_line(&mut l)? == 0 {
            return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "etcd closed the connection"));
        }
        Ok(l.trim_end_matches(['\r', '\n']).to_string())
    }
}

fn bad(what: String) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, what)
}
