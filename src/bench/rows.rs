//! `eps bench sparse --table`: the report of [`eps_bench::rows`].

use crate::bench::Json;

/// Runs and prints one table's pull costs: a new row's and a held row's, in
/// ns and as multiples of a memory copy of the row's bytes.
pub fn bench(dim: u32, keys: u64, iters: u64, optimizer: &str, json: bool) -> Result<(), String> {
    use eps_bench::rows::{HELD, RowsBench, run, table_spec};
    let keys = usize::try_from(keys).map_err(|_| format!("--keys {keys}: too many"))?;
    let table = table_spec(dim, optimizer)?;
    eps_proto::say!(
        "eps bench sparse --table: a table of {HELD} rows (dim {dim}, {optimizer}) in this process; pulls of {keys} distinct ids, all new or all held, {iters} of each"
    );
    let r = run(&RowsBench { table, keys, iters })?;
    println!("{:>9} {:>10} {:>22}", "", "ns/row", "x memcpy of its bytes");
    for (what, ns) in [("new row", r.new_ns), ("held row", r.held_ns)] {
        println!("{what:>9} {ns:>10.0} {:>22.1}", ns / r.memcpy_row_ns);
    }
    println!(
        "a row with its optimizer state is {} B; one thread copies it in {:.1} ns (64 MiB memcpy, same run)",
        r.row_bytes, r.memcpy_row_ns
    );
    if json {
        let j = Json::new()
            .int("dim", dim.into())
            .int("keys", keys as u64)
            .int("iters", iters)
            .int("held_rows", HELD)
            .num("new_row_ns", r.new_ns)
            .num("held_row_ns", r.held_ns)
            .int("row_bytes", r.row_bytes as u64)
            .num("memcpy_row_ns", r.memcpy_row_ns)
            .finish();
        println!("{j}");
    }
    Ok(())
}
