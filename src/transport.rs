//! `--transport auto|soft|shm|rdma` for the roles: which provider a server or
//! worker runs its data plane on, and on which RDMA device.
//!
//! Each choice is taken from the command line first, then the environment
//! (`EPS_TRANSPORT`, `EPS_RDMA_DEVICE`, `EPS_RDMA_PORT`, `EPS_RDMA_GID_INDEX`),
//! then the job spec's `[fabric]` section, and defaults to `auto`: rdma when a
//! usable device exists, else shm to each peer on this host and soft to the
//! others (per connection), saying which and why. A cluster whose every process
//! runs on this machine (`eps train`'s local launcher) takes `shm` for `auto`
//! ([`choose_local`]): every peer is on the same host.

use std::net::IpAddr;

use eps_fabric::Fabric;
use eps_proto::spec::{FabricSection, TRANSPORTS};

use crate::rdma::Named;

/// The transport flags of `eps server`, `eps worker` and `eps train`.
#[derive(Clone, Debug, Default, PartialEq, Eq, clap::Args)]
pub struct TransportFlags {
    /// Data-plane transport: `soft` (userspace verbs over TCP with io_uring),
    /// `shm` (shared memory; every peer on this host, as this user), `rdma` (an
    /// RDMA device; fails, saying what it found, when none can be used) or `auto`
    /// (rdma when a device is usable, else shm to peers on this host and soft to
    /// the others, per connection; `eps train` on one machine: shm; it says which).
    /// Default: EPS_TRANSPORT, else the spec's fabric.transport, else auto.
    #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(TRANSPORTS))]
    pub transport: Option<String>,
    /// The RDMA device for `--transport rdma|auto`.
    #[command(flatten)]
    pub rdma: Named,
}

impl TransportFlags {
    /// The flags naming `chosen` (and the device flags given here), for a child
    /// process, so that every process of a local cluster runs on the same choice.
    pub fn child_args(&self, chosen: &Chosen) -> Vec<String> {
        let name = if let Chosen::Mixed = chosen { "auto" } else { chosen.name() };
        let mut v = vec!["--transport".to_string(), name.to_string()];
        match chosen {
            #[cfg(feature = "rdma")]
            Chosen::Rdma(sel) => {
                v.extend(["--rdma-device".to_string(), sel.device.clone()]);
                v.extend(["--rdma-port".to_string(), sel.port.to_string()]);
                v.extend(["--gid-index".to_string(), sel.gid.index.to_string()]);
            }
            _ => v.extend(self.rdma.args()),
        }
        v
    }
}

/// A selected RDMA device (without the `rdma` feature there is none).
#[cfg(feature = "rdma")]
pub type RdmaSelection = eps_rdma::Selection;
/// A selected RDMA device (without the `rdma` feature there is none).
#[cfg(not(feature = "rdma"))]
pub type RdmaSelection = std::convert::Infallible;

/// The provider chosen for a process.
#[derive(Clone, Debug)]
pub enum Chosen {
    /// Userspace verbs over TCP.
    Soft,
    /// Shared memory between processes of this host.
    Shm,
    /// Per connection: shm to a peer on this host, soft to any other.
    Mixed,
    /// This RDMA device, port and GID.
    Rdma(RdmaSelection),
}

impl Chosen {
    /// `soft` or `rdma`.
    pub fn name(&self) -> &'static str {
        match self {
            Chosen::Soft => "soft",
            Chosen::Shm => "shm",
            Chosen::Mixed => "soft+shm",
            Chosen::Rdma(_) => "rdma",
        }
    }

    /// Where a server listens on this provider: `None` on soft and shm (any
    /// address the caller likes); on rdma the port's IPv4 address (its GID's, or its IPoIB
    /// interface's), or an error saying what to do.
    pub fn listen_ip(&self) -> Result<Option<IpAddr>, String> {
        match self {
            Chosen::Soft | Chosen::Shm | Chosen::Mixed => Ok(None),
            #[cfg(feature = "rdma")]
            Chosen::Rdma(sel) => crate::rdma::ip_of(sel).map(Some),
            #[cfg(not(feature = "rdma"))]
            Chosen::Rdma(never) => match *never {},
        }
    }
}

/// The transport asked for: the flag, else `EPS_TRANSPORT`, else the spec's,
/// else `auto` (not probed).
pub fn requested(flags: &TransportFlags, spec: Option<&FabricSection>) -> String {
    let env = std::env::var("EPS_TRANSPORT").ok().filter(|v| !v.is_empty());
    let requested = flags.transport.clone().or(env).or_else(|| spec.and_then(|s| s.transport.clone()));
    requested.unwrap_or_else(|| "auto".to_string())
}

/// Resolves the flags, the environment and the spec's `[fabric]` section (flags
/// first) to a provider. `rdma` without a usable device is an error that says what
/// was found and points to `--transport soft`; `auto` says which it took and why.
pub fn choose(flags: &TransportFlags, spec: Option<&FabricSection>) -> Result<Chosen, String> {
    let requested = requested(flags, spec);
    let mut named = flags.rdma.clone();
    // The environment fills what the flags leave open (in `rdma_selection`), the
    // spec only what both leave open.
    if let Some(s) = spec {
        let env_set = |k: &str| std::env::var(k).is_ok_and(|v| !v.is_empty());
        if named.device.is_none() && !env_set("EPS_RDMA_DEVICE") {
            named.device = s.device_for(crate::slurm::node_name().as_deref());
        }
        if named.port.is_none() && !env_set("EPS_RDMA_PORT") {
            named.port = s.rdma_port;
        }
        if named.gid_index.is_none() && !env_set("EPS_RDMA_GID_INDEX") {
            named.gid_index = s.gid_index;
        }
    }
    match requested.as_str() {
        "soft" => Ok(Chosen::Soft),
        "shm" => Ok(Chosen::Shm),
        "rdma" => match crate::rdma::selection(&named) {
            Ok(s) => Ok(Chosen::Rdma(s)),
            Err(e) if e.contains("--transport soft") => Err(format!("--transport rdma: {e}")),
            Err(e) => Err(format!("--transport rdma: {e}; use --transport soft (userspace verbs over TCP)")),
        },
        "auto" => match crate::rdma::selection(&named) {
            Ok(s) => {
                eps_proto::say!("eps: --transport auto: using rdma");
                Ok(Chosen::Rdma(s))
            }
            Err(e) => {
                eps_proto::say!("eps: --transport auto: using shm to peers on this host, soft to the others ({e})");
                Ok(Chosen::Mixed)
            }
        },
        other => {
            Err(format!("unknown transport {other:?} (from EPS_TRANSPORT or fabric.transport): use auto, soft, shm or rdma"))
        }
    }
}

/// As [`choose`], for a cluster whose every process runs on this machine:
/// `auto` takes `shm` there (each payload crosses once, through shared memory,
/// instead of four times through loopback TCP or once more through a NIC).
pub fn choose_local(flags: &TransportFlags, spec: Option<&FabricSection>) -> Result<Chosen, String> {
    if requested(flags, spec) == "auto" {
        eps_proto::say!("eps: --transport auto: using shm (every process of this cluster runs on this machine)");
        return Ok(Chosen::Shm);
    }
    choose(flags, spec)
}

/// Work that runs on whichever provider was chosen.
pub trait OnFabric {
    /// What the work returns.
    type Out;
    /// Runs on `pd`.
    fn run<P: Fabric>(self, pd: P) -> Self::Out;

    /// Runs on the `rdma` provider's `pd` (work that does more there overrides it).
    #[cfg(feature = "rdma")]
    fn run_rdma(self, pd: eps_rdma::RdmaPd) -> Self::Out
    where
        Self: Sized,
    {
        self.run(pd)
    }
}

/// Opens the chosen provider (logging the RDMA device, port, GID and MTU) and runs
/// `work` on it.
pub fn run_on<W: OnFabric>(chosen: &Chosen, work: W) -> Result<W::Out, String> {
    match chosen {
        Chosen::Soft => {
            let pd = eps_fabric::soft::SoftDevice::open().map_err(|e| format!("the soft transport: {e}"))?.alloc_pd();
            Ok(work.run(pd))
        }
        Chosen::Shm => {
            let pd = eps_fabric::shm::ShmDevice::open().map_err(|e| format!("the shm transport: {e}"))?.alloc_pd();
            Ok(work.run(pd))
        }
        Chosen::Mixed => {
            let pd = eps_fabric::mixed::MixedDevice::open().map_err(|e| format!("the auto transport: {e}"))?.alloc_pd();
            Ok(work.run(pd))
        }
        #[cfg(feature = "rdma")]
        Chosen::Rdma(sel) => Ok(work.run_rdma(crate::rdma::open(sel)?)),
        #[cfg(not(feature = "rdma"))]
        Chosen::Rdma(never) => match *never {},
    }
}

/// Resolves `--transport auto|soft|shm|rdma` of `eps bench fabric` to the
/// provider that runs (see [`choose_local`]: its peer process
/// is on this machine, so `auto` without a device is shm).
pub fn for_bench(requested: &str, named: &Named) -> Result<&'static str, String> {
    let flags = TransportFlags { transport: Some(requested.to_string()), rdma: named.clone() };
    match choose(&flags, None)? {
        Chosen::Mixed => Ok("shm"),
        c => Ok(c.name()),
    }
}
