//! The checked-in C header must be exactly what cbindgen makes of src/ffi/.
//! Set CKPT_REGENERATE_HEADER=1 to rewrite include/ckpt.h instead.

use std::path::Path;

/// The C ABI's files, in the order their items appear in the header
/// (cbindgen keeps the order it reads them in).
const FFI_FILES: [&str; 13] = [
    "src/ffi/codes.rs",
    "src/ffi/types.rs",
    "src/ffi/version.rs",
    "src/ffi/errors.rs",
    "src/ffi/args.rs",
    "src/ffi/connection.rs",
    "src/ffi/regions.rs",
    "src/ffi/save.rs",
    "src/ffi/load.rs",
    "src/ffi/catalog.rs",
    "src/ffi/process.rs",
    "src/ffi/cuda.rs",
    "src/ffi/pykey.rs",
];

#[test]
fn checked_in_header_matches_the_code() {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(crate_dir.join("cbindgen.toml")).expect("cbindgen.toml");
    let bindings = FFI_FILES
        .iter()
        .fold(cbindgen::Builder::new().with_config(config), |b, f| b.with_src(crate_dir.join(f)))
        .generate()
        .expect("cbindgen failed on src/ffi/");
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
            "shim-c/include/ckpt.h drifted from src/ffi/ (first difference at line {}):\n  checked in: {:?}\n  generated:  {:?}\nRegenerate: CKPT_REGENERATE_HEADER=1 cargo test -p ckpt-shim --test it header::",
            first + 1,
            checked_in.lines().nth(first),
            generated.lines().nth(first)
        );
    }
    // Every exported function is declared (a cheap second check, independent of cbindgen).
    let ffi: String = FFI_FILES.iter().map(|f| std::fs::read_to_string(crate_dir.join(f)).unwrap()).collect();
    for line in ffi.lines().filter(|l| l.contains("extern \"C\" fn ckpt_")) {
        let name = line.split("fn ").nth(1).unwrap().split('(').next().unwrap();
        assert!(generated.contains(&format!("{name}(")), "{name} missing from the header");
    }
}

#[test]
fn every_file_of_the_c_abi_is_read_for_the_header() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/ffi");
    for entry in std::fs::read_dir(&dir).expect("src/ffi") {
        let name = entry.expect("src/ffi entry").file_name().into_string().expect("utf-8 file name");
        if name.ends_with(".rs") && name != "mod.rs" {
            let path = format!("src/ffi/{name}");
            assert!(
                FFI_FILES.contains(&path.as_str()),
                "{path} is missing from FFI_FILES: its items would not reach the header"
            );
        }
    }
}
