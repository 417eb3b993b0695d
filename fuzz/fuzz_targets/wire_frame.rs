//! Fuzzes frame reading and message decoding, both directions: never a
//! panic, never an allocation past the frame limit, and whatever decodes
//! re-encodes to a frame that decodes to the same message.
#![no_main]
use libfuzzer_sys::fuzz_target;

use ckpt_wire::{decode, encode, read_frame_body, Reply, Request, FRAME_BYTES_MAX};

fuzz_target!(|data: &[u8]| {
    let mut r = data;
    while let Ok(body) = read_frame_body(&mut r, FRAME_BYTES_MAX) {
        if let Ok(req) = decode::<Request>(&body) {
            assert_eq!(decode::<Request>(&encode(&req)[4..]).ok(), Some(req));
        }
        if let Ok(rep) = decode::<Reply>(&body) {
            let again = decode::<Reply>(&encode(&rep)[4..]).expect("re-encoded reply decodes");
            // f64 fields may hold NaN, which is not equal to itself.
            assert_eq!(format!("{again:?}"), format!("{rep:?}"));
        }
    }
});
