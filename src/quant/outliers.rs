//! Dense-and-sparse outliers (KVQuant): per-channel thresholds calibrated from sample data;
//! elements outside them are kept exactly in a sparse store and clipped in the dense part (as
//! many as the store has slots for; the rest stay in the dense part as they are).

use half::f16;

use crate::error::{Error, Result};

/// One sparse outlier: channel and exact (f16) value.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Outlier {
    pub channel: u16,
    pub value: f32,
}

/// Per-head, per-channel `[lo, hi]` ranges; elements outside are outliers.
#[derive(Clone, Debug, PartialEq)]
pub struct OutlierThresholds {
    pub heads: usize,
    pub head_dim: usize,
    /// `heads × head_dim`, f16-representable.
    pub lo: Vec<f32>,
    pub hi: Vec<f32>,
}

impl OutlierThresholds {
    /// Calibrates thresholds from `samples` (`n × heads × head_dim`, token-major): for each
    /// channel the `fraction / 2` highest and `fraction / 2` lowest samples lie outside.
    pub fn calibrate(
        samples: &[f32],
        heads: usize,
        head_dim: usize,
        fraction: f32,
    ) -> Result<OutlierThresholds> {
        let width = heads * head_dim;
        if samples.is_empty() || !samples.len().is_multiple_of(width) {
            return Err(Error::Shape {
                what: "outlier calibration samples (a positive multiple of heads × head_dim)",
                expected: width,
                got: samples.len(),
            });
        }
        let n = samples.len() / width;
        let tail = ((n as f32 * fraction / 2.0).floor() as usize).min((n - 1) / 2);
        let mut lo = Vec::with_capacity(width);
        let mut hi = Vec::with_capacity(width);
        let mut column = vec![0f32; n];
        for i in 0..width {
            for (t, c) in column.iter_mut().enumerate() {
                let x = samples[t * width + i];
                if !x.is_finite() {
                    return Err(Error::Unsupported(format!(
                        "non-finite outlier calibration sample {x}"
                    )));
                }
                *c = f16::from_f32(x).to_f32();
            }
            column.sort_unstable_by(f32::total_cmp);
            lo.push(column[tail]);
            hi.push(column[n - 1 - tail]);
        }
        Ok(OutlierThresholds {
            heads,
            head_dim,
            lo,
            hi,
        })
    }

    /// Checks the shape against `heads × head_dim` and that every range is finite and ordered
    /// (a NaN or inverted range would make clipping meaningless).
    pub fn validate(&self, heads: usize, head_dim: usize) -> Result<()> {
        let n = heads * head_dim;
        if (self.heads, self.head_dim, self.lo.len(), self.hi.len()) != (heads, head_dim, n, n) {
            return Err(Error::Shape {
                what: "outlier thresholds (heads × head_dim, lo and hi)",
                expected: n,
                got: self.lo.len().min(self.hi.len()),
            });
        }
        match (0..n).find(|&i| {
            let (lo, hi) = (self.lo[i], self.hi[i]);
            !(lo.is_finite() && hi.is_finite() && lo <= hi)
        }) {
            None => Ok(()),
            Some(i) => Err(Error::InvalidOutlierThresholds {
                head: i / head_dim,
                channel: i % head_dim,
                lo: self.lo[i],
                hi: self.hi[i],
            }),
        }
    }

    /// The `(lo, hi)` slices of one head.
    pub fn head(&self, head: usize) -> (&[f32], &[f32]) {
        let r = head * self.head_dim..(head + 1) * self.head_dim;
        (&self.lo[r.clone()], &self.hi[r])
    }
}

/// Splits one row into dense and sparse parts.
///
/// Of the elements outside `[lo, hi]`, up to `capacity`, those farthest outside (ties: lower
/// channel first), are returned in channel order with their exact values and clipped to the
/// range in `x` (the dense part), so they no longer stretch their group's range. When a row has
/// more outliers than slots, the rest stay in the dense part unchanged, as without an outlier
/// store, and are counted in the returned `dropped`: a store never makes a group's range wider
/// than it would be without one.
pub fn split_outliers(
    x: &mut [f32],
    lo: &[f32],
    hi: &[f32],
    capacity: usize,
) -> (Vec<Outlier>, usize) {
    let mut found: Vec<(f32, Outlier)> = x
        .iter()
        .enumerate()
        .filter_map(|(c, &v)| {
            let clipped = v.clamp(lo[c], hi[c]);
            (clipped != v).then(|| {
                let outlier = Outlier {
                    channel: c as u16,
                    value: v,
                };
                ((v - clipped).abs(), outlier)
            })
        })
        .collect();
    let dropped = found.len().saturating_sub(capacity);
    if dropped > 0 {
        found.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.channel.cmp(&b.1.channel)));
        found.truncate(capacity);
        found.sort_by_key(|f| f.1.channel);
    }
    for (_, o) in &found {
        let c = usize::from(o.channel);
        x[c] = x[c].clamp(lo[c], hi[c]);
    }
    (found.into_iter().map(|f| f.1).collect(), dropped)
}
