//! The commit stage: the committer thread ([`committer`], the one owner of
//! the Store) takes what the saves hand it ([`jobs`]), gathers the ranks of
//! one node ([`rank_groups`]), writes several nodes' parts and commits them
//! as their coordinator ([`nodes`], [`slices`]), and decides when an
//! incremental save is written in full ([`full_every`]).

pub mod committer;
pub mod full_every;
pub mod nodes;
pub mod rank_groups;
pub mod slices;
