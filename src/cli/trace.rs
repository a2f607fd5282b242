//! The trace format of `settle simulate`, `settle tune` and the trace sources: one JSONL line
//! per upload (the upload record plus `"ts"`, its event time, and an optional `"partition"`;
//! module docs of `crate::cli::simulate`), parsed by [`parse_trace_line`]; and [`Trace`], a
//! trace held in memory with its unusable inputs counted by reason. Below the tools that
//! read traces, so none of them imports another for it.

use crate::codec;
use crate::engine::Upload;
use anyhow::Context as _;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::Path;

/// A trace line that could not be used.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// Not a JSON object, or `ts`/`partition` missing or of the wrong type.
    #[error("line {line}: {message}")]
    Line {
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        message: String,
    },
    /// The upload record inside the line breaks a rule of SEMANTICS §2.
    #[error("line {line}: {source}")]
    Upload {
        /// 1-based line number.
        line: usize,
        /// The failed rule.
        source: codec::DecodeError,
    },
    /// A record read from a broker (`settle tune --from-kafka`, `--from-nats`) that does not
    /// decode as an upload (SEMANTICS §2); the runtime would dead-letter it.
    #[error("{at}: {source}")]
    Record {
        /// Where it was read: `topic/partition@offset` or `stream/partition@sequence`.
        at: String,
        /// The failed rule.
        source: codec::DecodeError,
    },
}

impl TraceError {
    /// Short stable code of what is wrong: `bad_trace_line` for a line that is not a trace
    /// record, else the `codec::DecodeError::reason` code (the dead-letter reason).
    pub fn reason(&self) -> &'static str {
        match self {
            TraceError::Line { .. } => "bad_trace_line",
            TraceError::Upload { source, .. } | TraceError::Record { source, .. } => {
                source.reason()
            }
        }
    }
}

/// One usable trace line.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceLine {
    /// 1-based line number in the input.
    pub line: usize,
    /// `partition` field, if present.
    pub partition: Option<u32>,
    /// The decoded upload; its event time is `ts` (ms).
    pub upload: Upload,
}

/// Parses one trace line (`line` is its 1-based number, see `codec::decode_trace_line`).
/// `Ok(None)` for blank/comment lines.
pub fn parse_trace_line(text: &str, line: usize) -> Result<Option<TraceLine>, TraceError> {
    let trimmed = text.trim();
    if trimmed.is_empty() || trimmed.starts_with('#') {
        return Ok(None);
    }
    match codec::decode_trace_line(trimmed) {
        Ok(record) => Ok(Some(TraceLine {
            line,
            partition: record.partition,
            upload: record.upload,
        })),
        Err(codec::TraceLineError::NotATrace(message)) => Err(TraceError::Line { line, message }),
        Err(codec::TraceLineError::Upload(source)) => Err(TraceError::Upload { line, source }),
    }
}

/// Most unusable inputs a [`Trace`] keeps with their error (all are counted).
pub const MAX_REJECTED_KEPT: usize = 100;

/// A trace held in memory so that every setting replays the same uploads.
#[derive(Debug, Default)]
pub struct Trace {
    /// Usable uploads, in input order (event time = the line's `ts` or the record's
    /// timestamp).
    pub uploads: Vec<Upload>,
    /// The first [`MAX_REJECTED_KEPT`] inputs that could not be used (reported, skipped, as
    /// `settle simulate` skips bad lines), with why.
    pub rejected: Vec<TraceError>,
    /// Every unusable input, counted by [`TraceError::reason`].
    pub rejected_by_reason: BTreeMap<&'static str, u64>,
}

impl Trace {
    /// A trace from any source of uploads in arrival order (a file, a broker).
    pub fn from_uploads(uploads: impl IntoIterator<Item = Upload>) -> Self {
        Trace {
            uploads: uploads.into_iter().collect(),
            ..Trace::default()
        }
    }

    /// Reads a JSONL trace (format of `simulate`: an upload record plus `ts`). Bad lines go
    /// to [`Trace::reject`]; only I/O errors fail.
    pub fn read_jsonl(input: impl BufRead) -> std::io::Result<Self> {
        let mut trace = Trace::default();
        for (i, text) in input.lines().enumerate() {
            match parse_trace_line(&text?, i + 1) {
                Ok(Some(line)) => trace.uploads.push(line.upload),
                Ok(None) => {}
                Err(e) => trace.reject(e),
            }
        }
        Ok(trace)
    }

    /// Counts an unusable input; keeps it while fewer than [`MAX_REJECTED_KEPT`] are kept.
    pub fn reject(&mut self, e: TraceError) {
        *self.rejected_by_reason.entry(e.reason()).or_default() += 1;
        if self.rejected.len() < MAX_REJECTED_KEPT {
            self.rejected.push(e);
        }
    }

    /// How many inputs could not be used.
    pub fn rejected_count(&self) -> u64 {
        self.rejected_by_reason.values().sum()
    }

    /// The rejected inputs by reason, `invalid_json 3, missing_tenant 1`; `none` if none.
    pub fn rejected_summary(&self) -> String {
        if self.rejected_by_reason.is_empty() {
            return "none".to_owned();
        }
        let parts: Vec<String> = self
            .rejected_by_reason
            .iter()
            .map(|(reason, n)| format!("{reason} {n}"))
            .collect();
        parts.join(", ")
    }
}

/// Reads a JSONL trace file, logging each kept unusable line as a warning.
///
/// Errors: the file cannot be opened or read.
pub fn read_trace_file(path: &Path) -> anyhow::Result<Trace> {
    let file =
        std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let trace = Trace::read_jsonl(BufReader::new(file))
        .with_context(|| format!("cannot read {}", path.display()))?;
    for e in &trace.rejected {
        tracing::warn!(input = %path.display(), "skipped {e}");
    }
    Ok(trace)
}
