//! Fuzzes the safetensors header parser the reader runs on every shard:
//! it must never panic, and whatever it accepts must be self-consistent.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The first 8 bytes pick the claimed file length, the rest is the file.
    if data.len() < 8 {
        return;
    }
    let file_len = u64::from_le_bytes(data[..8].try_into().unwrap()) % (1 << 40);
    let file = &data[8..];
    if let Ok(h) = ckpt_store::format::decode_header(file, file_len) {
        let mut at = 0;
        for t in &h.tensors {
            assert_eq!(t.data_offsets.0, at);
            at = t.data_offsets.1;
        }
        assert_eq!(h.data_start + at, file_len);
    }
});
