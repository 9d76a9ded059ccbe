//! The frame decoder against random and mutated bytes: it never panics, never yields a frame
//! larger than the limit, and decodes valid streams identically however they are split.
//! Version 2 headers: 40 bytes, deadline and trace id at 24..40, the CANCEL flag.

use bytes::{Bytes, BytesMut};
use cleave_wire::frame::{flags, HEADER_LEN};
use cleave_wire::{Frame, FrameDecoder};
use proptest::prelude::*;

const MAX: u32 = 4096;

fn arb_frame() -> impl Strategy<Value = Frame> {
    (
        prop_oneof![
            Just(0u8),
            Just(flags::RESPONSE),
            Just(flags::RESPONSE | flags::ERROR),
            Just(flags::CANCEL)
        ],
        any::<u16>(),
        any::<u64>(),
        proptest::collection::vec(any::<u8>(), 0..300),
        any::<u64>(),
        any::<u64>(),
    )
        .prop_map(|(flags, kind, request_id, payload, deadline, trace)| {
            // A CANCEL frame carries no payload.
            let payload = if flags == flags::CANCEL {
                vec![]
            } else {
                payload
            };
            Frame {
                flags,
                kind,
                request_id,
                deadline_unix_us: deadline,
                trace_id: trace,
                payload: Bytes::from(payload),
            }
        })
}

/// Feeds `bytes` in the given chunk sizes; returns the frames and the first error, if any.
fn decode_chunked(bytes: &[u8], chunks: &[usize]) -> (Vec<Frame>, bool) {
    let mut d = FrameDecoder::new(MAX);
    let mut buf = BytesMut::new();
    let mut out = Vec::new();
    let mut pos = 0;
    let mut i = 0;
    while pos < bytes.len() {
        let n = chunks
            .get(i)
            .copied()
            .unwrap_or(bytes.len())
            .clamp(1, bytes.len() - pos);
        i += 1;
        buf.extend_from_slice(&bytes[pos..pos + n]);
        pos += n;
        loop {
            match d.decode(&mut buf) {
                Ok(Some(f)) => {
                    assert!(f.payload.len() <= MAX as usize);
                    out.push(f);
                }
                Ok(None) => break,
                Err(_) => return (out, true),
            }
        }
    }
    (out, false)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..2048),
                                chunks in proptest::collection::vec(1usize..64, 0..64)) {
        let _ = decode_chunked(&bytes, &chunks);
    }

    #[test]
    fn valid_streams_decode_whatever_the_split(frames in proptest::collection::vec(arb_frame(), 0..8),
                                               chunks in proptest::collection::vec(1usize..100, 0..64)) {
        let bytes: Vec<u8> = frames.iter().flat_map(|f| f.to_bytes().to_vec()).collect();
        let (out, failed) = decode_chunked(&bytes, &chunks);
        prop_assert!(!failed);
        prop_assert_eq!(out, frames);
    }

    #[test]
    fn random_mutations_never_panic(frames in proptest::collection::vec(arb_frame(), 1..6),
                                    flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..4),
                                    chunks in proptest::collection::vec(1usize..100, 0..64)) {
        let mut bytes: Vec<u8> = frames.iter().flat_map(|f| f.to_bytes().to_vec()).collect();
        for (pos, x) in flips {
            let i = pos % bytes.len();
            bytes[i] ^= x | 1;
        }
        let (out, _) = decode_chunked(&bytes, &chunks);
        prop_assert!(out.len() <= frames.len() + bytes.len() / HEADER_LEN);
    }

    #[test]
    fn damaged_fixed_header_fields_are_rejected(frames in proptest::collection::vec(arb_frame(), 1..4),
                                                field in prop::sample::select(vec![0usize, 1, 2, 3, 4, 20, 21, 22, 23]),
                                                x in 1u8..=255,
                                                chunks in proptest::collection::vec(1usize..100, 0..64)) {
        let mut bytes: Vec<u8> = frames.iter().flat_map(|f| f.to_bytes().to_vec()).collect();
        bytes[field] ^= x;
        let (out, failed) = decode_chunked(&bytes, &chunks);
        prop_assert!(failed, "damaged byte {} accepted", field);
        prop_assert!(out.is_empty());
    }

    #[test]
    fn truncated_streams_never_yield_a_partial_frame(frame in arb_frame(), cut in 0usize..400) {
        let bytes = frame.to_bytes();
        let cut = cut.min(bytes.len().saturating_sub(1));
        let (out, failed) = decode_chunked(&bytes[..cut], &[]);
        prop_assert!(out.is_empty());
        prop_assert!(!failed);
        prop_assert!(cut < HEADER_LEN + frame.payload.len());
    }
}

mod slot_refs {
    //! The slot-reference codec and resolver against random bytes and random references:
    //! never a panic, a reference resolves only to the exact slot, length and generation the
    //! sender wrote, and anything else is an error naming what was expected.

    use cleave_wire::shm::{Region, ShmConfig, ShmRx, ShmTx, SlotRef, SLOT_REF_LEN};
    use proptest::prelude::*;

    fn pair() -> (ShmTx, ShmRx) {
        let tx = ShmTx::new(ShmConfig {
            slots: 4,
            slot_bytes: 4096,
        })
        .unwrap();
        let fd = tx.region().fd().try_clone().unwrap();
        (tx, ShmRx::new(Region::open(fd).unwrap()))
    }

    proptest! {
        #[test]
        fn random_bytes_never_panic_the_codec(bytes in proptest::collection::vec(any::<u8>(), 0..40)) {
            match SlotRef::decode(&bytes) {
                Ok(r) => {
                    prop_assert_eq!(bytes.len(), SLOT_REF_LEN);
                    prop_assert_eq!(&r.encode()[..], &bytes[..]);
                }
                Err(e) => prop_assert!(e.contains("slot reference"), "{}", e),
            }
        }

        #[test]
        fn only_the_written_reference_resolves(
            index in 0u32..8, offset in 0u32..5000, len in 0u32..5000, gen_delta in 0u64..3,
            written in 1usize..4096,
        ) {
            let (tx, rx) = pair();
            let good = tx.write(&vec![9u8; written]).unwrap();
            let r = SlotRef { index, offset, len, generation: good.generation + gen_delta };
            let exact = index == good.index && offset == 0 && len as usize == written
                && gen_delta == 0;
            match rx.resolve(&r) {
                Ok(b) => {
                    // In range and current: resolves (a sub-range of the slot is allowed).
                    prop_assert!(index == good.index && gen_delta == 0);
                    prop_assert!(offset + len <= 4096);
                    prop_assert_eq!(b.len(), len as usize);
                }
                Err(e) => {
                    prop_assert!(!exact, "{}", e);
                    prop_assert!(e.contains("expected"), "{}", e);
                }
            }
        }
    }
}
