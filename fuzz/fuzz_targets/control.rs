//! The protocol decoders that read bytes from the network (control-plane
//! messages, worker hellos, immediates), on arbitrary input: none may panic, and
//! whatever decodes re-encodes to the same bytes.
#![no_main]

use eps_proto::control::ControlMsg;
use eps_proto::hello::{HELLO_LEN, Hello};
use eps_proto::imm::Imm;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = ControlMsg::decode(data) {
        assert_eq!(&m.encode()[4..], data);
    }
    if data.len() >= HELLO_LEN
        && let Some(h) = Hello::decode(&data[..HELLO_LEN])
    {
        assert_eq!(&h.encode()[..], &data[..HELLO_LEN]);
    }
    if data.len() >= 4 {
        let v = u32::from_le_bytes(data[..4].try_into().expect("4 bytes"));
        if let Some(i) = Imm::decode(v) {
            let _ = i.encode();
        }
    }
});
