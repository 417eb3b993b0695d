//! The checked-in C header must be exactly what cbindgen makes of src/ffi.rs.
//! Set CKPT_REGENERATE_HEADER=1 to rewrite include/ckpt.h instead.

use std::path::Path;

#[test]
fn checked_in_header_matches_the_code() {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(crate_dir.join("cbindgen.toml")).expect("cbindgen.toml");
    let bindings = cbindgen::Builder::new()
        .with_config(config)
        .with_src(crate_dir.join("src/ffi.rs"))
        .with_src(crate_dir.join("src/ffi_cuda.rs"))
        .generate()
        .expect("cbindgen failed on src/ffi.rs + src/ffi_cuda.rs");
    let mut generated = Vec::new();
    bindings.write(&mut generated);
    let generated = String::from_utf8(generated).expect("utf-8 header");
    let path = crate_dir.join("include/ckpt.h");
    if std::env::var_os("CKPT_REGENERATE_HEADER").is_some_and(|v| v == "1") {
        std::fs::write(&path, &generated).expect("write include/ckpt.h");
        return;
    }
    let checked_in = std::fs::read_to_string(&path).unwrap_or_default();
    if checked_in != generated {
        let first = checked_in
            .lines()
            .zip(generated.lines())
            .position(|(a, b)| a != b)
            .unwrap_or(checked_in.lines().count().min(generated.lines().count()));
        panic!(
            "shim-c/include/ckpt.h drifted from src/ffi.rs (first difference at line {}):\n  checked in: {:?}\n  generated:  {:?}\nRegenerate: CKPT_REGENERATE_HEADER=1 cargo test -p ckpt-shim --test it header::",
            first + 1,
            checked_in.lines().nth(first),
            generated.lines().nth(first)
        );
    }
    // Every exported function is declared (a cheap second check, independent of cbindgen).
    let ffi = std::fs::read_to_string(crate_dir.join("src/ffi.rs")).unwrap()
        + &std::fs::read_to_string(crate_dir.join("src/ffi_cuda.rs")).unwrap();
    for line in ffi.lines().filter(|l| l.contains("extern \"C\" fn ckpt_")) {
        let name = line.split("fn ").nth(1).unwrap().split('(').next().unwrap();
        assert!(generated.contains(&format!("{name}(")), "{name} missing from the header");
    }
}
