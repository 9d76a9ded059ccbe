//! `--profile FILE`: the access profile (docs/tiers.md, "Access profile"). The shard reads only
//! each table's `hot_rows` (hottest first) to warm its row cache; the planner reads the rest.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use serde::Deserialize;

#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    #[error("--profile {path}: cannot read it: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("--profile {path}: expected an access profile as JSON (docs/tiers.md): {source}")]
    Parse {
        path: PathBuf,
        source: serde_json::Error,
    },
}

#[derive(Deserialize)]
struct ProfileFile {
    tables: BTreeMap<String, TableProfile>,
}

#[derive(Deserialize)]
struct TableProfile {
    #[serde(default)]
    hot_rows: Vec<u64>,
}

/// The hottest rows of each table the profile lists rows for, hottest first.
pub fn hot_rows(path: &Path) -> Result<HashMap<String, Vec<u64>>, ProfileError> {
    let text = std::fs::read_to_string(path).map_err(|source| ProfileError::Read {
        path: path.into(),
        source,
    })?;
    let file: ProfileFile = serde_json::from_str(&text).map_err(|source| ProfileError::Parse {
        path: path.into(),
        source,
    })?;
    Ok(file
        .tables
        .into_iter()
        .filter(|(_, t)| !t.hot_rows.is_empty())
        .map(|(name, t)| (name, t.hot_rows))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_hot_rows_and_names_the_file_on_bad_input() {
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(
            file.path(),
            r#"{"format": "cleave-access-profile", "tables": {
                "a": {"queries_per_s": 10, "pooling": 2, "hot_rows": [5, 1]},
                "b": {"queries_per_s": 1, "pooling": 1}}}"#,
        )
        .unwrap();
        let got = hot_rows(file.path()).unwrap();
        assert_eq!(got, HashMap::from([("a".to_string(), vec![5, 1])]));
        std::fs::write(file.path(), r#"{"tables": {"a": {"hot_rows": [-1]}}}"#).unwrap();
        let err = hot_rows(file.path()).unwrap_err().to_string();
        assert!(err.contains(&file.path().display().to_string()), "{err}");
        assert!(err.contains("expected an access profile"), "{err}");
    }
}
