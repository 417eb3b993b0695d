//! The rank markers of a multi-rank step as its coordinator reads them:
//! each once, when it first sees it, with what the commit needs of its rank
//! (docs/format.md, "Several nodes").

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs;
use std::io;
use std::path::Path;
use std::sync::Arc;

use crate::commit::CommitError;
use crate::format::{self, BLOBS_DIR_NAME};
use crate::image::SliceDecl;
use crate::kept_markers::{KeptMarkers, MarkerIndex};

/// A rank's slice declarations as written beside its marker.
#[derive(serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RankSlices {
    pub(super) slices: Vec<SliceDecl>,
}

/// Whether the ranks' markers make a step that does not load
/// (crate::skeleton::parts_disagree), with the skeleton blobs read with
/// their markers ([`read_marker`]).
pub(super) fn disagreement(
    parts: &[(u32, MarkerIndex)],
    structures: &[(u32, Arc<Vec<u8>>)],
    decls: &[SliceDecl],
) -> Option<String> {
    use crate::skeleton::{self, RankPart};
    let ranks: Vec<RankPart<'_>> = parts
        .iter()
        .map(|(rank, ix)| RankPart {
            rank: *rank,
            tensors: ix.shape().ckpt.tensors.keys().map(String::as_str).collect(),
            structure: structures.iter().find(|(r, _)| r == rank).map(|(_, b)| &b[..]),
            parts_map: ix.blobs().iter().any(|b| b.name == skeleton::PARTS_BLOB),
        })
        .collect();
    let slices: Vec<(&str, &str)> = decls.iter().map(|d| (d.piece.as_str(), d.of.as_str())).collect();
    skeleton::parts_disagree(&ranks, &slices)
}

/// What the coordinator has read of a step's markers so far, each once
/// ([`Store::read_new_markers`]).
#[derive(Debug, Default)]
pub struct MarkersRead {
    pub(super) have: BTreeMap<u32, RankMarker>,
    /// The skeleton blobs read, by crc32c: every rank of a replicated state
    /// names the same one (one file in the temp folder), read once.
    structures: HashMap<u32, Arc<Vec<u8>>>,
    /// The temp folder's identity, looked up once, for markers sent by
    /// message ([`MarkersRead::insert_sent`]).
    folder: Option<FolderId>,
    /// Markers taken from messages rather than read from their files.
    n_sent: usize,
    /// Markers a listing found but left for a later look, and when it
    /// found them (their message may come first:
    /// [`Store::read_new_markers_deferred`]).
    pub(super) deferred: BTreeMap<u32, std::time::Instant>,
}

/// Which folder a step's temp folder is: its inode and its birth time (a
/// removed folder's inode is soon another's; both together tell two
/// attempts of a step apart).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FolderId {
    pub ino: u64,
    /// Nanoseconds since the epoch; 0 where the file system does not say
    /// (then no marker is taken from a message: the files are read).
    pub born_ns: u64,
}

impl FolderId {
    pub fn of(path: &Path) -> io::Result<FolderId> {
        let m = fs::metadata(path)?;
        let born_ns = m
            .created()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_nanos() as u64);
        Ok(FolderId { ino: std::os::unix::fs::MetadataExt::ino(&m), born_ns })
    }
}

/// A rank's marker as its own sidecar wrote it, for the coordinator to
/// take without reading the file (docs/protocol.md, "Peer protocol").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SentMarker {
    pub rank: u32,
    /// The temp folder the marker is in: a marker of an earlier attempt of
    /// the step (another folder of the same name) is not taken.
    pub folder: FolderId,
    /// The marker file's bytes.
    pub marker: Vec<u8>,
    /// The rank's slice declarations' file's bytes; empty when it has none.
    pub slices: Vec<u8>,
}

impl SentMarker {
    /// The bytes it holds (what a bound on queued or kept markers counts).
    pub fn len_bytes(&self) -> usize {
        self.marker.len() + self.slices.len()
    }
}

impl MarkersRead {
    /// The ranks whose markers were read.
    pub fn ranks(&self) -> BTreeSet<u32> {
        self.have.keys().copied().collect()
    }

    /// Whether rank `rank`'s marker is in.
    pub fn has(&self, rank: u32) -> bool {
        self.have.contains_key(&rank)
    }

    /// Whether the marker of every rank of `0..world_size` is in.
    pub fn has_all(&self, world_size: u32) -> bool {
        (0..world_size).all(|r| self.has(r))
    }

    /// How many markers were taken from messages, not read from files.
    pub fn n_sent(&self) -> usize {
        self.n_sent
    }

    /// Whether markers sent by message can be taken for this step's temp
    /// folder (looked up, and its file system gives birth times).
    pub fn takes_sent(&self) -> bool {
        self.folder.is_some_and(|f| f.born_ns != 0)
    }

    /// Whether a listing found markers it left for the next look.
    pub fn has_deferred(&self) -> bool {
        self.deferred.keys().any(|r| !self.have.contains_key(r))
    }

    /// A marker its rank's sidecar sent, taken as if read from its file in
    /// the temp folder `tmp`: checked the same way ([`parse_marker`]), the
    /// temp folder's identity looked up once per step. Ok(false) when it is
    /// not taken: its rank is in already, or it is of another temp folder
    /// (an earlier attempt's, or the folder is gone), or the file system
    /// gives no birth times to tell them apart.
    pub(super) fn insert_sent(
        &mut self,
        tmp: &Path,
        sent: SentMarker,
        kept: &KeptMarkers,
    ) -> Result<bool, CommitError> {
        if self.have.contains_key(&sent.rank) {
            return Ok(false);
        }
        let folder = match self.folder {
            Some(f) => f,
            None => match FolderId::of(tmp) {
                Ok(f) => *self.folder.insert(f),
                Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
                Err(e) => return Err(CommitError::io(tmp, "stat the multi-rank temp folder", e)),
            },
        };
        if folder != sent.folder || folder.born_ns == 0 {
            return Ok(false);
        }
        let rank = sent.rank;
        let slices = (!sent.slices.is_empty()).then_some(&sent.slices[..]);
        let m = parse_marker(tmp, rank, &sent.marker, Some(slices), kept)?;
        self.insert(tmp, rank, m)?;
        self.n_sent += 1;
        Ok(true)
    }

    /// Rank `rank`'s marker, read, with its skeleton blob if it names one:
    /// the bytes of that crc32c read before, else read now from `tmp` (a
    /// blob whose checksum does not match the marker, torn or another
    /// rank's, is not read as its skeleton).
    pub(super) fn insert(&mut self, tmp: &Path, rank: u32, mut m: RankMarker) -> Result<(), CommitError> {
        if let Some(want) = m.structure_crc {
            if let Some(b) = self.structures.get(&want) {
                m.structure = Some(b.clone());
            } else {
                let bp = tmp.join(BLOBS_DIR_NAME).join(crate::skeleton::STRUCTURE_BLOB);
                let got =
                    fs::read(&bp).map_err(|e| CommitError::io(&bp, format!("rank {rank}'s marker lists it"), e))?;
                if crc32c::crc32c(&got) == want {
                    let got = Arc::new(got);
                    self.structures.insert(want, got.clone());
                    m.structure = Some(got);
                }
            }
        }
        self.have.insert(rank, m);
        Ok(())
    }
}

/// One rank's marker as the coordinator read and checked it.
#[derive(Debug)]
pub(super) struct RankMarker {
    pub(super) index: MarkerIndex,
    pub(super) slices: Vec<SliceDecl>,
    /// The crc32c its marker gives its skeleton blob, if it names one.
    structure_crc: Option<u32>,
    /// That blob, read ([`MarkersRead::insert`]).
    pub(super) structure: Option<Arc<Vec<u8>>>,
    /// Its files' and blobs' bytes.
    pub(super) bytes: u64,
}

/// Reads rank `rank`'s marker in the temp folder `tmp` with what the commit
/// needs of its rank: the marker parsed, each file it lists in the shared
/// directory checked for its size (a node-held file: its node's marker,
/// written after they were synced there, is the word for it), its slice
/// declarations; its skeleton blob is read by [`MarkersRead::insert`].
pub(super) fn read_marker(tmp: &Path, rank: u32, kept: &KeptMarkers) -> Result<RankMarker, CommitError> {
    let p = tmp.join(format::rank_marker_name(rank));
    let raw = fs::read(&p).map_err(|e| CommitError::io(&p, "read rank marker", e))?;
    parse_marker(tmp, rank, &raw, None, kept)
}

/// [`read_marker`] of a marker's bytes `raw`; its slice declarations'
/// bytes given (`Some(None)`: it has none), else read from `tmp`.
fn parse_marker(
    tmp: &Path,
    rank: u32,
    raw: &[u8],
    slices_raw: Option<Option<&[u8]>>,
    kept: &KeptMarkers,
) -> Result<RankMarker, CommitError> {
    let p = tmp.join(format::rank_marker_name(rank));
    let marker = kept
        .read(rank, raw)
        .map_err(|e| CommitError::Format(format::FormatError::Index(format!("{}: {e}", p.display()))))?;
    let index = marker.shape();
    let mut bytes = 0u64;
    for f in &index.ckpt.files {
        if index.holder(&f.name).is_some() {
            bytes += f.len_bytes;
            continue;
        }
        let fp = tmp.join(&f.name);
        let len =
            fs::metadata(&fp).map_err(|e| CommitError::io(&fp, format!("rank {rank}'s marker lists it"), e))?.len();
        if len != f.len_bytes {
            return Err(CommitError::Format(format::FormatError::Index(format!(
                "{}: {len} bytes, rank {rank}'s marker says {}",
                fp.display(),
                f.len_bytes
            ))));
        }
        bytes += len;
    }
    bytes += marker.blobs().iter().map(|b| b.len_bytes).sum::<u64>();
    let sp = tmp.join(format::rank_slices_name(rank));
    let parse = |raw: &[u8]| -> Result<Vec<SliceDecl>, CommitError> {
        let d: RankSlices = serde_json::from_slice(raw)
            .map_err(|e| CommitError::Format(format::FormatError::Index(format!("{}: {e}", sp.display()))))?;
        Ok(d.slices)
    };
    let slices = match slices_raw {
        Some(Some(raw)) => parse(raw)?,
        Some(None) => Vec::new(),
        None => match fs::read(&sp) {
            Ok(raw) => parse(&raw)?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(CommitError::io(&sp, "read rank slice declarations", e)),
        },
    };
    let structure_crc = marker.blobs().iter().find(|b| b.name == crate::skeleton::STRUCTURE_BLOB).map(|b| b.crc32c);
    Ok(RankMarker { index: marker, slices, structure_crc, structure: None, bytes })
}
