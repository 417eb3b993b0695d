//! `ls`, `inspect` and `verify` of a drain target (file://, s3://): the
//! steps of a real checkpoint written by `bench write`, uploaded with
//! ckpt-tier, then read back by the command line; damage on the target is
//! named and exits 3 as the local verify does.

use std::path::Path;
use std::process::{Command, Output};

use ckpt_store::format;
use ckpt_test_support::s3::S3Server;
use ckpt_test_support::sidecar_bin;
use ckpt_tier::{local_files, Target, TargetOptions};

fn p(dir: &Path) -> &str {
    dir.to_str().unwrap()
}

fn run(args: &[&str], env: &[(String, String)]) -> Output {
    Command::new(sidecar_bin()).args(args).envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str()))).output().unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Steps 1 and 2 (several shards each) written locally, uploaded to `t`.
fn local_steps_uploaded(local: &Path, t: &Target) {
    for step in [1u64, 2] {
        let o = run(
            &[
                "bench",
                "write",
                "--dir",
                p(local),
                "--size",
                "8MiB",
                "--shard-size",
                "3MiB",
                "--step",
                &step.to_string(),
            ],
            &[],
        );
        assert!(o.status.success(), "{}", text(&o));
        let index = ckpt_store::restore::read_index(local, step).unwrap();
        let index_json =
            std::fs::read(local.join(format::step_dir_name(step).unwrap()).join(format::INDEX_FILE_NAME)).unwrap();
        t.upload_step(step, &local_files(local, &index), &index_json).unwrap();
    }
}

/// The largest shard of a step, by the index (its middle is tensor data).
fn a_shard(t: &Target, step: u64) -> (String, u64) {
    let index = format::Index::from_json_bytes(&t.get_index(step).unwrap()).unwrap();
    let f = index.ckpt.files.iter().max_by_key(|f| f.len_bytes).unwrap();
    (f.name.clone(), f.len_bytes)
}

/// ls, inspect and verify of `url`, whose steps 1 and 2 are on the target.
fn ls_inspect_verify_ok(url: &str, env: &[(String, String)]) {
    let o = run(&["ls", url], env);
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.lines().any(|l| l.trim_start().starts_with("1 "))
            && out.lines().any(|l| l.trim_start().starts_with("2 ") && l.ends_with('*')),
        "{}",
        text(&o)
    );

    let o = run(&["ls", url, "--json"], env);
    assert!(o.status.success(), "{}", text(&o));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(j["latest"], 2, "{j}");
    let steps: Vec<u64> = j["checkpoints"].as_array().unwrap().iter().map(|c| c["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, vec![1, 2], "{j}");

    let o = run(&["inspect", url, "--step", "1"], env);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stdout).starts_with(&format!("step 1 in {url}/step-000000000001: ")),
        "{}",
        text(&o)
    );

    let o = run(&["verify", url], env);
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("step 1: ok") && out.contains("step 2: ok"), "{}", text(&o));
}

#[test]
fn remote_cli_file_url_ls_inspect_verify_and_damage() {
    let (local, remote) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let url = format!("file://{}", p(remote.path()));
    let t = Target::open(&url, TargetOptions::default()).unwrap();
    local_steps_uploaded(local.path(), &t);
    ls_inspect_verify_ok(&url, &[]);

    // A flipped byte in the middle of a shard of step 2.
    let (name, len) = a_shard(&t, 2);
    let path = remote.path().join("step-000000000002").join(&name);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[(len / 2) as usize] ^= 0x40;
    std::fs::write(&path, &bytes).unwrap();
    let o = run(&["verify", &url], &[]);
    assert_eq!(o.status.code(), Some(3), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("step 1: ok") && out.contains("step 2: DAMAGED") && out.contains(&name), "{}", text(&o));
    // The same directory as a path: the local verify agrees.
    let o = run(&["verify", p(remote.path()), "--step", "2"], &[]);
    assert_eq!(o.status.code(), Some(3), "{}", text(&o));

    // A damaged remote index is named.
    let index_path = remote.path().join("step-000000000001").join(format::INDEX_FILE_NAME);
    let mut bytes = std::fs::read(&index_path).unwrap();
    let at = bytes.iter().position(|&b| b == b'"').unwrap() + 1;
    bytes[at] ^= 0x01;
    std::fs::write(&index_path, &bytes).unwrap();
    let o = run(&["verify", &url, "--step", "1", "--json"], &[]);
    assert_eq!(o.status.code(), Some(3), "{}", text(&o));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(j["ok"], false);
    assert_eq!(j["checkpoints"][0]["problems"][0]["file"], format::INDEX_FILE_NAME, "{j}");

    // A missing directory is an error, not an empty target.
    let o = run(&["ls", "file:///nonexistent/ckpt-drain"], &[]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stderr).contains("no such directory"), "{}", text(&o));
}

#[test]
fn remote_cli_s3_ls_inspect_verify_and_flipped_byte() {
    let server = S3Server::shared();
    let url = server.url("cli-run1");
    let local = tempfile::tempdir().unwrap();
    let t = Target::open(&url, TargetOptions::default()).unwrap();
    local_steps_uploaded(local.path(), &t);
    ls_inspect_verify_ok(&url, &server.env);

    // A flipped byte in a shard of step 2, put back over the object.
    let (name, len) = a_shard(&t, 2);
    let mut bytes = vec![0u8; len as usize];
    t.read_range(2, &name, 0, &mut bytes).unwrap();
    bytes[(len / 2) as usize] ^= 0x40;
    let flipped = local.path().join("flipped");
    std::fs::write(&flipped, &bytes).unwrap();
    let f = ckpt_tier::LocalFile { local_path: flipped, name: name.clone(), len, crc32c: crc32c::crc32c(&bytes) };
    t.upload_files(2, &[f]).unwrap();
    let o = run(&["verify", &url, "--step", "2"], &server.env);
    assert_eq!(o.status.code(), Some(3), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("step 2: DAMAGED") && out.contains(&name) && out.contains("checksum mismatch"),
        "{}",
        text(&o)
    );
}

#[test]
fn remote_cli_s3_wrong_credentials_are_one_error_naming_the_url() {
    let server = S3Server::shared();
    let url = server.url("cli-creds");
    let mut env = server.env.clone();
    let wrong = "wrong-secret-for-the-cli-test";
    env.retain(|(k, _)| k != "AWS_SECRET_ACCESS_KEY");
    env.push(("AWS_SECRET_ACCESS_KEY".into(), wrong.into()));
    let o = run(&["ls", &url], &env);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(err.trim_end().lines().count(), 1, "{}", text(&o));
    assert!(err.contains(&url) && err.contains("cannot open") && !err.contains(wrong), "{}", text(&o));
}
