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
