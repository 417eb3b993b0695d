//! Fuzzes frame reading and message decoding, both directions: never a
//! panic, never an allocation past the frame limit, and whatever decodes
//! re-encodes to a frame that decodes to the same message.
#![no_main]
use libfuzzer_sys::fuzz_target;

use ckpt_wire::{decode, decode_save, encode, read_frame_body, Reply, Request, TensorDescIn, FRAME_BYTES_MAX};

fuzz_target!(|data: &[u8]| {
    let mut r = data;
    while let Ok(body) = read_frame_body(&mut r, FRAME_BYTES_MAX) {
        if let Ok(req) = decode::<Request>(&body) {
            assert_eq!(decode::<Request>(&encode(&req)[4..]).ok(), Some(req));
        }
        // The sidecar's zero-copy read of a Save agrees with the owned one.
        if let Some(Ok(sv)) = decode_save(&body) {
            let (tensors, blobs) = match decode::<Request>(&body).expect("a decoded save decodes owned") {
                Request::Save { tensors, blobs, .. } | Request::SavePart { tensors, blobs, .. } => (tensors, blobs),
                other => panic!("decode_save read {other:?} as a save"),
            };
            assert_eq!(sv.tensors, tensors.iter().map(TensorDescIn::of).collect::<Vec<_>>());
            assert_eq!(sv.blobs, blobs);
        }
        if let Ok(rep) = decode::<Reply>(&body) {
            let again = decode::<Reply>(&encode(&rep)[4..]).expect("re-encoded reply decodes");
            // f64 fields may hold NaN, which is not equal to itself.
            assert_eq!(format!("{again:?}"), format!("{rep:?}"));
        }
    }
});
