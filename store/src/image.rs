//! The file image of a checkpoint in staging memory: which tensor goes to
//! which shard and directory, where each shard's header and tensor bytes sit
//! in the staging buffer, and their checksums.
//!
//! Invariants:
//! - staging holds every shard exactly as its file will hold it (header, then
//!   tensors in file order), each shard starting at an O_DIRECT-aligned
//!   offset and zero-padded to an aligned length, so the writer never copies;
//! - tensors are placed by decreasing element size, so with the data section
//!   aligned every tensor is aligned to its element size;
//! - shards are balanced in bytes and spread round-robin over directories.

use std::collections::{BTreeMap, HashSet};
use std::ops::Range;
use std::sync::{Arc, OnceLock};

use crate::config::{self, DIRECT_ALIGN_BYTES};
use crate::format::{
    self, CkptSection, Dtype, FormatError, HeaderTensor, Index, IndexBlob, IndexFile, IndexMetadata, IndexSlice,
    IndexSliced, IndexTensor,
};
use crate::index_template::IndexTemplate;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
}

impl TensorSpec {
    pub fn new(name: impl Into<String>, dtype: Dtype, shape: &[u64]) -> TensorSpec {
        TensorSpec { name: name.into(), dtype, shape: shape.to_vec() }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayoutOptions {
    pub n_dirs: usize,
    pub shard_bytes_max: u64,
    pub rank: u32,
    pub world_size: u32,
    /// Incremental checkpoints: stable tensors in stable shards
    /// ([`Layout::plan_with`]) and an index with a digest per tensor.
    pub incremental: bool,
    /// Which history (set of tensors that changed at the previous save)
    /// the layout was planned with: a kept save plan is reused only under
    /// the same one. 0: none.
    pub history_gen: u64,
}

impl Default for LayoutOptions {
    fn default() -> Self {
        LayoutOptions {
            n_dirs: 1,
            shard_bytes_max: config::SHARD_BYTES_DEFAULT,
            rank: 0,
            world_size: 1,
            incremental: false,
            history_gen: 0,
        }
    }
}

#[derive(Debug, Clone)]
pub struct ShardPlan {
    pub file_name: String,
    pub dir_idx: u32,
    /// Length prefix + JSON header + padding; the data section starts after it.
    pub header: Vec<u8>,
    pub staging_offset: u64,
    pub file_len: u64,
    /// `file_len` rounded up to the O_DIRECT block.
    pub io_len: u64,
    /// Indexes into `Layout::specs`, in file order.
    pub tensors: Vec<usize>,
    /// A stable shard (incremental layouts): its tensors were unchanged at
    /// the previous save, so the commit may link the previous step's file
    /// instead of writing it (`crate::incremental`).
    pub stable: bool,
}

#[derive(Debug, Clone, Copy)]
pub struct TensorPlace {
    pub shard_idx: usize,
    /// Relative to the shard's data section.
    pub data_offsets: (u64, u64),
    /// Absolute offset of the tensor's bytes in staging memory.
    pub staging_offset: u64,
}

#[derive(Debug, Clone)]
pub struct Layout {
    /// Shared by a layout's clones (a kept save plan, the job, the
    /// committer's rebased copy): a thousand names and shapes are not
    /// copied at every save.
    pub specs: Arc<Vec<TensorSpec>>,
    pub places: Vec<TensorPlace>,
    pub shards: Vec<ShardPlan>,
    pub opts: LayoutOptions,
    /// Bytes of staging memory the image needs.
    pub staging_len: u64,
    /// Tensors of this image that are pieces of logical tensors (several
    /// ranks' parts); empty for most images. Only [`Layout::set_slices`]
    /// sets it, after checking, so [`Layout::index`] cannot fail on it.
    slices: Vec<SliceDecl>,
    /// The rendered index ([`Layout::prepare_index`]), shared by clones;
    /// `None` inside if it could not be read (then built at once).
    index_template: Arc<OnceLock<Option<IndexTemplate>>>,
}

/// A stored tensor of a layout that is elements `elems` (row-major) of the
/// logical tensor `of`, whose whole shape is `shape`. (Serialized as a
/// rank's declarations beside its marker, docs/format.md "Several nodes".)
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SliceDecl {
    pub piece: String,
    pub of: String,
    pub shape: Vec<u64>,
    pub elems: [u64; 2],
}

impl Layout {
    pub fn plan(specs: Vec<TensorSpec>, opts: LayoutOptions) -> Result<Layout, FormatError> {
        Layout::plan_with(specs, opts, None)
    }

    /// [`Layout::plan`], and with `opts.incremental`, stable shards: the
    /// tensors not in `changed` (those that changed at the previous save;
    /// None: no history, every tensor counts as stable) go into shards of
    /// their own, after the others in staging (so a fed commit writes the
    /// changing shards first): each stable tensor of at least
    /// [`config::STABLE_OWN_SHARD_BYTES_MIN`] alone, the smaller ones in
    /// buckets of at most [`config::STABLE_BUCKET_BYTES_MAX`] in the
    /// caller's order, each on a directory chosen by its first tensor's
    /// name. So the same stable tensors give the same stable shards at the
    /// next save, whatever the others do, and their files can be linked.
    pub fn plan_with(
        specs: Vec<TensorSpec>,
        opts: LayoutOptions,
        changed: Option<&HashSet<String>>,
    ) -> Result<Layout, FormatError> {
        assert!(opts.n_dirs >= 1 && opts.shard_bytes_max > 0 && opts.world_size >= 1 && opts.rank < opts.world_size);
        let mut seen = HashSet::new();
        let mut lens = Vec::with_capacity(specs.len());
        for s in &specs {
            format::validate_tensor_name(&s.name)?;
            if !seen.insert(s.name.as_str()) {
                return Err(FormatError::DuplicateTensor(s.name.clone()));
            }
            lens.push(format::tensor_len_bytes(s.dtype, &s.shape).ok_or_else(|| FormatError::ShapeOverflow {
                name: s.name.clone(),
                shape: s.shape.clone(),
                dtype: s.dtype,
            })?);
        }
        let (volatile, stable): (Vec<usize>, Vec<usize>) = if opts.incremental {
            (0..specs.len()).partition(|&i| changed.is_some_and(|c| c.contains(&specs[i].name)))
        } else {
            ((0..specs.len()).collect(), Vec::new())
        };
        let n_dirs = opts.n_dirs as u64;
        let mut groups: Vec<(Vec<usize>, u32, bool)> = balanced_groups(&specs, &lens, volatile, opts)
            .into_iter()
            .enumerate()
            .map(|(k, g)| (g, (k as u64 % n_dirs) as u32, false))
            .collect();
        let bucket_max = config::STABLE_BUCKET_BYTES_MAX.min(opts.shard_bytes_max);
        let mut bucket: Vec<usize> = Vec::new();
        let mut bucket_bytes = 0u64;
        let mut stable_groups = Vec::new();
        for i in stable {
            if lens[i] >= config::STABLE_OWN_SHARD_BYTES_MIN {
                stable_groups.push(vec![i]);
                continue;
            }
            if !bucket.is_empty() && bucket_bytes + lens[i] > bucket_max {
                stable_groups.push(std::mem::take(&mut bucket));
                bucket_bytes = 0;
            }
            bucket.push(i);
            bucket_bytes += lens[i];
        }
        if !bucket.is_empty() {
            stable_groups.push(bucket);
        }
        for mut g in stable_groups {
            g.sort_by_key(|&i| std::cmp::Reverse(specs[i].dtype.size_bytes()));
            let dir_idx = (crc32c::crc32c(specs[g[0]].name.as_bytes()) as u64 % n_dirs) as u32;
            groups.push((g, dir_idx, true));
        }

        let mut places = vec![TensorPlace { shard_idx: 0, data_offsets: (0, 0), staging_offset: 0 }; specs.len()];
        let mut shards = Vec::with_capacity(groups.len());
        let mut staging = 0u64;
        for (shard_idx, (group, dir_idx, stable)) in groups.into_iter().enumerate() {
            let mut at = 0u64;
            let mut header_tensors = Vec::with_capacity(group.len());
            for &i in &group {
                let s = &specs[i];
                header_tensors.push(HeaderTensor {
                    name: s.name.clone(),
                    dtype: s.dtype,
                    shape: s.shape.clone(),
                    data_offsets: (at, at + lens[i]),
                });
                at += lens[i];
            }
            let header = format::encode_header(&header_tensors)?;
            let data_start = staging + header.len() as u64;
            for (&i, h) in group.iter().zip(&header_tensors) {
                places[i] = TensorPlace {
                    shard_idx,
                    data_offsets: h.data_offsets,
                    staging_offset: data_start + h.data_offsets.0,
                };
            }
            let file_len = header.len() as u64 + at;
            let io_len = config::align_up(file_len, DIRECT_ALIGN_BYTES);
            shards.push(ShardPlan {
                file_name: format::shard_file_name(opts.rank, opts.world_size, shard_idx),
                dir_idx,
                header,
                staging_offset: staging,
                file_len,
                io_len,
                tensors: group,
                stable,
            });
            staging += io_len;
        }
        Ok(Layout {
            specs: Arc::new(specs),
            places,
            shards,
            opts,
            staging_len: staging,
            slices: Vec::new(),
            index_template: Default::default(),
        })
    }

    /// Moves the whole image to start at `base_bytes` in a larger staging
    /// buffer (the daemon's staging holds several images at once).
    /// `staging_len` becomes the end of the image. `base_bytes` must keep
    /// O_DIRECT alignment.
    pub fn rebase(&mut self, base_bytes: u64) {
        assert_eq!(base_bytes % DIRECT_ALIGN_BYTES as u64, 0, "image base must be block-aligned");
        let old = self.shards.first().map_or(0, |s| s.staging_offset);
        let image_len = self.staging_len - old;
        for sh in &mut self.shards {
            sh.staging_offset = sh.staging_offset - old + base_bytes;
        }
        for p in &mut self.places {
            p.staging_offset = p.staging_offset - old + base_bytes;
        }
        self.staging_len = base_bytes + image_len;
    }

    /// Bytes of staging the image itself covers (from its first shard on).
    pub fn image_len(&self) -> u64 {
        self.shards.iter().map(|s| s.io_len).sum()
    }

    /// Bytes of tensor data (what `total_size` says).
    pub fn tensor_bytes(&self) -> u64 {
        self.places.iter().map(|p| p.data_offsets.1 - p.data_offsets.0).sum()
    }

    /// Bytes of all shard files.
    pub fn file_bytes(&self) -> u64 {
        self.shards.iter().map(|s| s.file_len).sum()
    }

    pub fn tensor_range(&self, i: usize) -> Range<usize> {
        let p = &self.places[i];
        let b = p.staging_offset as usize;
        b..b + (p.data_offsets.1 - p.data_offsets.0) as usize
    }

    pub fn shard_range(&self, s: usize) -> Range<usize> {
        let sh = &self.shards[s];
        sh.staging_offset as usize..(sh.staging_offset + sh.io_len) as usize
    }

    /// Writes every header and zeroes every tail pad; tensor bytes are the
    /// caller's to fill.
    pub fn write_headers(&self, staging: &mut [u8]) {
        assert!(staging.len() as u64 >= self.staging_len, "staging smaller than the layout");
        for sh in &self.shards {
            let b = sh.staging_offset as usize;
            staging[b..b + sh.header.len()].copy_from_slice(&sh.header);
            staging[(b + sh.file_len as usize)..(b + sh.io_len as usize)].fill(0);
        }
    }

    /// Checksums of every tensor, computed over staging memory (both cores).
    pub fn tensor_crcs(&self, staging: &[u8]) -> Vec<u32> {
        (0..self.specs.len()).map(|i| crc32c_parallel(&staging[self.tensor_range(i)])).collect()
    }

    /// File checksums from the header bytes and the tensor checksums, without
    /// reading tensor bytes again.
    pub fn file_crcs(&self, tensor_crcs: &[u32]) -> Vec<u32> {
        assert_eq!(tensor_crcs.len(), self.specs.len());
        self.shards
            .iter()
            .map(|sh| {
                sh.tensors.iter().fold(crc32c::crc32c(&sh.header), |acc, &i| {
                    let p = &self.places[i];
                    crate::crc::combine(acc, tensor_crcs[i], p.data_offsets.1 - p.data_offsets.0)
                })
            })
            .collect()
    }

    /// Declares which tensors are pieces of which logical tensors, checked
    /// as a reader will check the index: every piece a 1-D tensor of this
    /// layout of the logical dtype, the pieces of each logical tensor
    /// covering it exactly once, no logical name a stored one.
    pub fn set_slices(&mut self, decls: Vec<SliceDecl>) -> Result<(), FormatError> {
        let zeros = vec![0; self.specs.len()];
        checked_slices(&self.index_tensors(&zeros), &decls)?;
        self.slices = decls;
        self.index_template = Default::default();
        Ok(())
    }

    /// The declarations [`Layout::set_slices`] accepted.
    pub fn slices(&self) -> &[SliceDecl] {
        &self.slices
    }

    /// A layout of no tensors (what [`crate::ranks::merge`] fills).
    pub(crate) fn empty(opts: LayoutOptions) -> Layout {
        Layout {
            specs: Arc::new(Vec::new()),
            places: Vec::new(),
            shards: Vec::new(),
            opts,
            staging_len: 0,
            slices: Vec::new(),
            index_template: Default::default(),
        }
    }

    fn index_tensors(&self, tensor_crcs: &[u32]) -> BTreeMap<String, IndexTensor> {
        let mut tensors = BTreeMap::new();
        for (i, s) in self.specs.iter().enumerate() {
            let p = &self.places[i];
            let file = self.shards[p.shard_idx].file_name.clone();
            tensors.insert(
                s.name.clone(),
                IndexTensor {
                    file,
                    dtype: s.dtype,
                    shape: s.shape.clone(),
                    data_offsets: [p.data_offsets.0, p.data_offsets.1],
                    crc32c: tensor_crcs[i],
                    xxh128: None,
                },
            );
        }
        tensors
    }

    /// The commit record for this image.
    pub fn index(&self, step: u64, tensor_crcs: &[u32], blobs: &[Blob<'_>], secondary_dirs: Vec<String>) -> Index {
        self.index_with(step, tensor_crcs, None, blobs, secondary_dirs)
    }

    /// [`Layout::index`] with each tensor's digest (`xxh128`, format
    /// version 3), in the layout's order.
    pub fn index_with(
        &self,
        step: u64,
        tensor_crcs: &[u32],
        digests: Option<&[u128]>,
        blobs: &[Blob<'_>],
        secondary_dirs: Vec<String>,
    ) -> Index {
        let mut index = self.index_draft(step, blobs, secondary_dirs);
        if let Some(d) = digests {
            assert_eq!(d.len(), self.specs.len());
            for (s, &d) in self.specs.iter().zip(d) {
                index.ckpt.tensors.get_mut(&s.name).expect("the draft lists every tensor").xxh128 =
                    Some(crate::digest::to_hex(d));
            }
        } else {
            index.ckpt.tensors.values_mut().for_each(|t| t.xxh128 = None);
        }
        index.ckpt.format_version = config::format_version_for(!index.ckpt.slices.is_empty(), digests.is_some());
        let c = &mut index.ckpt;
        for (f, crc) in c.files.iter_mut().zip(self.file_crcs(tensor_crcs)) {
            f.crc32c = crc;
        }
        for (s, &crc) in self.specs.iter().zip(tensor_crcs) {
            c.tensors.get_mut(&s.name).expect("the draft lists every tensor").crc32c = crc;
        }
        for piece in c.slices.values_mut().flat_map(|l| l.slices.iter_mut()) {
            piece.crc32c = c.tensors[&piece.tensor].crc32c;
        }
        index.seal();
        index
    }

    /// The commit record's bytes ([`Layout::index`] as written), from the
    /// layout's rendered index ([`Layout::prepare_index`]), which its
    /// clones share: a kept save plan renders it once.
    pub fn index_json(
        &self,
        step: u64,
        tensor_crcs: &[u32],
        blobs: &[Blob<'_>],
        secondary_dirs: Vec<String>,
    ) -> Vec<u8> {
        self.index_json_with(step, tensor_crcs, None, blobs, secondary_dirs)
    }

    /// [`Layout::index_json`] with digests ([`Layout::index_with`]); the
    /// rendered index of an incremental layout has holes for them.
    pub fn index_json_with(
        &self,
        step: u64,
        tensor_crcs: &[u32],
        digests: Option<&[u128]>,
        blobs: &[Blob<'_>],
        secondary_dirs: Vec<String>,
    ) -> Vec<u8> {
        match self.template(&secondary_dirs).filter(|t| t.has_digests() == digests.is_some()) {
            Some(t) => {
                t.render(step, &self.file_crcs(tensor_crcs), tensor_crcs, digests.unwrap_or(&[]), &index_blobs(blobs))
            }
            None => self.index_with(step, tensor_crcs, digests, blobs, secondary_dirs).to_json_bytes(),
        }
    }

    /// Renders the index with holes for its numbers, unless done already:
    /// a commit calls it while the image is still copied, so that only
    /// the numbers wait for the copy's checksums.
    pub fn prepare_index(&self, secondary_dirs: &[String]) {
        self.template(secondary_dirs);
    }

    fn template(&self, secondary_dirs: &[String]) -> Option<&IndexTemplate> {
        let t = self.index_template.get_or_init(|| {
            let draft = self.index_draft(0, &[], secondary_dirs.to_vec());
            IndexTemplate::new(&draft, self.specs.iter().map(|s| s.name.as_str()))
        });
        // Another directory set (never, for one store) is not worth keeping.
        t.as_ref().filter(|t| t.names(secondary_dirs))
    }

    /// The index with step `step`, these blobs and every checksum 0.
    pub(crate) fn index_draft(&self, step: u64, blobs: &[Blob<'_>], secondary_dirs: Vec<String>) -> Index {
        let files = self
            .shards
            .iter()
            .map(|sh| IndexFile { name: sh.file_name.clone(), dir_idx: sh.dir_idx, len_bytes: sh.file_len, crc32c: 0 })
            .collect();
        let mut tensors = self.index_tensors(&vec![0; self.specs.len()]);
        if self.opts.incremental {
            // Zeros: the rendered index's holes (index_template).
            tensors.values_mut().for_each(|t| t.xxh128 = Some(crate::digest::to_hex(0)));
        }
        let weight_map = tensors.iter().map(|(n, t)| (n.clone(), t.file.clone())).collect();
        // Checked by set_slices: building them again cannot fail.
        let slices = slices_section(&tensors, &self.slices).expect("slices were checked when set");
        let format_version = config::format_version_for(!slices.is_empty(), self.opts.incremental);
        Index {
            metadata: IndexMetadata { total_size: self.tensor_bytes() },
            weight_map,
            ckpt: CkptSection {
                format_version,
                step,
                world_size: self.opts.world_size,
                secondary_dirs,
                files,
                tensors,
                blobs: index_blobs(blobs),
                slices,
                nodes: BTreeMap::new(),
                index_crc32c: 0,
            },
        }
    }
}

/// The tensors `which` grouped as [`Layout::plan`] always did: by
/// decreasing element size (stable), as many shards as the size cap needs,
/// a multiple of the directory count, balanced in bytes.
fn balanced_groups(specs: &[TensorSpec], lens: &[u64], mut order: Vec<usize>, opts: LayoutOptions) -> Vec<Vec<usize>> {
    let total: u64 = order.iter().map(|&i| lens[i]).sum();
    // Stable: bigger elements first, then the caller's order.
    order.sort_by_key(|&i| std::cmp::Reverse(specs[i].dtype.size_bytes()));
    let n_dirs = opts.n_dirs as u64;
    let n_shards = if order.is_empty() {
        0
    } else {
        let by_size = total.div_ceil(opts.shard_bytes_max).max(1);
        by_size.div_ceil(n_dirs) * n_dirs
    };
    let target = if n_shards == 0 { 0 } else { total.div_ceil(n_shards) };
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let mut cur: Vec<usize> = Vec::new();
    let mut cur_bytes = 0u64;
    for i in order {
        if !cur.is_empty() && cur_bytes + lens[i] > target && (groups.len() as u64) + 1 < n_shards {
            groups.push(std::mem::take(&mut cur));
            cur_bytes = 0;
        }
        cur.push(i);
        cur_bytes += lens[i];
    }
    if !cur.is_empty() {
        groups.push(cur);
    }
    groups
}

/// The index's entries of `blobs`.
pub(crate) fn index_blobs(blobs: &[Blob<'_>]) -> Vec<IndexBlob> {
    blobs
        .iter()
        .map(|b| IndexBlob {
            name: b.name.to_string(),
            len_bytes: b.bytes.len() as u64,
            crc32c: crc32c::crc32c(b.bytes),
        })
        .collect()
}

/// A small opaque byte blob saved beside the tensors (`blobs/<name>`).
#[derive(Debug, Clone, Copy)]
pub struct Blob<'a> {
    pub name: &'a str,
    pub bytes: &'a [u8],
}

pub fn validate_blobs(blobs: &[Blob<'_>]) -> Result<(), FormatError> {
    let mut seen = HashSet::new();
    for b in blobs {
        format::validate_blob_name(b.name)?;
        if b.bytes.len() > config::BLOB_BYTES_MAX {
            return Err(FormatError::BlobName { name: b.name.to_string(), why: "blob larger than 256 MiB" });
        }
        if !seen.insert(b.name) {
            return Err(FormatError::DuplicateBlob(b.name.to_string()));
        }
    }
    Ok(())
}

/// crc32c of `data`, split over two threads when it is large.
pub fn crc32c_parallel(data: &[u8]) -> u32 {
    const SPLIT_ABOVE_BYTES: usize = 8 << 20;
    if data.len() < SPLIT_ABOVE_BYTES {
        return crc32c::crc32c(data);
    }
    let (a, b) = data.split_at(data.len() / 2);
    let (ca, cb) = std::thread::scope(|s| {
        let h = s.spawn(|| crc32c::crc32c(b));
        (crc32c::crc32c(a), h.join().expect("crc thread"))
    });
    crate::crc::combine(ca, cb, b.len() as u64)
}

/// The `slices` section of an index whose stored tensors are `tensors`,
/// from declarations of any ranks (pieces in element order), checked as a
/// reader checks it ([`format::validate_slices`]). One sidecar's commit of
/// every rank's part ([`Layout::set_slices`]) and the coordinator's commit
/// of several nodes' markers ([`crate::ranks::merge_indexes`]) both check
/// declarations here.
pub fn checked_slices(
    tensors: &BTreeMap<String, IndexTensor>,
    decls: &[SliceDecl],
) -> Result<BTreeMap<String, IndexSliced>, FormatError> {
    let slices = slices_section(tensors, decls)?;
    format::validate_slices(tensors, &slices)?;
    Ok(slices)
}

/// The `slices` section from the declarations, unchecked beyond what
/// building it needs (every piece a stored tensor, one shape per name).
fn slices_section(
    tensors: &BTreeMap<String, IndexTensor>,
    decls: &[SliceDecl],
) -> Result<BTreeMap<String, IndexSliced>, FormatError> {
    let mut out: BTreeMap<String, IndexSliced> = BTreeMap::new();
    for d in decls {
        let t = tensors.get(&d.piece).ok_or_else(|| {
            FormatError::Index(format!("slice {:?} of {:?}: no such tensor in the checkpoint", d.piece, d.of))
        })?;
        let rank = format::rank_of_shard_file(&t.file).ok_or_else(|| {
            FormatError::Index(format!("slice {:?} of {:?}: file {:?} names no rank", d.piece, d.of, t.file))
        })?;
        let e = out.entry(d.of.clone()).or_insert_with(|| IndexSliced {
            dtype: t.dtype,
            shape: d.shape.clone(),
            slices: Vec::new(),
        });
        if e.shape != d.shape {
            return Err(FormatError::Index(format!(
                "sliced tensor {:?}: slices give shapes {:?} and {:?}",
                d.of, e.shape, d.shape
            )));
        }
        e.slices.push(IndexSlice {
            tensor: d.piece.clone(),
            rank,
            file: t.file.clone(),
            elems: d.elems,
            data_offsets: t.data_offsets,
            crc32c: t.crc32c,
        });
    }
    for e in out.values_mut() {
        e.slices.sort_by_key(|p| p.elems);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn specs() -> Vec<TensorSpec> {
        vec![
            TensorSpec::new("a.u8", Dtype::U8, &[3]),
            TensorSpec::new("b.f32", Dtype::F32, &[1000, 300]),
            TensorSpec::new("c.f16", Dtype::F16, &[7]),
            TensorSpec::new("d.i64", Dtype::I64, &[200_000]),
            TensorSpec::new("e.empty", Dtype::F32, &[0, 4]),
        ]
    }

    #[test]
    fn tensors_are_aligned_to_their_element_size_and_contiguous() {
        let l = Layout::plan(specs(), LayoutOptions::default()).unwrap();
        assert_eq!(l.shards.len(), 1);
        for (i, s) in l.specs.iter().enumerate() {
            assert_eq!(l.places[i].staging_offset % s.dtype.size_bytes(), 0, "{}", s.name);
        }
        let sh = &l.shards[0];
        assert_eq!(sh.staging_offset % DIRECT_ALIGN_BYTES as u64, 0);
        assert_eq!(sh.file_len, sh.header.len() as u64 + l.tensor_bytes());
    }

    #[test]
    fn shards_balance_over_directories() {
        let specs: Vec<_> = (0..40).map(|i| TensorSpec::new(format!("t{i}"), Dtype::F32, &[1 << 16])).collect();
        let l =
            Layout::plan(specs, LayoutOptions { n_dirs: 3, shard_bytes_max: 4 << 20, ..Default::default() }).unwrap();
        // 10 MiB over shards of at most 4 MiB -> 3, a multiple of 3 dirs.
        assert_eq!(l.shards.len(), 3);
        let dirs: Vec<u32> = l.shards.iter().map(|s| s.dir_idx).collect();
        assert_eq!(dirs, vec![0, 1, 2]);
        for sh in &l.shards {
            assert!(sh.file_len < (4 << 20) + 8192, "{}", sh.file_len);
        }
    }

    #[test]
    fn file_crc_from_tensor_crcs_matches_crc_of_the_bytes() {
        let l = Layout::plan(specs(), LayoutOptions::default()).unwrap();
        let mut buf = vec![0u8; l.staging_len as usize];
        l.write_headers(&mut buf);
        for i in 0..l.specs.len() {
            for (j, b) in buf[l.tensor_range(i)].iter_mut().enumerate() {
                *b = (i * 31 + j * 7) as u8;
            }
        }
        let crcs = l.tensor_crcs(&buf);
        let files = l.file_crcs(&crcs);
        let sh = &l.shards[0];
        let file = &buf[sh.staging_offset as usize..(sh.staging_offset + sh.file_len) as usize];
        assert_eq!(files[0], crc32c::crc32c(file));
        let big = vec![5u8; 20 << 20];
        assert_eq!(crc32c_parallel(&big), crc32c::crc32c(&big));
    }

    fn many_kinds_of_names() -> Layout {
        let mut s: Vec<TensorSpec> =
            (0..40).map(|i| TensorSpec::new(format!("layer.{i}.w"), Dtype::F32, &[1 + i * 500])).collect();
        // Names holding the keys the index template looks for, escaped in the JSON.
        s.push(TensorSpec::new("\"crc32c\": 0", Dtype::U8, &[2]));
        s.push(TensorSpec::new("    \"step\": 0,", Dtype::U8, &[2]));
        s.push(TensorSpec::new("step", Dtype::U8, &[3]));
        s.push(TensorSpec::new("blobs", Dtype::U8, &[0]));
        s.push(TensorSpec::new("w#elems[0:5]", Dtype::F32, &[5]));
        s.push(TensorSpec::new("w#elems[5:12]", Dtype::F32, &[7]));
        let mut l =
            Layout::plan(s, LayoutOptions { shard_bytes_max: 64 << 10, n_dirs: 2, ..Default::default() }).unwrap();
        let decl =
            |piece: &str, a, b| SliceDecl { piece: piece.into(), of: "w".into(), shape: vec![12], elems: [a, b] };
        l.set_slices(vec![decl("w#elems[5:12]", 5, 12), decl("w#elems[0:5]", 0, 5)]).unwrap();
        assert!(l.shards.len() > 2);
        l
    }

    #[test]
    fn the_rendered_index_is_the_index_built_at_once() {
        let l = many_kinds_of_names();
        let dirs = vec!["/second".to_string()];
        l.prepare_index(&dirs);
        assert!(l.template(&dirs).is_some(), "the template reads");
        for (step, blobs) in [
            (0, vec![]),
            (7, vec![Blob { name: "rng", bytes: b"state" }]),
            (format::STEP_MAX, vec![Blob { name: "a", bytes: b"" }, Blob { name: "z", bytes: b"\n\"" }]),
        ] {
            let crcs: Vec<u32> = (0..l.specs.len() as u32)
                .map(|i| 0x9e37_79b9u32.wrapping_mul(i.wrapping_add(step as u32) | 1))
                .collect();
            let whole = l.index(step, &crcs, &blobs, dirs.clone());
            // A clone (as the committer's rebased copy) shares the rendering.
            let bytes = l.clone().index_json(step, &crcs, &blobs, dirs.clone());
            assert_eq!(String::from_utf8(bytes.clone()).unwrap(), String::from_utf8(whole.to_json_bytes()).unwrap());
            assert_eq!(Index::from_json_bytes(&bytes).unwrap(), whole);
        }
        // Other directories than rendered: built at once, still right.
        assert!(l.template(&[]).is_none());
        assert_eq!(
            l.index_json(3, &vec![5; l.specs.len()], &[], vec![]),
            l.index(3, &vec![5; l.specs.len()], &[], vec![]).to_json_bytes()
        );
    }

    #[test]
    fn an_incremental_layouts_rendered_index_with_digests_is_the_index_built_at_once() {
        let specs: Vec<TensorSpec> =
            (0..12).map(|i| TensorSpec::new(format!("t{i}"), Dtype::F32, &[1 + (i % 3) * (300 << 10)])).collect();
        let changed: HashSet<String> = ["t1".to_string(), "t5".to_string()].into();
        let l = Layout::plan_with(
            specs,
            LayoutOptions { incremental: true, n_dirs: 2, ..Default::default() },
            Some(&changed),
        )
        .unwrap();
        let dirs = vec!["/second".to_string()];
        let crcs: Vec<u32> = (0..12).map(|i| i * 7 + 1).collect();
        let digests: Vec<u128> =
            (0..12u128).map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c834) ^ 5).collect();
        let whole = l.index_with(9, &crcs, Some(&digests), &[Blob { name: "rng", bytes: b"x" }], dirs.clone());
        let bytes = l.index_json_with(9, &crcs, Some(&digests), &[Blob { name: "rng", bytes: b"x" }], dirs.clone());
        assert_eq!(String::from_utf8(bytes.clone()).unwrap(), String::from_utf8(whole.to_json_bytes()).unwrap());
        let read = Index::from_json_bytes(&bytes).unwrap();
        assert_eq!(read.ckpt.format_version, config::FORMAT_VERSION_DIGESTS);
        assert_eq!(read.ckpt.tensors["t3"].xxh128.as_deref().and_then(crate::digest::parse_hex), Some(digests[3]));
        // Without digests: version 1, no xxh128 (built at once).
        let plain = Index::from_json_bytes(&l.index_json(9, &crcs, &[], dirs)).unwrap();
        assert_eq!(plain.ckpt.format_version, config::FORMAT_VERSION_OLDEST);
        assert!(plain.ckpt.tensors.values().all(|t| t.xxh128.is_none()));
        // Changed tensors in volatile shards first; each stable one of 1 MiB or more alone.
        let volatile: Vec<&ShardPlan> = l.shards.iter().filter(|s| !s.stable).collect();
        assert!(l.shards.iter().position(|s| s.stable).unwrap() >= volatile.len());
        let vnames: HashSet<&str> =
            volatile.iter().flat_map(|s| s.tensors.iter().map(|&i| l.specs[i].name.as_str())).collect();
        assert_eq!(vnames, ["t1", "t5"].into());
        for sh in l.shards.iter().filter(|s| s.stable) {
            let big = sh.tensors.iter().any(|&i| l.tensor_range(i).len() as u64 >= config::STABLE_OWN_SHARD_BYTES_MIN);
            assert!(!big || sh.tensors.len() == 1);
        }
    }

    #[test]
    fn an_index_without_slices_or_secondaries_renders_too() {
        let l = Layout::plan(
            vec![TensorSpec::new("a", Dtype::F16, &[3]), TensorSpec::new("b", Dtype::I64, &[0])],
            LayoutOptions::default(),
        )
        .unwrap();
        assert_eq!(l.index_json(3, &[11, 22], &[], vec![]), l.index(3, &[11, 22], &[], vec![]).to_json_bytes());
        assert!(l.template(&[]).is_some());
    }

    #[test]
    fn zero_byte_tensors_sharing_an_offset_keep_file_order() {
        // Regression: tensors_of sorted by start offset only, so an empty
        // tensor sharing its offset with the next one could come second and
        // the reader called a good shard's header wrong.
        let specs = vec![TensorSpec::new("b.empty", Dtype::F32, &[0]), TensorSpec::new("a", Dtype::F32, &[4])];
        let l = Layout::plan(specs, LayoutOptions::default()).unwrap();
        let idx = l.index(1, &[0, 0], &[], vec![]);
        let names: Vec<&str> = idx.tensors_of(&l.shards[0].file_name).map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["b.empty", "a"]);
    }

    #[test]
    fn rebase_moves_every_offset() {
        let mut l = Layout::plan(specs(), LayoutOptions::default()).unwrap();
        let before: Vec<_> = (0..l.specs.len()).map(|i| l.tensor_range(i)).collect();
        let len = l.image_len();
        l.rebase(8192);
        assert_eq!(l.staging_len, 8192 + len);
        for (i, r) in before.into_iter().enumerate() {
            assert_eq!(l.tensor_range(i), r.start + 8192..r.end + 8192);
        }
    }

    #[test]
    fn duplicate_and_bad_names_are_refused() {
        let mut s = specs();
        s.push(TensorSpec::new("a.u8", Dtype::U8, &[1]));
        assert!(matches!(Layout::plan(s, LayoutOptions::default()), Err(FormatError::DuplicateTensor(_))));
        let s = vec![TensorSpec::new("x\0", Dtype::U8, &[1])];
        assert!(Layout::plan(s, LayoutOptions::default()).is_err());
        let s = vec![TensorSpec::new("x", Dtype::U64, &[u64::MAX, 2])];
        assert!(matches!(Layout::plan(s, LayoutOptions::default()), Err(FormatError::ShapeOverflow { .. })));
    }
}
