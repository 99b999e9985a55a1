//! The committed `include/eps.h` is what cbindgen generates from this crate.
//! On drift this test fails and shows the first differing line;
//! `EPS_BLESS=1 cargo test -p eps-capi --test header` rewrites the header.

use std::path::PathBuf;

#[test]
fn the_committed_header_is_the_generated_one() {
    let krate = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(krate.join("cbindgen.toml")).expect("cbindgen.toml");
    let mut generated = Vec::new();
    cbindgen::Builder::new()
        .with_crate(&krate)
        .with_config(config)
        .generate()
        .expect("cbindgen generates the header")
        .write(&mut generated);
    let generated = String::from_utf8(generated).expect("UTF-8");
    let path = krate.join("../../include/eps.h");
    if std::env::var_os("EPS_BLESS").is_some() {
        std::fs::write(&path, &generated).expect("write include/eps.h");
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    if committed != generated {
        let line = committed.lines().zip(generated.lines()).position(|(a, b)| a != b);
        let at = line.unwrap_or_else(|| committed.lines().count().min(generated.lines().count()));
        panic!(
            "include/eps.h differs from the header generated from crates/eps-capi (first at line {}):\n  committed: {:?}\n  generated: {:?}\nrun `EPS_BLESS=1 cargo test -p eps-capi --test header` and commit the result",
            at + 1,
            committed.lines().nth(at).unwrap_or("<end of file>"),
            generated.lines().nth(at).unwrap_or("<end of file>")
        );
    }
}
