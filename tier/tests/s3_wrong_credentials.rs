//! Wrong credentials are one clear error at open, naming the URL and no
//! secret. Its own test binary: it changes the process's AWS_* variables.

use ckpt_test_support::s3::S3Server;
use ckpt_tier::{Target, TargetOptions};

#[test]
fn s3_wrong_credentials_fail_at_open() {
    let server = S3Server::start();
    for (k, v) in &server.env {
        std::env::set_var(k, v);
    }
    let url = server.url("creds");
    // The right ones work.
    Target::open(&url, TargetOptions::default()).unwrap();

    let wrong_secret = "wrong-secret-0123456789";
    std::env::set_var("AWS_SECRET_ACCESS_KEY", wrong_secret);
    let e = Target::open(&url, TargetOptions::default()).unwrap_err().to_string();
    assert!(e.contains(&url) && e.contains("cannot open"), "{e}");
    assert!(!e.contains(wrong_secret), "the secret is in the error: {e}");

    std::env::set_var("AWS_ACCESS_KEY_ID", "AKIANOSUCHKEY0000000");
    let e = Target::open(&url, TargetOptions::default()).unwrap_err().to_string();
    assert!(e.contains(&url) && e.contains("cannot open"), "{e}");

    // An endpoint nobody listens on: an error at open too, after bounded retries.
    server.kill();
    let e = Target::open(&url, TargetOptions::default()).unwrap_err().to_string();
    assert!(e.contains(&url) && e.contains("cannot open"), "{e}");
}
