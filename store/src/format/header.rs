//! The safetensors shard header: encoding it aligned so the data section
//! starts on a [`DATA_ALIGN_BYTES`] boundary, and decoding it with the
//! checks the safetensors library makes.
//!
//! Invariant: a [`ParsedHeader`] has contiguous data offsets from 0, each
//! tensor's length matching its dtype and shape, and a data section that
//! ends exactly at the end of the file.

use serde::de::{Deserializer, IgnoredAny, MapAccess, Visitor};
use serde::Deserialize;

use super::{tensor_len_bytes, validate_tensor_name, Dtype, FormatError};
use crate::config::{self, DATA_ALIGN_BYTES, HEADER_BYTES_MAX};

/// One tensor in a safetensors header. `data_offsets` are relative to the
/// start of the data section, as the safetensors format defines them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderTensor {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    pub data_offsets: (u64, u64),
}

/// Builds the first bytes of a shard: the 8-byte little-endian header length,
/// the JSON header, then spaces so that the data section starts at a multiple
/// of [`DATA_ALIGN_BYTES`]. Tensors must be given in file order with
/// contiguous offsets starting at 0.
pub fn encode_header(tensors: &[HeaderTensor]) -> Result<Vec<u8>, FormatError> {
    let mut json = String::from("{\"__metadata__\":{\"format\":\"pt\"}");
    let mut expected_begin = 0u64;
    for t in tensors {
        assert_eq!(t.data_offsets.0, expected_begin, "tensors must be contiguous and in file order");
        expected_begin = t.data_offsets.1;
        json.push(',');
        json.push_str(&serde_json::to_string(&t.name).expect("a String always serialises"));
        json.push_str(":{\"dtype\":\"");
        json.push_str(t.dtype.as_str());
        json.push_str("\",\"shape\":");
        json.push_str(&serde_json::to_string(&t.shape).expect("a Vec<u64> always serialises"));
        json.push_str(&format!(",\"data_offsets\":[{},{}]}}", t.data_offsets.0, t.data_offsets.1));
    }
    json.push('}');
    let data_start = config::align_up(8 + json.len() as u64, DATA_ALIGN_BYTES) as usize;
    let header_len = data_start - 8;
    if header_len > HEADER_BYTES_MAX {
        return Err(FormatError::Header(format!(
            "header of {header_len} bytes is above the limit of {HEADER_BYTES_MAX}"
        )));
    }
    let mut out = Vec::with_capacity(data_start);
    out.extend_from_slice(&(header_len as u64).to_le_bytes());
    out.extend_from_slice(json.as_bytes());
    out.resize(data_start, b' ');
    Ok(out)
}

/// A parsed and validated safetensors header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedHeader {
    /// Offset of the data section in the file (8 + header length).
    pub data_start: u64,
    /// Tensors in file order.
    pub tensors: Vec<HeaderTensor>,
}

/// A header tensor as the JSON holds it (other keys are ignored, as the
/// safetensors library does).
#[derive(Deserialize)]
struct RawTensor<'a> {
    #[serde(borrow)]
    dtype: std::borrow::Cow<'a, str>,
    shape: Vec<u64>,
    data_offsets: [u64; 2],
}

/// A header's tensors in the order the JSON lists them, `__metadata__`
/// skipped whatever it holds: read straight into these, not through a
/// `serde_json::Value` tree (a dozen allocations per tensor, a quarter of
/// a 100k-tensor load from disk).
struct Entries<'a>(Vec<(String, RawTensor<'a>)>);

impl<'de: 'a, 'a> Deserialize<'de> for Entries<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = Entries<'a>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object of tensors")
            }
            fn visit_map<M: MapAccess<'de>>(self, mut m: M) -> Result<Entries<'a>, M::Error> {
                let mut out = Vec::with_capacity(m.size_hint().unwrap_or(0));
                while let Some(name) = m.next_key::<String>()? {
                    if name == "__metadata__" {
                        m.next_value::<IgnoredAny>()?;
                    } else {
                        let t = m
                            .next_value::<RawTensor<'a>>()
                            .map_err(|e| serde::de::Error::custom(format_args!("tensor {name:?}: {e}")))?;
                        out.push((name, t));
                    }
                }
                Ok(Entries(out))
            }
        }
        d.deserialize_map(V(std::marker::PhantomData))
    }
}

/// Parses a safetensors header from the first bytes of a file whose total
/// length is `file_len_bytes`, with the checks the safetensors library makes:
/// contiguous offsets from 0, lengths that match dtype and shape, and a data
/// section that ends exactly at the end of the file.
pub fn decode_header(prefix: &[u8], file_len_bytes: u64) -> Result<ParsedHeader, FormatError> {
    let bad = |m: String| FormatError::Header(m);
    if prefix.len() < 8 {
        return Err(bad("shorter than 8 bytes".into()));
    }
    let header_len = u64::from_le_bytes(prefix[..8].try_into().expect("8 bytes"));
    if header_len > HEADER_BYTES_MAX as u64 {
        return Err(bad(format!("header length {header_len} above the limit")));
    }
    let data_start = 8 + header_len;
    if data_start > file_len_bytes {
        return Err(bad(format!("header length {header_len} runs past the end of the file ({file_len_bytes} bytes)")));
    }
    let json = prefix.get(8..data_start as usize).ok_or_else(|| bad("header not fully read".into()))?;
    let entries = serde_json::from_slice::<Entries>(json).map_err(|e| bad(format!("header is not JSON: {e}")))?.0;
    let mut tensors = Vec::with_capacity(entries.len());
    for (name, raw) in entries {
        validate_tensor_name(&name)?;
        let RawTensor { dtype, shape, data_offsets: [begin, end] } = raw;
        let dtype = Dtype::parse(&dtype)?;
        let len = tensor_len_bytes(dtype, &shape).ok_or_else(|| FormatError::ShapeOverflow {
            name: name.clone(),
            shape: shape.clone(),
            dtype,
        })?;
        if end < begin || end - begin != len {
            return Err(bad(format!(
                "tensor {name:?}: offsets [{begin},{end}] do not hold {len} bytes of {dtype} {shape:?}"
            )));
        }
        tensors.push(HeaderTensor { name, dtype, shape, data_offsets: (begin, end) });
    }
    tensors.sort_by_key(|t| t.data_offsets);
    let mut at = 0u64;
    for t in &tensors {
        if t.data_offsets.0 != at {
            return Err(bad(format!(
                "tensor {:?} starts at {} where {} was expected (holes or overlaps)",
                t.name, t.data_offsets.0, at
            )));
        }
        at = t.data_offsets.1;
    }
    if data_start + at != file_len_bytes {
        return Err(bad(format!("data section ends at {} but the file has {} bytes", data_start + at, file_len_bytes)));
    }
    Ok(ParsedHeader { data_start, tensors })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips_and_is_aligned() {
        let tensors = vec![
            HeaderTensor { name: "a".into(), dtype: Dtype::F32, shape: vec![2, 3], data_offsets: (0, 24) },
            HeaderTensor { name: "b\"q".into(), dtype: Dtype::U8, shape: vec![5], data_offsets: (24, 29) },
        ];
        let h = encode_header(&tensors).unwrap();
        assert_eq!(h.len() % DATA_ALIGN_BYTES, 0);
        let parsed = decode_header(&h, h.len() as u64 + 29).unwrap();
        assert_eq!(parsed.data_start, h.len() as u64);
        assert_eq!(parsed.tensors, tensors);
        // A file one byte too long has a hole at the end: refused.
        assert!(decode_header(&h, h.len() as u64 + 30).is_err());
    }

    fn file_of(json: &[u8], data_len: u64) -> (Vec<u8>, u64) {
        let mut f = (json.len() as u64).to_le_bytes().to_vec();
        f.extend_from_slice(json);
        let len = f.len() as u64 + data_len;
        (f, len)
    }

    #[test]
    fn header_reads_what_other_writers_add_and_names_the_tensor_it_refuses() {
        // __metadata__ of any shape is skipped; keys a tensor has beyond the
        // three are ignored; the order of the JSON does not matter.
        let json = br#"{"b":{"shape":[1],"dtype":"U8","data_offsets":[4,5],"extra":[1,{"x":2}]},"__metadata__":{"format":"pt","n":[1]},"a":{"dtype":"F32","shape":[],"data_offsets":[0,4]}}"#;
        let (f, len) = file_of(json, 5);
        let h = decode_header(&f, len).unwrap();
        let names: Vec<_> = h.tensors.iter().map(|t| (t.name.as_str(), t.dtype, t.shape.clone())).collect();
        assert_eq!(names, [("a", Dtype::F32, vec![]), ("b", Dtype::U8, vec![1])]);
        for (json, says) in [
            (&br#"{"a":{"shape":[1],"data_offsets":[0,4]}}"#[..], "tensor \"a\": missing field `dtype`"),
            (br#"{"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}"#, "tensor \"a\""),
            (br#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4,8]}}"#, "tensor \"a\""),
            (br#"[1,2]"#, "header is not JSON"),
        ] {
            let (f, len) = file_of(json, 4);
            let e = decode_header(&f, len).unwrap_err().to_string();
            assert!(e.contains(says), "{e}");
        }
    }

    #[test]
    fn header_refuses_overlaps_and_bad_lengths() {
        let json = br#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#;
        let mut f = (json.len() as u64).to_le_bytes().to_vec();
        f.extend_from_slice(json);
        assert!(decode_header(&f, f.len() as u64 + 12).is_err());
        let json = br#"{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#;
        let mut f = (json.len() as u64).to_le_bytes().to_vec();
        f.extend_from_slice(json);
        assert!(decode_header(&f, f.len() as u64 + 8).is_err());
        let mut f = (u64::MAX).to_le_bytes().to_vec();
        f.extend_from_slice(b"{}");
        assert!(decode_header(&f, 10).is_err());
    }
}
