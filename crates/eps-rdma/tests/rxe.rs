//! Device discovery and selection on real RDMA devices: soft-RoCE in the VM that
//! `ci/softroce.sh` boots (where `EPS_RDMA_REQUIRE` is set, so a missing device
//! fails), or any machine with an RDMA NIC. Elsewhere it says plainly that it
//! skipped.

use eps_rdma::{DeviceChoice, GidKind, RdmaError, devices, select};

#[test]
fn devices_are_found_and_the_selection_is_explained() {
    let require = std::env::var_os("EPS_RDMA_REQUIRE").is_some();
    let devs = match devices() {
        Ok(d) if !d.is_empty() => d,
        Ok(_) | Err(_) if !require => {
            println!("skipped: no RDMA device here ({:?})", devices().err().map(|e| e.to_string()));
            return;
        }
        other => panic!("EPS_RDMA_REQUIRE is set but no device is usable: {other:?}"),
    };
    for d in &devs {
        println!("{}: {:?}", d.name, d.ports);
    }
    let s = select(&DeviceChoice::default()).expect("a device with an active port");
    println!("{s}");
    assert!(s.mtu >= 256, "active MTU {}", s.mtu);
    let port = devs.iter().find(|d| d.name == s.device).and_then(|d| d.ports.iter().find(|p| p.num == s.port)).unwrap();
    if port.link_layer == "Ethernet" {
        assert_eq!(s.gid.kind, GidKind::RoceV2, "RoCE v2 is detected when no index is named");
    }
    if let Ok(a) = std::env::var("EPS_RDMA_ADDR") {
        let want: std::net::Ipv4Addr = a.parse().expect("EPS_RDMA_ADDR is an IPv4 address");
        assert_eq!(s.gid.addr().to_ipv4_mapped(), Some(want), "the RoCE v2 GID of the device's address");
    }
    // Naming what was chosen gives the same; naming what does not exist says what does.
    let named = DeviceChoice { device: Some(s.device.clone()), port: Some(s.port), gid_index: Some(s.gid.index) };
    let again = select(&named).unwrap();
    assert_eq!((again.gid.clone(), again.how), (s.gid.clone(), ["named"; 3]));
    let e = select(&DeviceChoice { device: Some("no_such_dev".into()), ..Default::default() }).unwrap_err();
    assert!(matches!(e, RdmaError::UnknownDevice { .. }) && e.to_string().contains(&s.device), "{e}");
}
