//! What tests need of their environment: an etcd (the one named by
//! `EPS_TEST_ETCD` (`HOST:PORT`, as the test command starts it), else a
//! private `etcd` on 127.0.0.1 if the binary is installed, stopped when
//! dropped), and [`skip`] for a test whose environment cannot be made.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// An etcd to test against.
#[derive(Debug)]
pub struct TestEtcd {
    /// Its client endpoint, `HOST:PORT`.
    pub endpoint: String,
    own: Option<(Child, std::path::PathBuf)>,
}

fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// A test that cannot run because its environment (root, Slurm, etcd,
/// network namespaces, a compiler) cannot be made here: under `CI=true` it
/// fails (panics) instead of passing; elsewhere it prints `SKIPPED: {test}:
/// {why}` and appends that line to the file `EPS_SKIP_LOG` names, which the
/// test command lists in its summary. The caller returns after it.
pub fn skip(test: &str, why: &str) {
    if std::env::var("CI").as_deref() == Ok("true") {
        panic!("{test}: CI=true and its environment cannot be made: {why}");
    }
    let line = format!("SKIPPED: {test}: {why}");
    println!("{line}");
    if let Some(path) = std::env::var_os("EPS_SKIP_LOG") {
        use std::io::Write as _;
        let appended = std::fs::OpenOptions::new().create(true).append(true).open(&path).and_then(|mut f| writeln!(f, "{line}"));
        if let Err(e) = appended {
            println!("(cannot note it in {}: {e})", std::path::Path::new(&path).display());
        }
    }
}

impl TestEtcd {
    /// The etcd to use, or why there is none (the caller prints that it skipped).
    pub fn get() -> Result<Self, String> {
        if let Ok(e) = std::env::var("EPS_TEST_ETCD") {
            return Ok(Self { endpoint: e, own: None });
        }
        let (client, peer) = (free_port().map_err(|e| e.to_string())?, free_port().map_err(|e| e.to_string())?);
        let dir = std::env::temp_dir().join(format!("eps-test-etcd-{}-{client}", std::process::id()));
        let child = Command::new("etcd")
            .args(["--data-dir", &dir.display().to_string(), "--name", "eps-test"])
            .args(["--listen-client-urls", &format!("http://127.0.0.1:{client}")])
            .args(["--advertise-client-urls", &format!("http://127.0.0.1:{client}")])
            .args(["--listen-peer-urls", &format!("http://127.0.0.1:{peer}")])
            .args(["--initial-advertise-peer-urls", &format!("http://127.0.0.1:{peer}")])
            .args(["--initial-cluster", &format!("eps-test=http://127.0.0.1:{peer}")])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("no etcd binary ({e}): install etcd-server, or set EPS_TEST_ETCD=HOST:PORT"))?;
        let mut t = Self { endpoint: format!("127.0.0.1:{client}"), own: Some((child, dir)) };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if crate::Client::connect(std::slice::from_ref(&t.endpoint), Duration::from_millis(500)).is_ok() {
                return Ok(t);
            }
            if let Some((c, _)) = t.own.as_mut()
                && let Ok(Some(st)) = c.try_wait()
            {
                return Err(format!("etcd exited at start ({st})"));
            }
            if Instant::now() > deadline {
                return Err("etcd did not answer within 20 s".into());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for TestEtcd {
    fn drop(&mut self) {
        if let Some((mut c, dir)) = self.own.take() {
            let _ = c.kill();
            let _ = c.wait();
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}
