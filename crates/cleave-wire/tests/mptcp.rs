//! `mptcp:host:port` (docs/protocol.md, "Multipath TCP"): a real MPTCP connection between a
//! Server and a Client on loopback, and the fallback to TCP where the kernel refuses MPTCP
//! (a network namespace of this test's own with `net.mptcp.enabled = 0`).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use cleave_wire::{
    Address, Client, ClientConfig, Handler, IoThreads, Request, Responder, Server, ServerConfig,
};

struct Echo;

impl Handler for Echo {
    fn handle(&self, req: Request, resp: Responder) {
        resp.reply(req.payload.clone());
    }
}

fn mptcp_enabled() -> bool {
    std::fs::read_to_string("/proc/sys/net/mptcp/enabled").is_ok_and(|s| s.trim() == "1")
}

/// Serves on `listen`, makes one call through a Client and returns whether a connection
/// made as the Client makes them runs MPTCP.
fn round_trip(listen: &str) -> bool {
    let addr: Address = listen.parse().unwrap();
    let server = Server::bind(&addr, Arc::new(Echo), ServerConfig::default()).unwrap();
    let local = server.local_addr().clone();
    assert!(matches!(local, Address::Mptcp(_)), "{local}");
    let io = IoThreads::new("test-io", 1).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let client = Client::new(local.clone(), io, ClientConfig::default());
    rt.block_on(async {
        let payload = Bytes::from_static(b"over every path");
        let got = client
            .call(
                cleave_wire::frame::kind::FIRST_APP,
                payload.clone(),
                Duration::from_secs(5),
            )
            .await
            .unwrap();
        assert_eq!(got, payload);
        local.connects_mptcp().await.unwrap()
    })
}

#[test]
fn mptcp_connection_is_made() {
    if !mptcp_enabled() {
        eprintln!("skipped: net.mptcp.enabled is not 1 on this kernel");
        return;
    }
    assert!(
        round_trip("mptcp:127.0.0.1:0"),
        "the connection fell back to TCP"
    );
}

#[test]
fn refused_by_the_kernel_falls_back_to_tcp() {
    // A thread of its own in a fresh network namespace: unshare moves only the calling
    // thread, and the threads it then starts (the server's, the client's) share its
    // namespace, so the rest of the test binary keeps the machine's.
    let outcome = std::thread::spawn(|| {
        // SAFETY: unshare(2) takes no pointers; it affects only this thread.
        if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
            return None; // not privileged
        }
        let status = std::process::Command::new("ip")
            .args(["link", "set", "lo", "up"])
            .status()
            .ok()?;
        assert!(status.success());
        std::fs::write("/proc/sys/net/mptcp/enabled", "0").ok()?;
        Some(round_trip("mptcp:127.0.0.1:0"))
    })
    .join()
    .unwrap();
    match outcome {
        None => eprintln!("skipped: cannot make a network namespace (needs root)"),
        Some(is_mptcp) => {
            assert!(!is_mptcp, "MPTCP is disabled in this namespace");
            assert!(
                cleave_wire::mptcp_refused_by_kernel(),
                "the fallback was not logged"
            );
        }
    }
}
