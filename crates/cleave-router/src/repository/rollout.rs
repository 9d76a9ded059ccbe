//! Which version takes a model's requests that name none: the default, or a canary's share
//! of them (docs/api.md, "Versions and rollout"); promotion, rollback, and the state's file.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::config::Version;

/// One model's rollout state, as `GET /admin/v1/rollout` shows it and the file keeps it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rollout {
    pub default: Version,
    pub canary: Option<Canary>,
    pub previous: Option<Version>,
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Canary {
    pub version: Version,
    /// The share of unversioned requests it takes, in [0, 100).
    pub percent: f64,
}

/// The whole state: model name → its rollout.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RolloutFile {
    pub models: BTreeMap<String, Rollout>,
}

impl Rollout {
    pub fn new(default: Version) -> Rollout {
        Rollout {
            default,
            canary: None,
            previous: None,
        }
    }

    /// The version an unversioned request goes to: with a key, a stable choice
    /// (`bucket(model, key) < percent * 100`); without, a random one in the same share.
    pub fn pick(&self, model: &str, key: Option<&str>) -> Version {
        let Some(canary) = self.canary else {
            return self.default;
        };
        let bucket = match key {
            Some(key) => bucket(model, key),
            None => random() % BUCKETS,
        };
        if (bucket as f64) < canary.percent * 100.0 {
            canary.version
        } else {
            self.default
        }
    }

    /// `percent` of the unversioned requests to `version` (0 clears the canary); 100
    /// promotes it: the default becomes `previous`, `version` the default.
    pub fn set(&mut self, version: Version, percent: f64) {
        if percent >= 100.0 {
            if version != self.default {
                self.previous = Some(self.default);
                self.default = version;
            }
            self.canary = None;
        } else if percent <= 0.0 || version == self.default {
            self.canary = None;
        } else {
            self.canary = Some(Canary { version, percent });
        }
    }

    /// Clears a canary; with none, returns the default to `previous` (what it returns to,
    /// for the caller to check it still serves). None: nothing to roll back to.
    pub fn rollback(&mut self) -> Result<(), String> {
        if self.canary.take().is_some() {
            return Ok(());
        }
        let Some(previous) = self.previous.take() else {
            return Err(format!(
                "nothing to roll back: no canary and no previous version (default is {})",
                self.default
            ));
        };
        self.default = previous;
        Ok(())
    }

    /// Every version the state names.
    pub fn versions(&self) -> Vec<Version> {
        let mut v = vec![self.default];
        v.extend(self.canary.map(|c| c.version));
        v.extend(self.previous);
        v
    }

    /// Forgets `version` (being unloaded); a default that goes becomes `successor`.
    pub fn forget(&mut self, version: Version, successor: Option<Version>) {
        if self.canary.is_some_and(|c| c.version == version) {
            self.canary = None;
        }
        if self.previous == Some(version) {
            self.previous = None;
        }
        if self.default == version {
            if let Some(next) = successor {
                self.default = next;
            }
        }
    }
}

/// Buckets of the stable choice: a share is kept to 0.01 %.
const BUCKETS: u64 = 10_000;

/// `fnv1a64(model + "\0" + key) % 10000` (docs/api.md gives it for clients).
pub fn bucket(model: &str, key: &str) -> u64 {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let bytes = model.bytes().chain([0]).chain(key.bytes());
    bytes.fold(OFFSET, |h, b| (h ^ b as u64).wrapping_mul(PRIME)) % BUCKETS
}

/// A thread-local xorshift64*: cheap, and good enough to split traffic.
fn random() -> u64 {
    thread_local! {
        static STATE: Cell<u64> = Cell::new(seed());
    }
    STATE.with(|s| {
        let mut x = s.get();
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        s.set(x);
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    })
}

fn seed() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    (nanos ^ n.wrapping_mul(0x9e37_79b9_7f4a_7c15)) | 1
}

impl RolloutFile {
    /// Reads the file; none there is an empty state, a malformed one an error naming it.
    pub fn read(path: &Path) -> Result<RolloutFile, String> {
        let text = match std::fs::read_to_string(path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Self::default()),
            Err(e) => return Err(format!("rollout file {}: {e}", path.display())),
        };
        serde_json::from_str(&text).map_err(|e| {
            format!(
                "rollout file {}: {e}; expected {{\"models\": {{NAME: {{\"default\": \"V\", \
                 \"canary\": {{\"version\": \"V\", \"percent\": P}} or null, \"previous\": \
                 \"V\" or null}}}}}}",
                path.display()
            )
        })
    }

    /// Writes the whole state atomically: a temporary file beside it, then a rename.
    pub fn write(&self, path: &Path) -> Result<(), String> {
        let text = serde_json::to_string_pretty(self).expect("a rollout state serializes");
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, text)
            .and_then(|()| std::fs::rename(&tmp, path))
            .map_err(|e| format!("cannot write the rollout file {}: {e}", path.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys() -> Vec<String> {
        (0..20_000).map(|i| format!("user-{i}")).collect()
    }

    #[test]
    fn a_canary_takes_its_share_of_keys_and_a_key_always_the_same_version() {
        let mut r = Rollout::new(Version(1));
        r.set(Version(2), 10.0);
        let to_canary = keys()
            .iter()
            .filter(|k| r.pick("dlrm", Some(k)) == Version(2))
            .count();
        let share = to_canary as f64 / keys().len() as f64;
        assert!((share - 0.10).abs() < 0.01, "canary share {share}");
        for k in keys().iter().take(100) {
            assert_eq!(r.pick("dlrm", Some(k)), r.pick("dlrm", Some(k)));
        }
        let random = (0..20_000)
            .filter(|_| r.pick("dlrm", None) == Version(2))
            .count();
        assert!((random as f64 / 20_000.0 - 0.10).abs() < 0.02, "{random}");
    }

    #[test]
    fn the_bucket_is_fnv1a_of_model_nul_key() {
        // "m", then the NUL (xor 0 leaves the hash as it is), by hand.
        let prime = 0x100_0000_01b3u64;
        let by_hand = (0xcbf2_9ce4_8422_2325u64 ^ b'm' as u64)
            .wrapping_mul(prime)
            .wrapping_mul(prime)
            % 10_000;
        assert_eq!(bucket("m", ""), by_hand);
        assert_ne!(bucket("a", "b"), bucket("b", "a"));
    }

    #[test]
    fn promotion_and_both_rollbacks() {
        let mut r = Rollout::new(Version(1));
        assert!(r.rollback().unwrap_err().contains("nothing to roll back"));
        r.set(Version(2), 25.0);
        assert_eq!(r.canary.unwrap().version, Version(2));
        r.rollback().unwrap();
        assert_eq!((r.canary, r.default), (None, Version(1)));
        r.set(Version(2), 100.0);
        assert_eq!(
            (r.default, r.previous, r.canary),
            (Version(2), Some(Version(1)), None)
        );
        assert_eq!(r.pick("m", Some("k")), Version(2));
        r.rollback().unwrap();
        assert_eq!((r.default, r.previous), (Version(1), None));
        r.set(Version(3), 5.0);
        r.set(Version(3), 0.0);
        assert_eq!(r.canary, None);
    }

    #[test]
    fn forgetting_a_version_clears_what_names_it() {
        let mut r = Rollout::new(Version(2));
        r.previous = Some(Version(1));
        r.set(Version(3), 10.0);
        r.forget(Version(3), None);
        assert_eq!(r.canary, None);
        r.forget(Version(2), Some(Version(1)));
        assert_eq!(r.default, Version(1));
        assert_eq!(r.versions(), vec![Version(1), Version(1)]);
    }

    #[test]
    fn the_file_round_trips_and_a_malformed_one_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rollout.json");
        assert_eq!(RolloutFile::read(&path).unwrap(), RolloutFile::default());
        let mut r = Rollout::new(Version(1));
        r.set(Version(2), 100.0);
        r.set(Version(3), 12.5);
        let state = RolloutFile {
            models: BTreeMap::from([("dlrm".to_string(), r)]),
        };
        state.write(&path).unwrap();
        assert_eq!(RolloutFile::read(&path).unwrap(), state);
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.contains("\"default\": \"2\""), "{text}");
        std::fs::write(&path, r#"{"models": {"dlrm": {"default": "two"}}}"#).unwrap();
        let e = RolloutFile::read(&path).unwrap_err();
        assert!(e.contains("rollout.json") && e.contains("\"two\""), "{e}");
    }
}
