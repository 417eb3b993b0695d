//! Several nodes, one checkpoint (docs/format.md, "Several nodes").
//!
//! Every node's sidecar sees one shared directory. The ranks of a step
//! write into one temp folder there, `.tmp-step-…-ranks`, whose name is a
//! function of the step alone. Each node's sidecar writes its ranks'
//! shards and blobs into it and syncs them ([`Store::write_rank_part`]).
//! Then it writes and syncs a marker `rank-RRRRR.done` per rank: an index
//! of that rank's files, tensors and blobs (with their digests, for an
//! incremental part). An incremental part's stable shards whose tensors are
//! all unchanged since the newest step committed in the shared directory
//! are hard-linked from that step's files instead of written: in the shared
//! directory, or, node-local, from this node's own `node-step-…` folder of
//! that step in the same directory ([`crate::incremental::Prev::newest_shared`]). A rank that declares slices of
//! split tensors has them written and synced before its marker, beside it
//! (`rank-RRRRR.slices.json`).
//!
//! The coordinator is the sidecar serving rank 0. When every marker is
//! there, it merges them, with every rank's slice declarations, into the
//! step's index ([`Store::commit_ranks`]).
//! Then it renames the folder to `step-…`, the commit point, and moves
//! `latest`. When the timeout passes first, it removes the folder
//! ([`Store::abort_ranks`]). The other sidecars learn the outcome only
//! from the directory ([`ranks_state`]).
//!
//! Invariants:
//! - Only the coordinator writes an index into, or renames or removes, a
//!   step's multi-rank temp folder.
//! - A marker is written only after its rank's files and blobs are synced,
//!   and under a temp name renamed into place, so a marker present means
//!   that rank's part is durable.
//! - A step is committed iff its index exists under its final name, as for
//!   one node.
//! - With a shared directory, it is the channel the outcome travels by:
//!   the peers' doorbells only wake a sidecar to look. Without one
//!   (`--shared-over-peers`, [`over_peers`]), each node's folder of its
//!   own stands in for it and the peers carry what it would share.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::Instant;

use tracing::info;

use crate::catalog;
use crate::commit::{
    link_if_same, write_dir, write_dirs, write_index, write_small_file, CommitError, CommitReport, DirWrite, Fill,
    IncrementalReport, Store, INDEX_PIECE_BYTES,
};
use crate::format::{self, BLOBS_DIR_NAME, INDEX_FILE_NAME};
use crate::image::{Blob, Layout, SliceDecl};
use crate::incremental::Prev;
use crate::mem::BufAddr;
use crate::progress::Progress;
use crate::ranks;

mod drain;
mod markers;
mod over_peers;
pub use drain::{
    drain_coordinator, flattened_index, mark_uploaded, node_part, remove_upload_marks, upload_marks_path,
    uploaded_nodes, KeptIndex, DRAIN_MARKS_PREFIX,
};
use markers::{disagreement, read_marker, RankMarker, RankSlices};
pub use markers::{FolderId, MarkersRead, SentMarker};
pub use over_peers::{committed_files, sync_written, SentPart, StepFiles};

/// Where a multi-rank step stands in the shared directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RanksState {
    /// Its index is under its final name.
    Committed,
    /// Its temp folder exists; these ranks' markers are in it.
    InFlight(BTreeSet<u32>),
    /// Neither: aborted by its coordinator (or never begun).
    Gone,
}

/// The multi-rank temp folder of `step` in the shared directory.
pub fn ranks_tmp_path(shared: &Path, step: u64) -> Result<PathBuf, format::FormatError> {
    Ok(shared.join(format::ranks_tmp_name(step)?))
}

/// The coordinator's abort record of `step` in the shared directory,
/// `.tmp-step-…-ranks.aborted` (a file beside the temp folder): the
/// reason it gave its ranks, written before it removed the folder. Removed
/// by the step's commit and, once stale, by recovery.
pub fn abort_record_path(shared: &Path, step: u64) -> Result<PathBuf, format::FormatError> {
    Ok(shared.join(format!("{}{}", format::ranks_tmp_name(step)?, format::RANKS_ABORT_SUFFIX)))
}

/// The reason the coordinator gave when it aborted `step` (its abort
/// record), if it left one.
pub fn abort_reason(shared: &Path, step: u64) -> Option<String> {
    let p = abort_record_path(shared, step).ok()?;
    let bytes = fs::read(p).ok()?;
    let s = String::from_utf8(bytes).ok()?;
    (!s.is_empty() && !s.contains('\n')).then_some(s)
}

/// Reads where `step` stands; committed is checked last, so a rename
/// between the two looks is seen as committed, never as gone.
pub fn ranks_state(shared: &Path, step: u64) -> io::Result<RanksState> {
    let tmp = ranks_tmp_path(shared, step).map_err(io::Error::other)?;
    let markers = match markers_in(&tmp) {
        Ok(m) => Some(m),
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        Err(e) => return Err(e),
    };
    if catalog::is_committed(shared, step) {
        return Ok(RanksState::Committed);
    }
    Ok(markers.map_or(RanksState::Gone, RanksState::InFlight))
}

/// Where a multi-rank step stands, from two looks and no listing (a
/// waiting sidecar's every tick, whatever the rank count): the temp
/// folder's presence, then the index under its final name (checked last,
/// as in [`ranks_state`]). In flight, the set of markers is not read: it is
/// left empty; the folder's modification time comes with it (it changes as
/// markers are renamed in: a hint of progress for how soon to look again,
/// never a sign of the outcome).
pub fn ranks_outcome(shared: &Path, step: u64) -> io::Result<(RanksState, Option<std::time::SystemTime>)> {
    let tmp = ranks_tmp_path(shared, step).map_err(io::Error::other)?;
    let modified = match fs::symlink_metadata(&tmp) {
        Ok(m) => Some(m.modified().ok()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        Err(e) => return Err(e),
    };
    if catalog::is_committed(shared, step) {
        return Ok((RanksState::Committed, None));
    }
    Ok(match modified {
        Some(t) => (RanksState::InFlight(BTreeSet::new()), t),
        None => (RanksState::Gone, None),
    })
}

/// The ranks whose markers are in a multi-rank temp folder.
fn markers_in(tmp: &Path) -> io::Result<BTreeSet<u32>> {
    let mut out = BTreeSet::new();
    for e in fs::read_dir(tmp)? {
        if let Some(r) = e?.file_name().to_str().and_then(format::parse_rank_marker_name) {
            out.insert(r);
        }
    }
    Ok(out)
}

/// Figures of one rank's part written into the shared directory.
#[derive(Debug, Clone)]
pub struct PartReport {
    /// Shard and blob bytes written (a linked shard's not counted).
    pub bytes: u64,
    pub marker: PathBuf,
    /// The marker's bytes as written, its slice declarations' file's
    /// (empty when it has none), and which temp folder they are in (inode
    /// and birth time): what the step's coordinator needs of this rank, so
    /// that it need not read the files (`Store::take_sent_marker`).
    pub sent: SentMarker,
    /// An incremental part (digests taken): the committed step it was
    /// compared with, the shards linked from it, the tensors that changed.
    pub incremental: Option<IncrementalReport>,
}

impl Store {
    /// The directory shared with other nodes' sidecars, if this store has one.
    pub fn shared_dir(&self) -> Option<&Path> {
        self.shared.as_ref().map(|d| d.path.as_path())
    }

    fn shared_or_panic(&self) -> &Path {
        self.shared_dir().expect("multi-node calls need a store opened with a shared directory")
    }

    /// Writes one rank's part of `step` (its layout planned for that rank,
    /// the world size and one directory) into the step's multi-rank temp
    /// folder in the shared directory: shards and blobs, synced, its slice
    /// declarations `slices` (if any; checked by the caller to name this
    /// part's tensors), synced, then its marker, synced. Files a failed earlier attempt of the same rank left
    /// are replaced. On failure this rank's files are removed again; the
    /// folder stays (other ranks may be in it).
    pub fn write_rank_part(
        &mut self,
        step: u64,
        layout: &Layout,
        staging: &dyn BufAddr,
        tensor_crcs: &[u32],
        blobs: &[Blob<'_>],
        slices: &[SliceDecl],
    ) -> Result<PartReport, CommitError> {
        self.write_rank_part_filled(step, layout, staging, Fill::Done(tensor_crcs), blobs, slices)
    }

    /// [`Store::write_rank_part`] of an incremental part (its layout
    /// planned with `LayoutOptions::incremental`) with each tensor's
    /// digest: the marker records them, and stable shards whose tensors
    /// are all unchanged since the newest committed step are linked.
    #[allow(clippy::too_many_arguments)]
    pub fn write_rank_part_with_digests(
        &mut self,
        step: u64,
        layout: &Layout,
        staging: &dyn BufAddr,
        tensor_crcs: &[u32],
        digests: &[u128],
        blobs: &[Blob<'_>],
        slices: &[SliceDecl],
    ) -> Result<PartReport, CommitError> {
        self.write_rank_part_filled(step, layout, staging, Fill::Summed(tensor_crcs, digests), blobs, slices)
    }

    /// [`Store::write_rank_part`] of an image still being filled (the
    /// several-node form of [`Store::commit_fed`]): each chunk of the
    /// rank's shards is written once `progress` says its bytes are
    /// copied, the shards are synced, and the marker waits for the
    /// filler's checksums, so a marker still means every byte of the part
    /// was copied, checked and synced. A filler that fails makes this fail
    /// with [`CommitError::Unfilled`], the rank's files removed again; no
    /// marker is written. The filler must write nothing below the ready
    /// prefix (the progress's contract).
    pub fn write_rank_part_fed(
        &mut self,
        step: u64,
        layout: &Layout,
        staging: &dyn BufAddr,
        progress: &Progress,
        blobs: &[Blob<'_>],
        slices: &[SliceDecl],
    ) -> Result<PartReport, CommitError> {
        self.write_rank_part_filled(step, layout, staging, Fill::Fed(progress), blobs, slices)
    }

    fn write_rank_part_filled(
        &mut self,
        step: u64,
        layout: &Layout,
        staging: &dyn BufAddr,
        fill: Fill<'_>,
        blobs: &[Blob<'_>],
        slices: &[SliceDecl],
    ) -> Result<PartReport, CommitError> {
        self.check_writable()?;
        crate::image::validate_blobs(blobs)?;
        match self.opts.node_local {
            None => {
                assert_eq!(layout.opts.n_dirs, 1, "a rank's part in the shared directory is planned for one directory")
            }
            Some(_) => assert_eq!(
                layout.opts.n_dirs,
                self.dirs().len(),
                "a rank's node-local part is planned for this node's directories"
            ),
        }
        assert!(staging.len_bytes() as u64 >= layout.staging_len, "staging smaller than the layout");
        let shared = self.shared_or_panic().to_path_buf();
        if catalog::is_committed(&shared, step) {
            return Err(CommitError::AlreadyCommitted { step, dir: shared });
        }
        self.check_abort(step)?;
        let rank = layout.opts.rank;
        let tmp = ranks_tmp_path(&shared, step)?;
        let r = self.write_rank_part_inner(step, &tmp, layout, staging, fill, blobs, slices);
        if r.is_err() {
            let _ = remove_rank_files(&tmp, rank, blobs);
            if self.opts.node_local.is_some() {
                for d in self.dirs() {
                    if let Ok(local) = node_step_path(d, step) {
                        let _ = remove_rank_files(&local, rank, &[]);
                    }
                }
            }
        }
        r
    }

    #[allow(clippy::too_many_arguments)]
    fn write_rank_part_inner(
        &mut self,
        step: u64,
        tmp: &Path,
        layout: &Layout,
        staging: &dyn BufAddr,
        fill: Fill<'_>,
        blobs: &[Blob<'_>],
        slices: &[SliceDecl],
    ) -> Result<PartReport, CommitError> {
        let shared = tmp.parent().expect("the temp folder is in the shared directory").to_path_buf();
        let rank = layout.opts.rank;
        match fs::create_dir(tmp) {
            Ok(()) => catalog::fsync_dir(&shared).map_err(|e| CommitError::io(&shared, "sync shared directory", e))?,
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(CommitError::io(tmp, "create the multi-rank temp folder", e)),
        }
        remove_rank_files(tmp, rank, blobs)
            .map_err(|e| CommitError::io(tmp, format!("remove rank {rank}'s files of an earlier attempt"), e))?;
        let chunk_bytes = self.opts.chunk_bytes;
        // Incremental (docs/format.md, "Incremental checkpoints"): the
        // newest committed step of the shared directory, and this part's
        // stable shards that may be linked from its files on the same file
        // system (decided once the copy's digests are in).
        let own_dirs = self.dirs().to_vec();
        let kept = self.kept_parts.remove(&rank);
        let (prev, prev_kept) = if layout.opts.incremental {
            let node = self.opts.node_local.as_deref().map(|id| (id, &own_dirs[..]));
            Prev::newest_shared_or_kept(&shared, node, kept, (rank, layout.opts.world_size))
        } else {
            (None, false)
        };
        let candidates: Vec<Option<PathBuf>> = (0..layout.shards.len())
            .map(|s| prev.as_ref().filter(|_| self.link_unchanged).and_then(|p| p.candidate(layout, s)))
            .collect();
        // The marker names this node as the holder of the rank's files,
        // and its directories (the files' dir_idx name one of them).
        let held: BTreeMap<String, format::IndexNode> = match &self.opts.node_local {
            Some(id) => {
                let files = layout.shards.iter().map(|sh| sh.file_name.clone()).collect();
                let dirs = self.dirs().iter().map(|d| d.display().to_string()).collect();
                [(id.clone(), format::IndexNode { dirs, files })].into()
            }
            None => BTreeMap::new(),
        };
        let marker = tmp.join(format::rank_marker_name(rank));
        let scratch = tmp.join(format!(".{}.tmp", format::rank_marker_name(rank)));
        let _ = fs::remove_file(&scratch);
        let w = DirWrite { step, layout, staging, fill, chunk_bytes, prev: prev.as_ref(), candidates: &candidates };
        let prev_blobs = prev.as_ref().map(|p| catalog::step_path(&shared, p.step).join(BLOBS_DIR_NAME));
        // The marker (this rank's index) is rendered, written under a temp
        // name and synced while the files are written and synced (their
        // syncs and its own are each a journal commit: 5-30 ms at 10k
        // tensors here); it names them only once renamed, after they are.
        // A fed part's checksums are its filler's end.
        let (files, marked) = std::thread::scope(|sc| {
            let marked = sc.spawn(|| -> Result<_, CommitError> {
                layout.prepare_index_held(&[], &held);
                let crcs = fill.crcs(step)?.into_owned();
                let digests = fill.digests().filter(|_| layout.opts.incremental).map(|d| d.into_owned());
                let index = layout.index_json_with(step, &crcs, digests.as_deref(), blobs, Vec::new(), &held);
                write_small_file(&scratch, &index).map_err(|e| CommitError::io(&scratch, "write rank marker", e))?;
                Ok((crcs, digests, index))
            });
            let files = self.write_part_files(tmp, w, blobs, slices, prev_blobs.as_deref());
            (files, marked.join().expect("the marker's writer panicked"))
        });
        let ((linked, bytes, slices_json), (crcs, digests, index)) = match (files, marked) {
            (Ok(f), Ok(m)) => (f, m),
            (Err(e), _) | (Ok(_), Err(e)) => {
                let _ = fs::remove_file(&scratch);
                return Err(e);
            }
        };
        let linked_bytes: u64 = linked.iter().map(|&s| layout.shards[s].file_len).sum();
        let incremental = digests.as_deref().map(|d| IncrementalReport {
            prev_step: prev.as_ref().map(|p| p.step),
            linked_files: linked.len(),
            linked_bytes,
            changed: prev.as_ref().map(|p| p.changed(layout, &crcs, d)),
            prev_kept,
        });
        if let Some(r) = &incremental {
            info!(rank, prev_step = ?r.prev_step, linked_files = r.linked_files, linked_bytes = r.linked_bytes, changed = ?r.changed.as_ref().map(|c| c.len()), "incremental (this rank's part)");
        }
        if let Err(e) = self.check_abort(step) {
            let _ = fs::remove_file(&scratch);
            return Err(e);
        }
        fs::rename(&scratch, &marker).map_err(|e| CommitError::io(&marker, "rename rank marker into place", e))?;
        catalog::fsync_dir(tmp).map_err(|e| CommitError::io(tmp, "sync the multi-rank temp folder", e))?;
        let folder = FolderId::of(tmp).map_err(|e| CommitError::io(tmp, "stat the multi-rank temp folder", e))?;
        let sent = SentMarker { rank, folder, marker: index, slices: slices_json };
        if let Some(d) = &digests {
            // This part as the step's index will record it once committed,
            // for this rank's next part to compare with.
            let folders: Vec<PathBuf> = match &self.opts.node_local {
                Some(_) => own_dirs.iter().map(|d| node_step_path(d, step)).collect::<Result<_, _>>()?,
                None => vec![catalog::step_path(&shared, step)],
            };
            let part = Prev::of_layout(step, layout, &crcs, d, |sh| {
                Some(folders.get(sh.dir_idx as usize)?.join(&sh.file_name))
            });
            self.kept_parts.insert(rank, part);
        }
        Ok(PartReport { bytes, marker, sent, incremental })
    }

    /// A rank's part's files, each synced with its name before the marker
    /// names them: its shards (into this node's own directories, or the
    /// shared temp folder `tmp`), its blobs (one with the very bytes of its
    /// namesake in `prev_blobs`, the blobs of the step the part compares
    /// with, linked from there: a skeleton is 0.5 MB at 10k tensors) and
    /// its slice declarations. Returns the shards linked, the bytes
    /// written and the declarations' JSON.
    fn write_part_files(
        &mut self,
        tmp: &Path,
        w: DirWrite<'_>,
        blobs: &[Blob<'_>],
        slices: &[SliceDecl],
        prev_blobs: Option<&Path>,
    ) -> Result<(Vec<usize>, u64, Vec<u8>), CommitError> {
        let layout = w.layout;
        let rank = layout.opts.rank;
        let linked = if self.opts.node_local.is_some() {
            // Node-local: the shards go into this node's own directories
            // (striped as the layout says), synced before the marker.
            self.write_node_local_shards(w)?
        } else {
            let d = self.shared.as_mut().expect("checked by the caller");
            let (_, _, linked) = write_dir(d, 0, tmp, w)?;
            if !linked.is_empty() {
                // The links' names durable before the marker says the part is.
                catalog::fsync_dir(tmp).map_err(|e| CommitError::io(tmp, "sync the multi-rank temp folder", e))?;
            }
            linked
        };
        let linked_bytes: u64 = linked.iter().map(|&s| layout.shards[s].file_len).sum();
        let mut bytes = layout.file_bytes() - linked_bytes;
        if !blobs.is_empty() {
            let bdir = tmp.join(BLOBS_DIR_NAME);
            match fs::create_dir(&bdir) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(CommitError::io(&bdir, "create blobs folder", e)),
            }
            for b in blobs {
                let p = bdir.join(b.name);
                if prev_blobs.is_some_and(|d| link_if_same(&d.join(b.name), &p, b.bytes)) {
                    continue;
                }
                write_small_file(&p, b.bytes).map_err(|e| {
                    CommitError::io(&p, format!("write blob {:?}", b.name), e).needing(b.bytes.len() as u64)
                })?;
                bytes += b.bytes.len() as u64;
            }
            catalog::fsync_dir(&bdir).map_err(|e| CommitError::io(&bdir, "sync blobs folder", e))?;
        }
        let mut slices_json = Vec::new();
        if !slices.is_empty() {
            // Synced, its entry too, before the marker: a marker present means they are in.
            let p = tmp.join(format::rank_slices_name(rank));
            slices_json =
                serde_json::to_vec(&RankSlices { slices: slices.to_vec() }).expect("slice declarations serialize");
            write_small_file(&p, &slices_json).map_err(|e| CommitError::io(&p, "write rank slice declarations", e))?;
            catalog::fsync_dir(tmp).map_err(|e| CommitError::io(tmp, "sync the multi-rank temp folder", e))?;
        }
        Ok((linked, bytes, slices_json))
    }

    /// Writes and syncs a rank's shards into this node's `node-step-…`
    /// folder of `step` in each of its directories (made, with their
    /// directory synced, if missing; the rank's files of an earlier attempt
    /// removed first): one writer thread per directory, as a commit does.
    /// A shard with a link candidate (incremental) is linked from this
    /// node's folder of `prev` when all its tensors are unchanged; returns
    /// the shards linked.
    fn write_node_local_shards(&mut self, w: DirWrite<'_>) -> Result<Vec<usize>, CommitError> {
        let DirWrite { step, layout, .. } = w;
        let rank = layout.opts.rank;
        let mut locals = Vec::new();
        for d in self.dirs() {
            let local = node_step_path(d, step)?;
            match fs::create_dir(&local) {
                Ok(()) => catalog::fsync_dir(d).map_err(|e| CommitError::io(d, "sync directory", e))?,
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                    remove_rank_files(&local, rank, &[]).map_err(|e| {
                        CommitError::io(&local, format!("remove rank {rank}'s files of an earlier attempt"), e)
                    })?
                }
                Err(e) => return Err(CommitError::io(&local, "create the node-local step folder", e)),
            }
            locals.push(local);
        }
        let (results, ()) = write_dirs(&mut self.dirs, &locals, w, || ());
        let mut linked = Vec::new();
        for r in results {
            linked.extend(r?.2);
        }
        // Synced with the written shards' names, the links' too.
        for local in &locals {
            catalog::fsync_dir(local).map_err(|e| CommitError::io(local, "sync the node-local step folder", e))?;
        }
        Ok(linked)
    }

    /// This node's id when its ranks' shards go to its own disks
    /// (`--node-local`).
    pub fn node_id(&self) -> Option<&str> {
        self.opts.node_local.as_deref()
    }

    /// Removes this node's `node-step-…` folders whose steps are neither
    /// committed nor in flight in the shared directory, `waiting` aside
    /// ([`sweep_node_local`]); a failure is logged.
    pub fn sweep_node_local(&self, waiting: &BTreeSet<u64>) -> Vec<PathBuf> {
        let (Some(_), Some(shared)) = (&self.opts.node_local, self.shared_dir()) else { return Vec::new() };
        if self.read_only().is_some() {
            return Vec::new();
        }
        match crate::recovery::sweep_node_local(self.dirs(), shared, waiting) {
            Ok(removed) => {
                for p in &removed {
                    info!(path = %p.display(), "removed a node-local step folder (its step is not committed in the shared directory: aborted, or gone by retention)");
                }
                removed
            }
            Err(e) => {
                tracing::warn!("could not sweep the node-local step folders ({e}); the next step or start tries again");
                Vec::new()
            }
        }
    }

    /// The ranks of `0..world_size` whose markers of `step` are not yet in
    /// the shared directory (all of them if its temp folder is gone).
    pub fn ranks_missing(&self, step: u64, world_size: u32) -> io::Result<Vec<u32>> {
        let tmp = ranks_tmp_path(self.shared_or_panic(), step).map_err(io::Error::other)?;
        let have = match markers_in(&tmp) {
            Ok(h) => h,
            Err(e) if e.kind() == io::ErrorKind::NotFound => BTreeSet::new(),
            Err(e) => return Err(e),
        };
        Ok((0..world_size).filter(|r| !have.contains(r)).collect())
    }

    /// The coordinator's look at a step's temp folder: one listing, then
    /// each marker that appeared since the last look read and checked once
    /// (with its rank's slice declarations, the sizes of its files in the
    /// shared directory and its skeleton blob) into `read`, so that the
    /// commit itself reads nothing per rank. Returns the ranks of
    /// `0..world_size` still missing. The outer error is the listing's (try
    /// again); the inner one a marker that does not make a step (abort).
    pub fn read_new_markers(
        &self,
        step: u64,
        world_size: u32,
        read: &mut MarkersRead,
    ) -> io::Result<Result<Vec<u32>, CommitError>> {
        self.read_markers(step, world_size, read, None)
    }

    /// [`Store::read_new_markers`] for a coordinator whose markers also
    /// come by message ([`Store::take_sent_marker`]): a marker is read
    /// only once a look found it at least `defer` earlier (and its message
    /// has not come since), so that the files are read only for markers
    /// whose messages are late or lost.
    pub fn read_new_markers_deferred(
        &self,
        step: u64,
        world_size: u32,
        read: &mut MarkersRead,
        defer: std::time::Duration,
    ) -> io::Result<Result<Vec<u32>, CommitError>> {
        self.read_markers(step, world_size, read, Some(defer))
    }

    fn read_markers(
        &self,
        step: u64,
        world_size: u32,
        read: &mut MarkersRead,
        defer: Option<std::time::Duration>,
    ) -> io::Result<Result<Vec<u32>, CommitError>> {
        let tmp = ranks_tmp_path(self.shared_or_panic(), step).map_err(io::Error::other)?;
        let have = match markers_in(&tmp) {
            Ok(h) => h,
            Err(e) if e.kind() == io::ErrorKind::NotFound => BTreeSet::new(),
            Err(e) => return Err(e),
        };
        let mut new: Vec<u32> =
            have.iter().copied().filter(|r| *r < world_size && !read.have.contains_key(r)).collect();
        if let Some(d) = defer {
            let now = Instant::now();
            let due = |r: &u32| read.deferred.get(r).is_some_and(|t| now.duration_since(*t) >= d);
            let (ready, later): (Vec<u32>, Vec<u32>) = new.into_iter().partition(due);
            for r in later {
                read.deferred.entry(r).or_insert(now);
            }
            new = ready;
        }
        // Bounded threads: on a shared file system each read is a round trip.
        let chunk = new.len().div_ceil(crate::config::MARKER_READ_THREADS_MAX).max(1);
        let results: Vec<Result<(u32, RankMarker), CommitError>> = std::thread::scope(|sc| {
            let handles: Vec<_> = new
                .chunks(chunk)
                .map(|ranks| {
                    let (tmp, kept) = (&tmp, &self.kept_markers);
                    sc.spawn(move || {
                        ranks.iter().map(|&r| read_marker(tmp, r, kept).map(|m| (r, m))).collect::<Vec<_>>()
                    })
                })
                .collect();
            handles.into_iter().flat_map(|h| h.join().expect("a marker reader panicked")).collect()
        });
        for r in results {
            if let Err(e) = r.and_then(|(rank, m)| read.insert(&tmp, rank, m)) {
                return Ok(Err(e));
            }
        }
        Ok(Ok((0..world_size).filter(|r| !read.have.contains_key(r)).collect()))
    }

    /// A marker its rank's sidecar sent (by message) into `read`, as
    /// [`Store::read_new_markers`] would read it from its file: Ok(true)
    /// when taken, Ok(false) when its rank is in already, it is beyond
    /// `world_size`, or it is of another attempt's temp folder. The inner
    /// error is a marker that does not make a step (abort).
    pub fn take_sent_marker(
        &self,
        step: u64,
        world_size: u32,
        sent: SentMarker,
        read: &mut MarkersRead,
    ) -> Result<bool, CommitError> {
        if sent.rank >= world_size {
            return Ok(false);
        }
        let tmp = ranks_tmp_path(self.shared_or_panic(), step)?;
        read.insert_sent(&tmp, sent, &self.kept_markers)
    }

    /// The coordinator's commit of a step whose every marker is there:
    /// markers read and checked ([`Store::read_new_markers`]) and merged
    /// into the index with every rank's slice declarations (checked across
    /// ranks), the index written and synced, the folder renamed to `step-…`
    /// (the commit point), the shared directory synced, `latest` moved,
    /// retention applied there. On failure the caller aborts.
    pub fn commit_ranks(&mut self, step: u64, world_size: u32) -> Result<CommitReport, CommitError> {
        let mut read = MarkersRead::default();
        let shared = self.shared_or_panic().to_path_buf();
        let missing = self
            .read_new_markers(step, world_size, &mut read)
            .map_err(|e| CommitError::io(&shared, "list the multi-rank temp folder", e))??;
        if let Some(&rank) = missing.first() {
            let p = ranks_tmp_path(&shared, step)?.join(format::rank_marker_name(rank));
            return Err(CommitError::io(&p, "read rank marker", io::Error::from(io::ErrorKind::NotFound)));
        }
        let mut rep = self.commit_read_ranks(step, world_size, read)?;
        rep.deleted_by_retention = self.retain_shared(step);
        Ok(rep)
    }

    /// [`Store::commit_ranks`] of markers already read, without retention
    /// (the caller applies it once its ranks are answered:
    /// [`Store::retain_shared`]; a crash between the two leaves it to the
    /// next commit, as retention is planned from the directory).
    pub fn commit_read_ranks(
        &mut self,
        step: u64,
        world_size: u32,
        read: MarkersRead,
    ) -> Result<CommitReport, CommitError> {
        self.check_writable()?;
        let t0 = Instant::now();
        let shared = self.shared_or_panic().to_path_buf();
        if catalog::is_committed(&shared, step) {
            return Err(CommitError::AlreadyCommitted { step, dir: shared });
        }
        let tmp = ranks_tmp_path(&shared, step)?;
        if let Some(rank) = (0..world_size).find(|r| !read.have.contains_key(r)) {
            let p = tmp.join(format::rank_marker_name(rank));
            return Err(CommitError::io(&p, "read rank marker", io::Error::from(io::ErrorKind::NotFound)));
        }
        let mut parts = Vec::with_capacity(world_size as usize);
        let mut decls = Vec::new();
        let mut structures = Vec::new();
        let mut bytes = 0u64;
        for (rank, m) in read.have.into_iter().filter(|(r, _)| *r < world_size) {
            bytes += m.bytes;
            decls.extend(m.slices);
            if let Some(s) = m.structure {
                structures.push((rank, s));
            }
            parts.push((rank, m.index));
        }
        let check = || disagreement(&parts, &structures, &decls);
        if let Some(why) = self.kept_markers.unless_agreed(&parts, &structures, &decls, check) {
            return Err(CommitError::PartsDisagree { step, why });
        }
        self.kept_markers.keep_world(world_size);
        let t_commit = Instant::now();
        let ipath = tmp.join(INDEX_FILE_NAME);
        // An index a coordinator that died before renaming left behind.
        let _ = fs::remove_file(&ipath);
        // Markers laid out as the last ones: the kept merge's template
        // filled and written in pieces as it is filled; else merged.
        let len = match self.kept_markers.merged(&parts, &decls)? {
            Some(m) => write_index(&ipath, |out| m.render(INDEX_PIECE_BYTES, out))
                .map_err(|e| CommitError::io(&ipath, "write index", e))?,
            None => {
                let parts = parts.into_iter().map(|(r, m)| (r, m.into_index())).collect();
                let index = ranks::merge_indexes(parts, &decls)?;
                if index.ckpt.world_size != world_size {
                    return Err(CommitError::Format(format::FormatError::Index(format!(
                        "the markers say world size {}, the ranks {world_size}",
                        index.ckpt.world_size
                    ))));
                }
                let json = index.to_json_bytes();
                write_small_file(&ipath, &json).map_err(|e| CommitError::io(&ipath, "write index", e))?;
                json.len() as u64
            }
        };
        bytes += len;
        catalog::fsync_dir(&tmp).map_err(|e| CommitError::io(&tmp, "sync temp folder", e))?;
        self.check_abort(step)?;
        let dest = self.publish_step(&shared, step, &tmp)?;
        info!(step, world_size, bytes, "committed (every node's ranks)");
        Ok(CommitReport {
            step,
            path: dest,
            bytes,
            write: std::time::Duration::ZERO,
            sync: std::time::Duration::ZERO,
            commit: t_commit.elapsed(),
            total: t0.elapsed(),
            deleted_by_retention: Vec::new(),
        })
    }

    /// Retention in the shared directory after `step`'s commit (the
    /// coordinator's `--keep`; the drain's hold, the step being uploaded,
    /// kept as in [`Store::retain`]): the steps deleted. A failure is logged.
    pub fn retain_shared(&self, step: u64) -> Vec<u64> {
        let Some(policy) = self.opts.retention else { return Vec::new() };
        let shared = self.shared_or_panic().to_path_buf();
        let dirs = std::slice::from_ref(&shared);
        let held = self
            .retention_hold
            .as_ref()
            .map(|h| h.lock().unwrap_or_else(|p| p.into_inner()).clone())
            .unwrap_or_default();
        let applied = crate::retention::plan(dirs, policy).and_then(|doomed| {
            let doomed: Vec<u64> = doomed.into_iter().filter(|s| !held.contains(s)).collect();
            for &s in &doomed {
                crate::retention::delete(dirs, s)?;
            }
            Ok(doomed)
        });
        applied.unwrap_or_else(|e| {
            tracing::warn!("retention in the shared directory failed ({e}); step {step} is committed");
            Vec::new()
        })
    }

    /// The coordinator gives a step up: `reason` is written first as the
    /// step's abort record ([`abort_record`]: the other sidecars answer their
    /// ranks with it, so every rank hears the coordinator's one reason, with
    /// the ranks whose markers were missing at that moment), then its
    /// multi-rank temp folder is removed (a committed step is never
    /// touched). Returns whether there was one.
    pub fn abort_ranks(&self, step: u64, reason: &str) -> io::Result<bool> {
        let shared = self.shared_or_panic();
        let tmp = ranks_tmp_path(shared, step).map_err(io::Error::other)?;
        if !tmp.exists() {
            return Ok(false);
        }
        let record = abort_record_path(shared, step).map_err(io::Error::other)?;
        let scratch = record.with_extension("aborted.tmp");
        let _ = fs::remove_file(&scratch);
        write_small_file(&scratch, reason.as_bytes())?;
        fs::rename(&scratch, &record)?;
        catalog::remove_tree(&tmp)?;
        // Earlier steps' records whose ranks were all answered long ago.
        if let Err(e) = crate::recovery::remove_stale_abort_records(shared, self.opts.shared_stale_after) {
            tracing::warn!("could not remove stale abort records in {} ({e})", shared.display());
        }
        catalog::fsync_dir(shared)?;
        Ok(true)
    }

    /// A sidecar that is not the coordinator gives its ranks of a step up:
    /// their files and markers are removed from the temp folder, which
    /// stays (the coordinator's, or recovery's once stale).
    pub fn withdraw_ranks(&self, step: u64, ranks: &[u32]) -> io::Result<()> {
        let tmp = ranks_tmp_path(self.shared_or_panic(), step).map_err(io::Error::other)?;
        for &r in ranks {
            match remove_rank_files(&tmp, r, &[]) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
                _ => {}
            }
        }
        Ok(())
    }
}

/// This node's folder of `step` in its directory `dir` (node-local files).
pub fn node_step_path(dir: &Path, step: u64) -> Result<PathBuf, format::FormatError> {
    Ok(dir.join(format::node_step_dir_name(step)?))
}

pub use crate::recovery::sweep_node_local;

/// Removes rank `rank`'s marker and slice declarations from the committed
/// step `step` of the shared directory `shared`, once a newer step of that
/// rank is committed: only a rank's part comparing with the newest readable
/// step reads them (else it reads the index), and readers never do. Done
/// by the node that wrote them, so retention on the coordinator is left
/// with the files of the step as a whole, whatever the rank count. Not
/// synced: a crash that brings one back costs its unlink at retention. A
/// file already gone (retention came first) is no error.
pub fn prune_rank_marker(shared: &Path, step: u64, rank: u32) -> io::Result<()> {
    let folder = catalog::step_path(shared, step);
    for name in [format::rank_marker_name(rank), format::rank_slices_name(rank)] {
        match fs::remove_file(folder.join(name)) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
    }
    Ok(())
}

/// Removes rank `rank`'s shards, marker, slice declarations and the named
/// blobs from a multi-rank temp folder (what an earlier attempt of that
/// rank left).
fn remove_rank_files(tmp: &Path, rank: u32, blobs: &[Blob<'_>]) -> io::Result<()> {
    let (marker, declared) = (format::rank_marker_name(rank), format::rank_slices_name(rank));
    let mut gone = false;
    for e in fs::read_dir(tmp)? {
        let e = e?;
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        if name == marker || name == declared || ranks::rank_of_file(name) == Some(rank) {
            fs::remove_file(e.path())?;
            gone = true;
        }
    }
    for b in blobs {
        match fs::remove_file(tmp.join(BLOBS_DIR_NAME).join(b.name)) {
            Ok(()) => gone = true,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    if gone {
        catalog::fsync_dir(tmp)?;
    }
    Ok(())
}
