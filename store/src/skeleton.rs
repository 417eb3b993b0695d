//! The tensors a Python skeleton refers to (docs/format.md: the blob
//! `structure.pkl`, the pickled `(version, skeleton)` of `ckpt_sidecar`,
//! whose leaves name tensors of the checkpoint: `ckpt_sidecar._tree.TensorRef`s
//! in version 1, persistent ids holding a TensorRef's state in version 2).
//!
//! A checkpoint whose skeleton names a tensor it does not hold cannot be
//! loaded by the Python package (several ranks that saved different states
//! under one step make one: rank 0's skeleton names its own tensors, the
//! other ranks' parts hold theirs). The store reads the names without
//! running Python: [`referenced_tensors`] walks the pickle's opcodes on a
//! small stack machine that builds nothing but strings, tuples and the one
//! class it looks for, and [`missing_tensors`] compares them with the index.
//!
//! Invariant: this is a check that can only refuse what is certainly wrong.
//! A blob that is not such a pickle (another client's `structure.pkl`, an
//! opcode this walker does not know, a skeleton of a later version) gives
//! `None`: no check, never a refusal.

use std::collections::BTreeSet;
use std::rc::Rc;

use crate::format::Index;

/// The blob holding the Python package's skeleton.
pub const STRUCTURE_BLOB: &str = "structure.pkl";
/// Checkpoints written before format version 2 by several ranks map their
/// pieces in this blob; their skeleton names tensors stored only as pieces.
pub const PARTS_BLOB: &str = "parts.pkl";

const TENSOR_REF_MODULE: &str = "ckpt_sidecar._tree";
const TENSOR_REF_CLASS: &str = "TensorRef";
/// Bounds of the walk, so a hostile blob costs little.
const STACK_DEPTH_MAX: usize = 1 << 20;
const MEMO_LEN_MAX: usize = 1 << 22;

/// A value on the walk's stack. Shared, not owned: the memo and DUP copy
/// values, and a skeleton memoizes every string and state tuple (100k
/// tensors made ~400k deep copies, 40 % of a load from disk).
#[derive(Clone, Debug, PartialEq)]
enum V {
    Str(Rc<str>),
    Tuple(Rc<[V]>),
    Global(Rc<str>, Rc<str>),
    TensorRef,
    Other,
}

/// The tensor names the `TensorRef`s of a pickled skeleton carry, or None
/// when `pkl` is not a pickle this walker reads in full.
pub fn referenced_tensors(pkl: &[u8]) -> Option<BTreeSet<String>> {
    let mut r = Reader { b: pkl, at: 0 };
    let mut stack: Vec<V> = Vec::new();
    let mut marks: Vec<usize> = Vec::new();
    let mut memo = Memo::default();
    let mut names = BTreeSet::new();
    fn pop(stack: &mut Vec<V>) -> Option<V> {
        stack.pop()
    }
    fn pop_mark(stack: &mut Vec<V>, marks: &mut Vec<usize>) -> Option<Vec<V>> {
        let m = marks.pop()?;
        if m > stack.len() {
            return None;
        }
        Some(stack.split_off(m))
    }
    fn is_tensor_ref(cls: &V) -> bool {
        matches!(cls, V::Global(m, n) if &**m == TENSOR_REF_MODULE && &**n == TENSOR_REF_CLASS)
    }
    loop {
        if stack.len() > STACK_DEPTH_MAX || memo.len > MEMO_LEN_MAX {
            return None;
        }
        let op = r.u8()?;
        match op {
            0x80 => {
                r.take(1)?; // PROTO
            }
            0x95 => {
                r.take(8)?; // FRAME
            }
            b'.' => break, // STOP
            b'(' => marks.push(stack.len()),
            b'0' => {
                pop(&mut stack)?;
            }
            b'1' => {
                pop_mark(&mut stack, &mut marks)?;
            }
            b'2' => stack.push(stack.last()?.clone()),
            // Numbers, None, booleans.
            b'N' | 0x88 | 0x89 => stack.push(V::Other),
            b'K' => {
                r.take(1)?;
                stack.push(V::Other)
            }
            b'M' => {
                r.take(2)?;
                stack.push(V::Other)
            }
            b'J' => {
                r.take(4)?;
                stack.push(V::Other)
            }
            b'G' => {
                r.take(8)?;
                stack.push(V::Other)
            }
            0x8a => {
                let n = r.u8()? as usize;
                r.take(n)?;
                stack.push(V::Other)
            }
            0x8b => {
                let n = r.len(4)?;
                r.take(n)?;
                stack.push(V::Other)
            }
            b'I' | b'L' | b'F' => {
                r.line()?;
                stack.push(V::Other)
            }
            // Strings.
            0x8c => {
                let n = r.u8()? as usize;
                stack.push(V::Str(r.utf8(n)?.into()))
            }
            b'X' => {
                let n = r.len(4)?;
                stack.push(V::Str(r.utf8(n)?.into()))
            }
            0x8d => {
                let n = r.len(8)?;
                stack.push(V::Str(r.utf8(n)?.into()))
            }
            // Bytes and byte strings (never a tensor's name).
            b'C' | b'U' => {
                let n = r.u8()? as usize;
                r.take(n)?;
                stack.push(V::Other)
            }
            b'B' | b'T' => {
                let n = r.len(4)?;
                r.take(n)?;
                stack.push(V::Other)
            }
            0x8e | 0x96 => {
                let n = r.len(8)?;
                r.take(n)?;
                stack.push(V::Other)
            }
            b'S' | b'V' => {
                r.line()?;
                stack.push(V::Other)
            }
            0x98 => {} // READONLY_BUFFER
            // Containers: only tuples are kept (a TensorRef's state is one).
            b'}' | b']' | 0x8f => stack.push(V::Other),
            b')' => stack.push(V::Tuple(Rc::new([]))),
            b't' => {
                let items = pop_mark(&mut stack, &mut marks)?;
                stack.push(V::Tuple(items.into()))
            }
            0x85..=0x87 => {
                let n = (op - 0x84) as usize;
                if stack.len() < n {
                    return None;
                }
                let items = stack.split_off(stack.len() - n);
                stack.push(V::Tuple(items.into()))
            }
            b'd' | b'l' | 0x91 => {
                pop_mark(&mut stack, &mut marks)?;
                stack.push(V::Other)
            }
            b'a' => {
                pop(&mut stack)?;
                stack.last()?;
            }
            b's' => {
                pop(&mut stack)?;
                pop(&mut stack)?;
                stack.last()?;
            }
            b'e' | b'u' | 0x90 => {
                pop_mark(&mut stack, &mut marks)?;
                stack.last()?;
            }
            // Memo.
            0x94 => {
                let v = stack.last()?.clone();
                memo.put(memo.len, v)?;
            }
            b'q' => {
                let k = r.u8()? as usize;
                memo.put(k, stack.last()?.clone())?;
            }
            b'r' => {
                let k = r.len(4)?;
                memo.put(k, stack.last()?.clone())?;
            }
            b'p' => {
                let k = r.line()?.parse().ok()?;
                memo.put(k, stack.last()?.clone())?;
            }
            b'h' => {
                let k = r.u8()? as usize;
                stack.push(memo.get(k)?)
            }
            b'j' => {
                let k = r.len(4)?;
                stack.push(memo.get(k)?)
            }
            b'g' => {
                let k: usize = r.line()?.parse().ok()?;
                stack.push(memo.get(k)?)
            }
            // Classes and objects.
            b'c' => {
                let module = r.line()?;
                let name = r.line()?;
                stack.push(V::Global(module.into(), name.into()))
            }
            0x93 => {
                let (V::Str(name), V::Str(module)) = (pop(&mut stack)?, pop(&mut stack)?) else { return None };
                stack.push(V::Global(module, name))
            }
            0x81 => {
                pop(&mut stack)?;
                let cls = pop(&mut stack)?;
                stack.push(if is_tensor_ref(&cls) { V::TensorRef } else { V::Other })
            }
            0x92 => {
                pop(&mut stack)?;
                pop(&mut stack)?;
                let cls = pop(&mut stack)?;
                stack.push(if is_tensor_ref(&cls) { V::TensorRef } else { V::Other })
            }
            b'R' => {
                let args = pop(&mut stack)?;
                let f = pop(&mut stack)?;
                // copyreg._reconstructor(cls, object, None): protocols 0 and 1.
                let made = match (&f, &args) {
                    (V::Global(m, n), V::Tuple(a)) if &**m == "copyreg" && &**n == "_reconstructor" => {
                        a.first().is_some_and(is_tensor_ref)
                    }
                    _ => false,
                };
                stack.push(if made { V::TensorRef } else { V::Other })
            }
            b'o' => {
                let items = pop_mark(&mut stack, &mut marks)?;
                let cls = items.first()?;
                stack.push(if is_tensor_ref(cls) { V::TensorRef } else { V::Other })
            }
            b'i' => {
                let module = r.line()?;
                let name = r.line()?;
                pop_mark(&mut stack, &mut marks)?;
                stack.push(if module == TENSOR_REF_MODULE && name == TENSOR_REF_CLASS {
                    V::TensorRef
                } else {
                    V::Other
                })
            }
            b'b' => {
                let state = pop(&mut stack)?;
                if *stack.last()? == V::TensorRef {
                    // TensorRef.__getstate__: (name, kind, dtype, shape, stored, extra).
                    let V::Tuple(items) = state else { return None };
                    let Some(V::Str(name)) = items.first() else { return None };
                    names.insert(name.to_string());
                }
            }
            b'P' => {
                r.line()?;
                stack.push(V::Other)
            }
            b'Q' => {
                // A persistent id: the package's version-2 skeleton gives
                // each tensor as its TensorRef's state, (name, kind, dtype,
                // shape, stored, extra), the kind "np", "torch" or "cuda".
                match pop(&mut stack)? {
                    V::Tuple(items) if items.len() == 6 && matches!(items[1], V::Str(_)) => {
                        let V::Str(name) = &items[0] else { return None };
                        names.insert(name.to_string());
                        stack.push(V::TensorRef)
                    }
                    _ => stack.push(V::Other),
                }
            }
            0x82 => {
                r.take(1)?;
                stack.push(V::Other)
            }
            0x83 => {
                r.take(2)?;
                stack.push(V::Other)
            }
            0x84 => {
                r.take(4)?;
                stack.push(V::Other)
            }
            // NEXT_BUFFER (out-of-band data) and anything unknown.
            _ => return None,
        }
    }
    Some(names)
}

/// The unpickler's memo: keys are dense from 0 (pickle numbers them in
/// order), so a vector; `len` counts the keys set, as MEMOIZE numbers them.
#[derive(Default)]
struct Memo {
    slots: Vec<Option<V>>,
    len: usize,
}

impl Memo {
    /// None (the blob is not read) for a key past the walk's bound, or one
    /// that skips keys (no pickler does; a blob that does is not ours).
    fn put(&mut self, k: usize, v: V) -> Option<()> {
        if k > MEMO_LEN_MAX || k > self.slots.len() {
            return None;
        }
        if k == self.slots.len() {
            self.slots.push(None);
        }
        if self.slots[k].replace(v).is_none() {
            self.len += 1;
        }
        Some(())
    }

    fn get(&self, k: usize) -> Option<V> {
        self.slots.get(k)?.clone()
    }
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.at.checked_add(n)?;
        let s = self.b.get(self.at..end)?;
        self.at = end;
        Some(s)
    }
    fn u8(&mut self) -> Option<u8> {
        Some(self.take(1)?[0])
    }
    /// A little-endian length of `n` bytes (4 or 8).
    fn len(&mut self, n: usize) -> Option<usize> {
        let s = self.take(n)?;
        let mut v = [0u8; 8];
        v[..n].copy_from_slice(s);
        usize::try_from(u64::from_le_bytes(v)).ok()
    }
    fn utf8(&mut self, n: usize) -> Option<String> {
        String::from_utf8(self.take(n)?.to_vec()).ok()
    }
    fn line(&mut self) -> Option<String> {
        let rest = self.b.get(self.at..)?;
        let n = rest.iter().position(|&c| c == b'\n')?;
        let s = std::str::from_utf8(&rest[..n]).ok()?.to_string();
        self.at += n + 1;
        Some(s)
    }
}

/// The tensors a checkpoint's skeleton names that the checkpoint does not
/// hold (as readers see them: a sliced tensor by its whole name), sorted;
/// empty when it holds them all or there is no skeleton this store reads.
/// `structure`: the bytes of the blob [`STRUCTURE_BLOB`]; `has_parts_map`:
/// whether the checkpoint has the blob [`PARTS_BLOB`] (then no check).
pub fn missing_tensors(structure: Option<&[u8]>, has_parts_map: bool, holds: impl Fn(&str) -> bool) -> Vec<String> {
    let Some(pkl) = structure else { return Vec::new() };
    if has_parts_map {
        return Vec::new();
    }
    let Some(names) = referenced_tensors(pkl) else { return Vec::new() };
    names.into_iter().filter(|n| !holds(n)).collect()
}

/// [`missing_tensors`] of a committed (or about to be committed) index whose
/// blobs are `blobs`.
pub fn missing_from_index(index: &Index, structure: Option<&[u8]>) -> Vec<String> {
    let has_parts = index.ckpt.blobs.iter().any(|b| b.name == PARTS_BLOB);
    // As `index.logical_tensor(n).is_some()`, without making the tensor's view.
    let c = &index.ckpt;
    missing_tensors(structure, has_parts, |n| c.tensors.contains_key(n) || c.slices.contains_key(n))
}

/// One line: `the skeleton (structure.pkl) names tensor "x" (and N more),
/// which the checkpoint does not hold`.
pub fn describe_missing(missing: &[String]) -> String {
    let more = match missing.len() {
        0 | 1 => String::new(),
        n => format!(" (and {} more)", n - 1),
    };
    format!(
        "the skeleton ({STRUCTURE_BLOB}) names tensor {:?}{more}, which the checkpoint does not hold",
        missing.first().map(String::as_str).unwrap_or("")
    )
}

/// What one rank's part of a step holds, for [`parts_disagree`].
pub struct RankPart<'a> {
    pub rank: u32,
    /// The tensors it stores, by stored name.
    pub tensors: Vec<&'a str>,
    /// Its blob [`STRUCTURE_BLOB`], if it has one.
    pub structure: Option<&'a [u8]>,
    /// Whether it has the blob [`PARTS_BLOB`].
    pub parts_map: bool,
}

/// Whether several ranks' parts of one step make a checkpoint that does not
/// load: a skeleton (some rank's `structure.pkl`) names a tensor that no
/// rank stores (whole, or in slices declared as `(piece, of)` in
/// `slices`). Then one line naming the skeleton's rank, the first such
/// tensor, and the ranks that store tensors the skeleton does not name
/// (what such ranks saved instead: a different state under the same step).
pub fn parts_disagree<'a>(parts: &[RankPart<'a>], slices: &[(&'a str, &'a str)]) -> Option<String> {
    if parts.iter().any(|p| p.parts_map) {
        return None;
    }
    fn whole_of<'s>(slices: &[(&'s str, &'s str)], t: &'s str) -> &'s str {
        slices.iter().find(|(piece, _)| *piece == t).map_or(t, |(_, of)| *of)
    }
    let stored: std::collections::HashSet<&str> =
        parts.iter().flat_map(|p| p.tensors.iter().copied()).chain(slices.iter().map(|(_, of)| *of)).collect();
    for p in parts {
        let Some(names) = p.structure.and_then(referenced_tensors) else { continue };
        let Some(missing) = names.iter().find(|n| !stored.contains(n.as_str())) else { continue };
        let n_missing = names.iter().filter(|n| !stored.contains(n.as_str())).count();
        let more = if n_missing > 1 { format!(" (and {} more)", n_missing - 1) } else { String::new() };
        let mut others = Vec::new();
        for q in parts {
            if let Some(t) = q.tensors.iter().map(|t| whole_of(slices, t)).find(|t| !names.contains(*t)) {
                others.push(format!("rank {} stores {t:?}, which it does not name", q.rank));
            }
        }
        let others = if others.is_empty() { String::new() } else { format!("; {}", others.join(", ")) };
        return Some(format!(
            "the ranks' parts do not make one loadable state: the skeleton rank {} saved ({STRUCTURE_BLOB}) names tensor {missing:?}{more}, which no rank stores{others} (every rank must save the same state under one step)",
            p.rank
        ));
    }
    None
}

/// The smallest skeleton the Python package could have written naming
/// `names`: pickle protocol 4 of `(1, [TensorRef(name, "np", None), ...])`,
/// assembled as `pickle` does (STACK_GLOBAL, EMPTY_TUPLE, NEWOBJ, the state
/// tuple, BUILD; the class memoized once). For tests of the check, here and
/// through the daemon. Names are at most 255 bytes.
pub fn minimal_skeleton(names: &[&str]) -> Vec<u8> {
    let mut p = vec![0x80, 4, b'K', 1, b']', 0x94, b'('];
    let s = |p: &mut Vec<u8>, t: &str| {
        p.push(0x8c);
        p.push(u8::try_from(t.len()).expect("a name of at most 255 bytes"));
        p.extend_from_slice(t.as_bytes());
    };
    s(&mut p, TENSOR_REF_MODULE);
    s(&mut p, TENSOR_REF_CLASS);
    p.extend([0x93, 0x94]);
    for (i, n) in names.iter().enumerate() {
        if i > 0 {
            p.extend([b'h', 1]);
        }
        p.extend([b')', 0x81, b'(']);
        s(&mut p, n);
        s(&mut p, "np");
        p.extend([b'N', b't', b'b']);
    }
    p.extend([b'e', 0x86, b'.']);
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `_tree.pickle_skeleton(1, Flattener().walk(state))` of ckpt_sidecar 1
    /// (pickle protocol 4) for `{"a": np.zeros(3, "f4"), "b": [np.ones(2), 3,
    /// "x", {"z": 1.5}], "c": np.int64(5), "t": torch.zeros(2, dtype=bfloat16),
    /// "opt": {"param_groups": [{"lr": 0.1, "params": [0, 1]}]}}`.
    const SKELETON_PROTO4: &str = "800495d0010000000000004b017d94288c0161948c12636b70745f736964656361722e5f7472\
6565948c0954656e736f725265669493942981942868018c026e70948c056e756d7079948c05\
64747970659493948c02663494898887945294284b038c013c944e4e4e4affffffff4affffff\
ff4b007494624b0385948c03463332944e7494628c0162945d94286804298194288c03622e30\
94680668098c02663894898887945294284b03680d4e4e4e4affffffff4affffffff4b007494\
624b0285948c03463634944e7494624b038c0178947d948c017a94473ff80000000000007365\
8c0163948c166e756d70792e5f636f72652e6d756c74696172726179948c067363616c617294\
939468098c02693894898887945294284b03680d4e4e4e4affffffff4affffffff4b00749462\
4308050000000000000094869452948c017494680429819428682b8c05746f726368948c0862\
666c6f61743136944b0285948c0442463136947d94288c05706172616d94898c0d7265717569\
7265735f6772616494898c06646576696365948c0363707594757494628c036f7074947d948c\
0c706172616d5f67726f757073945d947d94288c026c7294473fb999999999999a8c06706172\
616d73945d94284b004b01657561737586942e";

    /// The same package's skeleton of `{"a": np.zeros(3, "f4"), "b":
    /// [np.ones(2), {"c": np.ones(1)}], "d": np.zeros(2, "f4")}` pickled with
    /// protocol 2: BINPUT/BINGET, the memo keys set and read by number.
    const SKELETON_PROTO2: &str = "80024b017d710028580100000061710163636b70745f736964656361722e5f747265650a5465\
6e736f725265660a71022981710328680158020000006e707104636e756d70790a6474797065\
0a71055802000000663471068988877107527108284b0358010000003c71094e4e4e4affffff\
ff4affffffff4b0074710a624b0385710b5803000000463332710c4e74710d62580100000062\
710e5d710f28680229817110285803000000622e307111680468055802000000663871128988\
877113527114284b0368094e4e4e4affffffff4affffffff4b00747115624b02857116580300\
000046363471174e747118627d7119580100000063711a68022981711b285805000000622e31\
2e63711c680468144b0185711d68174e74711e627365580100000064711f6802298171202868\
1f680468084b02857121680c4e74712262758671232e";

    /// `_tree.pickle_skeleton(2, Flattener().walk(state))` (each tensor a
    /// persistent id: its TensorRef's state, then BINPERSID) for `{"a":
    /// np.zeros(3, "f4"), "b": [np.ones(2), {"c": torch.zeros(2,
    /// dtype=bfloat16)}], "n": 7}`.
    const SKELETON_V2: &str = "80049500010000000000004b027d94288c0161942868018c026e70948c056e756d7079948c05\
64747970659493948c02663494898887945294284b038c013c944e4e4e4affffffff4affffff\
ff4b007494624b0385948c03463332944e7494518c0162945d9428288c03622e309468026805\
8c02663894898887945294284b0368094e4e4e4affffffff4affffffff4b007494624b028594\
8c03463634944e7494517d948c016394288c05622e312e63948c05746f726368948c0862666c\
6f61743136944b0285948c0442463136947d94288c05706172616d94898c0d72657175697265\
735f6772616494898c06646576696365948c03637075947574945173658c016e944b07758694\
2e";

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
    }

    #[test]
    fn the_python_packages_skeleton_gives_the_names_of_its_tensors() {
        let p = hex(SKELETON_PROTO4);
        let names = referenced_tensors(&p).unwrap();
        assert_eq!(names.into_iter().collect::<Vec<_>>(), ["a", "b.0", "t"]);
    }

    #[test]
    fn a_version_2_skeleton_gives_the_names_of_its_persistent_ids() {
        let names = referenced_tensors(&hex(SKELETON_V2)).unwrap();
        assert_eq!(names.into_iter().collect::<Vec<_>>(), ["a", "b.0", "b.1.c"]);
        // A persistent id that is not a TensorRef's state names nothing.
        let foreign = [&[0x80u8, 4][..], &[0x8c, 1, b'x', 0x85, b'Q', b'.']].concat();
        assert_eq!(referenced_tensors(&foreign).unwrap().len(), 0);
    }

    #[test]
    fn protocol_2_memos_by_number_and_gives_the_same_names() {
        let names = referenced_tensors(&hex(SKELETON_PROTO2)).unwrap();
        assert_eq!(names.into_iter().collect::<Vec<_>>(), ["a", "b.0", "b.1.c", "d"]);
    }

    #[test]
    fn a_memo_key_that_skips_keys_is_not_read() {
        // BINPUT 5 as the first memo entry: no pickler numbers so.
        let mut p = minimal_skeleton(&["a"]);
        let at = p.iter().position(|&b| b == 0x94).unwrap();
        p.splice(at..=at, [b'q', 5]);
        assert_eq!(referenced_tensors(&p), None);
        // BINPUT 0 there instead reads as the MEMOIZE it replaced.
        let mut p = minimal_skeleton(&["a"]);
        p.splice(at..=at, [b'q', 0]);
        assert_eq!(referenced_tensors(&p).unwrap().into_iter().collect::<Vec<_>>(), ["a"]);
    }

    #[test]
    fn a_truncated_or_foreign_blob_is_not_read_and_refuses_nothing() {
        let p = hex(SKELETON_PROTO4);
        // Cut before STOP: not read in full.
        assert_eq!(referenced_tensors(&p[..p.len() - 1]), None);
        assert_eq!(referenced_tensors(&p[..p.len() / 2]), None);
        assert_eq!(referenced_tensors(b"s"), None);
        assert_eq!(referenced_tensors(b""), None);
        assert!(missing_tensors(Some(b"not a pickle"), false, |_| false).is_empty());
    }

    #[test]
    fn tensor_refs_built_by_newobj_give_their_names() {
        let p = minimal_skeleton(&["a", "only0"]);
        let names = referenced_tensors(&p).unwrap();
        assert_eq!(names.into_iter().collect::<Vec<_>>(), ["a", "only0"]);
        assert_eq!(missing_tensors(Some(&p), false, |n| n == "a"), ["only0"]);
        assert!(missing_tensors(Some(&p), true, |n| n == "a").is_empty());
        assert_eq!(
            describe_missing(&["only0".into()]),
            "the skeleton (structure.pkl) names tensor \"only0\", which the checkpoint does not hold"
        );
    }

    #[test]
    fn ranks_that_saved_different_states_disagree_naming_the_ranks_and_the_tensor() {
        let s0 = minimal_skeleton(&["a", "only0"]);
        let part = |rank, tensors, structure| RankPart { rank, tensors, structure, parts_map: false };
        // Rank 0 stores a (its partition gave only0 to rank 1), rank 1 stores only1.
        let parts = [part(0, vec!["a"], Some(&s0[..])), part(1, vec!["only1"], None)];
        let why = parts_disagree(&parts, &[]).unwrap();
        assert_eq!(
            why,
            "the ranks' parts do not make one loadable state: the skeleton rank 0 saved (structure.pkl) names tensor \"only0\", which no rank stores; rank 1 stores \"only1\", which it does not name (every rank must save the same state under one step)"
        );
        // The same state, partitioned with a tensor in slices: it loads.
        let s = minimal_skeleton(&["a", "w"]);
        let parts = [part(0, vec!["a", "w#elems[0:5]"], Some(&s[..])), part(1, vec!["w#elems[5:9]"], None)];
        assert_eq!(parts_disagree(&parts, &[("w#elems[0:5]", "w"), ("w#elems[5:9]", "w")]), None);
        // No skeleton this store reads (a C client's blob, DCP): no check.
        let parts = [part(0, vec!["a"], Some(&b"opaque"[..])), part(1, vec!["b"], None)];
        assert_eq!(parts_disagree(&parts, &[]), None);
    }
}
