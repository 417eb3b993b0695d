//! The hot path of a save on both sides, without a per-tensor allocation:
//! the client encodes a [`Request::Save`] / [`Request::SavePart`] straight
//! from borrowed descriptors ([`encode_save`]), and the sidecar decodes one
//! into descriptors that borrow the frame's bytes ([`decode_save`]). The
//! bytes are exactly those of the owned messages (tests compare them), so
//! this is no new message, only a cheaper way to write and read two.

use std::fmt;
use std::ops::Deref;

use serde::de::{Deserializer, SeqAccess, Visitor};
use serde::ser::{SerializeStructVariant, Serializer};
use serde::{Deserialize, Serialize};

use crate::{Blob, FrameError, TensorDesc};
#[cfg(test)]
use crate::Request;

/// Postcard writes an enum's variant index as a varint first: one byte
/// below 128. Pinned by `tags_match_the_request_enum` below.
const SAVE_TAG: u8 = 3;
const SAVE_PART_TAG: u8 = 12;

/// A tensor descriptor over borrowed strings and shape; encodes exactly as
/// a [`TensorDesc`] does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct TensorDescRef<'a> {
    pub name: &'a str,
    pub dtype: &'a str,
    pub shape: &'a [u64],
    pub region_id: u32,
    pub offset_bytes: u64,
    pub len_bytes: u64,
}

/// A blob over borrowed bytes; encodes exactly as a [`Blob`] does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct BlobRef<'a> {
    pub name: &'a str,
    pub bytes: &'a [u8],
}

/// Which of a checkpoint's parts a SavePart is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankOf {
    pub rank: u32,
    pub world_size: u32,
}

struct SaveOut<'a> {
    id: u64,
    step: u64,
    part: Option<RankOf>,
    tensors: &'a [TensorDescRef<'a>],
    blobs: &'a [BlobRef<'a>],
    lazy_release: bool,
}

impl Serialize for SaveOut<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        // Field for field as the derived Serialize of Request::Save / SavePart.
        let mut v = match self.part {
            None => s.serialize_struct_variant("Request", SAVE_TAG as u32, "Save", 5)?,
            Some(_) => s.serialize_struct_variant("Request", SAVE_PART_TAG as u32, "SavePart", 7)?,
        };
        v.serialize_field("id", &self.id)?;
        v.serialize_field("step", &self.step)?;
        if let Some(p) = self.part {
            v.serialize_field("rank", &p.rank)?;
            v.serialize_field("world_size", &p.world_size)?;
        }
        v.serialize_field("tensors", self.tensors)?;
        v.serialize_field("blobs", self.blobs)?;
        v.serialize_field("lazy_release", &self.lazy_release)?;
        v.end()
    }
}

/// The frame (length prefix included) of a `Request::Save` (`part` None) or
/// `Request::SavePart`, byte for byte what [`crate::encode`] makes of the
/// owned message.
pub fn encode_save(id: u64, step: u64, part: Option<RankOf>, tensors: &[TensorDescRef<'_>], blobs: &[BlobRef<'_>], lazy_release: bool) -> Vec<u8> {
    // About 40 bytes per tensor: one allocation for most saves.
    let mut out = Vec::with_capacity(64 + tensors.len() * 48 + blobs.iter().map(|b| b.bytes.len() + b.name.len() + 8).sum::<usize>());
    out.extend_from_slice(&[0; 4]);
    let mut out = postcard::to_extend(&SaveOut { id, step, part, tensors, blobs, lazy_release }, out).expect("encoding into a Vec cannot fail");
    let len = (out.len() - 4) as u32;
    out[..4].copy_from_slice(&len.to_le_bytes());
    out
}

/// Dimensions held inline up to this many (every common tensor), else on the heap.
const DIMS_INLINE: usize = 6;

/// A tensor's shape as decoded: no allocation for up to [`DIMS_INLINE`]
/// dimensions.
#[derive(Clone, PartialEq, Eq)]
pub enum Dims {
    Inline { n: u8, dims: [u64; DIMS_INLINE] },
    Heap(Vec<u64>),
}

impl Dims {
    pub fn from_slice(s: &[u64]) -> Dims {
        if s.len() <= DIMS_INLINE {
            let mut dims = [0; DIMS_INLINE];
            dims[..s.len()].copy_from_slice(s);
            Dims::Inline { n: s.len() as u8, dims }
        } else {
            Dims::Heap(s.to_vec())
        }
    }
}

impl Deref for Dims {
    type Target = [u64];
    fn deref(&self) -> &[u64] {
        match self {
            Dims::Inline { n, dims } => &dims[..*n as usize],
            Dims::Heap(v) => v,
        }
    }
}

impl fmt::Debug for Dims {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&**self, f)
    }
}

impl<'de> Deserialize<'de> for Dims {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Dims, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Dims;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a sequence of dimensions")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Dims, A::Error> {
                let mut dims = [0u64; DIMS_INLINE];
                let mut n = 0;
                while let Some(x) = seq.next_element::<u64>()? {
                    if n == DIMS_INLINE {
                        // Rare: more dimensions than fit inline.
                        let mut v = dims.to_vec();
                        v.push(x);
                        while let Some(x) = seq.next_element::<u64>()? {
                            v.push(x);
                        }
                        return Ok(Dims::Heap(v));
                    }
                    dims[n] = x;
                    n += 1;
                }
                Ok(Dims::Inline { n: n as u8, dims })
            }
        }
        d.deserialize_seq(V)
    }
}

/// A tensor descriptor as decoded by [`decode_save`]: the strings borrow the
/// frame, the shape is inline.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct TensorDescIn<'a> {
    pub name: &'a str,
    pub dtype: &'a str,
    pub shape: Dims,
    pub region_id: u32,
    pub offset_bytes: u64,
    pub len_bytes: u64,
}

impl<'a> TensorDescIn<'a> {
    /// The view of an owned descriptor (a message decoded the usual way).
    pub fn of(d: &'a TensorDesc) -> Self {
        TensorDescIn { name: &d.name, dtype: &d.dtype, shape: Dims::from_slice(&d.shape), region_id: d.region_id, offset_bytes: d.offset_bytes, len_bytes: d.len_bytes }
    }
}

/// A Save or SavePart as [`decode_save`] returns it.
#[derive(Debug, Clone, PartialEq)]
pub struct SaveIn<'a> {
    pub id: u64,
    pub step: u64,
    pub part: Option<RankOf>,
    pub tensors: Vec<TensorDescIn<'a>>,
    pub blobs: Vec<Blob>,
    pub lazy_release: bool,
}

#[derive(Deserialize)]
struct SaveFields<'a> {
    id: u64,
    step: u64,
    #[serde(borrow)]
    tensors: Vec<TensorDescIn<'a>>,
    blobs: Vec<Blob>,
    lazy_release: bool,
}

#[derive(Deserialize)]
struct SavePartFields<'a> {
    id: u64,
    step: u64,
    rank: u32,
    world_size: u32,
    #[serde(borrow)]
    tensors: Vec<TensorDescIn<'a>>,
    blobs: Vec<Blob>,
    lazy_release: bool,
}

/// Decodes a frame body that holds a Save or SavePart into descriptors
/// borrowing `body`; None when it holds another message (decode it with
/// [`crate::decode`]). Never panics on any input.
pub fn decode_save(body: &[u8]) -> Option<Result<SaveIn<'_>, FrameError>> {
    let (&tag, rest) = body.split_first()?;
    let dec = |e| FrameError::Decode(e);
    Some(match tag {
        SAVE_TAG => postcard::from_bytes::<SaveFields>(rest)
            .map(|f| SaveIn { id: f.id, step: f.step, part: None, tensors: f.tensors, blobs: f.blobs, lazy_release: f.lazy_release })
            .map_err(dec),
        SAVE_PART_TAG => postcard::from_bytes::<SavePartFields>(rest)
            .map(|f| SaveIn {
                id: f.id,
                step: f.step,
                part: Some(RankOf { rank: f.rank, world_size: f.world_size }),
                tensors: f.tensors,
                blobs: f.blobs,
                lazy_release: f.lazy_release,
            })
            .map_err(dec),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A request's variant index (one byte for these).
    fn request_tag(r: &Request) -> u8 {
        crate::encode(r)[4]
    }

    fn owned() -> (Vec<TensorDesc>, Vec<Blob>) {
        let ts = vec![
            TensorDesc { name: "model.w".into(), dtype: "BF16".into(), shape: vec![4, 3], region_id: 2, offset_bytes: 4096, len_bytes: 24 },
            TensorDesc { name: "scalar".into(), dtype: "F32".into(), shape: vec![], region_id: 2, offset_bytes: 0, len_bytes: 4 },
            TensorDesc { name: "deep".into(), dtype: "U8".into(), shape: vec![1, 1, 1, 1, 1, 1, 1, 2], region_id: 300, offset_bytes: u64::MAX, len_bytes: 2 },
        ];
        (ts, vec![Blob { name: "rng".into(), bytes: vec![9, 8, 7] }, Blob { name: "e".into(), bytes: vec![] }])
    }

    fn refs(ts: &[TensorDesc]) -> Vec<TensorDescRef<'_>> {
        ts.iter().map(|t| TensorDescRef { name: &t.name, dtype: &t.dtype, shape: &t.shape, region_id: t.region_id, offset_bytes: t.offset_bytes, len_bytes: t.len_bytes }).collect()
    }

    #[test]
    fn tags_match_the_request_enum() {
        let (ts, bs) = owned();
        assert_eq!(request_tag(&Request::Save { id: 1, step: 2, tensors: ts.clone(), blobs: bs.clone(), lazy_release: true }), SAVE_TAG);
        assert_eq!(request_tag(&Request::SavePart { id: 1, step: 2, rank: 0, world_size: 1, tensors: ts, blobs: bs, lazy_release: true }), SAVE_PART_TAG);
    }

    #[test]
    fn borrowed_saves_encode_and_decode_as_the_owned_messages() {
        let (ts, bs) = owned();
        let brefs: Vec<BlobRef> = bs.iter().map(|b| BlobRef { name: &b.name, bytes: &b.bytes }).collect();
        for (part, lazy) in [(None, false), (Some(RankOf { rank: 3, world_size: 4 }), true)] {
            let msg = match part {
                None => Request::Save { id: 7, step: 100, tensors: ts.clone(), blobs: bs.clone(), lazy_release: lazy },
                Some(p) => Request::SavePart { id: 7, step: 100, rank: p.rank, world_size: p.world_size, tensors: ts.clone(), blobs: bs.clone(), lazy_release: lazy },
            };
            let frame = encode_save(7, 100, part, &refs(&ts), &brefs, lazy);
            assert_eq!(frame, crate::encode(&msg));
            let got = decode_save(&frame[4..]).expect("a save").unwrap();
            let want = SaveIn { id: 7, step: 100, part, tensors: ts.iter().map(TensorDescIn::of).collect(), blobs: bs.clone(), lazy_release: lazy };
            assert_eq!(got, want);
            assert_eq!(&*got.tensors[2].shape, &[1, 1, 1, 1, 1, 1, 1, 2][..]);
            assert!(matches!(got.tensors[2].shape, Dims::Heap(_)) && matches!(got.tensors[0].shape, Dims::Inline { .. }));
        }
    }

    #[test]
    fn other_messages_and_garbage_are_not_saves() {
        assert!(decode_save(&crate::encode(&Request::List { id: 1 })[4..]).is_none());
        assert!(decode_save(&[]).is_none());
        let (ts, bs) = owned();
        let frame = crate::encode(&Request::Save { id: 7, step: 100, tensors: ts, blobs: bs, lazy_release: false });
        // Every truncation is an error, never a panic.
        for n in 1..frame.len() - 4 {
            assert!(matches!(decode_save(&frame[4..4 + n]), Some(Err(FrameError::Decode(_)))), "{n}");
        }
        // A name that is not UTF-8.
        let mut bad = frame[4..].to_vec();
        let at = bad.windows(7).position(|w| w == b"model.w").unwrap();
        bad[at] = 0xff;
        assert!(matches!(decode_save(&bad), Some(Err(FrameError::Decode(_)))));
    }
}
