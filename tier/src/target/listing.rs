//! What the target holds: its step folders (committed when they hold an
//! index), the committed steps, and the step `latest` names.

use ckpt_store::format::{self, INDEX_FILE_NAME};
use futures::{StreamExt, TryStreamExt};
use object_store::ObjectStoreExt;

use super::Inner;
use crate::error::TierError;

impl Inner {
    pub(super) async fn latest_object(&self) -> Result<Option<u64>, TierError> {
        let p = self.latest_path();
        match self.store.get(&p).await {
            Ok(r) => {
                let b = r.bytes().await.map_err(|e| self.store_err("get", &p, e))?;
                Ok(std::str::from_utf8(&b).ok().and_then(|s| format::parse_step_dir_name(s.trim())))
            }
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.store_err("get", &p, e)),
        }
    }

    pub(super) async fn has_index(&self, step: u64) -> Result<bool, TierError> {
        let p = self.step_path(step)?.join(INDEX_FILE_NAME);
        match self.store.head(&p).await {
            Ok(_) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(self.store_err("head", &p, e)),
        }
    }

    /// Every step folder, and whether it holds an index, ascending.
    pub(super) async fn step_folders(&self) -> Result<Vec<(u64, bool)>, TierError> {
        let list = self
            .store
            .list_with_delimiter(self.prefix_opt())
            .await
            .map_err(|e| self.store_err("list", &self.prefix, e))?;
        let steps: Vec<u64> =
            list.common_prefixes.iter().filter_map(|p| p.filename().and_then(format::parse_step_dir_name)).collect();
        let mut out: Vec<(u64, bool)> = futures::stream::iter(steps)
            .map(|s| async move { Ok::<_, TierError>((s, self.has_index(s).await?)) })
            .buffer_unordered(self.parallel)
            .try_collect()
            .await?;
        out.sort_unstable();
        Ok(out)
    }

    pub(super) async fn steps(&self) -> Result<Vec<u64>, TierError> {
        Ok(self.step_folders().await?.into_iter().filter(|&(_, c)| c).map(|(s, _)| s).collect())
    }
}
