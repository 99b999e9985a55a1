//! The fabric conformance suite, run against every provider available here.
//!
//! The `soft` and `shm` providers, and `auto` per connection over both, always run. The `rdma` provider runs the same cases when the
//! crate is built with its feature (`ci/softroce.sh` does, on soft-RoCE).

mod conformance {
    pub mod harness;
    pub mod suite;
}

use conformance::suite;

/// Instantiates every case of the suite for one provider.
macro_rules! conformance_for {
    ($provider:ident, $mk:expr) => {
        mod $provider {
            use super::suite;
            #[test]
            fn write_then_read() {
                suite::write_then_read($mk)
            }
            #[test]
            fn prepared_receives_take_the_first_send() {
                suite::prepared_receives_take_the_first_send($mk)
            }
            #[test]
            fn write_imm_consumes_recv() {
                suite::write_imm_consumes_recv($mk)
            }
            #[test]
            fn send_recv_scatter_gather() {
                suite::send_recv_scatter_gather($mk)
            }
            #[test]
            fn unsignaled_and_ordering() {
                suite::unsignaled_and_ordering($mk)
            }
            #[test]
            fn many_qps_one_cq() {
                suite::many_qps_one_cq($mk)
            }
            #[test]
            fn large_and_tiny() {
                suite::large_and_tiny($mk)
            }
            #[test]
            fn remote_access_errors() {
                suite::remote_access_errors($mk)
            }
            #[test]
            fn local_protection_errors() {
                suite::local_protection_errors($mk)
            }
            #[test]
            fn invalid_request_errors() {
                suite::invalid_request_errors($mk)
            }
            #[test]
            fn rnr_waits_then_times_out() {
                suite::rnr_waits_then_times_out($mk)
            }
            #[test]
            fn queue_full_is_backpressure() {
                suite::queue_full_is_backpressure($mk)
            }
            #[test]
            fn wrong_secret_is_rejected() {
                suite::wrong_secret_is_rejected($mk)
            }
            #[test]
            fn peer_vanishes_mid_transfer() {
                suite::peer_vanishes_mid_transfer($mk)
            }
            #[test]
            fn teardown_with_ops_in_flight() {
                suite::teardown_with_ops_in_flight($mk)
            }
        }
    };
}

conformance_for!(soft, || eps_fabric::soft::SoftDevice::open().expect("open soft device").alloc_pd());

// Peers on one host through shared memory (both ends of each pair are in this
// process, which the provider treats like any other process of the same user).
conformance_for!(shm, || eps_fabric::shm::ShmDevice::open().expect("open shm device").alloc_pd());

// `auto` per connection (both ends on this host: its shm QPs).
conformance_for!(mixed, || eps_fabric::mixed::MixedDevice::open().expect("open mixed device").alloc_pd());

// With the `rdma` feature (ci/softroce.sh builds it and runs it on soft-RoCE, with
// EPS_CONFORMANCE_ADDR set to the device's address): the selected device.
#[cfg(feature = "rdma")]
conformance_for!(rdma, || {
    let sel = eps_rdma::select(&eps_rdma::DeviceChoice::default()).expect("an RDMA device (this suite needs one)");
    eps_rdma::RdmaDevice::open(&sel.device).expect("open the RDMA device").alloc_pd().expect("a protection domain")
});
