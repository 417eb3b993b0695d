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
//!
//! The parts: which tensors are pieces of logical tensors (`slices`), the
//! blobs saved beside the tensors (`blobs`), and the index an image is
//! committed with (`index`).

use std::collections::HashSet;
use std::ops::Range;
use std::sync::{Arc, OnceLock};

use crate::config::{self, DIRECT_ALIGN_BYTES};
use crate::format::{self, Dtype, FormatError, HeaderTensor};
use crate::index_template::IndexTemplate;

mod blobs;
mod index;
mod slices;

pub(crate) use blobs::index_blobs;
pub use blobs::{validate_blobs, Blob};
pub(crate) use index::Held;
pub use slices::{checked_slices, SliceDecl};

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
        let lens = tensor_lens(&specs)?;
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
        for mut g in stable_groups(&lens, stable, opts) {
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

    /// Whether `other` is this layout or a clone of it, however placed
    /// ([`Layout::rebase`]): the same tensors, shards and index. Clones
    /// share their rendered index until [`Layout::set_slices`] changes what
    /// it says, and share their specs.
    pub fn same_plan(&self, other: &Layout) -> bool {
        Arc::ptr_eq(&self.index_template, &other.index_template) && Arc::ptr_eq(&self.specs, &other.specs)
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
        use crate::crc::{combine_op, shift_op, ShiftTable};
        /// Tensors of one length in a row after which their operator is tabulated.
        const TABULATE_AFTER: usize = 64;
        assert_eq!(tensor_crcs.len(), self.specs.len());
        // The shift operator of the last length again: tensors of one size
        // (experts, layers) need one, not one each; tabulated once it has
        // served TABULATE_AFTER of them in a row.
        let mut op = (0u64, shift_op(0), 0usize);
        let mut table: Option<(u64, ShiftTable)> = None;
        self.shards
            .iter()
            .map(|sh| {
                sh.tensors.iter().fold(crc32c::crc32c(&sh.header), |acc, &i| {
                    let p = &self.places[i];
                    let len = p.data_offsets.1 - p.data_offsets.0;
                    if len == 0 {
                        return acc;
                    }
                    if let Some((_, t)) = table.as_ref().filter(|(l, _)| *l == len) {
                        return t.combine(acc, tensor_crcs[i]);
                    }
                    if op.0 != len {
                        op = (len, shift_op(len), 0);
                    }
                    op.2 += 1;
                    if op.2 == TABULATE_AFTER {
                        table = Some((len, ShiftTable::new(op.1)));
                    }
                    combine_op(acc, tensor_crcs[i], op.1)
                })
            })
            .collect()
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
}

/// Each tensor's bytes, its name checked and unique, its shape not
/// overflowing.
fn tensor_lens(specs: &[TensorSpec]) -> Result<Vec<u64>, FormatError> {
    let mut seen = HashSet::new();
    let mut lens = Vec::with_capacity(specs.len());
    for s in specs {
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
    Ok(lens)
}

/// The stable tensors `stable` grouped into shards ([`Layout::plan_with`]):
/// each of at least [`config::STABLE_OWN_SHARD_BYTES_MIN`] alone, the
/// smaller ones in buckets of at most [`config::STABLE_BUCKET_BYTES_MAX`]
/// (and the shard size cap), in the caller's order.
fn stable_groups(lens: &[u64], stable: Vec<usize>, opts: LayoutOptions) -> Vec<Vec<usize>> {
    let bucket_max = config::STABLE_BUCKET_BYTES_MAX.min(opts.shard_bytes_max);
    let mut bucket: Vec<usize> = Vec::new();
    let mut bucket_bytes = 0u64;
    let mut groups = Vec::new();
    for i in stable {
        if lens[i] >= config::STABLE_OWN_SHARD_BYTES_MIN {
            groups.push(vec![i]);
            continue;
        }
        if !bucket.is_empty() && bucket_bytes + lens[i] > bucket_max {
            groups.push(std::mem::take(&mut bucket));
            bucket_bytes = 0;
        }
        bucket.push(i);
        bucket_bytes += lens[i];
    }
    if !bucket.is_empty() {
        groups.push(bucket);
    }
    groups
}

/// The tensors `order` grouped into shards as [`Layout::plan`] groups every
/// tensor: by decreasing element size (stable), as many shards as the size
/// cap needs, a multiple of the directory count, balanced in bytes.
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
        // Hundreds of tensors of one length in a row (their operator
        // tabulated), then of another, over several shards: each file's crc
        // is still its bytes'.
        let many: Vec<TensorSpec> = (0..700)
            .map(|i| TensorSpec::new(format!("e{i:04}"), Dtype::U8, &[if (300..650).contains(&i) { 33 } else { 1024 }]))
            .collect();
        let l = Layout::plan(many, LayoutOptions { shard_bytes_max: 128 << 10, ..Default::default() }).unwrap();
        assert!(l.shards.len() > 2);
        let mut buf = vec![0u8; l.staging_len as usize];
        l.write_headers(&mut buf);
        for i in 0..l.specs.len() {
            for (j, b) in buf[l.tensor_range(i)].iter_mut().enumerate() {
                *b = (i * 13 + j * 3) as u8;
            }
        }
        let files = l.file_crcs(&l.tensor_crcs(&buf));
        for (sh, crc) in l.shards.iter().zip(files) {
            assert_eq!(
                crc,
                crc32c::crc32c(&buf[sh.staging_offset as usize..(sh.staging_offset + sh.file_len) as usize])
            );
        }
        let big = vec![5u8; 20 << 20];
        assert_eq!(crc32c_parallel(&big), crc32c::crc32c(&big));
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
