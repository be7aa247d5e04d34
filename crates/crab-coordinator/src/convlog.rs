//! The per-sandbox conversation log: an append-only file of request/response records, each
//! checksummed and fsynced before the response it holds is released.
//!
//! Format (documented in `docs/conversation-log.md`): a header line `CRABCONV 1\n`, then
//! records `R <len> <sha256-hex>\n<len bytes of JSON>\n`. An offset is a record count; a restore
//! point stores the offset at its boundary, [`ConversationLog::read_until`] gives the
//! conversation up to it and [`ConversationLog::truncate_to`] rolls the log back to it. A torn
//! tail (a crash mid-append) is cut off on open; a damaged record followed by more data is
//! corruption and refuses to open.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use base64::Engine as _;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// First line of every log.
pub const HEADER: &[u8] = b"CRABCONV 1\n";

/// Failures of the conversation log. Each names the file.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    /// An I/O call failed.
    #[error("conversation log {path}: {what}: {source}")]
    Io {
        /// The log file.
        path: PathBuf,
        /// What was being done.
        what: &'static str,
        /// The error.
        source: std::io::Error,
    },
    /// The file is not a conversation log, or has an unknown version.
    #[error("{path} is not a version-1 conversation log (header {found:?})")]
    BadHeader {
        /// The log file.
        path: PathBuf,
        /// The first bytes found.
        found: String,
    },
    /// A record in the middle of the log failed its checksum or did not parse.
    #[error("conversation log {path} is corrupt at byte {offset}: {reason}; restore it from a checkpoint or move it away")]
    Corrupt {
        /// The log file.
        path: PathBuf,
        /// Byte offset of the bad record.
        offset: u64,
        /// What was wrong.
        reason: String,
    },
    /// An offset past the end of the log.
    #[error("conversation log {path} has {len} records; offset {offset} is past its end")]
    OffsetOutOfRange {
        /// The log file.
        path: PathBuf,
        /// Requested offset.
        offset: u64,
        /// Records in the log.
        len: u64,
    },
    /// A record could not be serialized.
    #[error("conversation log {path}: encoding a record: {source}")]
    Encode {
        /// The log file.
        path: PathBuf,
        /// The error.
        source: serde_json::Error,
    },
}

/// One request/response pair.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LogRecord {
    /// Turn number the request belonged to (retries repeat it).
    pub turn: u64,
    /// `openai` or `anthropic`.
    pub provider: String,
    /// HTTP method.
    pub method: String,
    /// Path and query as sent upstream (without the `/s/<sandbox>` prefix).
    pub path: String,
    /// Hex sha256 of the request body.
    pub request_sha256: String,
    /// The request body (JSON text, exactly as received).
    pub request: String,
    /// Upstream status.
    pub status: u16,
    /// Upstream response headers (hop-by-hop ones and `set-cookie` dropped).
    #[serde(default)]
    pub response_headers: Vec<(String, String)>,
    /// The response body when it is valid UTF-8 (for streams: every byte that arrived).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response: Option<String>,
    /// The response body in base64 when it is not UTF-8 (e.g. gzip-encoded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response_b64: Option<String>,
    /// Whether the response was a server-sent-event stream.
    pub stream: bool,
    /// Whether the upstream response arrived completely.
    pub complete: bool,
    /// Whether the client went away before the response was fully delivered.
    #[serde(default)]
    pub client_disconnected: bool,
    /// Whether the request was a retry of the previous one.
    #[serde(default)]
    pub retry: bool,
    /// Request arrival, milliseconds since the epoch.
    pub requested_at_ms: u64,
    /// Response end, milliseconds since the epoch.
    pub responded_at_ms: u64,
    /// Milliseconds the response was held for the turn's checkpoint.
    pub held_ms: f64,
    /// The checkpoint failure, when the turn's checkpoint failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_error: Option<String>,
}

impl LogRecord {
    /// Store `body` in `response` or `response_b64`.
    pub fn set_response_body(&mut self, body: &[u8]) {
        match std::str::from_utf8(body) {
            Ok(s) => {
                self.response = Some(s.to_string());
                self.response_b64 = None;
            }
            Err(_) => {
                self.response = None;
                self.response_b64 = Some(base64::engine::general_purpose::STANDARD.encode(body));
            }
        }
    }

    /// The response body bytes.
    pub fn response_body(&self) -> Vec<u8> {
        if let Some(s) = &self.response {
            return s.as_bytes().to_vec();
        }
        self.response_b64
            .as_ref()
            .and_then(|b| base64::engine::general_purpose::STANDARD.decode(b).ok())
            .unwrap_or_default()
    }
}

#[derive(Debug, Clone)]
struct Entry {
    start: u64,
    end: u64,
    turn: u64,
    request_sha256: String,
    status: u16,
    complete: bool,
}

#[derive(Deserialize)]
struct Meta {
    turn: u64,
    request_sha256: String,
    status: u16,
    complete: bool,
}

/// An open conversation log.
#[derive(Debug)]
pub struct ConversationLog {
    path: PathBuf,
    file: File,
    index: Vec<Entry>,
    end: u64,
    /// Records appended since the last fsync.
    unsynced: bool,
}

/// Hex sha256.
pub fn sha256_hex(data: &[u8]) -> String {
    let d = Sha256::digest(data);
    let mut s = String::with_capacity(64);
    for b in d {
        s.push(char::from(b"0123456789abcdef"[usize::from(b >> 4)]));
        s.push(char::from(b"0123456789abcdef"[usize::from(b & 15)]));
    }
    s
}

impl ConversationLog {
    /// Open the log at `path`, creating it (and its directory) if missing. A torn tail is cut
    /// off; mid-file corruption is an error.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, LogError> {
        let path = path.as_ref().to_path_buf();
        let io = |what: &'static str| {
            let path = path.clone();
            move |source| LogError::Io { path, what, source }
        };
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(io("creating its directory"))?;
        }
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(io("opening"))?;
        let mut data = Vec::new();
        file.read_to_end(&mut data).map_err(io("reading"))?;
        if data.len() < HEADER.len() && HEADER.starts_with(&data) {
            // New (or torn while being created): write the header.
            file.set_len(0).map_err(io("truncating"))?;
            file.seek(SeekFrom::Start(0)).map_err(io("seeking"))?;
            file.write_all(HEADER).map_err(io("writing the header"))?;
            file.sync_all().map_err(io("fsync"))?;
            if let Some(dir) = path.parent() {
                if let Ok(d) = File::open(dir) {
                    d.sync_all().map_err(io("fsync of its directory"))?;
                }
            }
            return Ok(ConversationLog {
                path,
                file,
                index: Vec::new(),
                end: HEADER.len() as u64,
                unsynced: false,
            });
        }
        if !data.starts_with(HEADER) {
            let found = String::from_utf8_lossy(&data[..data.len().min(16)]).into_owned();
            return Err(LogError::BadHeader { path, found });
        }
        let (index, end) = scan(&path, &data)?;
        if end < data.len() as u64 {
            tracing::warn!(path = %path.display(), kept = end, dropped = data.len() as u64 - end, "conversation log had a torn tail; cut it off");
            file.set_len(end).map_err(io("cutting off a torn tail"))?;
            file.sync_all().map_err(io("fsync"))?;
        }
        Ok(ConversationLog { path, file, index, end, unsynced: false })
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Current offset: the number of records.
    pub fn offset(&self) -> u64 {
        self.index.len() as u64
    }

    /// Size of the file in bytes.
    pub fn byte_len(&self) -> u64 {
        self.end
    }

    /// Turn of the last record, 0 when empty.
    pub fn last_turn(&self) -> u64 {
        self.index.last().map_or(0, |e| e.turn)
    }

    /// Request hash of the last record.
    pub fn last_request_sha256(&self) -> Option<&str> {
        self.index.last().map(|e| e.request_sha256.as_str())
    }

    /// Request hash of record `i`, with whether its response is complete and successful (2xx).
    pub fn request_sha256_at(&self, i: u64) -> Option<(&str, bool)> {
        let e = self.index.get(usize::try_from(i).ok()?)?;
        Some((e.request_sha256.as_str(), e.complete && (200..300).contains(&e.status)))
    }

    /// Turn of record `i`.
    pub fn turn_at(&self, i: u64) -> Option<u64> {
        self.index.get(usize::try_from(i).ok()?).map(|e| e.turn)
    }

    /// Append a record and fsync it. Returns the new offset.
    pub fn append(&mut self, rec: &LogRecord) -> Result<u64, LogError> {
        self.append_inner(rec, true)
    }

    /// Append without fsync: a crash may lose the record until [`ConversationLog::sync`] (the
    /// proxy syncs at the next turn boundary, before that turn's restore point can reference
    /// the record; benchmarks never sync).
    pub fn append_unsynced(&mut self, rec: &LogRecord) -> Result<u64, LogError> {
        self.append_inner(rec, false)
    }

    /// Make every appended record durable (`fdatasync`; nothing to do when all are).
    pub fn sync(&mut self) -> Result<(), LogError> {
        if !self.unsynced {
            return Ok(());
        }
        self.file.sync_data().map_err(|source| LogError::Io {
            path: self.path.clone(),
            what: "fsync",
            source,
        })?;
        self.unsynced = false;
        Ok(())
    }

    /// Whether records were appended since the last fsync.
    pub fn has_unsynced(&self) -> bool {
        self.unsynced
    }

    fn append_inner(&mut self, rec: &LogRecord, sync: bool) -> Result<u64, LogError> {
        let payload = serde_json::to_vec(rec)
            .map_err(|source| LogError::Encode { path: self.path.clone(), source })?;
        let mut buf = format!("R {} {}\n", payload.len(), sha256_hex(&payload)).into_bytes();
        buf.extend_from_slice(&payload);
        buf.push(b'\n');
        let start = self.end;
        let res = (|| {
            self.file.seek(SeekFrom::Start(start))?;
            self.file.write_all(&buf)?;
            if sync {
                self.file.sync_data()?;
            }
            Ok(())
        })();
        if let Err(source) = res {
            // Leave no partial record behind for the next append.
            let _ = self.file.set_len(start);
            return Err(LogError::Io {
                path: self.path.clone(),
                what: "appending a record",
                source,
            });
        }
        self.end = start + buf.len() as u64;
        // An fdatasync covers every earlier record too.
        self.unsynced = !sync;
        self.index.push(Entry {
            start,
            end: self.end,
            turn: rec.turn,
            request_sha256: rec.request_sha256.clone(),
            status: rec.status,
            complete: rec.complete,
        });
        Ok(self.offset())
    }

    /// Record `i` (0-based).
    pub fn read(&mut self, i: u64) -> Result<LogRecord, LogError> {
        let len = self.offset();
        let e =
            usize::try_from(i).ok().and_then(|i| self.index.get(i)).cloned().ok_or_else(|| {
                LogError::OffsetOutOfRange { path: self.path.clone(), offset: i, len }
            })?;
        let mut buf = vec![0u8; usize::try_from(e.end - e.start).unwrap_or(0)];
        let path = self.path.clone();
        self.file
            .seek(SeekFrom::Start(e.start))
            .and_then(|_| self.file.read_exact(&mut buf))
            .map_err(|source| LogError::Io { path, what: "reading a record", source })?;
        match parse_record(&buf) {
            Parsed::Ok { payload, .. } => {
                serde_json::from_slice(payload).map_err(|err| LogError::Corrupt {
                    path: self.path.clone(),
                    offset: e.start,
                    reason: err.to_string(),
                })
            }
            Parsed::Torn | Parsed::Bad(_) => Err(LogError::Corrupt {
                path: self.path.clone(),
                offset: e.start,
                reason: "record changed on disk since it was written".into(),
            }),
        }
    }

    /// Records `0..offset`: the conversation as of a restore point that stored `offset`.
    pub fn read_until(&mut self, offset: u64) -> Result<Vec<LogRecord>, LogError> {
        if offset > self.offset() {
            return Err(LogError::OffsetOutOfRange {
                path: self.path.clone(),
                offset,
                len: self.offset(),
            });
        }
        (0..offset).map(|i| self.read(i)).collect()
    }

    /// Drop every record at or after `offset` (rollback), durably.
    pub fn truncate_to(&mut self, offset: u64) -> Result<(), LogError> {
        let len = self.offset();
        if offset > len {
            return Err(LogError::OffsetOutOfRange { path: self.path.clone(), offset, len });
        }
        let i = usize::try_from(offset).unwrap_or(usize::MAX);
        let new_end = self.index.get(i).map_or(self.end, |e| e.start);
        let path = self.path.clone();
        self.file
            .set_len(new_end)
            .and_then(|_| self.file.sync_all())
            .map_err(|source| LogError::Io { path, what: "truncating", source })?;
        self.index.truncate(i);
        self.end = new_end;
        Ok(())
    }

    /// Write the first `offset` records into a new log at `dst` (fork). `dst` must not exist.
    pub fn copy_prefix_to(&mut self, offset: u64, dst: &Path) -> Result<ConversationLog, LogError> {
        let len = self.offset();
        if offset > len {
            return Err(LogError::OffsetOutOfRange { path: self.path.clone(), offset, len });
        }
        let i = usize::try_from(offset).unwrap_or(usize::MAX);
        let upto = self.index.get(i).map_or(self.end, |e| e.start);
        let mut data = vec![0u8; usize::try_from(upto).unwrap_or(0)];
        let path = self.path.clone();
        self.file
            .seek(SeekFrom::Start(0))
            .and_then(|_| self.file.read_exact(&mut data))
            .map_err(|source| LogError::Io { path, what: "reading for a fork", source })?;
        let dio = |what: &'static str| {
            let path = dst.to_path_buf();
            move |source| LogError::Io { path, what, source }
        };
        if let Some(dir) = dst.parent() {
            std::fs::create_dir_all(dir).map_err(dio("creating its directory"))?;
        }
        let tmp = dst.with_extension("tmp");
        {
            let mut f = File::create(&tmp).map_err(dio("creating"))?;
            f.write_all(&data).map_err(dio("writing"))?;
            f.sync_all().map_err(dio("fsync"))?;
        }
        if dst.exists() {
            let _ = std::fs::remove_file(&tmp);
            return Err(LogError::Io {
                path: dst.to_path_buf(),
                what: "creating a forked log",
                source: std::io::Error::from(std::io::ErrorKind::AlreadyExists),
            });
        }
        std::fs::rename(&tmp, dst).map_err(dio("renaming into place"))?;
        if let Some(dir) = dst.parent() {
            if let Ok(d) = File::open(dir) {
                d.sync_all().map_err(dio("fsync of its directory"))?;
            }
        }
        ConversationLog::open(dst)
    }
}

enum Parsed<'a> {
    /// A whole, verified record of `len` bytes in total.
    Ok { payload: &'a [u8], len: usize },
    /// The data ends inside the record.
    Torn,
    /// The record is malformed or fails its checksum.
    Bad(String),
}

fn parse_record(data: &[u8]) -> Parsed<'_> {
    let Some(nl) = data.iter().position(|b| *b == b'\n') else { return Parsed::Torn };
    let Ok(line) = std::str::from_utf8(&data[..nl]) else {
        return Parsed::Bad("record header is not text".into());
    };
    let mut parts = line.split(' ');
    let (Some("R"), Some(len), Some(sum), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Parsed::Bad(format!("bad record header {line:?}"));
    };
    let Ok(len) = len.parse::<usize>() else {
        return Parsed::Bad(format!("bad record length in {line:?}"));
    };
    let body = nl + 1;
    let Some(total) = body.checked_add(len).and_then(|x| x.checked_add(1)) else {
        return Parsed::Bad("record length overflows".into());
    };
    if data.len() < total {
        return Parsed::Torn;
    }
    let payload = &data[body..body + len];
    if data[total - 1] != b'\n' {
        return Parsed::Bad("record not terminated by a newline".into());
    }
    if sha256_hex(payload) != sum {
        return Parsed::Bad("checksum mismatch".into());
    }
    Parsed::Ok { payload, len: total }
}

fn scan(path: &Path, data: &[u8]) -> Result<(Vec<Entry>, u64), LogError> {
    let mut index = Vec::new();
    let mut pos = HEADER.len();
    while pos < data.len() {
        let corrupt = |reason: String| LogError::Corrupt {
            path: path.to_path_buf(),
            offset: pos as u64,
            reason,
        };
        match parse_record(&data[pos..]) {
            Parsed::Ok { payload, len } => {
                let m: Meta =
                    serde_json::from_slice(payload).map_err(|e| corrupt(e.to_string()))?;
                index.push(Entry {
                    start: pos as u64,
                    end: (pos + len) as u64,
                    turn: m.turn,
                    request_sha256: m.request_sha256,
                    status: m.status,
                    complete: m.complete,
                });
                pos += len;
            }
            Parsed::Torn => break,
            Parsed::Bad(reason) => {
                // A bad last record is a torn append (e.g. its bytes reached the disk out of
                // order); anything after it means real damage.
                if last_record_candidate(&data[pos..]) {
                    break;
                }
                return Err(corrupt(reason));
            }
        }
    }
    Ok((index, pos as u64))
}

/// Whether `data` (starting at a record) holds at most one record's worth of bytes.
fn last_record_candidate(data: &[u8]) -> bool {
    let Some(nl) = data.iter().position(|b| *b == b'\n') else { return true };
    let len = std::str::from_utf8(&data[..nl])
        .ok()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|l| l.parse::<usize>().ok());
    match len {
        Some(len) => data.len() <= nl + 1 + len + 1,
        None => !data[nl + 1..].windows(2).any(|w| w == b"\nR"),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn rec(turn: u64, body: &str) -> LogRecord {
        let mut r = LogRecord {
            turn,
            provider: "openai".into(),
            method: "POST".into(),
            path: "/v1/chat/completions".into(),
            request_sha256: sha256_hex(body.as_bytes()),
            request: body.into(),
            status: 200,
            response_headers: vec![("content-type".into(), "application/json".into())],
            response: None,
            response_b64: None,
            stream: false,
            complete: true,
            client_disconnected: false,
            retry: false,
            requested_at_ms: 1,
            responded_at_ms: 2,
            held_ms: 0.0,
            checkpoint_error: None,
        };
        r.set_response_body(format!("answer {turn}").as_bytes());
        r
    }

    #[test]
    fn append_read_truncate_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("sb/conversation.log");
        let mut log = ConversationLog::open(&p).unwrap();
        assert_eq!(log.offset(), 0);
        for t in 1..=3 {
            assert_eq!(log.append(&rec(t, &format!("{{\"t\":{t}}}"))).unwrap(), t);
        }
        assert_eq!(log.read_until(2).unwrap(), vec![rec(1, "{\"t\":1}"), rec(2, "{\"t\":2}")]);
        assert!(log.read_until(4).is_err());
        drop(log);
        let mut log = ConversationLog::open(&p).unwrap();
        assert_eq!((log.offset(), log.last_turn()), (3, 3));
        log.truncate_to(1).unwrap();
        assert_eq!(log.offset(), 1);
        log.append(&rec(2, "{\"t\":\"2b\"}")).unwrap();
        drop(log);
        let mut log = ConversationLog::open(&p).unwrap();
        let all = log.read_until(2).unwrap();
        assert_eq!(all[1].request, "{\"t\":\"2b\"}");
        assert_eq!(all[0].response_body(), b"answer 1");
    }

    #[test]
    fn unsynced_records_are_tracked_until_a_sync() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("l");
        let mut log = ConversationLog::open(&p).unwrap();
        assert!(!log.has_unsynced());
        log.append_unsynced(&rec(1, "{}")).unwrap();
        log.append_unsynced(&rec(2, "{\"x\":1}")).unwrap();
        assert!(log.has_unsynced());
        log.sync().unwrap();
        assert!(!log.has_unsynced());
        log.sync().unwrap();
        log.append_unsynced(&rec(3, "{\"x\":2}")).unwrap();
        log.append(&rec(4, "{\"x\":3}")).unwrap();
        assert!(!log.has_unsynced(), "a synced append covers the earlier records");
        drop(log);
        assert_eq!(ConversationLog::open(&p).unwrap().offset(), 4);
    }

    #[test]
    fn binary_bodies_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = ConversationLog::open(dir.path().join("l")).unwrap();
        let mut r = rec(1, "{}");
        r.set_response_body(&[0x1f, 0x8b, 0xff, 0]);
        log.append(&r).unwrap();
        let back = log.read(0).unwrap();
        assert!(back.response.is_none());
        assert_eq!(back.response_body(), vec![0x1f, 0x8b, 0xff, 0]);
    }

    #[test]
    fn torn_tail_is_cut_and_mid_file_damage_refused() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("l");
        let mut log = ConversationLog::open(&p).unwrap();
        log.append(&rec(1, "{\"a\":1}")).unwrap();
        log.append(&rec(2, "{\"a\":2}")).unwrap();
        let good = std::fs::read(&p).unwrap();
        drop(log);
        // Every truncation point inside the last record is a torn tail.
        let second_start = {
            let log = ConversationLog::open(&p).unwrap();
            log.index[1].start as usize
        };
        for cut in [second_start + 1, second_start + 10, good.len() - 1] {
            std::fs::write(&p, &good[..cut]).unwrap();
            let mut log = ConversationLog::open(&p).unwrap();
            assert_eq!(log.offset(), 1, "cut at {cut}");
            assert_eq!(std::fs::metadata(&p).unwrap().len(), second_start as u64);
            log.append(&rec(2, "{\"a\":2}")).unwrap();
            drop(log);
            assert_eq!(std::fs::read(&p).unwrap(), good);
        }
        // A flipped byte in the last record: torn, dropped.
        let mut bad = good.clone();
        let n = bad.len();
        bad[n - 5] ^= 1;
        std::fs::write(&p, &bad).unwrap();
        assert_eq!(ConversationLog::open(&p).unwrap().offset(), 1);
        // A flipped byte in the first record with a good one after it: corruption.
        let mut bad = good.clone();
        bad[HEADER.len() + 80] ^= 1;
        std::fs::write(&p, &bad).unwrap();
        let err = ConversationLog::open(&p).unwrap_err();
        assert!(matches!(err, LogError::Corrupt { .. }), "{err}");
        // Wrong header.
        std::fs::write(&p, b"NOTALOG 1\n").unwrap();
        assert!(matches!(ConversationLog::open(&p).unwrap_err(), LogError::BadHeader { .. }));
        // A torn header on a brand-new log is re-created.
        std::fs::write(&p, b"CRAB").unwrap();
        assert_eq!(ConversationLog::open(&p).unwrap().offset(), 0);
    }

    #[test]
    fn fork_copies_a_prefix() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = ConversationLog::open(dir.path().join("a")).unwrap();
        for t in 1..=3 {
            log.append(&rec(t, "{}")).unwrap();
        }
        let mut f = log.copy_prefix_to(2, &dir.path().join("b/log")).unwrap();
        assert_eq!(f.offset(), 2);
        assert_eq!(f.read(1).unwrap().turn, 2);
        assert!(log.copy_prefix_to(1, &dir.path().join("b/log")).is_err());
    }
}
