//! Errors as the command line prints them, and why a cluster could not run.

/// An error with its chain of causes, for printing.
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// Why training could not run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TrainError {
    /// The spec could not be built (its file unreadable, or invalid).
    #[error(transparent)]
    SpecFile(#[from] crate::jobspec::SpecFileError),
    /// The spec is invalid.
    #[error(transparent)]
    Spec(#[from] eps_proto::SpecError),
    /// A process could not be started.
    #[error("cannot start {what}")]
    Spawn {
        /// Which process.
        what: String,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// A process of the cluster failed.
    #[error("{0}")]
    Child(String),
    /// Ctrl-C.
    #[error("interrupted; stopped every process of the cluster")]
    Interrupted,
    /// A server process died: its shards are lost.
    #[error("{name} (server rank {}) exited with {status}; its shards are lost{}", rank.map_or("unknown".into(), |r| r.to_string()), if held.is_empty() { String::new() } else { format!(" ({held})") })]
    ServerLost {
        /// The process.
        name: String,
        /// Its rank, once it registered.
        rank: Option<u32>,
        /// How it exited.
        status: String,
        /// What the control plane says it held.
        held: String,
    },
    /// Its stop handle was set (a scheduler killed the job).
    #[error("stopped on request; stopped every process of the cluster")]
    Stopped,
}

/// The value of `key=value` in a line of space-separated pairs.
pub fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace().find_map(|kv| kv.strip_prefix(key).and_then(|r| r.strip_prefix('=')))
}
