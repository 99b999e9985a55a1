use super::*;
use crate::testing::TestEtcd;

#[test]
fn prefix_end_is_the_first_key_after_the_prefix() {
    assert_eq!(prefix_end(b"/eps/a/"), b"/eps/a0".to_vec());
    assert_eq!(prefix_end(b"a\xff"), b"b".to_vec());
    assert_eq!(prefix_end(b"\xff\xff"), vec![0]);
}

#[test]
fn an_unreachable_endpoint_is_a_clear_error_and_no_hang() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let t = std::time::Instant::now();
    let e = Client::connect(&[format!("127.0.0.1:{port}")], Duration::from_secs(2)).unwrap_err();
    assert!(e.to_string().starts_with(&format!("cannot reach etcd at 127.0.0.1:{port}")), "{e}");
    assert!(t.elapsed() < Duration::from_secs(3));
}

/// Keys, ranges by page, compare-and-swap on creation revisions, and a
/// lease whose key goes with it.
#[test]
fn keys_transactions_and_leases_against_a_real_etcd() {
    let etcd = match TestEtcd::get() {
        Ok(e) => e,
        Err(why) => return crate::testing::skip("keys_transactions_and_leases_against_a_real_etcd", &format!("no etcd: {why}")),
    };
    let mut c = Client::connect(&["127.0.0.1:1".into(), etcd.endpoint.clone()], Duration::from_secs(2)).unwrap();
    let p = format!("/eps-etcd-test/{}/", std::process::id()).into_bytes();
    let key = |s: &str| [p.as_slice(), s.as_bytes()].concat();
    c.delete_prefix(&p).unwrap();
    // Create-if-absent, twice: the second finds the first's value.
    let put = |v: &str, lease| Op::Put { key: key("leader"), value: v.into(), lease };
    let first = c.txn(&[Compare::Created(key("leader"), 0)], &[put("a", 0)], &[Op::Get(key("leader"))]).unwrap();
    assert!(first.succeeded && first.revision > 0);
    let second = c.txn(&[Compare::Created(key("leader"), 0)], &[put("b", 0)], &[Op::Get(key("leader"))]).unwrap();
    assert!(!second.succeeded);
    let held = second.gets[0].clone().unwrap();
    assert_eq!((held.value.as_slice(), held.create_revision), (b"a".as_slice(), first.revision));
    // Fenced on the creation revision: a later creation is another holder.
    assert!(c.txn(&[Compare::Created(key("leader"), first.revision)], &[put("a2", 0)], &[]).unwrap().succeeded);
    assert!(!c.txn(&[Compare::Created(key("leader"), first.revision + 100)], &[put("x", 0)], &[]).unwrap().succeeded);
    assert!(c.txn(&[Compare::Value(key("leader"), b"a2".to_vec())], &[], &[]).unwrap().succeeded);
    // Ranges in pages, in key order; binary values survive.
    for i in 0..25u32 {
        let value = vec![0u8, 255, i as u8, b'\n'];
        c.txn(&[], &[Op::Put { key: key(&format!("log/{i:04}")), value, lease: 0 }], &[]).unwrap();
    }
    let (mut from, end, mut seen) = (key("log/"), prefix_end(&key("log/")), Vec::new());
    loop {
        let (page, more) = c.range(&from, &end, 10).unwrap();
        assert!(page.len() <= 10);
        seen.extend(page.iter().map(|kv| kv.value[2]));
        match page.last() {
            Some(last) if more => from = [last.key.as_slice(), b"\0"].concat(),
            _ => break,
        }
    }
    assert_eq!(seen, (0..25u8).collect::<Vec<_>>());
    // A lease: its key lives while it is kept alive, and goes with it.
    let (lease, ttl) = c.grant(2).unwrap();
    assert!(ttl >= 2);
    c.txn(&[], &[Op::Put { key: key("alive"), value: b"1".to_vec(), lease }], &[]).unwrap();
    assert!(c.keepalive(lease).unwrap() > 0);
    assert_eq!(c.get(&key("alive")).unwrap().unwrap().lease, lease);
    c.revoke(lease).unwrap();
    assert!(c.get(&key("alive")).unwrap().is_none());
    assert_eq!(c.keepalive(lease).unwrap(), 0, "an ended lease is not renewed");
    c.revoke(lease).unwrap();
    assert_eq!(c.delete_prefix(&p).unwrap(), 26);
}
