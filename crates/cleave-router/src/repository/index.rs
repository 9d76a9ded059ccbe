//! `POST /v2/repository/index`: the versions on disk (the controller's index) merged with
//! those served and their states.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::config::Version;
use crate::repository::registry::{State, UNAVAILABLE};
use crate::repository::{Refusal, Why};

/// One entry of `POST /v2/repository/index`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct IndexEntry {
    pub name: String,
    pub version: String,
    pub state: String,
    pub reason: String,
}

/// The controller's index: `{"models": [{"name", "versions": ["1", ...]}]}`.
pub fn disk_versions(answer: &Value) -> Result<Vec<(String, Version)>, Refusal> {
    #[derive(Deserialize)]
    struct Index {
        models: Vec<OnDisk>,
    }
    #[derive(Deserialize)]
    struct OnDisk {
        name: String,
        versions: Vec<Version>,
    }
    let index: Index = serde_json::from_value(answer.clone()).map_err(|e| {
        Refusal::new(
            Why::Internal,
            format!("the repository controller's index answer: {e}"),
        )
    })?;
    Ok(index
        .models
        .into_iter()
        .flat_map(|m| m.versions.into_iter().map(move |v| (m.name.clone(), v)))
        .collect())
}

/// The versions on disk and those held, each once, by model then version.
pub fn merge_index(
    on_disk: &[(String, Version)],
    held: &[(String, Version, State)],
) -> Vec<IndexEntry> {
    let mut all: BTreeMap<(String, Version), &str> = on_disk
        .iter()
        .map(|(m, v)| ((m.clone(), *v), UNAVAILABLE))
        .collect();
    for (m, v, state) in held {
        all.insert((m.clone(), *v), state.as_str());
    }
    all.into_iter()
        .map(|((name, v), state)| IndexEntry {
            name,
            version: v.to_string(),
            state: state.to_string(),
            reason: String::new(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_index_merges_disk_and_served_states() {
        let on_disk = [
            ("dlrm".to_string(), Version(1)),
            ("dlrm".to_string(), Version(10)),
            ("dlrm".to_string(), Version(2)),
        ];
        let held = [
            ("dlrm".to_string(), Version(2), State::Ready),
            ("dlrm".to_string(), Version(3), State::Loading),
            ("a".to_string(), Version(1), State::Unloading),
        ];
        let got: Vec<(String, String, String)> = merge_index(&on_disk, &held)
            .into_iter()
            .map(|e| (e.name, e.version, e.state))
            .collect();
        let s = |a: &str, b: &str, c: &str| (a.to_string(), b.to_string(), c.to_string());
        assert_eq!(
            got,
            [
                s("a", "1", "UNLOADING"),
                s("dlrm", "1", "UNAVAILABLE"),
                s("dlrm", "2", "READY"),
                s("dlrm", "3", "LOADING"),
                s("dlrm", "10", "UNAVAILABLE"),
            ]
        );
        let answer = json!({"models": [{"name": "dlrm", "versions": ["1", "2"]}]});
        assert_eq!(disk_versions(&answer).unwrap().len(), 2);
        let bad = disk_versions(&json!({"models": [{"name": "dlrm", "versions": ["x"]}]}));
        assert!(bad
            .unwrap_err()
            .message
            .contains("expected a decimal integer"));
    }
}
