//! The bench's integration tests, one test binary (rust-analyzer's
//! `tests/it` layout): `bench stall` through the real binary.

mod stall;
