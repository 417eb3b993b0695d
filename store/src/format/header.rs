//! The safetensors shard header: encoding it aligned so the data section
//! starts on a [`DATA_ALIGN_BYTES`] boundary, and decoding it with the
//! checks the safetensors library makes.
//!
//! Invariant: a [`ParsedHeader`] has contiguous data offsets from 0, each
//! tensor's length matching its dtype and shape, and a data section that
//! ends exactly at the end of the file.

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
    let value: serde_json::Value = serde_json::from_slice(json).map_err(|e| bad(format!("header is not JSON: {e}")))?;
    let obj = value.as_object().ok_or_else(|| bad("header is not a JSON object".into()))?;
    let mut tensors = Vec::with_capacity(obj.len());
    for (name, v) in obj {
        if name == "__metadata__" {
            continue;
        }
        validate_tensor_name(name)?;
        let t = v.as_object().ok_or_else(|| bad(format!("tensor {name:?} is not an object")))?;
        let dtype = Dtype::parse(
            t.get("dtype").and_then(|d| d.as_str()).ok_or_else(|| bad(format!("tensor {name:?}: no dtype")))?,
        )?;
        let shape = t
            .get("shape")
            .and_then(|s| s.as_array())
            .ok_or_else(|| bad(format!("tensor {name:?}: no shape")))?
            .iter()
            .map(|d| d.as_u64().ok_or_else(|| bad(format!("tensor {name:?}: bad dimension {d}"))))
            .collect::<Result<Vec<u64>, _>>()?;
        let offs = t
            .get("data_offsets")
            .and_then(|s| s.as_array())
            .filter(|a| a.len() == 2)
            .ok_or_else(|| bad(format!("tensor {name:?}: no data_offsets")))?;
        let begin = offs[0].as_u64().ok_or_else(|| bad(format!("tensor {name:?}: bad offset")))?;
        let end = offs[1].as_u64().ok_or_else(|| bad(format!("tensor {name:?}: bad offset")))?;
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
        tensors.push(HeaderTensor { name: name.clone(), dtype, shape, data_offsets: (begin, end) });
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
