//! The wire crate's integration tests, one test binary (rust-analyzer's
//! `tests/it` layout): golden encodings of every message.
//!
//! Run them with `cargo test -p ckpt-wire --test it golden::`.

mod golden;
