//! Replica groups with real shards on loopback sockets: a dead replica's part is retried on
//! another and the dead one ejected, a probe readmits it once it is back, one replica alone
//! fails fast naming its range, a replica that does not answer in time costs one attempt,
//! and the membership changes while the client serves.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cleave_shard::{
    ClientError, Lookup, MembershipError, Op, ReplicaState, Route, RoutingTable, RowSpec, Shard,
    ShardClient, ShardClientConfig, ShardConfig,
};
use cleave_wire::{Address, Handler, Request, Responder, Server, ServerConfig};

const ROWS: u64 = 60;
const DIM: usize = 2;

fn value(r: u64, j: usize) -> f32 {
    (r * 10) as f32 + j as f32
}

fn write_bundle(dir: &Path) {
    std::fs::create_dir_all(dir.join("tables")).unwrap();
    let data: Vec<u8> = (0..ROWS)
        .flat_map(|r| (0..DIM).flat_map(move |j| value(r, j).to_le_bytes()))
        .collect();
    std::fs::write(dir.join("tables/t.bin"), &data).unwrap();
    let manifest = format!(
        r#"{{"format": "cleave-bundle", "version": 1, "tables": [{{"name": "t",
            "file": "tables/t.bin", "rows": {ROWS}, "dim": {DIM}, "dtype": "float32",
            "row_bytes": {}, "crc32": 0}}]}}"#,
        DIM * 4
    );
    std::fs::write(dir.join("manifest.json"), manifest).unwrap();
}

fn start(dir: &Path, rows: std::ops::Range<u64>, addr: &str) -> Shard {
    let mut config = ShardConfig::new(dir.to_owned(), addr.parse().unwrap());
    config.rows = RowSpec::Global(rows);
    Shard::start(&config).unwrap()
}

fn route(rows: std::ops::Range<u64>, addr: &Address) -> Route {
    Route {
        table: "t".into(),
        rows,
        addr: addr.clone(),
    }
}

fn client(routes: Vec<Route>) -> ShardClient {
    let config = ShardClientConfig {
        timeout: Duration::from_secs(10),
        ..ShardClientConfig::default()
    };
    ShardClient::new(RoutingTable::new(routes).unwrap(), &config).unwrap()
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Gathers every row; the result must be exact.
fn check_all(rt: &tokio::runtime::Runtime, c: &ShardClient) -> Result<(), ClientError> {
    let ids: Vec<i64> = (0..ROWS as i64).collect();
    let l = Lookup {
        table: "t".into(),
        op: Op::Gather,
        ids: ids.clone(),
        offsets: vec![],
        weights: None,
    };
    let out = rt.block_on(c.lookup(&[l]))?;
    let want: Vec<f32> = (0..ROWS)
        .flat_map(|r| (0..DIM).map(move |j| value(r, j)))
        .collect();
    assert_eq!(out[0].values, want);
    Ok(())
}

fn state(c: &ShardClient, addr: &Address) -> ReplicaState {
    c.members()
        .into_iter()
        .find(|m| m.addr == *addr)
        .map(|m| m.state)
        .unwrap()
}

#[test]
fn a_dead_replica_is_retried_elsewhere_ejected_and_readmitted() {
    let dir = tempfile::tempdir().unwrap();
    write_bundle(dir.path());
    let a = start(dir.path(), 0..ROWS, "127.0.0.1:0");
    let b = start(dir.path(), 0..ROWS, "127.0.0.1:0");
    let (a_addr, b_addr) = (a.info().listen.clone(), b.info().listen.clone());
    let c = client(vec![route(0..ROWS, &a_addr), route(0..ROWS, &b_addr)]);
    let rt = runtime();
    for _ in 0..4 {
        check_all(&rt, &c).unwrap();
    }
    // Both replicas took work: an unmeasured replica scores below a measured one.
    assert!(
        c.members().iter().all(|m| m.ewma_ms > 0.0),
        "{:?}",
        c.members()
    );

    // Kill the replica the next lookup picks (the lower EWMA; nothing is outstanding), so
    // that the lookup meets the dead one and must fail over.
    let members = c.members();
    let (dead, live) = if members[0].ewma_ms <= members[1].ewma_ms {
        (a, b)
    } else {
        (b, a)
    };
    let (a, b) = (dead, live);
    let a_addr = a.info().listen.clone();
    drop(a); // stops at once, its connections close
    for _ in 0..6 {
        check_all(&rt, &c).expect("the other replica answers every lookup");
    }
    assert_eq!(state(&c, &a_addr), ReplicaState::Ejected);
    let report = rt.block_on(c.probe(Duration::from_secs(5)));
    assert!(report.problems.is_empty(), "{report:?}");
    assert!(
        report.degraded[0].contains(&format!(
            "shard {a_addr} (a replica of table \"t\" rows [0, 60)) is ejected"
        )),
        "{report:?}"
    );

    let a = start(dir.path(), 0..ROWS, &a_addr.to_string());
    let report = rt.block_on(c.probe(Duration::from_secs(5)));
    assert_eq!(report, Default::default());
    assert_eq!(state(&c, &a_addr), ReplicaState::Active);
    check_all(&rt, &c).unwrap();
    assert!(a.join() && b.join());
}

#[test]
fn a_lone_replica_fails_fast_naming_its_range_and_recovers() {
    let dir = tempfile::tempdir().unwrap();
    write_bundle(dir.path());
    let s = start(dir.path(), 0..ROWS, "127.0.0.1:0");
    let addr = s.info().listen.clone();
    let c = client(vec![route(0..ROWS, &addr)]);
    let rt = runtime();
    check_all(&rt, &c).unwrap();
    drop(s);
    let err = check_all(&rt, &c).unwrap_err().to_string();
    assert!(err.starts_with(&format!("shard {addr}")), "{err}");
    assert!(err.contains("table \"t\" rows [0, 60)"), "{err}");
    // Ejected now: the next lookup fails without a call, naming the range and the replica.
    let err = check_all(&rt, &c).unwrap_err();
    assert!(matches!(err, ClientError::Unavailable { .. }), "{err}");
    let err = err.to_string();
    assert!(
        err.contains("table \"t\" rows [0, 60)") && err.contains(&format!("{addr} (ejected")),
        "{err}"
    );
    let report = rt.block_on(c.probe(Duration::from_secs(5)));
    assert!(
        report.problems[0].contains("no shard replica serves"),
        "{report:?}"
    );

    let s = start(dir.path(), 0..ROWS, &addr.to_string());
    assert_eq!(
        rt.block_on(c.probe(Duration::from_secs(5))),
        Default::default()
    );
    check_all(&rt, &c).unwrap();
    assert!(s.join());
}

#[test]
fn replicas_join_drain_and_leave_while_serving() {
    let dir = tempfile::tempdir().unwrap();
    write_bundle(dir.path());
    let a = start(dir.path(), 0..30, "127.0.0.1:0");
    let b = start(dir.path(), 30..ROWS, "127.0.0.1:0");
    let n = start(dir.path(), 0..30, "127.0.0.1:0");
    let (a_addr, b_addr, n_addr) = (
        a.info().listen.clone(),
        b.info().listen.clone(),
        n.info().listen.clone(),
    );
    let c = client(vec![route(0..30, &a_addr), route(30..ROWS, &b_addr)]);
    let rt = runtime();
    check_all(&rt, &c).unwrap();

    let first_half = vec![("t".to_owned(), 0..30)];
    c.add_replica(n_addr.clone(), first_half.clone()).unwrap();
    assert_eq!(state(&c, &n_addr), ReplicaState::Ejected, "not probed yet");
    let err = c.add_replica(n_addr.clone(), first_half).unwrap_err();
    assert!(matches!(err, MembershipError::Conflict(_)), "{err}");
    let elsewhere: Address = "127.0.0.1:9".parse().unwrap();
    let err = c
        .add_replica(elsewhere.clone(), vec![("t".to_owned(), 0..20)])
        .unwrap_err();
    assert!(
        matches!(&err, MembershipError::Invalid(m) if m.contains("exactly the ranges of one replica group")),
        "{err}"
    );
    assert_eq!(
        rt.block_on(c.probe(Duration::from_secs(5))),
        Default::default()
    );
    assert_eq!(state(&c, &n_addr), ReplicaState::Active);
    check_all(&rt, &c).unwrap();

    c.drain(&a_addr).unwrap();
    assert_eq!(state(&c, &a_addr), ReplicaState::Draining);
    let err = c.remove(&n_addr).unwrap_err().to_string();
    assert!(
        err.contains("last active replica of table \"t\" rows [0, 30)"),
        "{err}"
    );
    c.remove(&a_addr).unwrap();
    assert_eq!(c.members().len(), 2);
    for _ in 0..3 {
        check_all(&rt, &c).unwrap();
    }
    let err = c.drain(&b_addr).unwrap_err();
    assert!(matches!(err, MembershipError::Conflict(_)), "{err}");
    let err = c.remove(&elsewhere).unwrap_err();
    assert!(matches!(err, MembershipError::Unknown(_)), "{err}");
    assert!(a.join() && b.join() && n.join());
}

/// Answers READY but holds every LOOKUP without replying (a replica cut off mid-call).
#[derive(Default)]
struct Stuck(Mutex<Vec<Responder>>);

impl Handler for Stuck {
    fn handle(&self, _request: Request, responder: Responder) {
        self.0.lock().unwrap().push(responder);
    }
}

#[test]
fn a_replica_that_does_not_answer_in_time_costs_one_attempt() {
    let dir = tempfile::tempdir().unwrap();
    write_bundle(dir.path());
    let live = start(dir.path(), 0..ROWS, "127.0.0.1:0");
    let stuck = Arc::new(Stuck::default());
    let server = Server::bind(
        &"127.0.0.1:0".parse().unwrap(),
        stuck.clone(),
        ServerConfig::default(),
    )
    .unwrap();
    let stuck_addr = server.local_addr().clone();
    let c = client(vec![
        route(0..ROWS, &stuck_addr),
        route(0..ROWS, &live.info().listen),
    ]);
    let rt = runtime();
    let ids: Vec<i64> = (0..ROWS as i64).collect();
    let l = Lookup {
        table: "t".into(),
        op: Op::Gather,
        ids,
        offsets: vec![],
        weights: None,
    };
    let attempt = Duration::from_millis(100);
    for _ in 0..3 {
        let out = rt
            .block_on(c.lookup_within(
                std::slice::from_ref(&l),
                Duration::from_secs(10),
                attempt,
                0,
                None,
            ))
            .expect("the live replica answers the retry");
        assert_eq!(out[0].values.len(), ROWS as usize * DIM);
    }
    let stuck_member = c
        .members()
        .into_iter()
        .find(|m| m.addr == stuck_addr)
        .unwrap();
    assert!(
        stuck_member.outstanding == 0 && stuck_member.ewma_ms >= 100.0,
        "{stuck_member:?}"
    );
    assert_eq!(
        stuck_member.state,
        ReplicaState::Active,
        "slow is not dead: not ejected"
    );
    // With the whole budget as the attempt, a timeout is the request's answer: no retry.
    let c = client(vec![route(0..ROWS, &stuck_addr)]);
    let err = rt
        .block_on(c.lookup_within(std::slice::from_ref(&l), attempt, attempt, 0, None))
        .unwrap_err();
    assert!(
        matches!(err.wire(), Some(cleave_wire::WireError::Timeout { .. })),
        "{err}"
    );
    drop(server);
    assert!(live.join());
}
