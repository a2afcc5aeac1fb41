//! What fits on a card: for a model's KV shape, the cache bytes each scheme costs per token and
//! per sequence, and how many tokens and sequences of a given length fit in a memory budget
//! (`hipkv info --model`).

use crate::Scheme;
use crate::error::{Error, Result};

/// The part of a model's shape that sizes its KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvShape {
    pub layers: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// One scheme's cache for sequences of `context` tokens of a model, against a budget.
#[derive(Clone, Debug, PartialEq)]
pub struct Fit {
    pub scheme: Scheme,
    /// Bytes of one sequence of `context` tokens: every layer and KV head, K and V, with its
    /// scales, minimums, outlier stores, sinks and residual and value windows
    /// ([`Scheme::memory`] × layers × KV heads), as the cache allocates it.
    pub sequence_bytes: u64,
    /// `sequence_bytes / context`.
    pub bytes_per_token: f64,
    /// Tokens the budget holds, in sequences of `context` (fractional sequences counted).
    pub tokens: u64,
    /// Whole sequences of `context` tokens the budget holds.
    pub sequences: u64,
}

/// The fit of `scheme` for `shape` with sequences of `context` tokens in `budget` bytes.
pub fn fit(scheme: &Scheme, shape: KvShape, context: usize, budget: u64) -> Result<Fit> {
    if context == 0 {
        return Err(Error::Unsupported("a context of 0 tokens".into()));
    }
    scheme.validate(shape.head_dim, true)?;
    let per_head = scheme.memory(shape.head_dim, context).total() as u64;
    let sequence_bytes = per_head * (shape.layers * shape.kv_heads) as u64;
    let bytes_per_token = sequence_bytes as f64 / context as f64;
    Ok(Fit {
        scheme: *scheme,
        sequence_bytes,
        bytes_per_token,
        tokens: (budget as f64 / bytes_per_token) as u64,
        sequences: budget / sequence_bytes,
    })
}

/// Parses a byte count: a number with an optional unit, `B`, `KB`/`MB`/`GB`/`TB` (powers of
/// 1000) or `KiB`/`MiB`/`GiB`/`TiB` (powers of 1024); `16GiB`, `12.5 GB`, `4096`.
pub fn parse_bytes(text: &str) -> Result<u64> {
    let bad = || Error::Unsupported(format!("`{text}`: expected a size such as 16GiB or 12GB"));
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let number: f64 = number.parse().map_err(|_| bad())?;
    let scale: f64 = match unit.trim() {
        "" | "B" => 1.0,
        "KB" => 1e3,
        "MB" => 1e6,
        "GB" => 1e9,
        "TB" => 1e12,
        "KiB" => 1024.0,
        "MiB" => 1024f64.powi(2),
        "GiB" => 1024f64.powi(3),
        "TiB" => 1024f64.powi(4),
        _ => return Err(bad()),
    };
    let bytes = number * scale;
    if !bytes.is_finite() || bytes < 0.0 || bytes > u64::MAX as f64 {
        return Err(bad());
    }
    Ok(bytes as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMOLLM2: KvShape = KvShape {
        layers: 30,
        kv_heads: 3,
        head_dim: 64,
    };

    #[test]
    fn f16_costs_two_bytes_per_element() {
        let f = fit(&"f16".parse().unwrap(), SMOLLM2, 4096, 1 << 30).unwrap();
        // 30 layers × 3 heads × 64 channels × (K + V) × 2 bytes.
        assert_eq!(f.bytes_per_token, 23040.0);
        assert_eq!(f.sequence_bytes, 23040 * 4096);
        assert_eq!(f.sequences, (1u64 << 30) / (23040 * 4096));
        assert_eq!(f.tokens, (1u64 << 30) / 23040);
    }

    #[test]
    fn per_sequence_state_is_counted() {
        // kivi2's value window and residual page are per sequence: short sequences pay more
        // per token than long ones.
        let s: Scheme = "kivi2".parse().unwrap();
        let short = fit(&s, SMOLLM2, 256, 1 << 30).unwrap();
        let long = fit(&s, SMOLLM2, 8192, 1 << 30).unwrap();
        assert!(short.bytes_per_token > long.bytes_per_token);
        let m = s.memory(64, 256);
        assert_eq!(short.sequence_bytes, (m.total() * 90) as u64);
        assert!(m.window_bytes > 0 && m.residual_bytes > 0);
    }

    #[test]
    fn bad_inputs_are_errors() {
        assert!(fit(&"q8".parse().unwrap(), SMOLLM2, 0, 1).is_err());
        let odd = KvShape {
            head_dim: 96,
            ..SMOLLM2
        };
        assert!(fit(&"q8".parse().unwrap(), odd, 16, 1).is_err());
    }

    #[test]
    fn sizes_parse_in_both_unit_systems() {
        assert_eq!(parse_bytes("16GiB").unwrap(), 16 << 30);
        assert_eq!(parse_bytes("12.5 GB").unwrap(), 12_500_000_000);
        assert_eq!(parse_bytes("4096").unwrap(), 4096);
        assert_eq!(parse_bytes("512MiB").unwrap(), 512 << 20);
        for bad in ["", "GiB", "16 gigs", "-1GB", "1e99TB"] {
            assert!(parse_bytes(bad).is_err(), "{bad}");
        }
    }
}
