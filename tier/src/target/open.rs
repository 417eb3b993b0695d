//! Opening a target from its URL: `file:///dir` (a folder that must exist:
//! a missing one is refused, as an unmounted shared file system looks
//! exactly like it; only [`Target::open_creating`] makes it) or
//! `s3://bucket/prefix` (credentials from the environment), the one
//! process-wide crypto provider, the retry policy, and one probe request
//! so that a wrong credential or a missing bucket is one clear error here.
//!
//! Invariant: the URL kept and shown ([`shown_url`]) never holds user
//! info or a query, where a secret could be.

use std::path::PathBuf;
use std::sync::{Arc, Once};

use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::local::LocalFileSystem;
use object_store::path::Path;
use object_store::{BackoffConfig, ClientConfigKey, ObjectStore, RetryConfig};

use super::{Backend, Inner, Target, TargetOptions};
use crate::config::*;
use crate::error::TierError;
use crate::limiter::TokenBucket;

/// The URL to show: scheme, host and path only.
fn shown_url(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut u) => {
            let _ = u.set_username("");
            let _ = u.set_password(None);
            u.set_query(None);
            u.set_fragment(None);
            u.to_string().trim_end_matches('/').to_string()
        }
        // Unparsable: show up to an '@' or '?', which could start a secret.
        Err(_) => url.split(['@', '?']).next().unwrap_or("").to_string(),
    }
}

fn retry(max_retries: usize, timeout: std::time::Duration) -> RetryConfig {
    RetryConfig {
        backoff: BackoffConfig {
            init_backoff: RETRY_BACKOFF_INIT,
            max_backoff: RETRY_BACKOFF_MAX,
            base: RETRY_BACKOFF_BASE,
        },
        max_retries,
        retry_timeout: timeout,
    }
}

/// rustls needs one crypto provider per process: ring (object_store's
/// `aws-lc-rs` would build aws-lc-sys with cmake).
fn install_crypto_provider() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // Err: the process installed one already, which serves as well.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

impl Target {
    /// file:///abs/path (an existing folder) or s3://bucket/prefix.
    /// Credentials from the standard environment (AWS_*, incl.
    /// AWS_ENDPOINT_URL and AWS_ALLOW_HTTP); never logged or put in an
    /// error. Makes one cheap authenticated request (a listing of the
    /// prefix) so that a wrong credential, a missing bucket or an
    /// unreachable endpoint is one clear error naming the URL, here.
    pub fn open(url: &str, opts: TargetOptions) -> Result<Target, TierError> {
        Self::open_with(url, opts, false)
    }

    /// As [`Target::open`], a missing file:// folder created first (a
    /// benchmark's own scratch folder under a target that exists).
    pub fn open_creating(url: &str, opts: TargetOptions) -> Result<Target, TierError> {
        Self::open_with(url, opts, true)
    }

    fn open_with(url: &str, opts: TargetOptions, create: bool) -> Result<Target, TierError> {
        install_crypto_provider();
        let shown = shown_url(url);
        let bad = |reason: String| TierError::BadUrl { url: shown.clone(), reason };
        let parsed = url::Url::parse(url).map_err(|e| bad(format!("not a URL ({e})")))?;
        if !parsed.username().is_empty() || parsed.password().is_some() || parsed.query().is_some() {
            return Err(bad("credentials or options in the URL are not accepted: use the environment (AWS_*)".into()));
        }
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(RUNTIME_WORKER_THREADS)
            .thread_name("ckpt-tier")
            .enable_all()
            .build()
            .map_err(|e| TierError::TargetIo {
                url: shown.clone(),
                op: "start runtime",
                path: PathBuf::new(),
                source: e,
            })?;
        let (store, probe, backend, prefix): (Arc<dyn ObjectStore>, Arc<dyn ObjectStore>, Backend, Path) = match parsed
            .scheme()
        {
            "file" => {
                if parsed.host_str().is_some_and(|h| !h.is_empty() && h != "localhost") {
                    return Err(bad("file:// takes an absolute path (file:///dir), no host".into()));
                }
                let root =
                    parsed.to_file_path().map_err(|_| bad("file:// takes an absolute path (file:///dir)".into()))?;
                if create {
                    std::fs::create_dir_all(&root).map_err(|e| TierError::TargetIo {
                        url: shown.clone(),
                        op: "create directory",
                        path: root.clone(),
                        source: e,
                    })?;
                }
                if !root.is_dir() {
                    return Err(TierError::NoSuchDir { url: shown.clone(), path: root });
                }
                let fs = LocalFileSystem::new_with_prefix(&root)
                    .map_err(|e| TierError::Open {
                        url: shown.clone(),
                        what: format!("directory {}", root.display()),
                        source: Box::new(e),
                    })?
                    .with_fsync(true);
                let fs: Arc<dyn ObjectStore> = Arc::new(fs);
                (fs.clone(), fs, Backend::Local { root }, Path::default())
            }
            "s3" => {
                let bucket = parsed
                    .host_str()
                    .filter(|b| !b.is_empty())
                    .ok_or_else(|| bad("s3:// needs a bucket (s3://bucket/prefix)".into()))?;
                let prefix = parsed.path().trim_matches('/');
                let prefix = Path::parse(prefix).map_err(|e| bad(format!("bad prefix {prefix:?}: {e}")))?;
                let build = |r: RetryConfig| {
                    AmazonS3Builder::from_env()
                        .with_url(format!("s3://{bucket}"))
                        .with_retry(r)
                        .with_config(
                            AmazonS3ConfigKey::Client(ClientConfigKey::ConnectTimeout),
                            format!("{}ms", CONNECT_TIMEOUT.as_millis()),
                        )
                        .build()
                        .map_err(|e| TierError::Open {
                            url: shown.clone(),
                            what: "S3 configuration from the environment".into(),
                            source: Box::new(e),
                        })
                };
                let s3 = Arc::new(build(retry(RETRY_MAX, RETRY_TIMEOUT))?);
                let probe: Arc<dyn ObjectStore> = Arc::new(build(retry(OPEN_RETRY_MAX, OPEN_RETRY_TIMEOUT))?);
                (s3.clone(), probe, Backend::S3 { s3 }, prefix)
            }
            "gs" | "az" | "azure" | "abfs" | "abfss" => {
                return Err(bad(format!("{}:// is not built in (this build has file:// and s3://)", parsed.scheme())));
            }
            other => return Err(bad(format!("{other}:// is not supported (file:///dir, s3://bucket/prefix)"))),
        };
        let prefix_opt = (prefix.parts_count() > 0).then_some(&prefix);
        rt.block_on(probe.list_with_delimiter(prefix_opt)).map_err(|e| TierError::Open {
            url: shown.clone(),
            what: "listing it with the credentials of the environment".into(),
            source: Box::new(e),
        })?;
        let parallel = opts.parallel.clamp(1, MAX_PARALLEL);
        let part_size = opts.part_size_bytes.max(MIN_PART_SIZE_BYTES);
        let limiter = opts.bandwidth_bytes_per_s.map(|r| Arc::new(TokenBucket::new(r)));
        Ok(Target { inner: Arc::new(Inner { url: shown, rt, store, backend, prefix, parallel, part_size, limiter }) })
    }
}
