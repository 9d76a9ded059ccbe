//! The shard client drops a lookup that cannot make its deadline before sending it: with less
//! time left than the replica's lookups take (its moving average), nothing goes on the link.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use cleave_shard::{ClientError, Lookup, Op, Route, RoutingTable, ShardClient, ShardClientConfig};
use cleave_wire::{Address, Handler, Request, Responder, Server, ServerConfig};

/// Holds every LOOKUP without replying, counting them.
#[derive(Default)]
struct Stuck(Mutex<Vec<Responder>>);

impl Handler for Stuck {
    fn handle(&self, _request: Request, responder: Responder) {
        self.0.lock().unwrap().push(responder);
    }
}

fn client(addr: &Address) -> ShardClient {
    let route = Route {
        table: "t".into(),
        rows: 0..10,
        addr: addr.clone(),
    };
    let config = ShardClientConfig {
        timeout: Duration::from_secs(10),
        connections: 1, // one data connection: frames reach the shard in the order sent
        ..ShardClientConfig::default()
    };
    ShardClient::new(RoutingTable::new(vec![route]).unwrap(), &config).unwrap()
}

#[test]
fn a_lookup_with_less_time_left_than_the_replica_takes_is_not_sent() {
    let stuck = Arc::new(Stuck::default());
    let server = Server::bind(
        &"127.0.0.1:0".parse().unwrap(),
        stuck.clone(),
        ServerConfig::default(),
    )
    .unwrap();
    let c = client(server.local_addr());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let l = Lookup {
        table: "t".into(),
        op: Op::Gather,
        ids: vec![1, 2],
        offsets: vec![],
        weights: None,
    };
    let batch = std::slice::from_ref(&l);
    // A timeout teaches the client that this replica takes at least 200 ms.
    let wait = Duration::from_millis(200);
    let err = rt
        .block_on(c.lookup_within(batch, wait, wait, 0, None))
        .unwrap_err();
    assert!(
        matches!(err.wire(), Some(cleave_wire::WireError::Timeout { .. })),
        "{err}"
    );
    assert_eq!(stuck.0.lock().unwrap().len(), 1);
    // 50 ms left, 200 ms expected: refused before sending.
    let left = Duration::from_millis(50);
    let err = rt
        .block_on(c.lookup_within(batch, left, left, 0, None))
        .unwrap_err();
    assert!(
        matches!(err, ClientError::Late { expected_us, .. } if expected_us >= 150_000),
        "{err}"
    );
    assert!(err.to_string().contains("not sent to shard"), "{err}");
    // The drop pulled the estimate down (a sample of half the 50 ms left; only replies refresh
    // it otherwise: a replica once slow would never be sent a lookup again).
    let ewma_ms = c.members()[0].ewma_ms;
    assert!(ewma_ms < 199.0 && ewma_ms > 25.0, "{ewma_ms}");
    // With time enough it is sent (and times out again). Had the late one been sent, it would
    // have arrived before this one on the same connection.
    let err = rt
        .block_on(c.lookup_within(batch, wait * 2, wait * 2, 0, None))
        .unwrap_err();
    assert!(
        matches!(err.wire(), Some(cleave_wire::WireError::Timeout { .. })),
        "{err}"
    );
    assert_eq!(
        stuck.0.lock().unwrap().len(),
        2,
        "the late lookup went on the link"
    );
    server.shutdown();
}
