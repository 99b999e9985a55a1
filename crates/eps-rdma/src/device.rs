//! RDMA devices, their ports and GIDs, and the choice of one.
//!
//! The choice never guesses silently: what the operator names (flags, job spec,
//! or `EPS_RDMA_DEVICE` / `EPS_RDMA_PORT` / `EPS_RDMA_GID_INDEX`) must exist and
//! be usable, or the error says what exists; what is left unnamed is chosen by a
//! fixed rule (the first device with an active port; its first active port; on
//! Ethernet the first RoCE v2 GID, an IPv4-mapped one first; on InfiniBand GID 0),
//! and [`Selection`]'s `Display` is the log line that says what was chosen and
//! how.

use std::ffi::CStr;
use std::fmt;
use std::io;
use std::net::Ipv6Addr;
use std::path::Path;

use rdma_sys as sys;

/// What a GID is for (from the kernel's `gid_attrs/types`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GidKind {
    /// InfiniBand, or RoCE v1 (the kernel names both `IB/RoCE v1`).
    IbOrRoceV1,
    /// RoCE v2 (routable, UDP/IP).
    RoceV2,
    /// Unknown to this code (the kernel's own words).
    Other(String),
}

/// One GID of a port.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Gid {
    /// Index in the port's GID table.
    pub index: u32,
    /// The 16 bytes.
    pub raw: [u8; 16],
    /// What it is for.
    pub kind: GidKind,
    /// The network device it belongs to (RoCE).
    pub netdev: Option<String>,
}

impl Gid {
    /// The GID as an IPv6 address (RoCE v2 GIDs of IPv4 addresses are IPv4-mapped).
    pub fn addr(&self) -> Ipv6Addr {
        Ipv6Addr::from(self.raw)
    }
}

/// One port of a device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Port {
    /// Port number (from 1).
    pub num: u8,
    /// Whether the port is ACTIVE.
    pub active: bool,
    /// Its state in words.
    pub state: String,
    /// `InfiniBand` or `Ethernet`.
    pub link_layer: String,
    /// Active MTU in bytes (0 when unknown).
    pub mtu: u32,
    /// Its GIDs that are set (zero GIDs left out).
    pub gids: Vec<Gid>,
}

/// One RDMA device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Device {
    /// Its name (`mlx5_0`, `rxe0`, ...).
    pub name: String,
    /// Its ports.
    pub ports: Vec<Port>,
}

/// What the operator named (anything left `None` is chosen by the fixed rule).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeviceChoice {
    /// Device name.
    pub device: Option<String>,
    /// Port number.
    pub port: Option<u8>,
    /// GID index.
    pub gid_index: Option<u32>,
}

impl DeviceChoice {
    /// Fills what is unnamed from `EPS_RDMA_DEVICE`, `EPS_RDMA_PORT` and
    /// `EPS_RDMA_GID_INDEX`. A malformed variable is an error naming it.
    pub fn with_env(mut self) -> Result<Self, RdmaError> {
        let var = |k: &'static str| std::env::var(k).ok().filter(|v| !v.is_empty());
        if self.device.is_none() {
            self.device = var("EPS_RDMA_DEVICE");
        }
        if self.port.is_none()
            && let Some(v) = var("EPS_RDMA_PORT")
        {
            self.port = Some(v.parse().map_err(|_| RdmaError::BadEnv { var: "EPS_RDMA_PORT", value: v })?);
        }
        if self.gid_index.is_none()
            && let Some(v) = var("EPS_RDMA_GID_INDEX")
        {
            self.gid_index = Some(v.parse().map_err(|_| RdmaError::BadEnv { var: "EPS_RDMA_GID_INDEX", value: v })?);
        }
        Ok(self)
    }
}

/// The device, port and GID to use, and how each was chosen.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Selection {
    /// Device name.
    pub device: String,
    /// Port number.
    pub port: u8,
    /// The GID.
    pub gid: Gid,
    /// Active MTU in bytes.
    pub mtu: u32,
    /// `named` or `auto` for device, port and GID.
    pub how: [&'static str; 3],
}

impl fmt::Display for Selection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match &self.gid.kind {
            GidKind::IbOrRoceV1 => "IB/RoCE v1".to_string(),
            GidKind::RoceV2 => "RoCE v2".to_string(),
            GidKind::Other(s) => s.clone(),
        };
        write!(
            f,
            "rdma: device {} ({}), port {} ({}), GID index {} ({}: {kind} {}{}), MTU {}",
            self.device,
            self.how[0],
            self.port,
            self.how[1],
            self.gid.index,
            self.how[2],
            self.gid.addr(),
            self.gid.netdev.as_deref().map(|n| format!(" on {n}")).unwrap_or_default(),
            self.mtu
        )
    }
}

/// Why no device can be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RdmaError {
    /// The kernel has no RDMA support at all.
    #[error(
        "no RDMA device: this kernel has no RDMA support (ibv_get_device_list: {0}); use --transport soft, or a \
         machine with an RDMA NIC or the rdma_rxe module (soft-RoCE)"
    )]
    NoKernelSupport(#[source] io::Error),
    /// RDMA support, but no device.
    #[error("no RDMA device found (the kernel has RDMA support but lists no device); use --transport soft")]
    NoDevice,
    /// None of the devices has an active port.
    #[error("no RDMA device has an active port ({found}); use --transport soft")]
    NothingActive {
        /// What was found.
        found: String,
    },
    /// The named device does not exist.
    #[error("no RDMA device named {want:?} (found: {found})")]
    UnknownDevice {
        /// The name asked for.
        want: String,
        /// What was found.
        found: String,
    },
    /// The named port does not exist or is not active.
    #[error("device {device} has no active port {port} (ports: {ports})")]
    BadPort {
        /// Device.
        device: String,
        /// The port asked for.
        port: u8,
        /// What the device has.
        ports: String,
    },
    /// The named GID index is not set on the port.
    #[error("device {device} port {port} has no GID at index {index} (set: {gids})")]
    BadGid {
        /// Device.
        device: String,
        /// Port.
        port: u8,
        /// The index asked for.
        index: u32,
        /// What is set.
        gids: String,
    },
    /// An Ethernet port without a RoCE v2 GID, and none named.
    #[error("device {device} port {port} has no RoCE v2 GID (set: {gids}); name one with --gid-index")]
    NoRoceV2 {
        /// Device.
        device: String,
        /// Port.
        port: u8,
        /// What is set.
        gids: String,
    },
    /// A malformed environment variable.
    #[error("{var}={value:?} is not a number")]
    BadEnv {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
    },
    /// A verbs call failed.
    #[error("{call} failed: {source}")]
    Sys {
        /// The call.
        call: &'static str,
        /// The error.
        #[source]
        source: io::Error,
    },
}

fn sys_err(call: &'static str) -> RdmaError {
    RdmaError::Sys { call, source: io::Error::last_os_error() }
}

/// MTU in bytes of an `ibv_mtu` value.
fn mtu_bytes(m: u32) -> u32 {
    if (1..=5).contains(&m) { 128 << m } else { 0 }
}

fn port_state(s: u32) -> &'static str {
    match s {
        1 => "DOWN",
        2 => "INIT",
        3 => "ARMED",
        4 => "ACTIVE",
        5 => "ACTIVE_DEFER",
        _ => "NOP",
    }
}

fn read_trim(p: &Path) -> Option<String> {
    std::fs::read_to_string(p).ok().map(|s| s.trim().to_string()).filter(|s| !s.is_empty())
}

/// Every RDMA device with its ports and GIDs.
pub fn devices() -> Result<Vec<Device>, RdmaError> {
    let mut n: libc::c_int = 0;
    // SAFETY: `n` is a valid out-parameter; the list is freed below.
    let list = unsafe { sys::ibv_get_device_list(&mut n) };
    if list.is_null() {
        let e = io::Error::last_os_error();
        return Err(match e.raw_os_error() {
            Some(libc::ENOSYS) => RdmaError::NoKernelSupport(e),
            _ => RdmaError::Sys { call: "ibv_get_device_list", source: e },
        });
    }
    let mut out = Vec::with_capacity(n.max(0) as usize);
    let mut failure = None;
    for i in 0..n.max(0) as usize {
        // SAFETY: the list holds `n` device pointers.
        let dev = unsafe { *list.add(i) };
        match describe(dev) {
            Ok(d) => out.push(d),
            Err(e) => {
                failure = Some(e);
                break;
            }
        }
    }
    // SAFETY: `list` came from ibv_get_device_list and is freed once; no device
    // pointer from it is used after this.
    unsafe { sys::ibv_free_device_list(list) };
    match failure {
        Some(e) => Err(e),
        None => Ok(out),
    }
}

fn describe(dev: *mut sys::ibv_device) -> Result<Device, RdmaError> {
    // SAFETY: `dev` is an entry of a live device list; the name is a C string it owns.
    let name = unsafe { CStr::from_ptr(sys::ibv_get_device_name(dev)) }.to_string_lossy().into_owned();
    // SAFETY: as above; the context is closed below.
    let ctx = unsafe { sys::ibv_open_device(dev) };
    if ctx.is_null() {
        return Err(sys_err("ibv_open_device"));
    }
    let ports = query_ports(ctx, &name);
    // SAFETY: `ctx` came from ibv_open_device and is closed once.
    unsafe { sys::ibv_close_device(ctx) };
    Ok(Device { name, ports: ports? })
}

fn query_ports(ctx: *mut sys::ibv_context, name: &str) -> Result<Vec<Port>, RdmaError> {
    // SAFETY: all-zero bytes are a valid ibv_device_attr (plain integers).
    let mut attr: sys::ibv_device_attr = unsafe { std::mem::zeroed() };
    // SAFETY: `ctx` is open; `attr` is a whole ibv_device_attr.
    if unsafe { sys::ibv_query_device(ctx, &mut attr) } != 0 {
        return Err(sys_err("ibv_query_device"));
    }
    let sysfs = Path::new("/sys/class/infiniband").join(name).join("ports");
    let mut ports = Vec::new();
    for num in 1..=attr.phys_port_cnt {
        // SAFETY: all-zero bytes are a valid ibv_port_attr (integers and enums whose
        // zero is defined).
        let mut pa: sys::ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the exported `ibv_query_port` fills the compat prefix of
        // ibv_port_attr (the fields read here), which `pa` holds whole.
        let rc = unsafe { sys::ibv_query_port(ctx, num, (&mut pa as *mut sys::ibv_port_attr).cast()) };
        if rc != 0 {
            return Err(sys_err("ibv_query_port"));
        }
        let dir = sysfs.join(num.to_string());
        let link_layer = match pa.link_layer as u32 {
            1 => "InfiniBand".to_string(),
            2 => "Ethernet".to_string(),
            _ => read_trim(&dir.join("link_layer")).unwrap_or_else(|| "unknown".into()),
        };
        let mut gids = Vec::new();
        for index in 0..pa.gid_tbl_len.max(0) as u32 {
            // SAFETY: all-zero bytes are a valid ibv_gid (a 16-byte union).
            let mut g: sys::ibv_gid = unsafe { std::mem::zeroed() };
            // SAFETY: `ctx` is open, `index` is below the table length, `g` is whole.
            if unsafe { sys::ibv_query_gid(ctx, num, index as libc::c_int, &mut g) } != 0 {
                continue;
            }
            // SAFETY: every bit pattern is a valid `raw` view of the union.
            let raw = unsafe { g.raw };
            if raw == [0; 16] {
                continue;
            }
            let kind = match read_trim(&dir.join("gid_attrs/types").join(index.to_string())).as_deref() {
                Some("RoCE v2") => GidKind::RoceV2,
                Some("IB/RoCE v1") | None => GidKind::IbOrRoceV1,
                Some(other) => GidKind::Other(other.to_string()),
            };
            let netdev = read_trim(&dir.join("gid_attrs/ndevs").join(index.to_string()));
            gids.push(Gid { index, raw, kind, netdev });
        }
        ports.push(Port {
            num,
            active: pa.state == sys::ibv_port_state::IBV_PORT_ACTIVE,
            state: port_state(pa.state).to_string(),
            link_layer,
            mtu: mtu_bytes(pa.active_mtu),
            gids,
        });
    }
    Ok(ports)
}

/// Chooses device, port and GID (see the module docs) among the machine's devices.
pub fn select(choice: &DeviceChoice) -> Result<Selection, RdmaError> {
    choose(&devices()?, choice)
}

fn list(devs: &[Device]) -> String {
    let v: Vec<String> = devs
        .iter()
        .map(|d| {
            let p: Vec<String> = d.ports.iter().map(|p| format!("port {} {}", p.num, p.state)).collect();
            format!("{} ({})", d.name, p.join(", "))
        })
        .collect();
    if v.is_empty() { "none".into() } else { v.join("; ") }
}

fn gid_list(p: &Port) -> String {
    let v: Vec<String> = p.gids.iter().map(|g| format!("{} {:?} {}", g.index, g.kind, g.addr())).collect();
    if v.is_empty() { "none".into() } else { v.join(", ") }
}

/// The choice among `devs` (pure: the rules, testable without hardware).
pub fn choose(devs: &[Device], c: &DeviceChoice) -> Result<Selection, RdmaError> {
    if devs.is_empty() {
        return Err(RdmaError::NoDevice);
    }
    let dev = match &c.device {
        Some(want) => devs
            .iter()
            .find(|d| &d.name == want)
            .ok_or_else(|| RdmaError::UnknownDevice { want: want.clone(), found: list(devs) })?,
        None => devs
            .iter()
            .find(|d| d.ports.iter().any(|p| p.active))
            .ok_or_else(|| RdmaError::NothingActive { found: list(devs) })?,
    };
    let bad_port = |port| RdmaError::BadPort { device: dev.name.clone(), port, ports: list(std::slice::from_ref(dev)) };
    let port = match c.port {
        Some(n) => dev.ports.iter().find(|p| p.num == n && p.active).ok_or_else(|| bad_port(n))?,
        None => dev.ports.iter().find(|p| p.active).ok_or_else(|| bad_port(1))?,
    };
    let gid = match c.gid_index {
        Some(i) => port.gids.iter().find(|g| g.index == i).ok_or_else(|| RdmaError::BadGid {
            device: dev.name.clone(),
            port: port.num,
            index: i,
            gids: gid_list(port),
        })?,
        None if port.link_layer == "Ethernet" => {
            let v2 = || port.gids.iter().filter(|g| g.kind == GidKind::RoceV2);
            v2().find(|g| g.addr().to_ipv4_mapped().is_some()).or_else(|| v2().next()).ok_or_else(|| RdmaError::NoRoceV2 {
                device: dev.name.clone(),
                port: port.num,
                gids: gid_list(port),
            })?
        }
        None => port.gids.iter().find(|g| g.index == 0).ok_or_else(|| RdmaError::BadGid {
            device: dev.name.clone(),
            port: port.num,
            index: 0,
            gids: gid_list(port),
        })?,
    };
    let how = |named: bool| if named { "named" } else { "auto" };
    Ok(Selection {
        device: dev.name.clone(),
        port: port.num,
        gid: gid.clone(),
        mtu: port.mtu,
        how: [how(c.device.is_some()), how(c.port.is_some()), how(c.gid_index.is_some())],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gid(index: u32, kind: GidKind, v4: Option<[u8; 4]>) -> Gid {
        let raw = match v4 {
            Some(a) => std::net::Ipv4Addr::from(a).to_ipv6_mapped().octets(),
            None => {
                let mut r = [0u8; 16];
                r[0] = 0xfe;
                r[1] = 0x80;
                r[15] = index as u8 + 1;
                r
            }
        };
        Gid { index, raw, kind, netdev: Some("veth0".into()) }
    }

    fn roce(name: &str, active: bool) -> Device {
        Device {
            name: name.into(),
            ports: vec![Port {
                num: 1,
                active,
                state: if active { "ACTIVE" } else { "DOWN" }.into(),
                link_layer: "Ethernet".into(),
                mtu: 1024,
                gids: vec![
                    gid(0, GidKind::IbOrRoceV1, None),
                    gid(1, GidKind::RoceV2, None),
                    gid(2, GidKind::IbOrRoceV1, Some([10, 0, 0, 1])),
                    gid(3, GidKind::RoceV2, Some([10, 0, 0, 1])),
                ],
            }],
        }
    }

    #[test]
    fn auto_picks_the_first_active_device_and_its_ipv4_roce_v2_gid() {
        let devs = [roce("rxe0", false), roce("rxe1", true)];
        let s = choose(&devs, &DeviceChoice::default()).unwrap();
        assert_eq!((s.device.as_str(), s.port, s.gid.index, s.mtu), ("rxe1", 1, 3, 1024));
        assert_eq!(s.how, ["auto"; 3]);
        let line = s.to_string();
        assert!(
            line.contains("rxe1") && line.contains("GID index 3") && line.contains("RoCE v2") && line.contains("10.0.0.1"),
            "{line}"
        );
    }

    #[test]
    fn named_choices_must_exist() {
        let devs = [roce("rxe0", true)];
        let c = DeviceChoice { device: Some("mlx5_0".into()), ..Default::default() };
        let e = choose(&devs, &c).unwrap_err().to_string();
        assert!(e.contains("mlx5_0") && e.contains("rxe0"), "{e}");
        let c = DeviceChoice { port: Some(2), ..Default::default() };
        assert!(choose(&devs, &c).unwrap_err().to_string().contains("no active port 2"));
        let c = DeviceChoice { gid_index: Some(9), ..Default::default() };
        let e = choose(&devs, &c).unwrap_err().to_string();
        assert!(e.contains("index 9") && e.contains("RoceV2"), "says what is set: {e}");
        let c = DeviceChoice { gid_index: Some(1), ..Default::default() };
        let s = choose(&devs, &c).unwrap();
        assert_eq!((s.gid.index, s.how[2]), (1, "named"));
        assert!(matches!(choose(&[], &DeviceChoice::default()), Err(RdmaError::NoDevice)));
        assert!(matches!(choose(&[roce("rxe0", false)], &DeviceChoice::default()), Err(RdmaError::NothingActive { .. })));
    }

    #[test]
    fn an_ethernet_port_without_roce_v2_needs_a_named_gid() {
        let mut d = roce("rxe0", true);
        d.ports[0].gids.retain(|g| g.kind != GidKind::RoceV2);
        let e = choose(&[d], &DeviceChoice::default()).unwrap_err().to_string();
        assert!(e.contains("--gid-index"), "{e}");
    }

    #[test]
    fn mtu_values() {
        assert_eq!([1, 2, 3, 4, 5].map(mtu_bytes), [256, 512, 1024, 2048, 4096]);
        assert_eq!(mtu_bytes(0), 0);
    }

    /// On this machine: a list of devices, or a clear error when the kernel has no
    /// RDMA support (never a panic).
    #[test]
    fn probing_this_machine_is_a_list_or_a_clear_error() {
        match devices() {
            Ok(devs) => println!("RDMA devices here: {}", list(&devs)),
            Err(e) => {
                let msg = e.to_string();
                println!("skipped device checks: {msg}");
                assert!(msg.contains("--transport soft"), "{msg}");
            }
        }
    }
}
