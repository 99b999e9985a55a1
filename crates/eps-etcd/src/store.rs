//! The control plane's state in etcd, for clusters: the same log of records
//! as the file store, one key per record under the job's prefix, each
//! written only while its writer leads the job (a transaction that checks the
//! leader key's creation revision: a deposed leader's writes fail).
//!
//! Keys under `PREFIX/jobs/JOB/`: `owner` (a fingerprint of the job secret:
//! a second job with the same id is refused), `leader` (the elected control
//! plane's address and pid, on its lease), `log/NNNNNNNNNNNNNNNNNNNN` (the
//! records, in order).

use std::cell::{Cell, RefCell};
use std::time::Duration;

use crate::{Client, Compare, EtcdError, Op};

use eps_control::store::Store;

/// How many records a replay reads at once.
const PAGE: i64 = 512;

/// `etcd://HOST:PORT[,HOST:PORT...][/PREFIX]`: where a job's state goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EtcdTarget {
    /// `HOST:PORT` of each etcd member.
    pub endpoints: Vec<String>,
    /// The key prefix of every EPS job (default `/eps`).
    pub prefix: String,
}

impl std::str::FromStr for EtcdTarget {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let rest = s
            .strip_prefix("etcd://")
            .ok_or_else(|| format!("{s:?}: an etcd store is etcd://HOST:PORT[,HOST:PORT...][/PREFIX]"))?;
        let (hosts, prefix) = match rest.find('/') {
            Some(i) => (&rest[..i], rest[i..].trim_end_matches('/')),
            None => (rest, "/eps"),
        };
        let endpoints: Vec<String> = hosts.split(',').map(str::trim).map(str::to_string).collect();
        for e in &endpoints {
            let ok = e.rsplit_once(':').is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p > 0));
            if !ok {
                return Err(format!("{s:?}: {e:?} is not an etcd endpoint's HOST:PORT"));
            }
        }
        check_prefix(prefix).map_err(|why| format!("{s:?}: the key prefix {prefix:?} {why}"))?;
        Ok(Self { endpoints, prefix: prefix.to_string() })
    }
}

impl std::fmt::Display for EtcdTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "etcd://{}{}", self.endpoints.join(","), self.prefix)
    }
}

/// A key prefix is `/` and path segments of letters, digits, `-`, `_`, `.`.
fn check_prefix(p: &str) -> Result<(), &'static str> {
    if p.is_empty() {
        return Err("is empty (give /NAME, or leave it out for /eps)");
    }
    if !p.starts_with('/') {
        return Err("must start with /");
    }
    for seg in p[1..].split('/') {
        if seg.is_empty() || seg == "." || seg == ".." {
            return Err("has an empty, . or .. segment");
        }
        if !seg.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b)) {
            return Err("may hold only letters, digits, -, _, . and /");
        }
    }
    Ok(())
}

impl EtcdTarget {
    /// The prefix of job `job`'s keys (it ends with `/`).
    pub fn job_prefix(&self, job: &str) -> Vec<u8> {
        format!("{}/jobs/{job}/", self.prefix).into_bytes()
    }

    /// A client of this etcd, or a clear error within a few seconds.
    pub fn connect(&self) -> Result<Client, EtcdError> {
        Client::connect(&self.endpoints, Duration::from_secs(3))
    }
}

/// Claims job `job`'s keys for the holder of the secret whose fingerprint is
/// `owner`: the first control plane of a job writes it, its standbys and
/// restarts find it; another job with the same id is refused.
pub fn claim(c: &mut Client, target: &EtcdTarget, job: &str, owner: &[u8]) -> Result<(), String> {
    let key = [target.job_prefix(job).as_slice(), b"owner"].concat();
    let put = Op::Put { key: key.clone(), value: owner.to_vec(), lease: 0 };
    let t = c.txn(&[Compare::Created(key.clone(), 0)], &[put], &[Op::Get(key)]).map_err(|e| e.to_string())?;
    match t.gets.first().cloned().flatten() {
        _ if t.succeeded => Ok(()),
        Some(kv) if kv.value == owner => Ok(()),
        _ => Err(format!(
            "job {job:?} already exists in {target} and belongs to another run (another job secret): give this job \
             another name, or another prefix; if that job is over, remove its state with `etcdctl del --prefix {}`",
            String::from_utf8_lossy(&target.job_prefix(job))
        )),
    }
}

/// The log of one job in etcd, written while its writer leads.
#[derive(Debug)]
pub struct EtcdStore {
    /// (Borrowed by one call at a time: a replay, or an append.)
    c: RefCell<Client>,
    /// The job's key prefix.
    base: Vec<u8>,
    /// The creation revision of the leader key this writer holds.
    fence: i64,
    /// The number of the next record (known once replayed).
    next: Cell<u64>,
}

impl EtcdStore {
    /// The store of the job under `base` (see [`EtcdTarget::job_prefix`]),
    /// written while the leader key created at revision `fence` stands.
    pub fn new(c: Client, base: Vec<u8>, fence: i64) -> Self {
        Self { c: RefCell::new(c), base, fence, next: Cell::new(0) }
    }

    fn record_key(&self, n: u64) -> Vec<u8> {
        [self.base.as_slice(), format!("log/{n:020}").as_bytes()].concat()
    }
}

fn io(e: EtcdError) -> std::io::Error {
    std::io::Error::other(e)
}

impl Store for EtcdStore {
    fn append(&mut self, record: &[u8]) -> std::io::Result<()> {
        let n = self.next.get();
        let (key, leader) = (self.record_key(n), [self.base.as_slice(), b"leader"].concat());
        let put = Op::Put { key: key.clone(), value: record.to_vec(), lease: 0 };
        let cmp = [Compare::Created(leader.clone(), self.fence), Compare::Created(key.clone(), 0)];
        let t = self.c.get_mut().txn(&cmp, &[put], &[Op::Get(leader), Op::Get(key)]).map_err(io)?;
        match (t.gets.first().cloned().flatten(), t.gets.get(1).cloned().flatten()) {
            _ if t.succeeded => {}
            // Sent twice after a dropped connection: the first went through.
            (Some(l), Some(r)) if l.create_revision == self.fence && r.value == record => {}
            (l, _) if l.as_ref().is_none_or(|l| l.create_revision != self.fence) => {
                return Err(std::io::Error::other(format!(
                    "fenced: this control plane no longer leads the job (the leader now: {})",
                    l.map_or("none".into(), |l| String::from_utf8_lossy(&l.value).into_owned())
                )));
            }
            _ => return Err(std::io::Error::other(format!("record {n} of the job's log was written by another writer"))),
        }
        self.next.set(n + 1);
        Ok(())
    }

    fn replay(&self, f: &mut dyn FnMut(&[u8]) -> Result<(), String>) -> std::io::Result<Result<u64, String>> {
        let mut c = self.c.borrow_mut();
        let first = self.record_key(0);
        let end = crate::prefix_end(&[self.base.as_slice(), b"log/"].concat());
        let (mut from, mut n) = (first, 0u64);
        loop {
            let (page, more) = c.range(&from, &end, PAGE).map_err(io)?;
            for kv in &page {
                if kv.key != self.record_key(n) {
                    return Ok(Err(format!("record {n} is missing from the job's log in etcd")));
                }
                if let Err(e) = f(&kv.value) {
                    return Ok(Err(e));
                }
                n += 1;
            }
            match page.last() {
                Some(last) if more => from = [last.key.as_slice(), b"\0"].concat(),
                _ => break,
            }
        }
        self.next.set(n);
        Ok(Ok(n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::AtomicBool;

    /// Two control planes of one job: the first leads and writes; once its
    /// lease is gone and the second leads, the first's writes are fenced,
    /// the second replays every record and goes on; a second job with the
    /// same id and another secret cannot claim the keys.
    #[test]
    fn a_deposed_leaders_writes_are_fenced_and_its_successor_replays_the_log() {
        let etcd = match crate::testing::TestEtcd::get() {
            Ok(e) => e,
            Err(why) => return crate::testing::skip("a_deposed_leaders_writes_are_fenced", &format!("no etcd: {why}")),
        };
        let target: EtcdTarget = format!("etcd://{}/eps-store-test-{}", etcd.endpoint, std::process::id()).parse().unwrap();
        let mut c = target.connect().unwrap();
        c.delete_prefix(target.prefix.as_bytes()).unwrap();
        claim(&mut c, &target, "j", b"owner-a").unwrap();
        claim(&mut c, &target, "j", b"owner-a").unwrap();
        let e = claim(&mut c, &target, "j", b"owner-b").unwrap_err();
        assert!(e.contains("belongs to another run"), "{e}");
        let base = target.job_prefix("j");
        let never = AtomicBool::new(false);
        let lost = Arc::new(AtomicBool::new(false));
        let first = crate::election::campaign(&mut c, &base, "a", 2, &never, lost.clone(), &mut |_| {}).unwrap().unwrap();
        let mut a = EtcdStore::new(target.connect().unwrap(), base.clone(), first.fence);
        assert_eq!(a.replay(&mut |_| Ok(())).unwrap().unwrap(), 0);
        for r in [&b"one"[..], b"", b"three"] {
            a.append(r).unwrap();
        }
        // The leader resigns (as if its lease ran out); another is elected.
        first.resign();
        let mut c2 = target.connect().unwrap();
        let second = crate::election::campaign(&mut c2, &base, "b", 2, &never, lost, &mut |_| {}).unwrap().unwrap();
        assert_ne!(second.fence, 0);
        let e = a.append(b"late").unwrap_err();
        assert!(e.to_string().contains("fenced") && e.to_string().contains("the leader now: b"), "{e}");
        let b = EtcdStore::new(target.connect().unwrap(), base.clone(), second.fence);
        assert_eq!(b.records().unwrap(), vec![b"one".to_vec(), b"".to_vec(), b"three".to_vec()]);
        let mut b = b;
        b.append(b"four").unwrap();
        assert_eq!(b.records().unwrap().len(), 4);
        assert_eq!(crate::election::leader(&mut c2, &base).unwrap().as_deref(), Some("b"));
        second.resign();
        assert_eq!(crate::election::leader(&mut c2, &base).unwrap(), None, "resigning ends the lease");
        c2.delete_prefix(target.prefix.as_bytes()).unwrap();
    }

    #[test]
    fn targets_parse_and_bad_ones_say_why() {
        let t: EtcdTarget = "etcd://127.0.0.1:2379".parse().unwrap();
        assert_eq!((t.endpoints.clone(), t.prefix.as_str()), (vec!["127.0.0.1:2379".to_string()], "/eps"));
        assert_eq!(t.job_prefix("j"), b"/eps/jobs/j/".to_vec());
        let t: EtcdTarget = "etcd://a:1,b:2/team/eps-1/".parse().unwrap();
        assert_eq!(
            (t.endpoints.len(), t.prefix.as_str(), t.to_string().as_str()),
            (2, "/team/eps-1", "etcd://a:1,b:2/team/eps-1")
        );
        for (bad, why) in [
            ("127.0.0.1:2379", "etcd://HOST:PORT"),
            ("etcd://127.0.0.1", "HOST:PORT"),
            ("etcd://h:0", "HOST:PORT"),
            ("etcd://h:1//x", "empty"),
            ("etcd://h:1/a b", "only letters"),
            ("etcd://h:1/../x", ". or .."),
        ] {
            let e = bad.parse::<EtcdTarget>().unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }
}
