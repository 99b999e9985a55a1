//! Where the control plane keeps its state: an append-only log of encoded
//! records. The embedded store keeps it in one file, each append fsync'd
//! before it is acknowledged; `eps_etcd::store::EtcdStore` keeps it in etcd, each
//! append fenced by the writer's leadership. Reopening replays the log.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

/// Where the control plane keeps its metadata.
pub trait Store: Send {
    /// Appends one record durably.
    fn append(&mut self, record: &[u8]) -> std::io::Result<()>;
    /// Hands every record appended so far to `f`, in order, one at a time
    /// (a long job's log is never held whole); stops at the first error `f`
    /// returns. Returns how many records there were.
    fn replay(&self, f: &mut dyn FnMut(&[u8]) -> Result<(), String>) -> std::io::Result<Result<u64, String>>;

    /// Every record appended so far, in order.
    fn records(&self) -> std::io::Result<Vec<Vec<u8>>> {
        let mut out = Vec::new();
        let _ = self.replay(&mut |r| {
            out.push(r.to_vec());
            Ok(())
        })?;
        Ok(out)
    }
}

/// Reads `u32 length | bytes` records from `r` into `f` until the end or a
/// torn record; returns (records, bytes of whole records) or `f`'s error.
fn read_records(r: impl Read, f: &mut dyn FnMut(&[u8]) -> Result<(), String>) -> std::io::Result<Result<(u64, u64), String>> {
    let mut r = std::io::BufReader::with_capacity(64 << 10, r);
    let (mut n, mut valid) = (0u64, 0u64);
    let mut rec = Vec::new();
    loop {
        let mut len = [0u8; 4];
        // A torn last record (crash mid-append) ends the log.
        if !read_whole(&mut r, &mut len)? {
            return Ok(Ok((n, valid)));
        }
        rec.resize(u32::from_le_bytes(len) as usize, 0);
        if !read_whole(&mut r, &mut rec)? {
            return Ok(Ok((n, valid)));
        }
        if let Err(e) = f(&rec) {
            return Ok(Err(e));
        }
        n += 1;
        valid += 4 + rec.len() as u64;
    }
}

/// Fills `buf` from `r`: false if the input ends first.
fn read_whole(r: &mut impl Read, buf: &mut [u8]) -> std::io::Result<bool> {
    match r.read_exact(buf) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Ok(false),
        Err(e) => Err(e),
    }
}

/// A file-backed [`Store`]: `u32 length | bytes` records, fsync'd per append.
#[derive(Debug)]
pub struct FileStore {
    path: PathBuf,
    file: File,
}

impl FileStore {
    /// Opens (creating if needed) the log at `dir/control.log`.
    pub fn open(dir: &Path) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let path = dir.join("control.log");
        let file = OpenOptions::new().create(true).append(true).read(true).open(&path)?;
        // Make the directory entry durable too.
        File::open(dir)?.sync_all()?;
        let s = Self { path, file };
        // Drop a torn last record (crash mid-append) so new records follow valid ones.
        let valid = match read_records(File::open(&s.path)?, &mut |_| Ok(()))? {
            Ok((_, valid)) => valid,
            Err(_) => unreachable!("the visitor accepts every record"),
        };
        if s.file.metadata()?.len() != valid {
            s.file.set_len(valid)?;
            s.file.sync_all()?;
        }
        Ok(s)
    }
}

impl Store for FileStore {
    fn append(&mut self, record: &[u8]) -> std::io::Result<()> {
        let mut buf = Vec::with_capacity(4 + record.len());
        buf.extend_from_slice(&(record.len() as u32).to_le_bytes());
        buf.extend_from_slice(record);
        self.file.write_all(&buf)?;
        self.file.sync_data()
    }

    fn replay(&self, f: &mut dyn FnMut(&[u8]) -> Result<(), String>) -> std::io::Result<Result<u64, String>> {
        Ok(read_records(File::open(&self.path)?, f)?.map(|(n, _)| n))
    }
}

/// A [`Store`] in memory (tests, throwaway clusters).
#[derive(Debug, Default)]
pub struct MemStore(Vec<Vec<u8>>);

impl Store for MemStore {
    fn append(&mut self, record: &[u8]) -> std::io::Result<()> {
        self.0.push(record.to_vec());
        Ok(())
    }
    fn replay(&self, f: &mut dyn FnMut(&[u8]) -> Result<(), String>) -> std::io::Result<Result<u64, String>> {
        for r in &self.0 {
            if let Err(e) = f(r) {
                return Ok(Err(e));
            }
        }
        Ok(Ok(self.0.len() as u64))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_store_replays_and_ignores_a_torn_tail() {
        let dir = std::env::temp_dir().join(format!("eps-store-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        {
            let mut s = FileStore::open(&dir).unwrap();
            s.append(b"one").unwrap();
            s.append(b"").unwrap();
            s.append(b"three").unwrap();
        }
        // Simulate a crash in the middle of an append.
        let mut f = OpenOptions::new().append(true).open(dir.join("control.log")).unwrap();
        f.write_all(&[9, 0, 0, 0, b'x']).unwrap();
        let s = FileStore::open(&dir).unwrap();
        assert_eq!(s.records().unwrap(), vec![b"one".to_vec(), b"".to_vec(), b"three".to_vec()]);
        // A replay hands them over one at a time and stops where it is told.
        let mut seen = Vec::new();
        let r = s.replay(&mut |r| {
            seen.push(r.len());
            if r.is_empty() { Err("an empty one".into()) } else { Ok(()) }
        });
        assert_eq!((r.unwrap(), seen), (Err("an empty one".to_string()), vec![3, 0]));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
