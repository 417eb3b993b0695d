//! The save stage: a Save checked, planned and copied into staging
//! ([`snapshot`]), its plan kept for the next Save of the same tensors
//! ([`plan_cache`]), tensors the trainer proves unchanged taken from the
//! resident image ([`trusted_unchanged`]), and whole files at a client's
//! path for the torch.save hook ([`file_save`], [`torch_zip`]).

pub mod file_save;
pub mod plan_cache;
pub mod snapshot;
pub mod torch_zip;
pub mod trusted_unchanged;
