//! Property tests of the control codec, the window and the queue policies.

use std::collections::VecDeque;

use cleave_flow::control::{decode, ControlMessage, ErrorCode, MAX_TEXT};
use cleave_flow::{IncastScheduler, Order, Pending};
use proptest::prelude::*;

fn message() -> impl Strategy<Value = ControlMessage> {
    prop_oneof![
        (any::<u64>(), any::<u64>(), any::<u64>(), any::<u64>()).prop_map(|(id, bytes, s, t)| {
            ControlMessage::RequestToSend {
                id,
                bytes,
                slo_left_us: s,
                stamp_ns: t,
            }
        }),
        any::<u64>().prop_map(|id| ControlMessage::Grant { id }),
        any::<u64>().prop_map(|id| ControlMessage::Done { id }),
        any::<u64>().prop_map(|id| ControlMessage::Expired { id }),
        (any::<u32>(), any::<u64>(), any::<u64>()).prop_map(|(conn, bytes, stamp_ns)| {
            ControlMessage::Credit {
                conn,
                bytes,
                stamp_ns,
            }
        }),
        "[a-z é]{0,60}".prop_map(|message| ControlMessage::Error {
            code: ErrorCode::Unexpected,
            message
        }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// Whatever arrives, the decoder answers Ok(None), a message, or an error: never a panic,
    /// and never claims more bytes than it was given.
    #[test]
    fn decoder_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
        if let Ok(Some((_, used))) = decode(&bytes) {
            prop_assert!(used <= bytes.len());
        }
    }

    /// Valid headers with random bodies and lengths: still no panic.
    #[test]
    fn decoder_survives_valid_headers(kind in 0u8..8, len in 0u32..300, body in proptest::collection::vec(any::<u8>(), 0..300)) {
        let mut f = vec![0x46, 0x43, 1, kind];
        f.extend_from_slice(&len.to_le_bytes());
        f.extend_from_slice(&body);
        let _ = decode(&f);
    }

    #[test]
    fn messages_round_trip(m in message()) {
        let frame = m.encode();
        prop_assert!(frame.len() <= 8 + 2 + MAX_TEXT);
        prop_assert_eq!(decode(&frame).unwrap(), Some((m, frame.len())));
    }

    /// Grants never take the bytes in flight past the window, except one message alone.
    #[test]
    fn grants_never_exceed_the_window(
        window in 1u64..50,
        edf in any::<bool>(),
        ops in proptest::collection::vec((0u8..4, 1u64..20, 0u64..1000, 0u32..4), 1..200),
    ) {
        let order = if edf { Order::Edf } else { Order::Fcfs };
        let mut s = IncastScheduler::new(window, order, 1.0);
        let mut limit = window;
        let mut in_flight: Vec<(u32, u64, u64)> = Vec::new();
        let mut next_id = 0u64;
        for (i, (op, bytes, slo, sender)) in ops.into_iter().enumerate() {
            let grants = match op {
                0 | 1 => { next_id += 1; s.request(sender, next_id, bytes, slo, i as u64) }
                2 => match in_flight.first().copied() {
                    Some((snd, id, _)) => s.complete(snd, id),
                    None => Vec::new(),
                },
                _ => { limit = bytes * 3; s.set_limit(limit) }
            };
            if op == 2 && !in_flight.is_empty() {
                in_flight.remove(0);
            }
            for g in grants {
                in_flight.push((g.sender, g.id, g.bytes));
                let total: u64 = in_flight.iter().map(|m| m.2).sum();
                prop_assert!(total <= limit || in_flight.len() == 1,
                    "{total} bytes in flight over a window of {limit}");
            }
            prop_assert_eq!(s.window().in_flight(), in_flight.iter().map(|m| m.2).sum::<u64>());
        }
    }

    /// The queue pops in its policy's order: EDF by (deadline, arrival), FCFS by arrival.
    #[test]
    fn queue_order_matches_the_policy(deadlines in proptest::collection::vec(0u64..20, 0..60), edf in any::<bool>()) {
        let order = if edf { Order::Edf } else { Order::Fcfs };
        let mut q = order.queue();
        for (seq, d) in deadlines.iter().enumerate() {
            q.push(Pending { id: seq as u64, sender: 0, bytes: 1, start_by_ns: *d, seq: seq as u64 });
        }
        let mut popped = Vec::new();
        while let Some(p) = q.pop() {
            popped.push((p.start_by_ns, p.seq));
        }
        let mut expected: Vec<(u64, u64)> = deadlines.iter().enumerate().map(|(s, d)| (*d, s as u64)).collect();
        if edf {
            expected.sort();
        }
        prop_assert_eq!(popped, expected);
    }

    /// No starvation when the load allows: bursts of messages at ≤ 80% of the link on
    /// average, a few tight SLOs among loose ones; under either order and any window, every
    /// request is granted and every loose one arrives within its SLO.
    #[test]
    fn loose_requests_are_not_starved(
        bursts in proptest::collection::vec(proptest::collection::vec((1u64..=8, any::<bool>()), 1..8), 1..15),
        window_msgs in 1u64..6,
        edf in any::<bool>(),
    ) {
        const UNIT: u64 = 1000; // bytes; the link moves 1 byte per ns
        let max_burst = 8 * 8 * UNIT;
        let gap = max_burst * 10 / 8; // a full burst every gap is 80% load
        let tight = 2 * 8 * UNIT;
        let loose = 20 * max_burst;
        let order = if edf { Order::Edf } else { Order::Fcfs };
        let mut s = IncastScheduler::new(window_msgs * 8 * UNIT, order, 1.0);
        // (sender, id, bytes, arrival, slo)
        let mut arrivals = VecDeque::new();
        let mut all = Vec::new();
        for (b, burst) in bursts.iter().enumerate() {
            for (i, (units, is_tight)) in burst.iter().enumerate() {
                let id = all.len() as u64;
                let m = (i as u32, id, units * UNIT, b as u64 * gap, if *is_tight { tight } else { loose });
                arrivals.push_back(m);
                all.push(m);
            }
        }
        // The link serves granted messages one after another in grant order.
        let mut link: VecDeque<(u32, u64, u64)> = VecDeque::new();
        let mut link_free_at = 0u64;
        let mut done_at = vec![None; all.len()];
        let mut now;
        for _ in 0..10_000 {
            let next_done = link.front().map(|_| link_free_at);
            let next_arrival = arrivals.front().map(|m| m.3);
            let grants = match (next_arrival, next_done) {
                (None, None) => break,
                (Some(a), d) if d.is_none_or(|d| a <= d) => {
                    let (snd, id, bytes, at, slo) = arrivals.pop_front().unwrap();
                    now = at;
                    s.request(snd, id, bytes, slo, now)
                }
                (_, Some(d)) => {
                    now = d;
                    let (snd, id, _) = link.pop_front().unwrap();
                    done_at[id as usize] = Some(now);
                    if let Some(next) = link.front() { link_free_at = now + next.2; }
                    s.complete(snd, id)
                }
                _ => unreachable!(),
            };
            for g in grants {
                if link.is_empty() { link_free_at = now + g.bytes; }
                link.push_back((g.sender, g.id, g.bytes));
            }
        }
        for (snd, id, _, at, slo) in &all {
            let done = done_at[*id as usize];
            prop_assert!(done.is_some(), "request {id} of sender {snd} was never served");
            if *slo == loose {
                prop_assert!(done.unwrap() - at <= loose, "loose request {id} waited {}", done.unwrap() - at);
            }
        }
    }
}
