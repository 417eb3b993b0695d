//! A torch.save file finished in staging (SaveFilePieces with
//! `FileFinish::TorchZip`, the torch.save hook's CUDA way).
//!
//! torch.save writes a zip archive of stored (uncompressed) records, each
//! followed by a data descriptor holding its CRC-32, a central directory
//! repeating the CRC-32s, and a last record `<archive>/.data/serialization_id`:
//! 40 ASCII digits, a hash of the record names then a hash of the CRC-32s of
//! the records before it (c10::hash_combine folded from 0, in file order).
//! Under `torch.serialization.skip_data()` the storage records' bytes are
//! left out (the hook places them from the device) and their CRC-32s are 0;
//! this module finds where every CRC-32 lies ([`parse`], cheap, before
//! Released: a piece list that is not such an archive is refused) and
//! computes them from the finished bytes ([`fill`], after the copy), so the
//! file is the one torch.save writes for the same object.
//!
//! Invariants: every offset found is checked against the file's length
//! (overflow-checked) before any read or write; only CRC fields and the
//! serialization id's last 20 digits are written.

use std::ops::Range;

/// Why a file is not a torch.save zip archive this module can finish.
#[derive(Debug, thiserror::Error)]
#[error("not a torch.save zip archive: {0}")]
pub struct TorchZipError(String);

const LOCAL_SIG: u32 = 0x0403_4b50;
const CENTRAL_SIG: u32 = 0x0201_4b50;
const EOCD_SIG: u32 = 0x0605_4b50;
const ZIP64_LOCATOR_SIG: u32 = 0x0706_4b50;
const ZIP64_EOCD_SIG: u32 = 0x0606_4b50;
const DESCRIPTOR_SIG: u32 = 0x0807_4b50;
const DESCRIPTOR_FLAG: u16 = 1 << 3;
const SERIALIZATION_ID: &str = ".data/serialization_id";
/// Its content: 20 digits of the names' hash, then 20 of the CRC-32s' hash.
const SERIALIZATION_ID_DIGITS: usize = 40;

/// One record of the archive: its data, and where its CRC-32 is written.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Record {
    data: Range<usize>,
    /// In the data descriptor (or the local header, without one).
    crc_at: usize,
    /// In its central-directory entry.
    central_crc_at: usize,
    /// torch.save folds only records with a data descriptor into the id.
    has_descriptor: bool,
    is_serialization_id: bool,
}

/// Where a torch.save archive's CRC-32s lie, records in file order.
#[derive(Debug)]
pub struct TorchZip {
    records: Vec<Record>,
}

fn bad<T>(why: impl Into<String>) -> Result<T, TorchZipError> {
    Err(TorchZipError(why.into()))
}

fn range(file: &[u8], at: usize, len: usize, what: &str) -> Result<Range<usize>, TorchZipError> {
    match at.checked_add(len) {
        Some(end) if end <= file.len() => Ok(at..end),
        _ => bad(format!("{what} at byte {at} (+{len}) lies past the end ({} bytes)", file.len())),
    }
}

fn u16_at(file: &[u8], at: usize, what: &str) -> Result<u16, TorchZipError> {
    let r = range(file, at, 2, what)?;
    Ok(u16::from_le_bytes(file[r].try_into().expect("2 bytes")))
}

fn u32_at(file: &[u8], at: usize, what: &str) -> Result<u32, TorchZipError> {
    let r = range(file, at, 4, what)?;
    Ok(u32::from_le_bytes(file[r].try_into().expect("4 bytes")))
}

fn u64_at(file: &[u8], at: usize, what: &str) -> Result<u64, TorchZipError> {
    let r = range(file, at, 8, what)?;
    Ok(u64::from_le_bytes(file[r].try_into().expect("8 bytes")))
}

fn usize_of(v: u64, what: &str) -> Result<usize, TorchZipError> {
    usize::try_from(v).or_else(|_| bad(format!("{what} {v} does not fit this machine")))
}

/// Finds every record's data and CRC-32 fields; refuses anything but a
/// single-disk archive of stored records (what torch.save writes).
pub fn parse(file: &[u8]) -> Result<TorchZip, TorchZipError> {
    const EOCD_BYTES: usize = 22;
    // torch.save writes no archive comment: the end record is the last 22
    // bytes; a comment would be skipped by searching back.
    let search_from = file.len().saturating_sub(EOCD_BYTES + u16::MAX as usize);
    let eocd = (search_from..=file.len().saturating_sub(EOCD_BYTES))
        .rev()
        .find(|&at| file.len() >= EOCD_BYTES && u32_at(file, at, "end record").ok() == Some(EOCD_SIG))
        .ok_or_else(|| TorchZipError("no end-of-central-directory record".into()))?;
    let mut count = u16_at(file, eocd + 10, "end record")? as u64;
    let mut cd_off = u32_at(file, eocd + 16, "end record")? as u64;
    if eocd >= 20 && u32_at(file, eocd - 20, "zip64 locator")? == ZIP64_LOCATOR_SIG {
        let z = usize_of(u64_at(file, eocd - 20 + 8, "zip64 locator")?, "zip64 end record offset")?;
        if u32_at(file, z, "zip64 end record")? != ZIP64_EOCD_SIG {
            return bad(format!("the zip64 locator points at byte {z}, where no zip64 end record is"));
        }
        count = u64_at(file, z + 32, "zip64 end record")?;
        cd_off = u64_at(file, z + 48, "zip64 end record")?;
    }
    let mut at = usize_of(cd_off, "central directory offset")?;
    let mut records = Vec::new();
    for i in 0..count {
        if u32_at(file, at, "central directory entry")? != CENTRAL_SIG {
            return bad(format!("central directory entry {i} at byte {at} has no signature"));
        }
        let method = u16_at(file, at + 10, "central directory entry")?;
        let mut csize = u32_at(file, at + 20, "central directory entry")? as u64;
        let mut usize_ = u32_at(file, at + 24, "central directory entry")? as u64;
        let name_len = u16_at(file, at + 28, "central directory entry")? as usize;
        let extra_len = u16_at(file, at + 30, "central directory entry")? as usize;
        let comment_len = u16_at(file, at + 32, "central directory entry")? as usize;
        let mut lho = u32_at(file, at + 42, "central directory entry")? as u64;
        let name = &file[range(file, at + 46, name_len, "record name")?];
        // The zip64 extra field holds, in this order, each 32-bit field that is all ones.
        let extra = range(file, at + 46 + name_len, extra_len, "extra field")?;
        let mut e = extra.start;
        while e + 4 <= extra.end {
            let (id, len) = (u16_at(file, e, "extra field")?, u16_at(file, e + 2, "extra field")? as usize);
            if id == 1 {
                let mut f = e + 4;
                for v in [&mut usize_, &mut csize, &mut lho] {
                    if *v == u32::MAX as u64 {
                        *v = u64_at(file, f, "zip64 extra field")?;
                        f += 8;
                    }
                }
            }
            e += 4 + len;
        }
        let name = String::from_utf8_lossy(name).into_owned();
        if method != 0 || csize != usize_ {
            return bad(format!("record {name:?} is compressed (method {method}); torch.save stores records"));
        }
        let lho = usize_of(lho, "local header offset")?;
        if u32_at(file, lho, "local header")? != LOCAL_SIG {
            return bad(format!("record {name:?}: no local header at byte {lho}"));
        }
        let flags = u16_at(file, lho + 6, "local header")?;
        let local_name = u16_at(file, lho + 26, "local header")? as usize;
        let local_extra = u16_at(file, lho + 28, "local header")? as usize;
        let start = lho + 30 + local_name + local_extra;
        let data = range(file, start, usize_of(usize_, "record size")?, "record data")?;
        let has_descriptor = flags & DESCRIPTOR_FLAG != 0;
        let crc_at = if !has_descriptor {
            lho + 14
        } else if u32_at(file, data.end, "data descriptor")? == DESCRIPTOR_SIG {
            data.end + 4
        } else {
            data.end
        };
        range(file, crc_at, 4, "CRC-32 field")?;
        let is_serialization_id = name.ends_with(&format!("/{SERIALIZATION_ID}"));
        if is_serialization_id
            && (data.len() != SERIALIZATION_ID_DIGITS || !file[data.clone()].iter().all(u8::is_ascii_digit))
        {
            return bad(format!("record {name:?} is not {SERIALIZATION_ID_DIGITS} digits"));
        }
        records.push(Record { data, crc_at, central_crc_at: at + 16, has_descriptor, is_serialization_id });
        at = at + 46 + name_len + extra_len + comment_len;
    }
    records.sort_by_key(|r| r.data.start);
    Ok(TorchZip { records })
}

/// c10::hash_combine (64-bit), as torch folds the records' CRC-32s.
fn hash_combine(seed: u64, value: u64) -> u64 {
    seed ^ value.wrapping_add(0x9e37_79b9).wrapping_add(seed << 6).wrapping_add(seed >> 2)
}

fn put_crc(file: &mut [u8], at: usize, crc: u32) {
    file[at..at + 4].copy_from_slice(&crc.to_le_bytes());
}

/// Computes every record's CRC-32 into its fields and the serialization
/// id's CRC half, as torch.save does; `file` is the one [`parse`] read.
pub fn fill(file: &mut [u8], zip: &TorchZip) {
    let mut combined = 0u64;
    for r in &zip.records {
        if r.is_serialization_id {
            let digits = format!("{combined:020}");
            let tail = r.data.end - 20..r.data.end;
            file[tail].copy_from_slice(&digits.as_bytes()[digits.len() - 20..]);
        }
        let crc = crc32fast::hash(&file[r.data.clone()]);
        put_crc(file, r.crc_at, crc);
        put_crc(file, r.central_crc_at, crc);
        if r.has_descriptor && !r.is_serialization_id {
            combined = hash_combine(combined, crc as u64);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// torch.save({"a": torch.arange(1000, dtype=torch.float32)}, buf) by torch 2.15 (CRC-32s computed).
    const FULL: &[u8] = include_bytes!("../../tests/fixtures/torch_save_arange.pt");

    fn records(file: &[u8]) -> Vec<Record> {
        parse(file).unwrap().records
    }

    /// The file with what skip_data leaves: CRC-32 fields zeroed, the id's crc half arbitrary.
    fn blanked(full: &[u8]) -> Vec<u8> {
        let mut f = full.to_vec();
        for r in records(full) {
            put_crc(&mut f, r.crc_at, 0);
            put_crc(&mut f, r.central_crc_at, 0);
            if r.is_serialization_id {
                f[r.data.end - 20..r.data.end].copy_from_slice(b"00000000000000000007");
            }
        }
        f
    }

    #[test]
    fn a_blanked_torch_file_is_finished_into_the_original() {
        let rs = records(FULL);
        assert_eq!(rs.len(), 7, "{rs:?}");
        assert!(rs.last().unwrap().is_serialization_id && rs.iter().all(|r| r.has_descriptor));
        let mut f = blanked(FULL);
        assert_ne!(f, FULL);
        let z = parse(&f).unwrap();
        fill(&mut f, &z);
        assert!(f == FULL, "the finished file differs from torch.save's");
    }

    #[test]
    fn changed_data_gets_its_own_crcs() {
        // The storage record (data/0) changed: its CRC, the id and the id's CRC follow.
        let data0 = records(FULL)[4].clone();
        let mut f = FULL.to_vec();
        f[data0.data.start] ^= 0xff;
        let z = parse(&f).unwrap();
        fill(&mut f, &z);
        let crc = crc32fast::hash(&f[data0.data.clone()]);
        assert_eq!(u32::from_le_bytes(f[data0.crc_at..data0.crc_at + 4].try_into().unwrap()), crc);
        assert_eq!(u32::from_le_bytes(f[data0.central_crc_at..data0.central_crc_at + 4].try_into().unwrap()), crc);
        let id = records(FULL).last().unwrap().data.clone();
        assert_eq!(f[id.start..id.start + 20], FULL[id.start..id.start + 20], "the names' half is kept");
        assert_ne!(f[id.clone()], FULL[id], "the CRC half follows the data");
    }

    #[test]
    fn what_is_not_a_torch_archive_is_refused_with_a_reason() {
        for (file, why) in [
            (b"not a zip at all, long enough to hold an end record".to_vec(), "end-of-central-directory"),
            (FULL[..FULL.len() - 30].to_vec(), "not a torch.save zip archive"),
            (vec![], "end-of-central-directory"),
        ] {
            let e = parse(&file).unwrap_err().to_string();
            assert!(e.contains(why), "{e}");
        }
        // A compressed record.
        let mut f = FULL.to_vec();
        let cd = records(FULL)[0].central_crc_at - 16;
        f[cd + 10] = 8;
        assert!(parse(&f).unwrap_err().to_string().contains("compressed"));
    }
}
