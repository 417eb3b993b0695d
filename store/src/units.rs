//! Sizes as people write them, and as we print them: one parser for every
//! size option of every command, so `1.5GB` means the same everywhere.
//!
//! Decimal units are powers of 1000 (`KB`, `MB`, `GB`, `TB`, `PB`), binary
//! units powers of 1024 (`KiB`, `MiB`, `GiB`, `TiB`, `PiB`); a bare letter
//! (`K`, `M`, `G`, `T`, `P`, as in `dd` or `fallocate`) is binary; no unit or
//! `B` is bytes. Case is ignored. Fractions are exact (`1.5GiB` is
//! 1610612736); a result that is not a whole number of bytes is refused, as
//! is one above `u64::MAX`.

/// Parses a size; the error names the text it could not take.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let s = text.trim();
    let split = s.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let expected = || format!("size {text:?}: expected a number and an optional unit, like 512MiB, 1.5GB or 1048576");
    let (int, frac) = num.split_once('.').unwrap_or((num, ""));
    if int.is_empty() && frac.is_empty() || frac.contains('.') || int.len() > 20 || frac.len() > 18 {
        return Err(expected());
    }
    let mult: u128 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        "pb" => 1_000_000_000_000_000,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "p" | "pib" => 1 << 50,
        u => {
            return Err(format!(
                "size {text:?}: unknown unit {u:?} (bytes, or KB MB GB TB PB = powers of 1000, KiB MiB GiB TiB PiB = powers of 1024)"
            ))
        }
    };
    let int_v: u128 = if int.is_empty() { 0 } else { int.parse().map_err(|_| expected())? };
    let frac_v: u128 = if frac.is_empty() { 0 } else { frac.parse().map_err(|_| expected())? };
    let scale = 10u128.pow(frac.len() as u32);
    let frac_bytes = frac_v * mult;
    if frac_bytes % scale != 0 {
        return Err(format!("size {text:?} is not a whole number of bytes"));
    }
    let total = int_v.checked_mul(mult).and_then(|v| v.checked_add(frac_bytes / scale));
    match total {
        Some(v) if v <= u64::MAX as u128 => Ok(v as u64),
        _ => Err(format!("size {text:?} is too large (at most 16 EiB)")),
    }
}

/// A size for people: `512 B`, `1.5 GiB`.
pub fn human_bytes(b: u64) -> String {
    const U: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = b as f64;
    let mut i = 0;
    while v >= 1024.0 && i < U.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", U[i])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decimal_and_binary_units_mean_what_they_say() {
        for (text, want) in [
            ("0", 0u64),
            ("4096", 4096),
            ("1B", 1),
            ("1KB", 1000),
            ("1000KB", 1_000_000),
            ("1.5GB", 1_500_000_000),
            ("1.5GiB", 3 << 29),
            ("2gib", 2 << 30),
            ("1K", 1024),
            ("1PiB", 1 << 50),
            ("1PB", 1_000_000_000_000_000),
            (" 512MiB ", 512 << 20),
            ("0.5KiB", 512),
            (".5KiB", 512),
        ] {
            assert_eq!(parse_size(text), Ok(want), "{text}");
        }
    }

    #[test]
    fn bad_sizes_are_refused_naming_the_text() {
        for text in ["", "lots", "1.2.3GiB", "1XB", "-1", "0.3B", "1.0000001KiB", "99999999PiB", "18446744073709551616"]
        {
            let e = parse_size(text).unwrap_err();
            assert!(e.contains(&format!("{text:?}")), "{text}: {e}");
        }
    }
}
