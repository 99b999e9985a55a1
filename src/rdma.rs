//! `eps rdma devices`: the RDMA devices of this machine, their ports and GIDs,
//! and the choice `--transport rdma` makes (built with the `rdma` feature).

/// What the operator named: device, port, GID index (the rest is chosen); the
/// command-line flags of every command that uses an RDMA device.
#[derive(Clone, Debug, Default, PartialEq, Eq, clap::Args)]
pub struct Named {
    /// RDMA device (default: the first with an active port; `eps rdma devices`
    /// lists them). Also EPS_RDMA_DEVICE.
    #[arg(long = "rdma-device")]
    pub device: Option<String>,
    /// Port of the RDMA device, from 1 (default: its first active port). Also
    /// EPS_RDMA_PORT.
    #[arg(long = "rdma-port")]
    pub port: Option<u8>,
    /// GID index (default: the first RoCE v2 GID with an IPv4 address on
    /// Ethernet, 0 on InfiniBand). Also EPS_RDMA_GID_INDEX.
    #[arg(long)]
    pub gid_index: Option<u32>,
}

/// Lists the devices and the selection; an error (non-zero exit) when no device
/// can be used, saying what was found.
#[cfg(feature = "rdma")]
pub fn devices(named: &Named, json: bool) -> Result<(), String> {
    use crate::json::Json;
    use eps_rdma::{DeviceChoice, GidKind};

    let choice = DeviceChoice { device: named.device.clone(), port: named.port, gid_index: named.gid_index }
        .with_env()
        .map_err(|e| e.to_string())?;
    let devs = eps_rdma::devices().map_err(|e| e.to_string())?;
    let chosen = eps_rdma::device::choose(&devs, &choice);
    let kind = |k: &GidKind| match k {
        GidKind::IbOrRoceV1 => "IB/RoCE v1".to_string(),
        GidKind::RoceV2 => "RoCE v2".to_string(),
        GidKind::Other(s) => s.clone(),
    };
    if json {
        let mut ds = Vec::new();
        for d in &devs {
            let mut ps = Vec::new();
            for p in &d.ports {
                let gs: Vec<String> = p
                    .gids
                    .iter()
                    .map(|g| {
                        Json::new()
                            .int("index", u64::from(g.index))
                            .str("gid", &g.addr().to_string())
                            .str("kind", &kind(&g.kind))
                            .str("netdev", g.netdev.as_deref().unwrap_or(""))
                            .finish()
                    })
                    .collect();
                ps.push(
                    Json::new()
                        .int("port", u64::from(p.num))
                        .str("state", &p.state)
                        .str("link_layer", &p.link_layer)
                        .int("mtu", u64::from(p.mtu))
                        .raw("gids", &format!("[{}]", gs.join(",")))
                        .finish(),
                );
            }
            ds.push(Json::new().str("name", &d.name).raw("ports", &format!("[{}]", ps.join(","))).finish());
        }
        let sel = match &chosen {
            Ok(s) => Json::new().str("selected", &s.to_string()),
            Err(e) => Json::new().str("error", &e.to_string()),
        };
        println!("{}", sel.raw("devices", &format!("[{}]", ds.join(","))).finish());
    } else {
        for d in &devs {
            println!("{}", d.name);
            for p in &d.ports {
                println!("  port {}: {}, {}, MTU {}", p.num, p.state, p.link_layer, p.mtu);
                for g in &p.gids {
                    let on = g.netdev.as_deref().map(|n| format!(" on {n}")).unwrap_or_default();
                    println!("    GID {}: {} ({}{on})", g.index, g.addr(), kind(&g.kind));
                }
            }
        }
        if let Ok(s) = &chosen {
            println!("{s}");
        }
    }
    chosen.map(|_| ()).map_err(|e| e.to_string())
}

/// Without the `rdma` feature: says how to get it.
#[cfg(not(feature = "rdma"))]
pub fn devices(_named: &Named, _json: bool) -> Result<(), String> {
    Err("this eps was built without RDMA support: rebuild it with `cargo build --release --features rdma` \
         (needs the Debian packages libibverbs-dev, librdmacm-dev and libclang-dev)"
        .into())
}

impl Named {
    /// The flags that name the same choice, for a child process.
    pub fn args(&self) -> Vec<String> {
        let mut v = Vec::new();
        if let Some(d) = &self.device {
            v.extend(["--rdma-device".to_string(), d.clone()]);
        }
        if let Some(p) = self.port {
            v.extend(["--rdma-port".to_string(), p.to_string()]);
        }
        if let Some(g) = self.gid_index {
            v.extend(["--gid-index".to_string(), g.to_string()]);
        }
        v
    }
}

/// The RDMA device selected for what `named` names (the `EPS_RDMA_*` variables
/// fill what it leaves open); or why none can be used.
#[cfg(feature = "rdma")]
pub fn selection(named: &Named) -> Result<eps_rdma::Selection, String> {
    eps_rdma::DeviceChoice { device: named.device.clone(), port: named.port, gid_index: named.gid_index }
        .with_env()
        .and_then(|c| eps_rdma::select(&c))
        .map_err(|e| e.to_string())
}

/// Without the `rdma` feature no device can be selected.
#[cfg(not(feature = "rdma"))]
pub fn selection(_named: &Named) -> Result<std::convert::Infallible, String> {
    Err("this eps was built without RDMA support (the `rdma` feature)".to_string())
}

/// Opens a protection domain on the selected device and logs the selection
/// (device, port, GID, MTU).
#[cfg(feature = "rdma")]
pub fn open(sel: &eps_rdma::Selection) -> Result<eps_rdma::RdmaPd, String> {
    eps_proto::say!("eps: {sel}");
    let dev = eps_rdma::RdmaDevice::open(&sel.device).map_err(|e| format!("{}: {e}", sel.device))?;
    dev.alloc_pd().map_err(|e| format!("{}: {e}", sel.device))
}

/// The IPv4 address peers reach the selected port at through rdma_cm: the GID's
/// own (RoCE v2), else that of the port's network interface (IPoIB on
/// InfiniBand); an error saying what to do when there is neither.
#[cfg(feature = "rdma")]
pub fn ip_of(sel: &eps_rdma::Selection) -> Result<std::net::IpAddr, String> {
    if let Some(v4) = sel.gid.addr().to_ipv4_mapped() {
        return Ok(v4.into());
    }
    eps_rdma::addr::port_ipv4(&sel.device, sel.port).map(Into::into).ok_or_else(|| {
        format!(
            "{} port {}: GID {} carries no IPv4 address and the port's network interface (IPoIB) has none: \
             give the port's interface an IPv4 address, name a RoCE v2 GID with --gid-index, or pass --listen-ip",
            sel.device,
            sel.port,
            sel.gid.addr()
        )
    })
}

/// A protection domain on the selected RDMA device and the IPv4 address of its
/// GID (where the benchmark's peer listens), for `eps bench fabric`.
#[cfg(feature = "rdma")]
pub fn bench_pd(named: &Named) -> Result<(eps_rdma::RdmaPd, std::net::IpAddr), String> {
    let sel = selection(named)?;
    Ok((open(&sel)?, ip_of(&sel)?))
}

/// Without the `rdma` feature: says how to get it.
#[cfg(not(feature = "rdma"))]
pub fn bench_pd(named: &Named) -> Result<(eps_fabric::soft::SoftPd, std::net::IpAddr), String> {
    selection(named).map(|never| match never {})
}
