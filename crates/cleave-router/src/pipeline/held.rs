//! Router-held shards (Prism's CN keeps its tables local): the bundle's tables open in the
//! router's process and a request's lookups run there, through the same LOOKUP encoding and
//! shard service the shard processes use, with no socket in between. Lookups run on the
//! router's I/O thread that handles the request, as a shard runs them on its own I/O threads.

use std::path::Path;
use std::sync::Arc;

use cleave_shard::message::{decode_response, encode_request};
use cleave_shard::{Lookup, Pooled, Shard, ShardConfig, ShardService};
use cleave_wire::Address;

use crate::error::{ErrorKind, RequestError};

pub struct HeldShards {
    service: Arc<ShardService>,
}

impl HeldShards {
    /// Opens every table of the bundle whole, with `threads` lookup threads.
    pub fn open(bundle: &Path, threads: usize) -> Result<HeldShards, String> {
        let config = ShardConfig {
            threads: threads.max(1),
            // Never bound: a held shard has no listener (ShardConfig needs an address).
            ..ShardConfig::new(bundle.to_path_buf(), Address::Tcp("127.0.0.1:0".into()))
        };
        let service =
            Shard::open_in_process(&config).map_err(|e| format!("router-held shards: {}", e.0))?;
        Ok(HeldShards { service })
    }

    /// One result per lookup, in order, as a shard holding every row would answer.
    pub fn lookup(&self, batch: &[Lookup]) -> Result<Vec<Pooled>, RequestError> {
        let payload = encode_request(batch.iter().map(Lookup::view));
        let (response, _) = self.service.lookup(&payload).map_err(|(code, message)| {
            RequestError::new(
                ErrorKind::Shard,
                format!("router-held lookup: {code:?}: {message}"),
            )
        })?;
        decode_response(&response, batch.len()).map_err(|e| {
            RequestError::new(ErrorKind::Shard, format!("router-held lookup: {}", e.0))
        })
    }
}
