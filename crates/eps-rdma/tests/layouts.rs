//! rdma-sys writes some libibverbs and librdmacm structs by hand (the ones with
//! unions) instead of generating them. Those this crate uses are checked here
//! against the C headers: gcc compiles a probe that prints their sizes and field
//! offsets, and they must equal rdma-sys's. Where gcc or the headers are missing
//! it says plainly that it skipped.

use std::mem::{offset_of, size_of};
use std::process::Command;

use rdma_sys as sys;

const PROBE: &str = r#"
#include <stddef.h>
#include <stdio.h>
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>
#define F(s, f) printf("%s.%s %zu\n", #s, #f, offsetof(struct s, f))
int main(void) {
    printf("ibv_send_wr.size %zu\n", sizeof(struct ibv_send_wr));
    F(ibv_send_wr, wr_id); F(ibv_send_wr, next); F(ibv_send_wr, sg_list); F(ibv_send_wr, num_sge);
    F(ibv_send_wr, opcode); F(ibv_send_wr, send_flags); F(ibv_send_wr, imm_data); F(ibv_send_wr, wr);
    F(ibv_send_wr, wr.rdma.remote_addr); F(ibv_send_wr, wr.rdma.rkey);
    printf("ibv_wc.size %zu\n", sizeof(struct ibv_wc));
    F(ibv_wc, wr_id); F(ibv_wc, status); F(ibv_wc, opcode); F(ibv_wc, vendor_err); F(ibv_wc, byte_len);
    F(ibv_wc, imm_data); F(ibv_wc, qp_num); F(ibv_wc, src_qp); F(ibv_wc, wc_flags);
    F(rdma_cm_event, id); F(rdma_cm_event, listen_id); F(rdma_cm_event, event); F(rdma_cm_event, status);
    F(rdma_cm_event, param); F(rdma_cm_event, param.conn.private_data); F(rdma_cm_event, param.conn.private_data_len);
    F(rdma_cm_id, route); F(rdma_cm_id, route.addr.dst_addr);
    return 0;
}
"#;

fn ours() -> Vec<(&'static str, usize)> {
    let wr = offset_of!(sys::ibv_send_wr, wr);
    let param = offset_of!(sys::rdma_cm_event, param);
    let route = offset_of!(sys::rdma_cm_id, route);
    vec![
        ("ibv_send_wr.size", size_of::<sys::ibv_send_wr>()),
        ("ibv_send_wr.wr_id", offset_of!(sys::ibv_send_wr, wr_id)),
        ("ibv_send_wr.next", offset_of!(sys::ibv_send_wr, next)),
        ("ibv_send_wr.sg_list", offset_of!(sys::ibv_send_wr, sg_list)),
        ("ibv_send_wr.num_sge", offset_of!(sys::ibv_send_wr, num_sge)),
        ("ibv_send_wr.opcode", offset_of!(sys::ibv_send_wr, opcode)),
        ("ibv_send_wr.send_flags", offset_of!(sys::ibv_send_wr, send_flags)),
        ("ibv_send_wr.imm_data", offset_of!(sys::ibv_send_wr, imm_data_invalidated_rkey_union)),
        ("ibv_send_wr.wr", wr),
        ("ibv_send_wr.wr.rdma.remote_addr", wr + offset_of!(sys::rdma_t, remote_addr)),
        ("ibv_send_wr.wr.rdma.rkey", wr + offset_of!(sys::rdma_t, rkey)),
        ("ibv_wc.size", size_of::<sys::ibv_wc>()),
        ("ibv_wc.wr_id", offset_of!(sys::ibv_wc, wr_id)),
        ("ibv_wc.status", offset_of!(sys::ibv_wc, status)),
        ("ibv_wc.opcode", offset_of!(sys::ibv_wc, opcode)),
        ("ibv_wc.vendor_err", offset_of!(sys::ibv_wc, vendor_err)),
        ("ibv_wc.byte_len", offset_of!(sys::ibv_wc, byte_len)),
        ("ibv_wc.imm_data", offset_of!(sys::ibv_wc, imm_data_invalidated_rkey_union)),
        ("ibv_wc.qp_num", offset_of!(sys::ibv_wc, qp_num)),
        ("ibv_wc.src_qp", offset_of!(sys::ibv_wc, src_qp)),
        ("ibv_wc.wc_flags", offset_of!(sys::ibv_wc, wc_flags)),
        ("rdma_cm_event.id", offset_of!(sys::rdma_cm_event, id)),
        ("rdma_cm_event.listen_id", offset_of!(sys::rdma_cm_event, listen_id)),
        ("rdma_cm_event.event", offset_of!(sys::rdma_cm_event, event)),
        ("rdma_cm_event.status", offset_of!(sys::rdma_cm_event, status)),
        ("rdma_cm_event.param", param),
        ("rdma_cm_event.param.conn.private_data", param + offset_of!(sys::rdma_conn_param, private_data)),
        ("rdma_cm_event.param.conn.private_data_len", param + offset_of!(sys::rdma_conn_param, private_data_len)),
        ("rdma_cm_id.route", route),
        (
            "rdma_cm_id.route.addr.dst_addr",
            route + offset_of!(sys::rdma_route, addr) + offset_of!(sys::rdma_addr, dst_addr_union),
        ),
    ]
}

#[test]
fn hand_written_layouts_match_the_c_headers() {
    let dir = std::env::temp_dir().join(format!("eps-rdma-layouts-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (src, exe) = (dir.join("probe.c"), dir.join("probe"));
    std::fs::write(&src, PROBE).unwrap();
    let built = Command::new("gcc").arg("-o").arg(&exe).arg(&src).output();
    let built = match built {
        Ok(o) if o.status.success() => true,
        Ok(o) => {
            println!("skipped: the probe does not compile here (headers missing?): {}", String::from_utf8_lossy(&o.stderr));
            false
        }
        Err(e) => {
            println!("skipped: no gcc here ({e})");
            false
        }
    };
    if !built {
        std::fs::remove_dir_all(&dir).ok();
        return;
    }
    let out = Command::new(&exe).output().expect("the probe runs");
    std::fs::remove_dir_all(&dir).ok();
    let text = String::from_utf8(out.stdout).unwrap();
    let c: std::collections::HashMap<&str, usize> =
        text.lines().filter_map(|l| l.split_once(' ')).map(|(k, v)| (k, v.trim().parse().unwrap())).collect();
    let mut wrong = Vec::new();
    for (name, rust) in ours() {
        let Some(&want) = c.get(name) else { panic!("the probe did not print {name}:\n{text}") };
        if want != rust {
            wrong.push(format!("{name}: C {want}, rdma-sys {rust}"));
        }
    }
    assert!(wrong.is_empty(), "layouts differ from the C headers:\n{}", wrong.join("\n"));
    println!("{} sizes and offsets equal the C headers'", c.len());
}
