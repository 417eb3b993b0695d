//! The binary's commands, one module per group, over the library; `main.rs`
//! keeps only the process: the panic hook, error printing, exit codes.
//! - `args`: the clap types of every command and flag, and their parsers;
//! - `serve`: `serve` and `launch` (the daemon);
//! - `status`: a running sidecar's status;
//! - `local`: the tools over a local directory (`ls`, `inspect`, `verify`,
//!   `gc`, `rollback`, `doctor`); `remote`: `ls`, `inspect`, `verify` of a
//!   drain target's URL; `print`: what those three print, for both;
//! - `bench`, `bench_drain`: the benchmarks; `debug`: the test suite's commands;
//! - `created_dirs`: what a failed start removes again.

use std::process::ExitCode;

pub mod args;
mod bench;
mod bench_drain;
pub mod created_dirs;
mod debug;
mod local;
mod print;
mod remote;
mod serve;
mod status;

use args::Cmd;

/// Runs a parsed command; its exit code (errors: `main` prints them).
pub fn run(cmd: Cmd) -> anyhow::Result<ExitCode> {
    match cmd {
        Cmd::Serve { d } => serve::serve(&d),
        Cmd::Launch { d, preload, preload_lib, cmd } => serve::launch(&d, preload, preload_lib, &cmd),
        Cmd::Status { socket, json } => status::status(socket, json),
        // A drain target's URL (file://, s3://) is read through ckpt-tier (remote.rs).
        Cmd::Ls { dir, json, peers, peer_secret_file } => match remote::url_of(&dir) {
            Some(_) if !peers.is_empty() => {
                anyhow::bail!("--peers lists what peers hold of a checkpoint directory's nodes, not of a drain target")
            }
            Some(url) => remote::ls(url, json),
            None => local::ls(&dir, json, &peers, peer_secret_file),
        },
        Cmd::Inspect { dir, step, step_flag, json } => match remote::url_of(&dir) {
            Some(url) => remote::inspect(url, step.or(step_flag), json),
            None => local::inspect(&dir, step.or(step_flag), json),
        },
        Cmd::Verify { dir, step, secondaries, json, io } => match remote::url_of(&dir) {
            Some(url) => remote::verify(url, step, &secondaries, json),
            None => local::verify(&dir, step, secondaries, json, io.policy()),
        },
        Cmd::Gc { dirs, keep, keep_every, json } => local::gc(&dirs, keep, keep_every, json),
        Cmd::Rollback { dirs, to, json } => local::rollback(&dirs, to, json),
        Cmd::Doctor { dirs, json, io } => local::doctor(&dirs, json, io.policy()),
        Cmd::Bench { what } => bench::bench_cmd(what),
        Cmd::Debug { what } => debug::debug_cmd(what),
    }
}
