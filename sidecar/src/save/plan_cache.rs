//! A session's recently planned saves, reused when a Save describes the
//! same tensors again: a trainer saves the same state (same names, dtypes,
//! shapes, regions and offsets) again and again, and planning it (checks,
//! layout, headers) costs about as much per tensor as copying a small one.
//!
//! Invariants:
//! - a plan is reused only for descriptors equal to those it was made from,
//!   field for field, or for the very bytes of the encoded list they were
//!   decoded from (the same bytes decode to the same descriptors: a Save
//!   of a kept list is not decoded at all, [`SavePlans::kept_list`]), with
//!   the same layout options, while every region its
//!   sources read is still the session's registered region of that id (the
//!   same mapping), and, for incremental saves, a history that sorts its
//!   tensors into changed and stable ones as when it was planned (the
//!   stable shards depend on that alone: another state saved in between
//!   moves `LayoutOptions::history_gen` on without changing this state's
//!   sorting, and its plan still fits); every check of [`plan_save`] depends only on these, so
//!   a reused plan is one that would pass them again; blobs, which the plan
//!   does not cover, are checked at every save;
//! - the session drops its plans when it unregisters a region, so a plan
//!   never keeps a mapping alive after that ([`SavePlans::clear`]);
//! - at most [`config::SAVE_PLANS_KEPT`] plans and
//!   [`config::SAVE_PLAN_TENSORS_MAX`] descriptors are kept per session.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use ckpt_store::image::{Layout, LayoutOptions};
use ckpt_wire::{Blob, FrameError, SaveHead, TensorDescIn};

use crate::config;
use crate::memory::regions::Region;
use crate::save::checks::check_blobs;
use crate::save::error::SaveError;
use crate::save::plan::{plan_save, Planner, SaveTensors, Source};

/// One descriptor as a plan remembers it.
struct Kept {
    name: Box<str>,
    dtype: Box<str>,
    shape: Box<[u64]>,
    region_id: u32,
    offset_bytes: u64,
    len_bytes: u64,
}

impl Kept {
    fn of(d: &TensorDescIn<'_>) -> Kept {
        Kept {
            name: d.name.into(),
            dtype: d.dtype.into(),
            shape: d.shape.to_vec().into(),
            region_id: d.region_id,
            offset_bytes: d.offset_bytes,
            len_bytes: d.len_bytes,
        }
    }

    fn is(&self, d: &TensorDescIn<'_>) -> bool {
        self.offset_bytes == d.offset_bytes
            && self.len_bytes == d.len_bytes
            && self.region_id == d.region_id
            && *self.name == *d.name
            && *self.dtype == *d.dtype
            && *self.shape == *d.shape
    }
}

struct Plan {
    opts: LayoutOptions,
    descs: Vec<Kept>,
    /// The encoded list the descriptors were decoded from, when known: a
    /// Save whose frame holds these bytes is planned without decoding it.
    encoded: Option<Box<[u8]>>,
    /// The distinct regions the sources read, as registered when planned.
    regions: Vec<(u32, Arc<Region>)>,
    layout: Layout,
    sources: Vec<Source>,
    /// Incremental layouts: per tensor, whether it was laid out as changed
    /// at the previous save (volatile) rather than stable; empty otherwise.
    volatile: Vec<bool>,
}

/// Per spec, whether `changed` counts it as changed ([`Layout::plan_with`]'s sorting).
fn sorting(names: impl Iterator<Item = impl AsRef<str>>, changed: Option<&HashSet<String>>) -> Vec<bool> {
    names.map(|n| changed.is_some_and(|c| c.contains(n.as_ref()))).collect()
}

impl Plan {
    fn fits(
        &self,
        tensors: &[TensorDescIn<'_>],
        regions: &HashMap<u32, Arc<Region>>,
        opts: LayoutOptions,
        changed: Option<&HashSet<String>>,
    ) -> bool {
        self.descs.len() == tensors.len()
            && self.descs.iter().zip(tensors).all(|(k, d)| k.is(d))
            && self.fits_regions(regions, opts, changed)
    }

    /// Same options and regions, and a history that sorts this plan's
    /// tensors as it did (checked tensor by tensor only when the history
    /// moved on since this plan was last used).
    fn fits_regions(
        &self,
        regions: &HashMap<u32, Arc<Region>>,
        opts: LayoutOptions,
        changed: Option<&HashSet<String>>,
    ) -> bool {
        LayoutOptions { history_gen: opts.history_gen, ..self.opts } == opts
            && (self.opts.history_gen == opts.history_gen
                || !opts.incremental
                || self
                    .descs
                    .iter()
                    .zip(&self.volatile)
                    .all(|(k, &v)| changed.is_some_and(|c| c.contains(&*k.name)) == v))
            && self.regions.iter().all(|(id, r)| regions.get(id).is_some_and(|now| Arc::ptr_eq(now, r)))
    }
}

/// The plans of one session, most recently used last.
#[derive(Default)]
pub struct SavePlans {
    plans: Vec<Plan>,
    /// Saves planned from scratch (not reused), for the tests.
    fresh: u64,
}

impl Planner for SavePlans {
    /// The image and sources of a Save of `tensors`: a kept plan when one
    /// was made from the same descriptors (or the same encoded list), else
    /// [`plan_save`]'s (kept for the next save).
    fn plan(
        &mut self,
        tensors: SaveTensors<'_>,
        blobs: &[Blob],
        regions: &HashMap<u32, Arc<Region>>,
        opts: LayoutOptions,
        changed: Option<&HashSet<String>>,
    ) -> Result<(Layout, Vec<Source>), SaveError> {
        let (tensors, encoded) = match tensors {
            SaveTensors::Kept(list) => {
                if let Some(i) = self
                    .plans
                    .iter()
                    .rposition(|p| p.encoded.as_deref() == Some(list) && p.fits_regions(regions, opts, changed))
                {
                    return self.reuse(i, blobs, opts);
                }
                // Its plan no longer fits (a region registered anew): the
                // list decoded after all, and planned as any other.
                let (tensors, _) = ckpt_wire::decode_tensors(list).map_err(|e| SaveError::BadRequest(e.to_string()))?;
                return self.plan_decoded(&tensors, Some(list), blobs, regions, opts, changed);
            }
            SaveTensors::Decoded { tensors, encoded } => (tensors, encoded),
        };
        self.plan_decoded(tensors, encoded, blobs, regions, opts, changed)
    }
}

impl SavePlans {
    /// Forgets every plan (a region was unregistered: no plan may keep its mapping).
    pub fn clear(&mut self) {
        self.plans.clear();
    }

    /// When `head`'s tensor list is, byte for byte, the encoded list of a
    /// kept plan: that list (the frame's bytes, for [`SaveTensors::Kept`])
    /// and the rest of the Save read after it, the list not decoded.
    #[allow(clippy::type_complexity)]
    pub fn kept_list<'a>(
        &self,
        head: &SaveHead<'a>,
    ) -> Option<(&'a [u8], Result<(Vec<Blob>, bool, Option<ckpt_wire::Unchanged>), FrameError>)> {
        self.plans.iter().rev().filter_map(|p| p.encoded.as_deref()).find_map(|list| head.rest_after(list))
    }

    /// Plan `i` reused (most recently used last), now under `opts`' history.
    fn reuse(&mut self, i: usize, blobs: &[Blob], opts: LayoutOptions) -> Result<(Layout, Vec<Source>), SaveError> {
        check_blobs(blobs)?;
        let mut p = self.plans.remove(i);
        p.opts.history_gen = opts.history_gen;
        let out = (p.layout.clone(), p.sources.clone());
        self.plans.push(p);
        Ok(out)
    }

    fn plan_decoded(
        &mut self,
        tensors: &[TensorDescIn<'_>],
        encoded: Option<&[u8]>,
        blobs: &[Blob],
        regions: &HashMap<u32, Arc<Region>>,
        opts: LayoutOptions,
        changed: Option<&HashSet<String>>,
    ) -> Result<(Layout, Vec<Source>), SaveError> {
        if let Some(i) = self.plans.iter().position(|p| p.fits(tensors, regions, opts, changed)) {
            if self.plans[i].encoded.is_none() {
                self.plans[i].encoded = encoded.map(Box::from);
            }
            return self.reuse(i, blobs, opts);
        }
        let (layout, sources) = plan_save(tensors, blobs, regions, opts, changed)?;
        self.fresh += 1;
        if tensors.len() <= config::SAVE_PLAN_TENSORS_MAX {
            let mut used: Vec<(u32, Arc<Region>)> = Vec::new();
            for (d, s) in tensors.iter().zip(sources.iter()) {
                if let Some(r) = &s.region {
                    if !used.iter().any(|(id, _)| *id == d.region_id) {
                        used.push((d.region_id, r.clone()));
                    }
                }
            }
            let descs = tensors.iter().map(Kept::of).collect();
            self.plans.push(Plan {
                opts,
                descs,
                encoded: encoded.map(Box::from),
                regions: used,
                layout: layout.clone(),
                sources: sources.clone(),
                volatile: if opts.incremental { sorting(tensors.iter().map(|d| d.name), changed) } else { Vec::new() },
            });
            let mut kept: usize = self.plans.iter().map(|p| p.descs.len()).sum();
            while self.plans.len() > config::SAVE_PLANS_KEPT || kept > config::SAVE_PLAN_TENSORS_MAX {
                kept -= self.plans.remove(0).descs.len();
            }
        }
        Ok((layout, sources))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::regions::{test_segment, unlink_segment};

    fn d(name: &str, region_id: u32, off: u64, len: u64) -> TensorDescIn<'_> {
        TensorDescIn {
            name,
            dtype: "U8",
            shape: ckpt_wire::Dims::from_slice(&[len]),
            region_id,
            offset_bytes: off,
            len_bytes: len,
        }
    }

    fn decoded<'a>(tensors: &'a [TensorDescIn<'a>]) -> SaveTensors<'a> {
        SaveTensors::Decoded { tensors, encoded: None }
    }

    fn region(id: u32) -> Arc<Region> {
        let (name, _fd) = test_segment(1 << 16, |i| i as u8);
        // SAFETY: getuid has no preconditions.
        let r = Region::open_shm(id, &name, 1 << 16, unsafe { libc::getuid() }, false).unwrap();
        unlink_segment(&name);
        Arc::new(r)
    }

    #[test]
    fn a_plan_is_reused_only_for_the_same_descriptors_and_regions() {
        let mut regions = HashMap::from([(1, region(1)), (2, region(2))]);
        let mut plans = SavePlans::default();
        let ts = [d("a", 1, 0, 64), d("b", 2, 64, 8)];
        let opts = LayoutOptions::default();
        let (l1, _) = plans.plan(decoded(&ts), &[], &regions, opts, None).unwrap();
        let (l2, s2) = plans.plan(decoded(&ts), &[], &regions, opts, None).unwrap();
        assert_eq!(plans.fresh, 1, "the same descriptors reuse the plan");
        assert_eq!(l1.shards[0].header, l2.shards[0].header);
        assert!(Arc::ptr_eq(s2[0].region.as_ref().unwrap(), &regions[&1]) && s2[1].offset_bytes == 64);
        // Any field changed: planned anew (and checked anew).
        for other in [
            [d("a", 1, 0, 64), d("c", 2, 64, 8)],
            [d("a", 1, 8, 64), d("b", 2, 64, 8)],
            [d("a", 1, 0, 64), d("b", 1, 64, 8)],
        ] {
            let fresh = plans.fresh;
            plans.plan(decoded(&other), &[], &regions, opts, None).unwrap();
            assert_eq!(plans.fresh, fresh + 1);
        }
        assert!(matches!(
            plans.plan(decoded(&[d("a", 1, 0, 64), d("b", 1, 32, 8)]), &[], &regions, opts, None),
            Err(SaveError::BadRequest(_))
        ));
        // Other layout options: planned anew.
        let fresh = plans.fresh;
        plans.plan(decoded(&ts), &[], &regions, LayoutOptions { rank: 1, world_size: 2, ..opts }, None).unwrap();
        assert_eq!(plans.fresh, fresh + 1);
        // Bad blobs are refused even when the plan is reused.
        let bad = Blob { name: "../x".into(), bytes: vec![1] };
        assert!(matches!(plans.plan(decoded(&ts), &[bad], &regions, opts, None), Err(SaveError::BadRequest(_))));
        // A region registered anew under the same id: planned anew, reading the new one.
        plans.plan(decoded(&ts), &[], &regions, opts, None).unwrap();
        let fresh = plans.fresh;
        regions.insert(2, region(2));
        let (_, after) = plans.plan(decoded(&ts), &[], &regions, opts, None).unwrap();
        assert_eq!(plans.fresh, fresh + 1);
        assert!(Arc::ptr_eq(after[1].region.as_ref().unwrap(), &regions[&2]));
        // A region gone: refused as before.
        regions.remove(&2);
        assert!(matches!(plans.plan(decoded(&ts), &[], &regions, opts, None), Err(SaveError::BadRegion(_))));
        plans.clear();
        assert!(plans.plans.is_empty());
    }

    #[test]
    fn a_save_whose_list_a_plan_was_made_from_is_planned_without_decoding_it_while_its_regions_stay() {
        let mut regions = HashMap::from([(1, region(1)), (2, region(2))]);
        let mut plans = SavePlans::default();
        let opts = LayoutOptions::default();
        let refs = |ts: &[(&'static str, u32, u64, u64)]| -> Vec<u8> {
            let shapes: Vec<[u64; 1]> = ts.iter().map(|t| [t.3]).collect();
            let descs: Vec<ckpt_wire::TensorDescRef> = ts
                .iter()
                .zip(&shapes)
                .map(|(t, shape)| ckpt_wire::TensorDescRef {
                    name: t.0,
                    dtype: "U8",
                    shape,
                    region_id: t.1,
                    offset_bytes: t.2,
                    len_bytes: t.3,
                })
                .collect();
            ckpt_wire::encode_tensors(&descs)
        };
        let frame = |list: &[u8], step| ckpt_wire::encode_save_with(step, step, None, list, &[], false, None);
        let list = refs(&[("a", 1, 0, 64), ("b", 2, 64, 8)]);
        let f1 = frame(&list, 1);
        let head = ckpt_wire::decode_save_head(&f1[4..]).unwrap().unwrap();
        assert!(plans.kept_list(&head).is_none(), "no plan yet");
        let rest = head.rest().unwrap();
        let (l1, _) = plans
            .plan(
                SaveTensors::Decoded { tensors: &rest.tensors, encoded: Some(rest.tensors_encoded) },
                &[],
                &regions,
                opts,
                None,
            )
            .unwrap();
        assert_eq!(plans.fresh, 1);
        // The same list in another save's frame: found, and its plan reused.
        let f2 = frame(&list, 300);
        let head = ckpt_wire::decode_save_head(&f2[4..]).unwrap().unwrap();
        let (found, rest) = plans.kept_list(&head).expect("the kept list");
        assert_eq!((found, rest.unwrap()), (&list[..], (vec![], false, None)));
        let (l2, s2) = plans.plan(SaveTensors::Kept(found), &[], &regions, opts, None).unwrap();
        assert_eq!(plans.fresh, 1, "reused");
        assert_eq!(l1.shards[0].header, l2.shards[0].header);
        assert!(Arc::ptr_eq(s2[1].region.as_ref().unwrap(), &regions[&2]) && s2[1].offset_bytes == 64);
        // Any descriptor changed: not found (decoded and planned as any other).
        for other in [
            [("a", 1, 0, 64), ("c", 2, 64, 8)],
            [("a", 1, 8, 64), ("b", 2, 64, 8)],
            [("a", 1, 0, 64), ("b", 1, 64, 8)],
            [("a", 1, 0, 64), ("b", 2, 64, 9)],
        ] {
            let f = frame(&refs(&other), 4);
            assert!(plans.kept_list(&ckpt_wire::decode_save_head(&f[4..]).unwrap().unwrap()).is_none());
        }
        // Region 2 registered anew under its id: the list is still found,
        // but planned anew from its descriptors, reading the new region.
        regions.insert(2, region(2));
        let (found, _) = plans.kept_list(&head).expect("the kept list");
        let (_, after) = plans.plan(SaveTensors::Kept(found), &[], &regions, opts, None).unwrap();
        assert_eq!(plans.fresh, 2);
        assert!(Arc::ptr_eq(after[1].region.as_ref().unwrap(), &regions[&2]));
        // Bad blobs are refused with a kept list too; a region gone: refused as before.
        let bad = Blob { name: "../x".into(), bytes: vec![1] };
        assert!(matches!(
            plans.plan(SaveTensors::Kept(found), &[bad], &regions, opts, None),
            Err(SaveError::BadRequest(_))
        ));
        regions.remove(&2);
        assert!(matches!(
            plans.plan(SaveTensors::Kept(found), &[], &regions, opts, None),
            Err(SaveError::BadRegion(_))
        ));
        plans.clear();
        assert!(plans.kept_list(&head).is_none());
    }

    #[test]
    fn alternating_states_reuse_their_plans_while_the_history_sorts_their_tensors_alike() {
        let regions = HashMap::from([(1, region(1))]);
        let mut plans = SavePlans::default();
        let (a, b) = ([d("a0", 1, 0, 64), d("a1", 1, 64, 64)], [d("b", 1, 256, 128)]);
        let opts = |history_gen| LayoutOptions { incremental: true, history_gen, ..LayoutOptions::default() };
        // Each commit of one state moves the history on (the other state's
        // tensors are new to it, so changed): neither's sorting changes.
        let after_a: HashSet<String> = ["a0", "a1"].map(String::from).into();
        let after_b: HashSet<String> = ["b".to_string()].into();
        plans.plan(decoded(&a), &[], &regions, opts(1), Some(&after_b)).unwrap();
        plans.plan(decoded(&b), &[], &regions, opts(2), Some(&after_a)).unwrap();
        for gen in 3..9 {
            let (ts, changed): (&[TensorDescIn<'_>], _) = if gen % 2 == 1 { (&a, &after_b) } else { (&b, &after_a) };
            plans.plan(decoded(ts), &[], &regions, opts(gen), Some(changed)).unwrap();
        }
        assert_eq!(plans.fresh, 2, "each state planned once");
        // A history that sorts a tensor of `a` the other way: planned anew,
        // with that tensor in a shard of the changed ones.
        let one: HashSet<String> = ["a1".to_string()].into();
        let (l, _) = plans.plan(decoded(&a), &[], &regions, opts(9), Some(&one)).unwrap();
        assert_eq!(plans.fresh, 3);
        let shard_of = |name: &str| &l.shards[l.places[l.specs.iter().position(|s| s.name == name).unwrap()].shard_idx];
        assert!(!shard_of("a1").stable && shard_of("a0").stable);
        // Not incremental: the history plays no part.
        plans.plan(decoded(&a), &[], &regions, LayoutOptions::default(), Some(&one)).unwrap();
        plans.plan(decoded(&a), &[], &regions, LayoutOptions { history_gen: 10, ..Default::default() }, None).unwrap();
        assert_eq!(plans.fresh, 4);
    }

    #[test]
    fn kept_plans_are_bounded() {
        let regions = HashMap::from([(1, region(1))]);
        let mut plans = SavePlans::default();
        let names: Vec<String> = (0..config::SAVE_PLANS_KEPT + 3).map(|i| format!("t{i}")).collect();
        for n in &names {
            plans.plan(decoded(&[d(n, 1, 0, 8)]), &[], &regions, LayoutOptions::default(), None).unwrap();
        }
        assert_eq!(plans.plans.len(), config::SAVE_PLANS_KEPT);
        assert_eq!(&*plans.plans.last().unwrap().descs[0].name, names.last().unwrap().as_str());
    }
}
