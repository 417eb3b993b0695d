//! The binary's commands that live apart from `main.rs`.

pub mod bench_drain;
pub mod remote;
