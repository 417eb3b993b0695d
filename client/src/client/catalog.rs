//! What the sidecar holds: the committed steps, a rollback to one of them,
//! and its status report. Each is one round trip.

use ckpt_wire::{Reply, Request, StatusReport};

use super::requests::unexpected;
use super::Client;
use crate::error::Result;

impl Client {
    /// Committed steps, oldest first, and the latest one.
    pub fn list(&self) -> Result<(Vec<u64>, Option<u64>)> {
        match self.call("List", |id| Request::List { id })? {
            Reply::Listing { steps, latest, .. } => Ok((steps, latest)),
            other => Err(unexpected("List", other)),
        }
    }

    /// Makes the committed checkpoint `step` the newest again: the sidecar
    /// moves `latest` to it, then un-commits every later step (crash-safe),
    /// after the saves sent before this call. Returns the steps removed,
    /// newest first. Later steps can then be saved again.
    pub fn rollback(&self, step: u64) -> Result<Vec<u64>> {
        match self.call("Rollback", |id| Request::Rollback { id, step })? {
            Reply::RolledBack { removed, .. } => Ok(removed),
            other => Err(unexpected("Rollback", other)),
        }
    }

    /// The sidecar's status report.
    pub fn status(&self) -> Result<StatusReport> {
        match self.call("Status", |id| Request::Status { id })? {
            Reply::Status { report, .. } => Ok(report),
            other => Err(unexpected("Status", other)),
        }
    }
}
