//! The wire crate's integration tests, one test binary (rust-analyzer's
//! `tests/it` layout): golden encodings of every message (the client protocol and the peer protocol).
//!
//! Run them with `cargo test -p ckpt-wire --test it golden::`.

mod golden;
mod peer_golden;
