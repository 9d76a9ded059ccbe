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
    let timed_out = |err: &ClientError| {
        assert!(
            matches!(err.wire(), Some(cleave_wire::WireError::Timeout { .. })),
            "{err}"
        );
    };
    // A timeout says this replica took at least 200 ms; one is not yet its speed, so a
    // lookup with 50 ms left is still sent (and times out at its own deadline).
    let (wait, left) = (Duration::from_millis(200), Duration::from_millis(50));
    timed_out(
        &rt.block_on(c.lookup_within(batch, wait, wait, 0, None))
            .unwrap_err(),
    );
    timed_out(
        &rt.block_on(c.lookup_within(batch, left, left, 0, None))
            .unwrap_err(),
    );
    assert_eq!(stuck.0.lock().unwrap().len(), 2);
    // More timeouts settle the estimate (cleave_wire::SURE_AFTER samples in all).
    for sent in 3..=cleave_wire::SURE_AFTER as usize {
        timed_out(
            &rt.block_on(c.lookup_within(batch, wait, wait, 0, None))
                .unwrap_err(),
        );
        assert_eq!(stuck.0.lock().unwrap().len(), sent);
    }
    let sent = stuck.0.lock().unwrap().len();
    // 50 ms left, about 200 ms expected: refused before sending.
    let err = rt
        .block_on(c.lookup_within(batch, left, left, 0, None))
        .unwrap_err();
    assert!(
        matches!(err, ClientError::Late { expected_us, .. } if expected_us >= 100_000),
        "{err}"
    );
    assert!(err.to_string().contains("not sent to shard"), "{err}");
    // The drop pulled the estimate down (a sample of half the 50 ms left; only replies refresh
    // it otherwise: a replica once slow would never be sent a lookup again).
    let ewma_ms = c.members()[0].ewma_ms;
    assert!(ewma_ms < 199.0 && ewma_ms > 25.0, "{ewma_ms}");
    // With time enough it is sent (and times out again). Had the late one been sent, it would
    // have arrived before this one on the same connection.
    let long = wait * 2;
    timed_out(
        &rt.block_on(c.lookup_within(batch, long, long, 0, None))
            .unwrap_err(),
    );
    assert_eq!(
        stuck.0.lock().unwrap().len(),
        sent + 1,
        "the late lookup went on the link"
    );
    server.shutdown();
}
