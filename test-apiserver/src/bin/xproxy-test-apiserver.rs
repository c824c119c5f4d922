//! A stand-in for kube-apiserver: plain HTTP, no auth, the resources xproxy
//! reads (see `xproxy_test_apiserver`). Prints `listening on http://ADDR`
//! once it serves.
//!
//! Test controls, over HTTP:
//!   GET  /_test/stats                          open watches, request counts
//!   GET  /_test/requests                       the last requests (method, path, query, accept)
//!   POST /_test/compact                        next watch resume gets 410
//!   POST /_test/drop-watches                   cut open watches mid-stream
//!   POST /_test/bookmark-interval?seconds=N    0 turns bookmarks off
//!   POST /_test/outage?seconds=N               stop, wait N s, serve again

use std::{net::SocketAddr, time::Duration};

use clap::Parser;
use xproxy_test_apiserver::{Allocation, ServerConfig, TestApiServer};

#[derive(Parser, Debug)]
#[command(name = "xproxy-test-apiserver", about = "A small Kubernetes API server for tests")]
struct Args {
    /// Address to listen on (port 0: any free port).
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// Seconds between watch bookmarks; 0 turns them off.
    #[arg(long, default_value_t = 60.0)]
    bookmark_interval: f64,
    /// Change events kept for watch resumes.
    #[arg(long, default_value_t = 10_000)]
    history: usize,
    /// IPv4 network cluster IPs are allocated from.
    #[arg(long, default_value = "10.96.0.0/12")]
    service_cluster_ip_range: String,
    /// Node ports are allocated from this range.
    #[arg(long, default_value = "30000-32767")]
    service_node_port_range: String,
    /// Do not serve the /_test/ control endpoints.
    #[arg(long)]
    no_test_endpoints: bool,
}

fn allocation(args: &Args) -> Result<Allocation, String> {
    let (ip, prefix) = args
        .service_cluster_ip_range
        .split_once('/')
        .ok_or("--service-cluster-ip-range must be ADDR/PREFIX")?;
    let ip = ip.parse().map_err(|e| format!("--service-cluster-ip-range: {e}"))?;
    let prefix: u8 = prefix.parse().map_err(|e| format!("--service-cluster-ip-range: {e}"))?;
    let (lo, hi) = args
        .service_node_port_range
        .split_once('-')
        .ok_or("--service-node-port-range must be LOW-HIGH")?;
    let lo = lo.parse().map_err(|e| format!("--service-node-port-range: {e}"))?;
    let hi = hi.parse().map_err(|e| format!("--service-node-port-range: {e}"))?;
    Ok(Allocation {
        service_cidr: (ip, prefix),
        node_ports: (lo, hi),
    })
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let allocation = allocation(&args).map_err(anyhow::Error::msg)?;
    let config = ServerConfig {
        addr: args.listen,
        bookmark_interval: (args.bookmark_interval > 0.0).then(|| Duration::from_secs_f64(args.bookmark_interval)),
        history_limit: args.history,
        allocation,
        test_endpoints: !args.no_test_endpoints,
    };
    let server = TestApiServer::start_with(config).await?;
    println!("listening on {}", server.url());
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    server.stop().await;
    Ok(())
}
