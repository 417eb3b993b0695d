//! Memory the daemon copies between: its own staging buffer ([`staging`],
//! allocated once, leased per save and load) and the clients' memory it
//! maps ([`regions`]: host shm segments and CUDA allocations).

pub mod cuda_probe;
pub mod regions;
pub mod staging;
