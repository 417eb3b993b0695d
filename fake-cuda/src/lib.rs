//! The test-only fake CUDA driver: its build script compiles `fake_cuda.c`
//! into `target/<profile>/fake-cuda/libcuda.so.1`. This library only says
//! where that folder is, for tests that put it on `LD_LIBRARY_PATH` of the
//! processes they start.

use std::path::PathBuf;

/// The folder holding the fake `libcuda.so.1` of this build.
pub fn dir() -> PathBuf {
    PathBuf::from(env!("CKPT_FAKE_CUDA_DIR"))
}
