//! Wrong credentials are one clear error at open, naming the URL and no
//! secret. The check changes the process's AWS_* variables, which the other
//! S3 tests of this binary read, so it runs in a process of its own: this
//! test binary again, running only this test, with [`IN_CHILD`] set.

use std::process::Command;

use ckpt_test_support::s3::S3Server;
use ckpt_tier::{Target, TargetOptions};

/// Set in the child that runs the check; the parent only spawns it.
const IN_CHILD: &str = "CKPT_TIER_TEST_WRONG_CREDENTIALS_CHILD";

#[test]
fn s3_wrong_credentials_fail_at_open() {
    if std::env::var_os(IN_CHILD).is_some() {
        wrong_credentials_fail_at_open();
        return;
    }
    // The test's name in this binary: the module path without the crate.
    let (_, module) = module_path!().split_once("::").expect("a module of the test binary");
    let name = format!("{module}::s3_wrong_credentials_fail_at_open");
    let out = Command::new(std::env::current_exe().expect("the test binary's path"))
        .args([name.as_str(), "--exact", "--nocapture", "--test-threads", "1"])
        .env(IN_CHILD, "1")
        .output()
        .expect("run the test binary again");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(
        out.status.success(),
        "the check failed in its child:
{stdout}
{stderr}"
    );
    // A filter that matched nothing passes too: the child must have run it.
    assert!(
        stdout.contains("1 passed"),
        "the child ran no test named {name}:
{stdout}
{stderr}"
    );
}

fn wrong_credentials_fail_at_open() {
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
