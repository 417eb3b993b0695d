//! Fuzzes index parsing and validation: never a panic, and an accepted
//! index re-serialises to something that parses to the same value.
#![no_main]
use libfuzzer_sys::fuzz_target;

use ckpt_store::format::Index;

fuzz_target!(|data: &[u8]| {
    if let Ok(index) = Index::from_json_bytes(data) {
        let again = Index::from_json_bytes(&index.to_json_bytes()).expect("a valid index round-trips");
        assert_eq!(index, again);
    }
});
