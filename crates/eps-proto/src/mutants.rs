//! Known past bugs, put back on purpose to check that the simulation finds
//! them (`eps-sim --mutant NAME`). Built only with the `mutants` feature,
//! which nothing but the simulator's mutant runs turns on: without it
//! [`active`] is the constant `false` and every mutant's branch compiles
//! away.

/// The mutants: name, and the bug it puts back.
pub const ALL: &[(&str, &str)] = &[
    (
        "late-cutover-notice",
        "a migration target takes its source's \"no forwards follow\" notice, arriving after the target aggregated the cutover iteration itself from pushes that all landed there, for a forward of the wrong version",
    ),
    (
        "source-takes-cutover-pushes",
        "a migration source takes pushes of the cutover iteration itself, which belong to the target",
    ),
    (
        "cutover-keeps-waiting-pulls",
        "a migration source cutting over at its snapshot's version keeps the pull requests waiting there instead of answering them \"pull moved\" (nobody will answer them)",
    ),
    (
        "sparse-pull-before-bucket-order",
        "a server refuses, instead of holding, a sparse request for keys the bucket maps it knows give elsewhere while a bucket map is voted on (a worker may route by the committed map before the server is told it)",
    ),
    (
        "job-end-retires-mid-read",
        "the job ends while a bucket move's target READs rows from its source, and both are told to retire: the source exits under the READ, which fails",
    ),
    (
        "ssp-push-held-by-bucket-vote",
        "an SSP/ASP shard only records a push that lands while a bucket map is voted on, as a BSP one does: it counts in the worker's clock, pulls are answered without it, and it is never applied",
    ),
    ("expired-worker-still-awaited", "a BSP shard still waits for the push of a worker whose lease expired before it pushed"),
    (
        "promoted-backup-reapplies",
        "a promoted backup takes a push of an iteration it already applied (pushed again after its owner was lost)",
    ),
    (
        "ssp-pull-ignores-staleness",
        "an SSP shard answers a pull at once, whether or not the slowest worker's contributions reached the staleness bound the pull asks for",
    ),
    (
        "relay-releases-early",
        "an SSP/ASP migration source releases the shard once every worker routes to the target, with contributions still queued in its relay",
    ),
    (
        "dead-retiring-server-awaited",
        "the control plane waits for a server it told to retire to say it finished, though the server died (its lease lapsed): the job never ends",
    ),
    (
        "last-expiry-keeps-job-open",
        "the last worker the job waits for is removed by lease expiry after the others finished, and the job goes on (no server is told to retire)",
    ),
    (
        "adopted-epoch-not-persisted",
        "the control plane applies a worker's report of a newer epoch (releases and retirements follow from it) without keeping it in its store, so a standby that takes over replays another job",
    ),
];

#[cfg(feature = "mutants")]
static ACTIVE: std::sync::Mutex<Option<&'static str>> = std::sync::Mutex::new(None);

/// Turns on mutant `name` (`None`: none) for the whole process.
#[cfg(feature = "mutants")]
pub fn set(name: Option<&str>) -> Result<(), String> {
    let found = match name {
        None => None,
        Some(n) => Some(ALL.iter().find(|(m, _)| *m == n).map(|(m, _)| *m).ok_or_else(|| {
            let names: Vec<&str> = ALL.iter().map(|(m, _)| *m).collect();
            format!("no mutant {n:?} (there are: {})", names.join(", "))
        })?),
    };
    *ACTIVE.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = found;
    Ok(())
}

/// Whether mutant `name` is on.
#[cfg(feature = "mutants")]
pub fn active(name: &str) -> bool {
    debug_assert!(ALL.iter().any(|(m, _)| *m == name), "unknown mutant {name}");
    *ACTIVE.lock().unwrap_or_else(std::sync::PoisonError::into_inner) == Some(name)
}

/// Whether mutant `name` is on: never, in a build without mutants.
#[cfg(not(feature = "mutants"))]
#[inline(always)]
pub fn active(_name: &str) -> bool {
    false
}
