//! The `ckpt-sidecar` binary: the command line over the library. Only this
//! file and its `cli` modules use `anyhow`; it maps outcomes to exit codes:
//! 0 success, 1 error, 2 usage, 3 `verify` found damage; a tool whose
//! stdout is closed (`| head`) ends quietly by SIGPIPE (141 in a shell).
//! Every error is one line on stderr, each cause said once.

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::Parser;

use cli::args::{Cli, Cmd};
use cli::created_dirs::Made;

mod cli;

/// `verify` found a damaged checkpoint.
const EXIT_DAMAGED: u8 = 3;
/// The command line did not parse (clap's error, as one line).
const EXIT_USAGE: u8 = 2;

/// A panic anywhere in this binary ends the process at once: a
/// thread that unwound would leave what it held registered (its session's
/// duplicate socket, a step in flight), so its trainer would wait forever
/// for an answer and a drain never end. An abort closes every socket (the
/// trainers see EOF) and the next start recovers the directory. libckpt, a
/// library inside the trainer, keeps unwinding into its catch_unwind.
fn abort_on_panic() {
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        report(info);
        eprintln!("ckpt-sidecar: aborting on a broken invariant (clients see their connection close; the next start recovers the directory)");
        std::process::abort();
    }));
}

fn main() -> ExitCode {
    abort_on_panic();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) if !e.use_stderr() => e.exit(), // --help, --version
        Err(e) => {
            eprintln!("{}", usage_line(&e));
            return ExitCode::from(EXIT_USAGE);
        }
    };
    let daemon = matches!(cli.cmd, Cmd::Serve { .. } | Cmd::Launch { .. });
    if !daemon {
        // A tool whose reader went away (`inspect D | head -1`) ends quietly,
        // as other Unix tools do. The daemon keeps ignoring SIGPIPE: it
        // writes to client sockets, and a client gone is not its end.
        // SAFETY: setting a signal's disposition before any thread starts.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    }
    // The daemon says what it does (one line per checkpoint); tools stay quiet.
    let default_level = if daemon { "info" } else { "warn" };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("CKPT_SIDECAR_LOG").unwrap_or_else(|_| default_level.into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let made = Made::before(&cli.cmd);
    match cli::run(cli.cmd) {
        Ok(code) => code,
        Err(e) => {
            made.undo();
            eprintln!("error: {}", one_line(&e));
            ExitCode::FAILURE
        }
    }
}

/// clap's error as one line: its text up to the first blank line (the
/// message and any argument it lists), then where help is.
fn usage_line(e: &clap::Error) -> String {
    let text = e.render().to_string();
    let msg: Vec<&str> = text.lines().map(str::trim).take_while(|l| !l.is_empty()).collect();
    format!("{} (see --help)", msg.join(" "))
}

/// An error and its causes, each said once: a cause whose text the line
/// already holds (a wrapper that printed its source) is not repeated.
fn one_line(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if line.contains(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    // A multi-line message (a list of problems, each indented) reads as one
    // line: each break and the indent after it become one space.
    line.lines().map(str::trim).filter(|l| !l.is_empty()).collect::<Vec<_>>().join(" ")
}
