//! The tests' S3-compatible server: `tests/s3/serve.sh PORT` (moto, fixed
//! test credentials, bucket `ckpt-test`) on a free loopback port, waited
//! for until it answers. A server that cannot be started is a panic: the
//! test fails, it is never skipped.
//!
//! The server dies with the test process (PR_SET_PDEATHSIG, set on a
//! spawner thread that lives as long as the process, since the signal
//! follows the thread that forked), and with its [`S3Server`] when owned.

use std::io::{BufRead, BufReader};
use std::net::{TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long the server may take to come up: the first run installs moto
/// into .venv (a minute or two), and the import alone takes seconds on a
/// busy machine. Only bounds a hang.
const START_DEADLINE: Duration = Duration::from_secs(600);

/// The bucket serve.sh makes.
pub const BUCKET: &str = "ckpt-test";

pub struct S3Server {
    pub port: u16,
    /// The variables its `export` lines set (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...).
    pub env: Vec<(String, String)>,
    /// Its stderr (request log), for a failing test to show.
    pub log: PathBuf,
    child: Mutex<Option<Child>>,
}

/// The repository's root (this crate is `test-support/` in it).
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().expect("test-support is inside the repository").to_path_buf()
}

fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("binding a loopback port");
    l.local_addr().expect("its address").port()
}

type SpawnRequest = (Command, mpsc::Sender<std::io::Result<Child>>);

/// Spawns children from one thread that never exits, so that their
/// parent-death signal fires when the process ends, not when the test
/// thread that asked for them does.
fn spawn_from_long_lived_thread(cmd: Command) -> std::io::Result<Child> {
    static SPAWNER: OnceLock<Mutex<mpsc::Sender<SpawnRequest>>> = OnceLock::new();
    let tx = SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnRequest>();
        std::thread::Builder::new()
            .name("s3-server-spawner".into())
            .spawn(move || {
                for (mut cmd, reply) in rx {
                    let _ = reply.send(cmd.spawn());
                }
                // The sender lives in a static: never reached.
                loop {
                    std::thread::park();
                }
            })
            .expect("spawning the spawner thread");
        Mutex::new(tx)
    });
    let (reply_tx, reply_rx) = mpsc::channel();
    tx.lock().expect("spawner lock").send((cmd, reply_tx)).expect("the spawner thread lives");
    reply_rx.recv().expect("the spawner replies")
}

impl S3Server {
    /// Starts a server of its own (killed on drop). Panics when it cannot.
    pub fn start() -> S3Server {
        let port = free_port();
        let script = repo_root().join("tests/s3/serve.sh");
        let log = std::env::temp_dir().join(format!("ckpt-s3-server-{}-{port}.log", std::process::id()));
        let log_file = std::fs::File::create(&log).unwrap_or_else(|e| panic!("creating {}: {e}", log.display()));
        let mut cmd = Command::new("bash");
        cmd.arg(&script).arg(port.to_string()).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(log_file);
        // SAFETY: prctl is async-signal-safe and touches no memory of ours;
        // it runs in the child between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child =
            spawn_from_long_lived_thread(cmd).unwrap_or_else(|e| panic!("starting {}: {e}", script.display()));
        let show_log = |log: &PathBuf| std::fs::read_to_string(log).unwrap_or_default();

        // The export lines come first, then the server listens.
        let stdout = child.stdout.take().expect("piped stdout");
        let (line_tx, line_rx) = mpsc::channel::<String>();
        std::thread::spawn(move || {
            let mut r = BufReader::new(stdout);
            let mut line = String::new();
            while r.read_line(&mut line).is_ok_and(|n| n > 0) {
                if line_tx.send(line.trim_end().to_string()).is_err() {
                    // Nobody listens any more: keep the pipe drained.
                    let _ = std::io::copy(&mut r, &mut std::io::sink());
                    return;
                }
                line.clear();
            }
        });
        let t0 = Instant::now();
        let mut env = Vec::new();
        while env.len() < 5 {
            let left = START_DEADLINE.saturating_sub(t0.elapsed());
            match line_rx.recv_timeout(left) {
                Ok(line) => {
                    if let Some((k, v)) = line.strip_prefix("export ").and_then(|kv| kv.split_once('=')) {
                        env.push((k.to_string(), v.to_string()));
                    }
                }
                Err(_) => {
                    let _ = child.kill();
                    let st = child.wait();
                    panic!("tests/s3/serve.sh {port} printed no environment ({st:?}); its log:\n{}", show_log(&log));
                }
            }
        }
        drop(line_rx);
        // Then wait until it accepts connections (or dies).
        loop {
            if TcpStream::connect(("127.0.0.1", port)).is_ok() {
                break;
            }
            if let Some(st) = child.try_wait().expect("polling the server") {
                panic!("tests/s3/serve.sh {port} exited ({st}); its log:\n{}", show_log(&log));
            }
            if t0.elapsed() > START_DEADLINE {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "tests/s3/serve.sh {port} did not answer within {START_DEADLINE:?}; its log:\n{}",
                    show_log(&log)
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        S3Server { port, env, log, child: Mutex::new(Some(child)) }
    }

    /// One server for the whole test process, started on first use; its
    /// environment is set in the process (AWS_*), so clients that read
    /// the standard environment reach it.
    pub fn shared() -> &'static S3Server {
        static SHARED: OnceLock<S3Server> = OnceLock::new();
        SHARED.get_or_init(|| {
            let s = S3Server::start();
            for (k, v) in &s.env {
                // Set once, before any test of this process uses the variables.
                std::env::set_var(k, v);
            }
            s
        })
    }

    /// `s3://ckpt-test/<prefix>`.
    pub fn url(&self, prefix: &str) -> String {
        format!("s3://{BUCKET}/{prefix}")
    }

    /// Stops the server (SIGKILL) and reaps it.
    pub fn kill(&self) {
        if let Some(mut c) = self.child.lock().expect("server lock").take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        self.kill();
    }
}
