//! One request's way through the router once parsed, whatever its protocol: `validate`
//! checks the inputs against the manifest, `sparse` fans the lookups out to the shards (or
//! `held`, the router's own tables), `router` packs the payload and sends it to a ranker.

pub mod cache;
pub mod held;
pub mod kjt;
pub mod router;
pub mod sparse;
pub mod validate;
