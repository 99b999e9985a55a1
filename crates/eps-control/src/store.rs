//! The embedded store: an append-only log of encoded records in one file, each
//! append fsync'd before it is acknowledged. Reopening replays the log.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

/// Where the control plane keeps its metadata.
pub trait Store: Send {
    /// Appends one record durably.
    fn append(&mut self, record: &[u8]) -> std::io::Result<()>;
    /// Every record appended so far, in order.
    fn records(&self) -> std::io::Result<Vec<Vec<u8>>>;
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
        let valid: u64 = s.records()?.iter().map(|r| 4 + r.len() as u64).sum();
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

    fn records(&self) -> std::io::Result<Vec<Vec<u8>>> {
        let mut all = Vec::new();
        File::open(&self.path)?.read_to_end(&mut all)?;
        let mut out = Vec::new();
        let mut rest = &all[..];
        // A torn last record (crash mid-append) is ignored.
        while rest.len() >= 4 {
            let n = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
            if rest.len() < 4 + n {
                break;
            }
            out.push(rest[4..4 + n].to_vec());
            rest = &rest[4 + n..];
        }
        Ok(out)
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
    fn records(&self) -> std::io::Result<Vec<Vec<u8>>> {
        Ok(self.0.clone())
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
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
