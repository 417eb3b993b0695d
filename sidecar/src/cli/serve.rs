//! `serve` and `launch`: the daemon's flags made into the library's
//! [`DaemonOptions`] (the node id defaulting to the host name), and the
//! library `launch --preload` puts into the trainer, checked to be a shared
//! library before the trainer starts (the dynamic loader would skip a bad
//! one with a line of its own and run the trainer without the shim).

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context};

use ckpt_sidecar::daemon::{self, DaemonOptions};
use ckpt_store::retention::Retention;

use super::args::DaemonArgs;

/// `serve`: the daemon in this process; its exit code once it stopped.
pub fn serve(d: &DaemonArgs) -> anyhow::Result<ExitCode> {
    Ok(ExitCode::from(daemon::serve(&d.options()?)?))
}

/// `launch`: the daemon with the trainer `cmd` as its child (with the shim
/// preloaded when `preload`); exits with the child's status.
pub fn launch(
    d: &DaemonArgs,
    preload: bool,
    preload_lib: Option<PathBuf>,
    cmd: &[std::ffi::OsString],
) -> anyhow::Result<ExitCode> {
    let preload = if preload { Some(resolve_preload(preload_lib)?) } else { None };
    Ok(ExitCode::from(daemon::launch(&d.options()?, cmd, preload.as_deref())?))
}

impl DaemonArgs {
    /// The daemon's options as the flags give them; `--node-id` without a
    /// node-local layout is refused here, not by clap (it depends on two flags).
    fn options(&self) -> anyhow::Result<DaemonOptions> {
        Ok(DaemonOptions {
            dirs: self.dirs.clone(),
            socket: self.socket.clone(),
            staging_bytes: self.staging,
            retention: self.keep.map(|k| Retention { keep_last: k, keep_every: self.keep_every }),
            allow_uids: self.allow_uids.clone(),
            io: self.io.policy(),
            shard_bytes_max: self.shard_size,
            cpus: self.cpus.as_ref().map(|c| c.0.clone()),
            shared_dir: self.shared.clone(),
            node_local: match (self.node_local || (self.shared.is_some() && self.drain.is_some()), &self.node_id) {
                (false, Some(_)) => {
                    bail!("--node-id names this node's files: it needs --node-local (or --shared with --drain)")
                }
                (false, None) => None,
                (true, Some(id)) => Some(id.clone()),
                (true, None) => Some(host_node_id()?),
            },
            metrics: self.metrics,
            read_only: self.read_only,
            drain: self.drain.as_ref().map(|url| ckpt_sidecar::drain::DrainOptions {
                url: url.clone(),
                every: self.drain_every,
                keep: self.drain_keep,
                bandwidth_bytes_per_s: self.drain_bandwidth,
            }),
            incremental: self.incremental,
            full_every: self.full_every,
            scrub_interval: self.scrub_interval,
            peers: self.peer_options()?,
        })
    }
}

impl DaemonArgs {
    /// The peer options, when --peer-listen asks for peers.
    fn peer_options(&self) -> anyhow::Result<Option<ckpt_sidecar::peer::PeerOptions>> {
        let Some(listen) = self.peer_listen else { return Ok(None) };
        let secret_file = super::args::peer_secret_file(self.peer_secret_file.clone(), "--peer-listen")?;
        Ok(Some(ckpt_sidecar::peer::PeerOptions {
            listen,
            peers: self.peers.clone(),
            secret_file,
            replicas: self.peer_replicas,
            keep: self.peer_keep,
            budget_bytes: self.peer_budget,
            io_timeout: self
                .peer_timeout
                .unwrap_or(std::time::Duration::from_millis(ckpt_sidecar::config::PEER_IO_TIMEOUT_MS)),
            shared_over_peers: self.shared_over_peers,
            bandwidth_bytes_per_s: self.peer_bandwidth,
            failure_domain: self.failure_domain.clone().unwrap_or_default(),
            spill: self.peer_spill.clone(),
        }))
    }
}

/// The default node id: this host's name, as far as it is a valid one
/// (`--node-id` otherwise).
fn host_node_id() -> anyhow::Result<String> {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into buf.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        bail!("--node-local: cannot read the host name ({}); give --node-id NAME", std::io::Error::last_os_error());
    }
    let name = String::from_utf8_lossy(buf.split(|&b| b == 0).next().unwrap_or_default()).into_owned();
    ckpt_store::format::validate_node_id(&name)
        .map_err(|e| anyhow::anyhow!("--node-local: the host name is no valid node id ({e}); give --node-id NAME"))?;
    Ok(name)
}

/// The library `--preload` uses: the given one, else libckpt.so beside this binary.
fn resolve_preload(p: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    let p = match p {
        Some(p) => p,
        None => std::env::current_exe().context("locating this binary")?.with_file_name("libckpt.so"),
    };
    let p = std::fs::canonicalize(&p).with_context(|| {
        format!("--preload: {} (build it with cargo build --release, or pass its path)", p.display())
    })?;
    // The dynamic loader ignores a preload it cannot load (one line of its
    // own, then the trainer runs without the shim): refused here instead.
    let mut magic = [0u8; 4];
    std::fs::File::open(&p)
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic))
        .with_context(|| format!("--preload: {}", p.display()))?;
    if &magic != b"\x7fELF" {
        bail!("--preload: {} is not a shared library (no ELF header)", p.display());
    }
    Ok(p)
}
