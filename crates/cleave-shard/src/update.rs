//! Model updates on a shard (docs/tiers.md, "Updates"): UPDATE frames stage a table's next
//! version durably in the shard's state directory, then switch to it.
//!
//! * `stage`: chunks of a delta or of a whole table file are appended to a part file; with the
//!   last chunk the shard checks it against the table, writes the next version as a table file
//!   (`T.vN.tbl`: temporary file, fsync, rename, fsync the directory) and opens it beside the
//!   serving version. Nothing serves it yet.
//! * `switch`: records `T -> (N, T.vN.tbl)` in `state.json` (atomically replaced, fsynced:
//!   the commit point), then swaps the table in; lookups in flight keep the version they
//!   started with, which is freed when the last of them ends.
//! * `abort`: drops a staged version and its files.
//! * `status`: the table's serving version and the `source` its last switch recorded.
//!
//! A switch may carry a `source` (any JSON value: a stream consumer's topic and offsets,
//! docs/streaming.md); it is stored with the version in `state.json` and reported by `status`,
//! so a consumer that dies after a switch and before its offset commit applies nothing twice.
//!
//! On start, [`replay`] opens each table at its committed version and deletes every file in
//! the state directory that `state.json` does not name (staged, never switched updates).

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use cleave_embed::update::{write_atomically, write_version, Change, Delta, UpdateError};
use cleave_embed::{Manifest, OpenOptions, Table, TableMeta};
use serde::{Deserialize, Serialize};

/// The state file in a shard's state directory.
pub const STATE_FILE: &str = "state.json";
/// Held locked (flock) by the shard that uses the directory: two shards on one directory
/// would delete each other's versions.
const LOCK_FILE: &str = ".lock";
const STATE_FORMAT: &str = "cleave-shard-state";

/// Why an update step failed; the message names the shard's file, table or value.
#[derive(Debug, thiserror::Error)]
pub enum StepError {
    #[error("bad UPDATE message: {0}")]
    BadMessage(String),
    #[error("this shard has no --state-dir: updates need one to keep them across restarts")]
    NoStateDir,
    #[error("table {0:?} is not held by this shard")]
    UnknownTable(String),
    #[error(
        "update {0} is not staged on this shard (aborted, never staged, or the shard restarted)"
    )]
    NotStaged(u64),
    #[error("update {update}: chunk at offset {offset}, expected offset {expected}")]
    OutOfOrder {
        update: u64,
        offset: u64,
        expected: u64,
    },
    #[error(transparent)]
    Update(#[from] UpdateError),
    #[error("cannot open the new version of table {table:?}: {reason}")]
    Open { table: String, reason: String },
}

/// The header of an UPDATE request (JSON, after a u32 length; the chunk's bytes follow).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Header {
    pub op: String,
    pub update: u64,
    pub table: String,
    #[serde(default)]
    pub kind: String,
    #[serde(default)]
    pub offset: u64,
    #[serde(default)]
    pub last: bool,
    /// switch: when the new version starts serving, Unix µs (0: at once). Lookups as of an
    /// earlier time keep reading the version before (docs/tiers.md, "One version per request").
    #[serde(default)]
    pub switch_at_unix_us: u64,
    /// switch: where the update came from, kept with the version (see the module's docs).
    #[serde(default)]
    pub source: Option<serde_json::Value>,
}

/// Splits an UPDATE payload into its header and data.
pub fn decode(payload: &[u8]) -> Result<(Header, &[u8]), StepError> {
    let bad = |m: String| StepError::BadMessage(m);
    if payload.len() < 4 {
        return Err(bad(format!(
            "{} bytes, shorter than the u32 header length",
            payload.len()
        )));
    }
    let n = u32::from_le_bytes(payload[..4].try_into().unwrap()) as usize;
    let end = 4usize.saturating_add(n);
    if end > payload.len() {
        return Err(bad(format!(
            "header of {n} bytes, the payload has {}",
            payload.len()
        )));
    }
    let header: Header = serde_json::from_slice(&payload[4..end])
        .map_err(|e| bad(format!("header is not the expected JSON: {e}")))?;
    Ok((header, &payload[end..]))
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct State {
    format: String,
    tables: HashMap<String, Committed>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Committed {
    pub version: u64,
    /// The table file, in the state directory.
    pub file: String,
    /// What the switch that committed it said it applied (its `source`), if anything.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<serde_json::Value>,
}

fn load_state(dir: &Path) -> Result<State, String> {
    let path = dir.join(STATE_FILE);
    match std::fs::read(&path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(State::default()),
        Err(e) => Err(format!("{}: {e}", path.display())),
        Ok(bytes) => {
            let s: State = serde_json::from_slice(&bytes)
                .map_err(|e| format!("{}: not a shard state file: {e}", path.display()))?;
            if s.format != STATE_FORMAT {
                return Err(format!(
                    "{}: format {:?}, expected {STATE_FORMAT:?}",
                    path.display(),
                    s.format
                ));
            }
            Ok(s)
        }
    }
}

/// Opens (creating it) the state directory, deletes what no committed version names, and
/// returns the committed version of each table that has one.
pub fn replay(dir: &Path) -> Result<HashMap<String, Committed>, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("--state-dir {}: {e}", dir.display()))?;
    lock(dir)?;
    let state = load_state(dir)?;
    let keep: Vec<&str> = state.tables.values().map(|c| c.file.as_str()).collect();
    let entries = std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name != STATE_FILE && name != LOCK_FILE && !keep.contains(&name.as_str()) {
            tracing::info!(file = %name, "discarding an update that was staged, never switched");
            let _ = std::fs::remove_file(entry.path());
        }
    }
    Ok(state.tables)
}

/// Locks `dir` for this process's lifetime, or says which directory another shard holds.
fn lock(dir: &Path) -> Result<(), String> {
    use std::os::fd::AsRawFd;
    static HELD: Mutex<Vec<std::fs::File>> = Mutex::new(Vec::new());
    let path = dir.join(LOCK_FILE);
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    // SAFETY: flock on a descriptor we own; no memory is shared with the call.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        return Err(format!(
            "--state-dir {}: another shard uses it (its {LOCK_FILE} is locked); give each shard \
             its own state directory",
            dir.display()
        ));
    }
    HELD.lock().unwrap().push(file);
    Ok(())
}

/// The manifest entry of a table's committed version: its file in the state directory.
pub fn committed_meta(meta: &TableMeta, committed: &Committed) -> TableMeta {
    TableMeta {
        file: committed.file.clone(),
        ..meta.clone()
    }
}

/// A version staged, not yet switched.
pub struct Staged {
    pub table: String,
    pub version: u64,
    pub opened: Table,
    file: String,
}

struct Pending {
    table: String,
    kind: String,
    part: PathBuf,
    received: u64,
    staged: Option<Staged>,
}

/// A shard's updates in progress and where they are kept.
pub struct Updates {
    dir: Option<PathBuf>,
    bundle: PathBuf,
    manifest: Option<Manifest>,
    options: OpenOptions,
    pending: Mutex<HashMap<u64, Pending>>,
    /// Serialises switches: state.json is read, changed and replaced by one at a time.
    switching: Mutex<()>,
}

impl Updates {
    pub fn new(
        dir: Option<PathBuf>,
        bundle: PathBuf,
        manifest: Option<Manifest>,
        options: OpenOptions,
    ) -> Updates {
        Updates {
            dir,
            bundle,
            manifest,
            options,
            pending: Mutex::new(HashMap::new()),
            switching: Mutex::new(()),
        }
    }

    fn dir(&self) -> Result<&Path, StepError> {
        self.dir.as_deref().ok_or(StepError::NoStateDir)
    }

    fn meta(&self, table: &str) -> Result<&TableMeta, StepError> {
        self.manifest
            .as_ref()
            .and_then(|m| m.table(table))
            .ok_or_else(|| StepError::UnknownTable(table.to_owned()))
    }

    /// Appends one chunk of update `h.update`; with the last one, writes and opens the next
    /// version of the table after `current` (the serving table and its version). Returns the
    /// staged version once complete.
    pub fn stage(
        &self,
        h: &Header,
        data: &[u8],
        current: (&Table, u64),
    ) -> Result<Option<u64>, StepError> {
        let dir = self.dir()?.to_path_buf();
        let meta = self.meta(&h.table)?.clone();
        if h.kind != "rows" && h.kind != "file" {
            return Err(StepError::BadMessage(format!(
                "kind {:?}, expected \"rows\" or \"file\"",
                h.kind
            )));
        }
        let mut pending = self.pending.lock().unwrap();
        if h.offset == 0 {
            // A new update of this table replaces one staged and never switched (its CLI
            // died, say): at most one staged version per table.
            let stale: Vec<u64> = pending
                .iter()
                .filter(|(id, p)| p.table == h.table && **id != h.update)
                .map(|(id, _)| *id)
                .collect();
            for id in stale {
                if let Some(p) = pending.remove(&id) {
                    discard(&dir, p);
                }
            }
            if let Some(p) = pending.remove(&h.update) {
                discard(&dir, p);
            }
            pending.insert(
                h.update,
                Pending {
                    table: h.table.clone(),
                    kind: h.kind.clone(),
                    part: dir.join(format!("{}.u{}.part", h.table, h.update)),
                    received: 0,
                    staged: None,
                },
            );
        }
        let p = pending
            .get_mut(&h.update)
            .ok_or(StepError::NotStaged(h.update))?;
        if p.table != h.table || p.kind != h.kind || p.staged.is_some() {
            return Err(StepError::BadMessage(format!(
                "update {} is of table {:?} ({}), already complete: {}",
                h.update,
                p.table,
                p.kind,
                p.staged.is_some()
            )));
        }
        let result = append_and_finish(&dir, p, h, data, &meta, current, &self.options);
        match result {
            Ok(version) => Ok(version),
            Err(e) => {
                if let Some(p) = pending.remove(&h.update) {
                    discard(&dir, p);
                }
                Err(e)
            }
        }
    }

    /// Takes update `id`'s staged version, recording it in state.json first (the commit).
    /// The caller swaps it in; `previous` (the file it replaces, if in the state directory) is
    /// deleted here (open maps and descriptors keep its rows for lookups in flight).
    pub fn switch(
        &self,
        id: u64,
        table: &str,
        source: Option<serde_json::Value>,
    ) -> Result<Staged, StepError> {
        let dir = self.dir()?.to_path_buf();
        let _one = self.switching.lock().unwrap();
        let staged = {
            let mut pending = self.pending.lock().unwrap();
            match pending.get(&id) {
                Some(p) if p.table == table && p.staged.is_some() => {}
                _ => return Err(StepError::NotStaged(id)),
            }
            pending.remove(&id).and_then(|p| p.staged).unwrap()
        };
        let mut state = load_state(&dir).map_err(StepError::BadMessage)?;
        state.format = STATE_FORMAT.to_owned();
        let previous = state.tables.insert(
            table.to_owned(),
            Committed {
                version: staged.version,
                file: staged.file.clone(),
                source,
            },
        );
        let text = serde_json::to_vec_pretty(&state).expect("state serialises");
        if let Err(e) = write_atomically(&dir.join(STATE_FILE), &text) {
            let _ = std::fs::remove_file(dir.join(&staged.file));
            return Err(e.into());
        }
        if let Some(old) = previous.filter(|c| c.file != staged.file) {
            let _ = std::fs::remove_file(dir.join(old.file));
        }
        Ok(staged)
    }

    /// The `source` recorded with `table`'s committed version (None: never switched with one).
    pub fn source(&self, table: &str) -> Result<Option<serde_json::Value>, StepError> {
        let state = load_state(self.dir()?).map_err(StepError::BadMessage)?;
        Ok(state.tables.get(table).and_then(|c| c.source.clone()))
    }

    /// Drops update `id` (staged or partly received); unknown ids are not an error.
    pub fn abort(&self, id: u64) -> Result<(), StepError> {
        let dir = self.dir()?.to_path_buf();
        if let Some(p) = self.pending.lock().unwrap().remove(&id) {
            discard(&dir, p);
        }
        Ok(())
    }

    /// The bundle directory (the base of tables never updated).
    pub fn bundle(&self) -> &Path {
        &self.bundle
    }
}

fn discard(dir: &Path, p: Pending) {
    let _ = std::fs::remove_file(&p.part);
    if let Some(s) = p.staged {
        let _ = std::fs::remove_file(dir.join(s.file));
    }
}

fn append_and_finish(
    dir: &Path,
    p: &mut Pending,
    h: &Header,
    data: &[u8],
    meta: &TableMeta,
    (table, version): (&Table, u64),
    options: &OpenOptions,
) -> Result<Option<u64>, StepError> {
    if h.offset != p.received {
        return Err(StepError::OutOfOrder {
            update: h.update,
            offset: h.offset,
            expected: p.received,
        });
    }
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| StepError::Update(UpdateError::Io { path, source })
    };
    let mut part = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&p.part)
        .map_err(io(&p.part))?;
    part.write_all(data).map_err(io(&p.part))?;
    p.received += data.len() as u64;
    if !h.last {
        return Ok(None);
    }
    drop(part);
    let next = version + 1;
    let file = format!("{}.v{next}.tbl", h.table);
    let dest = dir.join(&file);
    let base = table.path();
    if h.kind == "rows" {
        let bytes = std::fs::read(&p.part).map_err(io(&p.part))?;
        let delta = Delta::parse(&bytes, meta)?;
        write_version(base, meta, Change::Rows(&delta), &dest)?;
    } else {
        write_version(base, meta, Change::File(&p.part), &dest)?;
    }
    let _ = std::fs::remove_file(&p.part);
    let new_meta = TableMeta {
        file: file.clone(),
        ..meta.clone()
    };
    let opened = Table::open_with(dir, &new_meta, table.row_range(), options).map_err(|e| {
        let _ = std::fs::remove_file(&dest);
        StepError::Open {
            table: h.table.clone(),
            reason: e.to_string(),
        }
    })?;
    tracing::info!(table = %h.table, version = next, file = %dest.display(), "update staged");
    p.staged = Some(Staged {
        table: h.table.clone(),
        version: next,
        opened,
        file,
    });
    Ok(Some(next))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn payload(header: &str, data: &[u8]) -> Vec<u8> {
        let mut out = (header.len() as u32).to_le_bytes().to_vec();
        out.extend_from_slice(header.as_bytes());
        out.extend_from_slice(data);
        out
    }

    #[test]
    fn decodes_headers_and_refuses_bad_ones() {
        let p = payload(
            r#"{"op":"stage","update":7,"table":"t0","kind":"rows","offset":0,"last":true}"#,
            b"xy",
        );
        let (h, data) = decode(&p).unwrap();
        assert_eq!(
            (h.op.as_str(), h.update, h.last, data),
            ("stage", 7, true, &b"xy"[..])
        );
        let p = payload(
            r#"{"op":"switch","update":7,"table":"t0","source":{"topic":"rows","offsets":{"0":41}}}"#,
            b"",
        );
        let (h, _) = decode(&p).unwrap();
        assert_eq!(h.source.unwrap()["offsets"]["0"], 41);
        for (bad, says) in [
            (vec![1u8], "shorter than the u32"),
            (payload("{", b""), "not the expected JSON"),
            (
                payload(r#"{"op":"x","update":1,"table":"t","bogus":1}"#, b""),
                "unknown field",
            ),
            ([200u8, 0, 0, 0].to_vec(), "header of 200 bytes"),
        ] {
            let err = decode(&bad).unwrap_err().to_string();
            assert!(err.contains(says), "{says}: {err}");
        }
    }

    #[test]
    fn replay_keeps_committed_files_only() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("t0.v1.tbl"), b"old").unwrap();
        std::fs::write(dir.path().join("t0.v2.tbl"), b"committed").unwrap();
        std::fs::write(dir.path().join("t0.v3.tbl"), b"staged").unwrap();
        std::fs::write(dir.path().join("t0.u9.part"), b"part").unwrap();
        std::fs::write(dir.path().join("t1.v1.tbl"), b"streamed").unwrap();
        let state = r#"{"format":"cleave-shard-state","tables":{
            "t0":{"version":2,"file":"t0.v2.tbl"},
            "t1":{"version":1,"file":"t1.v1.tbl","source":{"topic":"rows","offsets":{"0":9}}}}}"#;
        std::fs::write(dir.path().join(STATE_FILE), state).unwrap();
        let tables = replay(dir.path()).unwrap();
        assert_eq!(tables["t0"].version, 2);
        assert_eq!(tables["t0"].source, None);
        // A switch's source survives the restart, and `status` reads it back.
        let updates = Updates::new(
            Some(dir.path().to_path_buf()),
            dir.path().to_path_buf(),
            None,
            OpenOptions::default(),
        );
        let source = updates.source("t1").unwrap().unwrap();
        assert_eq!(source["offsets"]["0"], 9);
        assert_eq!(updates.source("t0").unwrap(), None);
        let mut left: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left, [".lock", "state.json", "t0.v2.tbl", "t1.v1.tbl"]);
        let err = replay(dir.path()).unwrap_err();
        assert!(err.contains("another shard uses it"), "{err}");
        let bad = tempfile::tempdir().unwrap();
        std::fs::write(bad.path().join(STATE_FILE), b"{").unwrap();
        let err = replay(bad.path()).unwrap_err();
        assert!(err.contains("not a shard state file"), "{err}");
    }
}
