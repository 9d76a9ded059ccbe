//! How the rows of a bag are combined: shared by the kernels and the lookup API, so that
//! neither depends on the other.

use std::str::FromStr;

/// How the rows of a bag are combined.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Pooling {
    /// Sum of the rows, each times its per-sample weight if there are weights.
    Sum,
    /// Sum divided by the number of ids of the bag.
    Mean,
    /// Element-wise maximum.
    Max,
}

impl Pooling {
    pub fn as_str(self) -> &'static str {
        match self {
            Pooling::Sum => "sum",
            Pooling::Mean => "mean",
            Pooling::Max => "max",
        }
    }

    /// The pooling a shard runs when its result is merged with other shards' ([`merge`]):
    /// a mean is merged from partial sums.
    pub fn partial(self) -> Pooling {
        match self {
            Pooling::Mean => Pooling::Sum,
            other => other,
        }
    }
}

impl FromStr for Pooling {
    type Err = String;

    fn from_str(s: &str) -> Result<Pooling, String> {
        match s {
            "sum" => Ok(Pooling::Sum),
            "mean" => Ok(Pooling::Mean),
            "max" => Ok(Pooling::Max),
            other => Err(format!(
                "pooling must be \"sum\", \"mean\" or \"max\", found {other:?}"
            )),
        }
    }
}
