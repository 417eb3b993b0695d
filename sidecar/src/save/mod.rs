//! The save stage: a Save admitted, planned and copied into staging, then
//! queued for the committer ([`snapshot`], the flow), in steps of their
//! own: its checks ([`checks`]), its plan ([`plan`]), the copies
//! ([`copy`]) on threads kept for them ([`helpers`]), the checksums of the staged image ([`checksums`]), the copy
//! that feeds the writer as it runs ([`fed`]), and the refusals they end
//! in ([`error`]). Beside them: a plan kept for the next Save of the same
//! tensors ([`plan_cache`]), tensors the trainer proves unchanged taken
//! from the resident image ([`trusted_unchanged`]), and whole files at a
//! client's path for the torch.save hook ([`file_save`], [`torch_zip`]).

pub mod checks;
pub mod checksums;
pub mod copy;
pub mod error;
pub mod fed;
pub mod file_save;
pub mod helpers;
pub mod pieces;
pub mod plan;
pub mod plan_cache;
pub mod snapshot;
pub mod torch_zip;
pub mod trusted_unchanged;
