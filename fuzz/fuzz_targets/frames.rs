//! Every decoder that reads bytes from the network, on arbitrary input: none may
//! panic, and whatever a request decoder accepts re-encodes to the same bytes.
#![no_main]

use eps_fabric::wire::{REQ_LEN, RESP_LEN, Request, Response, decode_all};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = decode_all(data);
    if let Ok(r) = Request::decode(data) {
        assert_eq!(&r.encode()[..], &data[..REQ_LEN]);
    }
    if let Ok(r) = Response::decode(data) {
        assert_eq!(&r.encode()[..], &data[..RESP_LEN]);
    }
});
