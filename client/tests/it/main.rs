//! The client's integration tests, one test binary (rust-analyzer's
//! `tests/it` layout): the client in a forked child.

mod fork;
