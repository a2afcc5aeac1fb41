//! Non-uniform codebooks (KVQuant's nuq): the `2^b` levels a low-bit code decodes to, in code
//! units, so that an element is `min + scale · level[code]` instead of `min + scale · code`.
//! Scales and minimums stay exactly what the uniform format stores (`scale = (hi − lo) / (2^b −
//! 1)`), so a codebook changes neither the layout nor the bytes per token; the uniform
//! codebook `level[i] = i` is the plain format. An element takes the level nearest to its
//! normalized value `u = (x − min) / scale`, the upper one on a tie, as rounding does.

use crate::error::{Error, Result};
use crate::scheme::LowBits;

/// Levels of the widest codebook (4-bit codes).
pub const MAX_LEVELS: usize = 16;

/// Lloyd iterations of [`Codebook::fit`]; it settles well before on every sample set tried.
const FIT_ITERATIONS: usize = 64;

/// The fraction of k-means' attenuation that [`Codebook::fit`] undoes. Measured on SmolLM2
/// over 2048 tokens, rotated 2-bit values at the 56-byte point, mean KL for 0 (plain k-means),
/// 0.5, 0.75 and 1 (no attenuation): 0.088, 0.075, 0.075, 0.085; uniform codes 0.104.
const UNDO_ATTENUATION: f64 = 0.5;

/// The levels of one stream's codes: `2^b` strictly increasing values in `[0, 2^b − 1]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Codebook {
    bits: LowBits,
    /// The levels, repeated to fill all 16 entries (2-bit: four times), so that a vector
    /// lookup may take any 8 consecutive entries as its table.
    levels: [f32; MAX_LEVELS],
}

impl Codebook {
    /// `level[i] = i`: the plain affine format.
    pub fn uniform(bits: LowBits) -> Codebook {
        let n = 1usize << bits.bits();
        let levels: Vec<f32> = (0..n).map(|i| i as f32).collect();
        Codebook::new(bits, &levels).expect("uniform levels are valid")
    }

    /// A codebook of the given levels, checked: `2^bits` finite, strictly increasing values
    /// within `[0, 2^bits − 1]`.
    pub fn new(bits: LowBits, levels: &[f32]) -> Result<Codebook> {
        let bad = |problem| {
            Err(Error::InvalidCodebook {
                bits: bits.bits(),
                problem,
            })
        };
        let n = 1usize << bits.bits();
        if levels.len() != n {
            return bad("expected 2^bits levels");
        }
        let top = f32::from(bits.max_code());
        if !levels.iter().all(|l| (0.0..=top).contains(l)) {
            return bad("a level is not finite or outside [0, 2^bits - 1]");
        }
        if !levels.windows(2).all(|w| w[0] < w[1]) {
            return bad("levels are not strictly increasing");
        }
        let mut stored = [0f32; MAX_LEVELS];
        for (i, l) in stored.iter_mut().enumerate() {
            *l = levels[i % n];
        }
        Ok(Codebook {
            bits,
            levels: stored,
        })
    }

    pub fn bits(&self) -> LowBits {
        self.bits
    }

    /// The `2^b` levels.
    pub fn levels(&self) -> &[f32] {
        &self.levels[..1 << self.bits.bits()]
    }

    /// The levels repeated over 16 entries: `table()[i] = levels()[i % 2^b]`.
    pub fn table(&self) -> &[f32; MAX_LEVELS] {
        &self.levels
    }

    /// The value code `code` decodes to, in code units.
    #[inline(always)]
    pub fn level(&self, code: u8) -> f32 {
        self.levels[usize::from(code)]
    }

    /// The code of normalized value `u`: how many of the midpoints `(l[i] + l[i+1]) · 0.5`
    /// lie at or below it. For the uniform codebook this is `round(u)` clamped to the codes (u
    /// is never negative but by f16 rounding of the minimum, and then below every midpoint).
    /// The kernels compute the midpoints with the same f32 operations.
    #[inline(always)]
    pub fn code(&self, u: f32) -> u8 {
        let l = self.levels();
        l.windows(2)
            .map(|w| u8::from((w[0] + w[1]) * 0.5 <= u))
            .sum()
    }

    /// Fits a codebook to normalized samples (`u` values of a stream, as the quantizer sees
    /// them; non-finite ones are skipped) by Lloyd's algorithm with one change: after each
    /// update the levels are stretched about the samples' mean to undo half of the
    /// attenuation of the quantized values (`UNDO_ATTENUATION`).
    ///
    /// Why: plain k-means levels are conditional means, whose error `q − u` is
    /// anticorrelated with `u` (`cov(q − u, u) = −mse`): every token's value shrinks toward its
    /// group's centre. Attention sums values over many tokens, where independent errors average
    /// out but a shrinkage does not; undoing all of it costs more squared error than it saves.
    /// On SmolLM2 half was best (docs/accuracy.md, "Codebooks").
    pub fn fit(bits: LowBits, samples: &[f32]) -> Result<Codebook> {
        Codebook::fit_undoing(bits, samples, UNDO_ATTENUATION)
    }

    /// [`fit`](Self::fit), undoing the fraction `undo` of the attenuation (0: k-means).
    fn fit_undoing(bits: LowBits, samples: &[f32], undo: f64) -> Result<Codebook> {
        let top = f32::from(bits.max_code());
        let u: Vec<f64> = samples
            .iter()
            .filter(|x| x.is_finite())
            .map(|&x| f64::from(x.clamp(0.0, top)))
            .collect();
        let n = 1usize << bits.bits();
        if u.len() < n {
            return Err(Error::InvalidCodebook {
                bits: bits.bits(),
                problem: "fewer finite calibration samples than levels",
            });
        }
        let mean = u.iter().sum::<f64>() / u.len() as f64;
        let var = u.iter().map(|x| (x - mean).powi(2)).sum::<f64>();
        let mut book = Codebook::uniform(bits);
        if var == 0.0 {
            return Ok(book);
        }
        for _ in 0..FIT_ITERATIONS {
            let (mut sum, mut count) = ([0f64; MAX_LEVELS], [0usize; MAX_LEVELS]);
            let codes: Vec<u8> = u.iter().map(|&x| book.code(x as f32)).collect();
            for (&x, &c) in u.iter().zip(&codes) {
                sum[usize::from(c)] += x;
                count[usize::from(c)] += 1;
            }
            let mut levels = [0f64; MAX_LEVELS];
            for i in 0..n {
                levels[i] = if count[i] > 0 {
                    sum[i] / count[i] as f64
                } else {
                    f64::from(book.levels[i])
                };
            }
            let cov: f64 = u
                .iter()
                .zip(&codes)
                .map(|(x, &c)| (levels[usize::from(c)] - mean) * (x - mean))
                .sum();
            let stretch = if cov > 0.0 {
                1.0 + undo * (var / cov - 1.0)
            } else {
                1.0
            };
            let next: Vec<f32> = levels[..n]
                .iter()
                .map(|l| ((mean + stretch * (l - mean)) as f32).clamp(0.0, top))
                .collect();
            // A level that lost all its samples or met its neighbour ends the fit where it is.
            match Codebook::new(bits, &next) {
                Ok(b) if b == book => break,
                Ok(b) => book = b,
                Err(_) => break,
            }
        }
        Ok(book)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniform_codes_are_rounding() {
        for bits in [LowBits::Two, LowBits::Four] {
            let book = Codebook::uniform(bits);
            let top = f32::from(bits.max_code());
            for i in -100..=2000 {
                let u = i as f32 * 0.0078125;
                let want = u.round().clamp(0.0, top) as u8;
                assert_eq!(book.code(u), want, "u = {u}");
            }
            assert_eq!(book.code(f32::NAN), 0);
        }
    }

    #[test]
    fn codes_take_the_nearest_level() {
        // Midpoints 0.6875, 1.5 and 2.3125, exact in f32; a tie takes the upper level.
        let book = Codebook::new(LowBits::Two, &[0.25, 1.125, 1.875, 2.75]).unwrap();
        for (u, code) in [
            (-0.5, 0),
            (0.68, 0),
            (0.6875, 1),
            (1.49, 1),
            (1.5, 2),
            (2.31, 2),
            (2.3125, 3),
            (3.0, 3),
        ] {
            assert_eq!(book.code(u), code, "u = {u}");
        }
        assert_eq!(book.level(2), 1.875);
        assert_eq!(book.table()[6], 1.875);
    }

    #[test]
    fn bad_levels_are_refused() {
        for levels in [
            &[0.0, 1.0, 2.0][..],
            &[0.0, 1.0, 1.0, 3.0],
            &[0.0, 2.0, 1.0, 3.0],
            &[-0.1, 1.0, 2.0, 3.0],
            &[0.0, 1.0, 2.0, 3.5],
            &[0.0, f32::NAN, 2.0, 3.0],
        ] {
            assert!(
                matches!(
                    Codebook::new(LowBits::Two, levels),
                    Err(Error::InvalidCodebook { bits: 2, .. })
                ),
                "{levels:?}"
            );
        }
    }

    /// Samples shaped like rotated values: a bell over [0, 3].
    fn bell(n: usize) -> Vec<f32> {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        (0..n)
            .map(|_| {
                let mut s = 0.0;
                for _ in 0..6 {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    s += (state >> 40) as f32 / (1u64 << 24) as f32;
                }
                s / 2.0
            })
            .collect()
    }

    #[test]
    fn fitted_levels_beat_uniform_and_undo_attenuation() {
        for bits in [LowBits::Two, LowBits::Four] {
            let u: Vec<f32> = bell(20_000)
                .iter()
                .map(|x| x * f32::from(bits.max_code()) / 3.0)
                .collect();
            // (mean squared error, attenuation cov(q − u, u) / var(u))
            let stats = |b: &Codebook| {
                let n = u.len() as f64;
                let mean = u.iter().map(|&x| f64::from(x)).sum::<f64>() / n;
                let (mut mse, mut cov, mut var) = (0.0, 0.0, 0.0);
                for &x in &u {
                    let q = f64::from(b.level(b.code(x)));
                    let x = f64::from(x);
                    mse += (q - x).powi(2) / n;
                    cov += (q - x) * (x - mean) / n;
                    var += (x - mean).powi(2) / n;
                }
                (mse, cov / var)
            };
            let fit = |undo| stats(&Codebook::fit_undoing(bits, &u, undo).unwrap());
            let (uniform_mse, _) = stats(&Codebook::uniform(bits));
            let (kmeans_mse, kmeans_att) = fit(0.0);
            let (half_mse, half_att) = fit(0.5);
            let (_, full_att) = fit(1.0);
            assert!(
                kmeans_mse < half_mse && half_mse < 0.9 * uniform_mse,
                "{bits:?}"
            );
            assert!(
                kmeans_att < half_att && half_att < -0.001,
                "{bits:?}: {half_att}"
            );
            assert!(full_att.abs() < 0.005, "{bits:?}: {full_att}");
            // Levels crowd where the samples are: the middle gaps are the narrowest.
            let book = Codebook::fit(bits, &u).unwrap();
            let l = book.levels();
            let mid = l.len() / 2;
            assert!(l[mid] - l[mid - 1] < l[1] - l[0], "{l:?}");
        }
    }

    #[test]
    fn constant_and_scarce_samples() {
        let book = Codebook::fit(LowBits::Two, &[1.0; 100]).unwrap();
        assert_eq!(book, Codebook::uniform(LowBits::Two));
        assert!(Codebook::fit(LowBits::Four, &[0.5; 3]).is_err());
        assert!(Codebook::fit(LowBits::Two, &[f32::NAN; 100]).is_err());
    }
}
