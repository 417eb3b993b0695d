//! Slice declarations of a rank's part (docs/protocol.md, SavePart): the
//! blob [`SLICES_BLOB`] of a part says which of its tensors are element
//! ranges of which logical tensors. The committer reads it from every part
//! of a step, never writes it as a blob, and the merged layout turns the
//! declarations into the index's `slices` (checked there as a reader
//! checks them: the ranks' slices cover each logical tensor exactly once).
//! Several nodes: each node's sidecar reads its ranks' declarations and
//! writes them beside their markers; the coordinator's merge of the
//! markers checks them the same way (`ckpt_store::image::checked_slices`).
//!
//! Invariant: a rank declares only tensors of its own part.

use ckpt_store::image::{Layout, SliceDecl};
use ckpt_wire::Blob;
use serde::Deserialize;

/// The reserved blob name of a part's slice declarations (JSON).
pub const SLICES_BLOB: &str = "ckpt.slices.json";

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Declared {
    slices: Vec<Declared1>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Declared1 {
    /// The part's tensor holding the elements.
    tensor: String,
    /// The logical tensor's name and whole shape.
    of: String,
    shape: Vec<u64>,
    elems: [u64; 2],
}

/// Whether a blob is a part's slice declarations rather than a blob to store.
pub fn is_declaration(b: &Blob) -> bool {
    b.name == SLICES_BLOB
}

/// The declarations of one rank's part (none without the blob), each
/// naming one of the part's own tensors; Err: one line saying what is wrong.
pub fn declared(rank: u32, layout: &Layout, blobs: &[Blob]) -> Result<Vec<SliceDecl>, String> {
    let Some(b) = blobs.iter().find(|b| is_declaration(b)) else { return Ok(Vec::new()) };
    let d: Declared = serde_json::from_slice(&b.bytes).map_err(|e| format!("rank {rank}: blob {SLICES_BLOB}: {e}"))?;
    let mut out = Vec::with_capacity(d.slices.len());
    for s in d.slices {
        if !layout.specs.iter().any(|t| t.name == s.tensor) {
            return Err(format!(
                "rank {rank}: blob {SLICES_BLOB} declares tensor {:?}, which is not in its part",
                s.tensor
            ));
        }
        out.push(SliceDecl { piece: s.tensor, of: s.of, shape: s.shape, elems: s.elems });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ckpt_store::format::Dtype;
    use ckpt_store::image::{LayoutOptions, TensorSpec};

    fn blob(json: &str) -> Blob {
        Blob { name: SLICES_BLOB.into(), bytes: json.as_bytes().to_vec() }
    }

    #[test]
    fn declarations_name_the_parts_own_tensors() {
        let l = Layout::plan(
            vec![TensorSpec::new("w#elems[0:5]", Dtype::F32, &[5])],
            LayoutOptions { world_size: 2, ..Default::default() },
        )
        .unwrap();
        assert!(declared(0, &l, &[]).unwrap().is_empty());
        let ok = blob(r#"{"slices":[{"tensor":"w#elems[0:5]","of":"w","shape":[4,3],"elems":[0,5]}]}"#);
        assert_eq!(
            declared(0, &l, &[ok]).unwrap(),
            [SliceDecl { piece: "w#elems[0:5]".into(), of: "w".into(), shape: vec![4, 3], elems: [0, 5] }]
        );
        let other = blob(r#"{"slices":[{"tensor":"v","of":"w","shape":[4,3],"elems":[0,5]}]}"#);
        assert_eq!(
            declared(1, &l, &[other]).unwrap_err(),
            "rank 1: blob ckpt.slices.json declares tensor \"v\", which is not in its part"
        );
        let e = declared(0, &l, &[blob("{\"slices\":[{\"tensor\":1}]}")]).unwrap_err();
        assert!(e.starts_with("rank 0: blob ckpt.slices.json: "), "{e}");
    }
}
