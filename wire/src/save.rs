//! The hot path of a save on both sides, without a per-tensor allocation:
//! the client encodes a [`Request::Save`] / [`Request::SavePart`] straight
//! from borrowed descriptors ([`encode_save`]), and the sidecar decodes one
//! into descriptors that borrow the frame's bytes ([`decode_save`]). The
//! bytes are exactly those of the owned messages (tests compare them), so
//! this is no new message, only a cheaper way to write and read two.

use std::fmt;
use std::ops::Deref;

use serde::de::{Deserializer, SeqAccess, Visitor};
use serde::{Deserialize, Serialize};

#[cfg(test)]
use crate::Request;
use crate::{Blob, FrameError, TensorDesc, Unchanged};

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
    #[serde(serialize_with = "crate::byte_buf::serialize")]
    pub bytes: &'a [u8],
}

/// A Save's `unchanged` over a borrowed bitmap; encodes exactly as an
/// [`Unchanged`] does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct UnchangedRef<'a> {
    pub since_step: u64,
    #[serde(serialize_with = "crate::byte_buf::serialize")]
    pub bits: &'a [u8],
}

/// What follows the tensor list of a Save or SavePart: blobs,
/// lazy_release, unchanged.
type Tail = (Vec<Blob>, bool, Option<Unchanged>);

/// Which of a checkpoint's parts a SavePart is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankOf {
    pub rank: u32,
    pub world_size: u32,
}

/// The encoded tensor list of a Save or SavePart (its length, then each
/// descriptor): the bytes [`encode_save`] writes between the step (or the
/// world size) and the blobs. A client that saves the same descriptors
/// again keeps them and sends them with [`encode_save_with`]; the sidecar
/// then finds them byte for byte ([`SaveHead::rest_after`]).
pub fn encode_tensors(tensors: &[TensorDescRef<'_>]) -> Vec<u8> {
    // About 40 bytes per tensor: one allocation for most saves.
    postcard::to_extend(tensors, Vec::with_capacity(8 + tensors.len() * 48)).expect("encoding into a Vec cannot fail")
}

/// The frame (length prefix included) of a `Request::Save` (`part` None) or
/// `Request::SavePart`, byte for byte what [`crate::encode`] makes of the
/// owned message.
pub fn encode_save(
    id: u64,
    step: u64,
    part: Option<RankOf>,
    tensors: &[TensorDescRef<'_>],
    blobs: &[BlobRef<'_>],
    lazy_release: bool,
    unchanged: Option<UnchangedRef<'_>>,
) -> Vec<u8> {
    encode_save_with(id, step, part, &encode_tensors(tensors), blobs, lazy_release, unchanged)
}

/// [`encode_save`] with the tensor list already encoded ([`encode_tensors`]).
pub fn encode_save_with(
    id: u64,
    step: u64,
    part: Option<RankOf>,
    tensors_encoded: &[u8],
    blobs: &[BlobRef<'_>],
    lazy_release: bool,
    unchanged: Option<UnchangedRef<'_>>,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(
        48 + unchanged.map_or(0, |u| u.bits.len())
            + tensors_encoded.len()
            + blobs.iter().map(|b| b.bytes.len() + b.name.len() + 8).sum::<usize>(),
    );
    // Field for field as the derived Serialize of Request::Save / SavePart:
    // the variant's index (one byte), then each field (a struct is its
    // fields one after another).
    out.extend_from_slice(&[0; 4]);
    let out = match part {
        None => {
            out.push(SAVE_TAG);
            postcard::to_extend(&(id, step), out)
        }
        Some(p) => {
            out.push(SAVE_PART_TAG);
            postcard::to_extend(&(id, step, p.rank, p.world_size), out)
        }
    };
    let mut out = out.expect("encoding into a Vec cannot fail");
    out.extend_from_slice(tensors_encoded);
    let mut out = postcard::to_extend(&(blobs, lazy_release, unchanged), out).expect("encoding into a Vec cannot fail");
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
        TensorDescIn {
            name: &d.name,
            dtype: &d.dtype,
            shape: Dims::from_slice(&d.shape),
            region_id: d.region_id,
            offset_bytes: d.offset_bytes,
            len_bytes: d.len_bytes,
        }
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
    pub unchanged: Option<Unchanged>,
}

/// A Save or SavePart read up to its tensor list ([`decode_save_head`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SaveHead<'a> {
    pub id: u64,
    pub step: u64,
    pub part: Option<RankOf>,
    /// The encoded tensor list, the blobs, lazy_release and unchanged.
    rest: &'a [u8],
}

/// The rest of a Save decoded ([`SaveHead::rest`]).
#[derive(Debug, Clone, PartialEq)]
pub struct SaveRest<'a> {
    pub tensors: Vec<TensorDescIn<'a>>,
    /// The bytes the tensors were decoded from ([`encode_tensors`]' of them).
    pub tensors_encoded: &'a [u8],
    pub blobs: Vec<Blob>,
    pub lazy_release: bool,
    pub unchanged: Option<Unchanged>,
}

/// Reads a frame body that holds a Save or SavePart up to its tensor list;
/// None when it holds another message (decode it with [`crate::decode`]).
/// Never panics on any input.
pub fn decode_save_head(body: &[u8]) -> Option<Result<SaveHead<'_>, FrameError>> {
    let (&tag, rest) = body.split_first()?;
    let dec = |e| FrameError::Decode(e);
    Some(match tag {
        SAVE_TAG => postcard::take_from_bytes::<(u64, u64)>(rest)
            .map(|((id, step), rest)| SaveHead { id, step, part: None, rest })
            .map_err(dec),
        SAVE_PART_TAG => postcard::take_from_bytes::<(u64, u64, u32, u32)>(rest)
            .map(|((id, step, rank, world_size), rest)| SaveHead {
                id,
                step,
                part: Some(RankOf { rank, world_size }),
                rest,
            })
            .map_err(dec),
        _ => return None,
    })
}

impl<'a> SaveHead<'a> {
    /// The tensor list (descriptors borrowing the frame), its bytes, the
    /// blobs, lazy_release and unchanged.
    pub fn rest(&self) -> Result<SaveRest<'a>, FrameError> {
        let (tensors, after) = decode_tensors(self.rest)?;
        let tensors_encoded = &self.rest[..self.rest.len() - after.len()];
        let (blobs, lazy_release, unchanged) = postcard::from_bytes::<Tail>(after).map_err(FrameError::Decode)?;
        Ok(SaveRest { tensors, tensors_encoded, blobs, lazy_release, unchanged })
    }

    /// When the tensor list is `tensors_encoded` byte for byte (the list of
    /// an earlier save, as [`SaveRest::tensors_encoded`] gave it): the list
    /// (this frame's bytes), and the blobs, lazy_release and unchanged after it, the
    /// list itself not decoded again. None when the list differs.
    /// (Decoding is a function of the bytes it reads, and a list's encoding
    /// ends where it ends: the same bytes are the same descriptors.)
    #[allow(clippy::type_complexity)]
    pub fn rest_after(
        &self,
        tensors_encoded: &[u8],
    ) -> Option<(&'a [u8], Result<(Vec<Blob>, bool, Option<Unchanged>), FrameError>)> {
        let after = self.rest.strip_prefix(tensors_encoded)?;
        Some((&self.rest[..tensors_encoded.len()], postcard::from_bytes::<Tail>(after).map_err(FrameError::Decode)))
    }
}

/// Decodes an encoded tensor list ([`encode_tensors`]) at the start of
/// `bytes`; returns the descriptors and the bytes after the list.
pub fn decode_tensors(bytes: &[u8]) -> Result<(Vec<TensorDescIn<'_>>, &[u8]), FrameError> {
    postcard::take_from_bytes::<Vec<TensorDescIn>>(bytes).map_err(FrameError::Decode)
}

/// Decodes a frame body that holds a Save or SavePart into descriptors
/// borrowing `body`; None when it holds another message (decode it with
/// [`crate::decode`]). Never panics on any input.
pub fn decode_save(body: &[u8]) -> Option<Result<SaveIn<'_>, FrameError>> {
    let head = match decode_save_head(body)? {
        Ok(h) => h,
        Err(e) => return Some(Err(e)),
    };
    Some(head.rest().map(|r| SaveIn {
        id: head.id,
        step: head.step,
        part: head.part,
        tensors: r.tensors,
        blobs: r.blobs,
        lazy_release: r.lazy_release,
        unchanged: r.unchanged,
    }))
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
            TensorDesc {
                name: "model.w".into(),
                dtype: "BF16".into(),
                shape: vec![4, 3],
                region_id: 2,
                offset_bytes: 4096,
                len_bytes: 24,
            },
            TensorDesc {
                name: "scalar".into(),
                dtype: "F32".into(),
                shape: vec![],
                region_id: 2,
                offset_bytes: 0,
                len_bytes: 4,
            },
            TensorDesc {
                name: "deep".into(),
                dtype: "U8".into(),
                shape: vec![1, 1, 1, 1, 1, 1, 1, 2],
                region_id: 300,
                offset_bytes: u64::MAX,
                len_bytes: 2,
            },
        ];
        (ts, vec![Blob { name: "rng".into(), bytes: vec![9, 8, 7] }, Blob { name: "e".into(), bytes: vec![] }])
    }

    fn refs(ts: &[TensorDesc]) -> Vec<TensorDescRef<'_>> {
        ts.iter()
            .map(|t| TensorDescRef {
                name: &t.name,
                dtype: &t.dtype,
                shape: &t.shape,
                region_id: t.region_id,
                offset_bytes: t.offset_bytes,
                len_bytes: t.len_bytes,
            })
            .collect()
    }

    #[test]
    fn tags_match_the_request_enum() {
        let (ts, bs) = owned();
        assert_eq!(
            request_tag(&Request::Save {
                id: 1,
                step: 2,
                tensors: ts.clone(),
                blobs: bs.clone(),
                lazy_release: true,
                unchanged: None
            }),
            SAVE_TAG
        );
        assert_eq!(
            request_tag(&Request::SavePart {
                id: 1,
                step: 2,
                rank: 0,
                world_size: 1,
                tensors: ts,
                blobs: bs,
                lazy_release: true,
                unchanged: None
            }),
            SAVE_PART_TAG
        );
    }

    #[test]
    fn borrowed_saves_encode_and_decode_as_the_owned_messages() {
        let (ts, bs) = owned();
        let brefs: Vec<BlobRef> = bs.iter().map(|b| BlobRef { name: &b.name, bytes: &b.bytes }).collect();
        let flags = Unchanged { since_step: 99, bits: vec![0b101] };
        for (part, lazy, unchanged) in [
            (None, false, None),
            (Some(RankOf { rank: 3, world_size: 4 }), true, None),
            (None, true, Some(flags.clone())),
            (Some(RankOf { rank: 0, world_size: 2 }), false, Some(flags.clone())),
        ] {
            let msg = match part {
                None => Request::Save {
                    id: 7,
                    step: 100,
                    tensors: ts.clone(),
                    blobs: bs.clone(),
                    lazy_release: lazy,
                    unchanged: unchanged.clone(),
                },
                Some(p) => Request::SavePart {
                    id: 7,
                    step: 100,
                    rank: p.rank,
                    world_size: p.world_size,
                    tensors: ts.clone(),
                    blobs: bs.clone(),
                    lazy_release: lazy,
                    unchanged: unchanged.clone(),
                },
            };
            let uref = unchanged.as_ref().map(|u| UnchangedRef { since_step: u.since_step, bits: &u.bits });
            let frame = encode_save(7, 100, part, &refs(&ts), &brefs, lazy, uref);
            assert_eq!(frame, crate::encode(&msg));
            let got = decode_save(&frame[4..]).expect("a save").unwrap();
            let want = SaveIn {
                id: 7,
                step: 100,
                part,
                tensors: ts.iter().map(TensorDescIn::of).collect(),
                blobs: bs.clone(),
                lazy_release: lazy,
                unchanged,
            };
            assert_eq!(got, want);
            assert_eq!(&*got.tensors[2].shape, &[1, 1, 1, 1, 1, 1, 1, 2][..]);
            assert!(
                matches!(got.tensors[2].shape, Dims::Heap(_)) && matches!(got.tensors[0].shape, Dims::Inline { .. })
            );
        }
    }

    #[test]
    fn a_kept_tensor_list_is_sent_and_found_byte_for_byte() {
        let (ts, bs) = owned();
        let brefs: Vec<BlobRef> = bs.iter().map(|b| BlobRef { name: &b.name, bytes: &b.bytes }).collect();
        let list = encode_tensors(&refs(&ts));
        for part in [None, Some(RankOf { rank: 1, world_size: 2 })] {
            // Any id and step (varints of other lengths) around the same list.
            for (id, step) in [(1, 2), (300, 1 << 40)] {
                let u = UnchangedRef { since_step: 5, bits: &[2] };
                let frame = encode_save_with(id, step, part, &list, &brefs, true, Some(u));
                assert_eq!(frame, encode_save(id, step, part, &refs(&ts), &brefs, true, Some(u)));
                let head = decode_save_head(&frame[4..]).expect("a save").unwrap();
                assert_eq!((head.id, head.step, head.part), (id, step, part));
                let rest = head.rest().unwrap();
                assert_eq!(rest.tensors_encoded, &list[..]);
                assert_eq!(rest.tensors, ts.iter().map(TensorDescIn::of).collect::<Vec<_>>());
                let (same, tail) = head.rest_after(&list).expect("the same list");
                assert_eq!(
                    (same, tail.unwrap()),
                    (&list[..], (bs.clone(), true, Some(Unchanged { since_step: 5, bits: vec![2] })))
                );
                assert_eq!(rest.unchanged, Some(Unchanged { since_step: 5, bits: vec![2] }));
                assert_eq!(decode_tensors(&list).unwrap(), (rest.tensors.clone(), &[][..]));
            }
        }
        // Any descriptor changed in any field: another list, not found.
        let mut other = ts.clone();
        for change in 0..6 {
            other.clone_from(&ts);
            let t = &mut other[1];
            match change {
                0 => t.name.push('x'),
                1 => t.dtype = "F16".into(),
                2 => t.shape = vec![1],
                3 => t.region_id += 1,
                4 => t.offset_bytes += 1,
                _ => t.len_bytes += 1,
            }
            let frame = encode_save(9, 9, None, &refs(&other), &brefs, false, None);
            let head = decode_save_head(&frame[4..]).unwrap().unwrap();
            assert!(head.rest_after(&list).is_none(), "change {change}");
            assert_eq!(head.rest().unwrap().tensors[1], TensorDescIn::of(&other[1]));
        }
        // A list that is a prefix of the kept one (fewer tensors) differs in its length.
        let frame = encode_save(9, 9, None, &refs(&ts[..2]), &brefs, false, None);
        assert!(decode_save_head(&frame[4..]).unwrap().unwrap().rest_after(&list).is_none());
    }

    #[test]
    fn other_messages_and_garbage_are_not_saves() {
        assert!(decode_save(&crate::encode(&Request::List { id: 1 })[4..]).is_none());
        assert!(decode_save(&[]).is_none());
        let (ts, bs) = owned();
        let frame = crate::encode(&Request::Save {
            id: 7,
            step: 100,
            tensors: ts,
            blobs: bs,
            lazy_release: false,
            unchanged: Some(Unchanged { since_step: 3, bits: vec![1] }),
        });
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
