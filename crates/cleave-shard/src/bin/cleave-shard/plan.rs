//! `--plan FILE --shard-index N`: a shard takes its row ranges and threads from entry N of a
//! deployment plan's `shards` (docs/plan.md), as a Kubernetes StatefulSet pod does with its
//! ordinal (docs/deploy.md). The file is the plan as JSON (the Helm chart renders it with
//! `toJson`); only the keys read here are checked, the rest is the planner's business.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use cleave_shard::RowSpec;
use serde::Deserialize;

#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error("--plan {path}: cannot read it: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("--plan {path}: expected a plan as JSON (docs/plan.md; the Helm chart renders one with toJson): {source}")]
    Parse {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("--plan {path}: --shard-index {index} is out of range: the plan has {count} shards (indices 0..{count})")]
    OutOfRange {
        path: PathBuf,
        index: usize,
        count: usize,
    },
    #[error("--plan {path}: shards[{index}] ({name}) holds no ranges")]
    NoRanges {
        path: PathBuf,
        index: usize,
        name: String,
    },
}

#[derive(Deserialize)]
struct PlanFile {
    shards: Vec<PlanShard>,
}

#[derive(Deserialize)]
struct PlanShard {
    name: String,
    threads: usize,
    ranges: BTreeMap<String, (u64, u64)>,
    /// Bytes of DRAM for the SSD tier's caches (docs/tiers.md); 0 or absent: all in DRAM.
    #[serde(default)]
    dram_budget: u64,
    /// The plan's placement: tables read from SSD, the rest kept in DRAM (docs/tiers.md).
    #[serde(default)]
    ssd_tables: Vec<String>,
    /// The access profile whose hottest rows warm the row cache; relative to the plan.
    #[serde(default)]
    profile: String,
    /// Where the shard keeps model updates (docs/tiers.md, "Updates"); relative to the plan.
    #[serde(default)]
    state_dir: String,
}

/// What a shard of the plan holds and runs with.
#[derive(Debug, PartialEq)]
pub struct PlannedShard {
    pub name: String,
    pub rows: RowSpec,
    pub threads: usize,
    pub dram_budget: u64,
    /// None: not placed (every table on SSD when they exceed the budget).
    pub ssd_tables: Option<Vec<String>>,
    pub profile: Option<PathBuf>,
    pub state_dir: Option<PathBuf>,
}

/// Entry `index` of the plan's `shards`.
pub fn planned_shard(path: &Path, index: usize) -> Result<PlannedShard, PlanError> {
    let text = std::fs::read_to_string(path).map_err(|source| PlanError::Read {
        path: path.into(),
        source,
    })?;
    let plan: PlanFile = serde_json::from_str(&text).map_err(|source| PlanError::Parse {
        path: path.into(),
        source,
    })?;
    let count = plan.shards.len();
    let shard = plan
        .shards
        .into_iter()
        .nth(index)
        .ok_or_else(|| PlanError::OutOfRange {
            path: path.into(),
            index,
            count,
        })?;
    if shard.ranges.is_empty() {
        return Err(PlanError::NoRanges {
            path: path.into(),
            index,
            name: shard.name,
        });
    }
    let rows = shard
        .ranges
        .into_iter()
        .map(|(table, (a, b))| (table, a..b))
        .collect();
    Ok(PlannedShard {
        name: shard.name,
        rows: RowSpec::PerTable(rows),
        threads: shard.threads.max(1),
        dram_budget: shard.dram_budget,
        ssd_tables: Some(shard.ssd_tables).filter(|t| !t.is_empty()),
        profile: Some(shard.profile).filter(|p| !p.is_empty()).map(|p| {
            // Relative to the plan file, as its bundle is.
            path.parent().unwrap_or(Path::new("")).join(p)
        }),
        state_dir: Some(shard.state_dir)
            .filter(|p| !p.is_empty())
            .map(|p| path.parent().unwrap_or(Path::new("")).join(p)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan_file(text: &str) -> tempfile::NamedTempFile {
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), text).unwrap();
        file
    }

    const PLAN: &str = r#"{"format": "cleave-plan", "shards": [
        {"name": "shard-0", "threads": 2, "ranges": {"t1": [0, 5], "t0": [0, 10]}},
        {"name": "shard-1", "threads": 1, "ranges": {"t0": [10, 20], "t1": [5, 9]}}]}"#;

    #[test]
    fn takes_the_entry_at_the_index() {
        let file = plan_file(PLAN);
        let got = planned_shard(file.path(), 1).unwrap();
        let rows = vec![("t0".to_string(), 10..20), ("t1".to_string(), 5..9)];
        assert_eq!(
            got,
            PlannedShard {
                name: "shard-1".into(),
                rows: RowSpec::PerTable(rows),
                threads: 1,
                dram_budget: 0,
                ssd_tables: None,
                profile: None,
                state_dir: None,
            }
        );
    }

    #[test]
    fn reads_the_placement_and_resolves_the_profile_against_the_plan() {
        let file = plan_file(
            r#"{"shards": [{"name": "s", "threads": 1, "ranges": {"a": [0, 4], "b": [0, 2]},
                "dram_budget": 4096, "ssd_tables": ["b"], "profile": "p.json"}]}"#,
        );
        let got = planned_shard(file.path(), 0).unwrap();
        assert_eq!(got.ssd_tables, Some(vec!["b".to_string()]));
        assert_eq!(
            got.profile,
            Some(file.path().parent().unwrap().join("p.json"))
        );
    }

    #[test]
    fn an_index_out_of_range_names_the_file_and_the_index() {
        let file = plan_file(PLAN);
        let err = planned_shard(file.path(), 2).unwrap_err().to_string();
        assert!(err.contains(&file.path().display().to_string()), "{err}");
        assert!(
            err.contains("--shard-index 2") && err.contains("2 shards"),
            "{err}"
        );
    }

    #[test]
    fn a_plan_that_is_not_json_or_lacks_shards_is_refused() {
        let yaml = plan_file("format: cleave-plan\nshards: []\n");
        let err = planned_shard(yaml.path(), 0).unwrap_err().to_string();
        assert!(err.contains("expected a plan as JSON"), "{err}");
        let empty = plan_file(r#"{"format": "cleave-plan"}"#);
        let err = planned_shard(empty.path(), 0).unwrap_err().to_string();
        assert!(err.contains("missing field `shards`"), "{err}");
        let bare = plan_file(r#"{"shards": [{"name": "s", "threads": 1, "ranges": {}}]}"#);
        let err = planned_shard(bare.path(), 0).unwrap_err().to_string();
        assert!(err.contains("shards[0] (s) holds no ranges"), "{err}");
    }
}
