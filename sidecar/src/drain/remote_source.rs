//! A step read from the drain target for a load (`crate::drain`,
//! `crate::load`): a `file://` target is a checkpoint directory, read in
//! place by the ordinary loader; an object store's step is streamed
//! straight into the load's memory ([`RemoteStep`], a
//! `ckpt_store::fetch::FetchFiles` over `ckpt_tier::Target::fetch_file`),
//! every file checked as its bytes arrive, nothing written to any
//! directory. The request pattern per file is the tier's
//! (`ckpt_tier::fetch_ranges`).

use std::path::PathBuf;

use ckpt_store::fetch::{FetchFiles, SourceError};
use ckpt_store::format::Index;
use ckpt_tier::Target;

/// A step of the drain target, made readable for a load.
pub struct RemoteCkpt {
    pub step: u64,
    pub from: RemoteFrom,
    /// Newer remote steps passed over, and why.
    pub fell_back: Vec<String>,
}

/// Made once per load and matched at once, never stored in bulk: the size
/// difference between its variants costs nothing worth a Box.
#[allow(clippy::large_enum_variant)]
pub enum RemoteFrom {
    /// A `file://` target: a checkpoint directory holding the step.
    Dir(PathBuf),
    /// An object store's step: its files streamed into the load's memory.
    Stream(RemoteStep),
}

/// Files of one committed step of the target, fetched for a load.
pub struct RemoteStep {
    target: Target,
    pub step: u64,
    /// The remote index, as the target gave it (the loader parses and checks it).
    pub index_bytes: Vec<u8>,
    /// Its parse (lengths, names), for sizing the load before it runs.
    pub index: Index,
    /// How many files a load fetches (the request pattern depends on it).
    n_files: usize,
}

impl RemoteStep {
    /// `n_files`: the files a load fetches from it.
    pub fn new(target: Target, step: u64, index_bytes: Vec<u8>, index: Index, n_files: usize) -> RemoteStep {
        RemoteStep { target, step, index_bytes, index, n_files }
    }
}

impl FetchFiles for RemoteStep {
    fn label(&self) -> &str {
        self.target.url()
    }

    fn parallel(&self) -> usize {
        self.target.parallel()
    }

    fn fetch(&self, name: &str, dst: &mut [u8], feed: &mut dyn FnMut(&[u8])) -> Result<(), SourceError> {
        let ranges = ckpt_tier::fetch_ranges(
            self.n_files,
            dst.len() as u64,
            self.target.parallel(),
            self.target.part_size_bytes(),
        );
        Ok(self.target.fetch_file(self.step, name, dst, ranges, feed)?)
    }
}

/// A step's files on the drain target, for the engine's streaming verify
/// (`ckpt_store::source::verify_source`).
struct TargetFiles<'a> {
    t: &'a Target,
    step: u64,
}

impl ckpt_store::source::StepSource for TargetFiles<'_> {
    fn file_len(&mut self, name: &str) -> Result<u64, ckpt_store::source::SourceError> {
        Ok(self.t.file_len(self.step, name)?)
    }

    fn read(&mut self, name: &str, offset: u64, dst: &mut [u8]) -> Result<(), ckpt_store::source::SourceError> {
        Ok(self.t.read_range(self.step, name, offset, dst)?)
    }
}

/// What a verify of the drain target's step found.
pub enum RemoteVerify {
    Verified(ckpt_store::restore::VerifyReport),
    /// Deleted meanwhile (`--drain-keep`): not checked.
    Gone,
    /// The target did not answer: why.
    Failed(String),
}

impl super::Drain {
    /// Verifies the target's `step`, every byte, through a window of
    /// `window_bytes`; `progress(bytes_done, bytes_total)` after each file.
    pub fn verify_remote(&self, step: u64, window_bytes: usize, progress: impl FnMut(u64, u64)) -> RemoteVerify {
        let index_bytes = match self.target.get_index(step) {
            Ok(b) => b,
            Err(ckpt_tier::TierError::NotFound { .. }) => return RemoteVerify::Gone,
            Err(e) => return RemoteVerify::Failed(e.to_string()),
        };
        let mut src = TargetFiles { t: &self.target, step };
        RemoteVerify::Verified(ckpt_store::source::verify_source(&index_bytes, step, &mut src, window_bytes, progress))
    }
}
