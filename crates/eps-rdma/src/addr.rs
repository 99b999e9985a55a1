//! The IPv4 address rdma_cm reaches a port at, when its GID does not carry one:
//! on InfiniBand the GIDs are IB addresses, and rdma_cm connects through the
//! port's IPoIB interface (ib0, ...). The interface is found in sysfs
//! (`/sys/class/infiniband/DEV/device/net/NETDEV`, its `dev_port` naming the port
//! from 0) and its address with getifaddrs.

use std::ffi::CStr;
use std::net::Ipv4Addr;
use std::path::Path;

/// The network interfaces of `device`'s port `port` (numbered from 1), read from
/// `sysfs` (normally `/sys/class/infiniband`), in name order.
pub fn port_netdevs(sysfs: &Path, device: &str, port: u8) -> Vec<String> {
    let dir = sysfs.join(device).join("device").join("net");
    let Ok(entries) = std::fs::read_dir(&dir) else { return Vec::new() };
    let mut out: Vec<String> = entries
        .flatten()
        .filter(|e| {
            // `dev_port` counts ports from 0; older kernels only have `dev_id`.
            let read = |f: &str| std::fs::read_to_string(e.path().join(f)).ok().map(|s| s.trim().to_string());
            let n = read("dev_port").or_else(|| read("dev_id")).and_then(|s| {
                let s = s.trim_start_matches("0x");
                u32::from_str_radix(s, if read("dev_port").is_some() { 10 } else { 16 }).ok()
            });
            n.unwrap_or(0) + 1 == u32::from(port)
        })
        .filter_map(|e| e.file_name().into_string().ok())
        .collect();
    out.sort();
    out
}

/// The first IPv4 address of network interface `netdev`, if it has one.
pub fn ipv4_of(netdev: &str) -> Option<Ipv4Addr> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: a valid out-parameter; the list is freed below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return None;
    }
    let mut found = None;
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the live list getifaddrs returned.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_name.is_null() {
            continue;
        }
        // SAFETY: a non-null name is a C string owned by the list.
        let name = unsafe { CStr::from_ptr(ifa.ifa_name) };
        // SAFETY: a non-null address starts with its family.
        let family = i32::from(unsafe { (*ifa.ifa_addr).sa_family });
        if name.to_bytes() == netdev.as_bytes() && family == libc::AF_INET {
            // SAFETY: an AF_INET address is a sockaddr_in.
            let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
            found = Some(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)));
            break;
        }
    }
    // SAFETY: `head` came from getifaddrs and is freed once; no node is used after.
    unsafe { libc::freeifaddrs(head) };
    found
}

/// The IPv4 address of `device`'s port `port`: the first one of its network
/// interfaces that has one.
pub fn port_ipv4(device: &str, port: u8) -> Option<Ipv4Addr> {
    port_netdevs(Path::new("/sys/class/infiniband"), device, port).iter().find_map(|n| ipv4_of(n))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_has_its_address() {
        assert_eq!(ipv4_of("lo"), Some(Ipv4Addr::LOCALHOST));
        assert_eq!(ipv4_of("no-such-netdev"), None);
    }

    /// A fake sysfs tree: a two-port HCA with ib0 on port 1 and ib1 on port 2.
    #[test]
    fn the_netdev_of_a_port_is_found_in_sysfs() {
        let root = std::env::temp_dir().join(format!("eps-sysfs-{}", std::process::id()));
        for (dev, port0) in [("ib0", "0"), ("ib1", "1")] {
            let d = root.join("mlx5_0/device/net").join(dev);
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("dev_port"), format!("{port0}\n")).unwrap();
        }
        // An older kernel: dev_id only, in hex.
        let d = root.join("mlx4_0/device/net/ib7");
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("dev_id"), "0x1\n").unwrap();
        assert_eq!(port_netdevs(&root, "mlx5_0", 1), ["ib0"]);
        assert_eq!(port_netdevs(&root, "mlx5_0", 2), ["ib1"]);
        assert!(port_netdevs(&root, "mlx5_0", 3).is_empty());
        assert_eq!(port_netdevs(&root, "mlx4_0", 2), ["ib7"]);
        assert!(port_netdevs(&root, "nosuch", 1).is_empty());
        std::fs::remove_dir_all(root).ok();
    }
}
