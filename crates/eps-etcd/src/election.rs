//! Which of a job's control planes leads: the one holding the job's `leader`
//! key in etcd, attached to a lease it keeps alive. The others stand by,
//! watching the key; when the leader dies its lease runs out, the key goes,
//! and one of them takes it. The key's creation revision fences the store's
//! writes ([`crate::store::EtcdStore`]): a deposed leader cannot write.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::{Client, Compare, EtcdError, Op};

/// How often a standby looks whether the leader key is still there.
const WATCH: Duration = Duration::from_millis(100);

/// Leadership of a job, held while its lease is kept alive.
#[derive(Debug)]
pub struct Leadership {
    /// The leader key's creation revision (fences the store).
    pub fence: i64,
    lease: i64,
    /// Set when the lease could not be renewed: no longer the leader.
    lost: Arc<AtomicBool>,
    /// Tells the keep-alive thread to stop.
    quit: Arc<AtomicBool>,
    thread: Option<JoinHandle<Client>>,
}

impl Leadership {
    /// Whether the lease ran out (another control plane may lead now).
    pub fn lost(&self) -> bool {
        self.lost.load(Ordering::Acquire)
    }

    /// Steps down: ends the lease, so a standby takes over at once.
    pub fn resign(mut self) {
        self.quit.store(true, Ordering::Release);
        if let Some(t) = self.thread.take()
            && let Ok(mut c) = t.join()
        {
            let _ = c.revoke(self.lease);
        }
    }
}

impl Drop for Leadership {
    fn drop(&mut self) {
        self.quit.store(true, Ordering::Release);
    }
}

/// The leader key of the job whose keys start with `base`.
pub fn leader_key(base: &[u8]) -> Vec<u8> {
    [base, b"leader"].concat()
}

/// Who leads the job now (the leader key's value), if anyone.
pub fn leader(c: &mut Client, base: &[u8]) -> Result<Option<String>, EtcdError> {
    Ok(c.get(&leader_key(base))?.map(|kv| String::from_utf8_lossy(&kv.value).into_owned()))
}

/// Campaigns for the job under `base` as `me` (what the others are told: an
/// address and a pid) with leases of `ttl` seconds: returns once leading, or
/// `None` if `give_up` is set first. `standing_by` is told each leader seen.
/// When the lease cannot be renewed, `lost` is set (and `on_lost` too: the
/// service's stop flag).
pub fn campaign(
    c: &mut Client,
    base: &[u8],
    me: &str,
    ttl: i64,
    give_up: &AtomicBool,
    on_lost: Arc<AtomicBool>,
    standing_by: &mut dyn FnMut(&str),
) -> Result<Option<Leadership>, EtcdError> {
    let key = leader_key(base);
    let mut seen = String::new();
    loop {
        let (lease, granted) = c.grant(ttl)?;
        let put = Op::Put { key: key.clone(), value: me.as_bytes().to_vec(), lease };
        let t = c.txn(&[Compare::Created(key.clone(), 0)], &[put], &[Op::Get(key.clone())])?;
        if t.succeeded {
            let lost = Arc::new(AtomicBool::new(false));
            let quit = Arc::new(AtomicBool::new(false));
            let keeper = c.fresh()?;
            let (l, q) = (lost.clone(), quit.clone());
            let period = Duration::from_millis((granted.max(1) as u64 * 1000) / 3);
            let thread = std::thread::Builder::new()
                .name("eps-lease".into())
                .spawn(move || keep_alive(keeper, lease, period, &l, &q, &on_lost))
                .map_err(|e| EtcdError::Unreachable { endpoints: "(a thread)".into(), source: e })?;
            return Ok(Some(Leadership { fence: t.revision, lease, lost, quit, thread: Some(thread) }));
        }
        c.revoke(lease)?;
        let holder = t.gets.first().cloned().flatten().map(|kv| String::from_utf8_lossy(&kv.value).into_owned());
        if let Some(h) = holder
            && h != seen
        {
            standing_by(&h);
            seen = h;
        }
        // Stand by until the key goes.
        while c.get(&key)?.is_some() {
            if give_up.load(Ordering::Acquire) {
                return Ok(None);
            }
            std::thread::sleep(WATCH);
        }
        if give_up.load(Ordering::Acquire) {
            return Ok(None);
        }
    }
}

/// Renews `lease` every `period` until `quit`; sets `lost` and `on_lost`
/// once it has expired, or could not be renewed for its whole TTL (3 periods).
fn keep_alive(mut c: Client, lease: i64, period: Duration, lost: &AtomicBool, quit: &AtomicBool, on_lost: &AtomicBool) -> Client {
    let mut renewed = Instant::now();
    while !quit.load(Ordering::Acquire) {
        std::thread::sleep(period.min(Duration::from_millis(200)));
        if renewed.elapsed() < period {
            continue;
        }
        match c.keepalive(lease) {
            Ok(ttl) if ttl > 0 => renewed = Instant::now(),
            r => {
                let expired = r.is_ok() || renewed.elapsed() >= period * 3;
                if expired {
                    lost.store(true, Ordering::Release);
                    on_lost.store(true, Ordering::Release);
                    return c;
                }
            }
        }
    }
    c
}
