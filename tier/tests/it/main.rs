//! The tier's integration tests, one test binary (rust-analyzer's
//! `tests/it` layout): every backend passes the checks of [`common`],
//! against a file:// target and an S3 server (tests/s3/serve.sh).
//!
//! Run one module with `cargo test --release -p ckpt-tier --test it s3::`.

mod common;
mod file;
mod s3;
mod s3_wrong_credentials;
