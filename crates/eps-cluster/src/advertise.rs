//! Where others reach a service this process listens on, and the line a
//! launcher reads to learn it.

use std::net::SocketAddr;

/// Prints the line a launcher reads (the address others reach the control
/// plane at, and the Slurm node its state is on); returns that address.
pub fn ready_line(bound: SocketAddr) -> SocketAddr {
    let addr = advertised(bound);
    match std::env::var("SLURMD_NODENAME") {
        // For a Slurm launcher: the node its state is on.
        Ok(node) if !node.is_empty() && !node.contains(char::is_whitespace) => {
            println!("EPS_CONTROL_READY addr={addr} node={node}")
        }
        _ => println!("EPS_CONTROL_READY addr={addr}"),
    }
    addr
}

/// Where others reach a service bound to `addr`: itself, unless bound to
/// every interface; then this host's address (its name resolved), else
/// loopback.
pub fn advertised(addr: SocketAddr) -> SocketAddr {
    if !addr.ip().is_unspecified() {
        return addr;
    }
    // Slurm's name for the node, else the host name.
    let names = [crate::slurm::node_name(), nix::unistd::gethostname().ok().and_then(|h| h.into_string().ok())];
    let host = names.iter().flatten().find_map(|h| {
        let found = std::net::ToSocketAddrs::to_socket_addrs(&(h.as_str(), addr.port())).ok()?;
        found.into_iter().find(|a| a.is_ipv4() && !a.ip().is_unspecified())
    });
    host.unwrap_or_else(|| {
        eps_proto::say!("eps control: this host's name does not resolve; telling others 127.0.0.1");
        SocketAddr::from(([127, 0, 0, 1], addr.port()))
    })
}
