//! Builds the fake driver `fake_cuda.c` into `libcuda.so.1` and leaves it in
//! `target/<profile>/fake-cuda/` (a folder of its own, so putting it on
//! LD_LIBRARY_PATH brings in nothing else). Test-only: nothing installs,
//! bundles or ships it.
use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=fake_cuda.c");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let lib = out.join("libcuda.so.1");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = Command::new(&cc)
        .args([
            "-shared",
            "-fPIC",
            "-O2",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-std=gnu11",
            "-Wl,-soname,libcuda.so.1",
            "-o",
        ])
        .arg(&lib)
        .arg("fake_cuda.c")
        .args(["-lpthread", "-lrt"])
        .status()
        .unwrap_or_else(|e| panic!("running {cc}: {e}"));
    assert!(status.success(), "{cc} failed to build the fake libcuda.so.1");
    // OUT_DIR is target/<profile>/build/<pkg>-<hash>/out.
    let profile_dir = out.ancestors().nth(3).expect("OUT_DIR under target/<profile>/build");
    let dir = profile_dir.join("fake-cuda");
    std::fs::create_dir_all(&dir).expect("creating target/<profile>/fake-cuda");
    let tmp = dir.join(".libcuda.so.1.tmp");
    std::fs::copy(&lib, &tmp).expect("copying the fake driver");
    std::fs::rename(&tmp, dir.join("libcuda.so.1")).expect("placing the fake driver");
    println!("cargo:rustc-env=CKPT_FAKE_CUDA_DIR={}", dir.display());
}
