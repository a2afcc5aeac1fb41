//! The rotation of `rot` schemes: the orthonormal Walsh–Hadamard transform `H/√d` of one head.
//!
//! It is its own inverse, so the same call rotates keys and values into the cache, queries into
//! the rotated key space, and attention outputs back. The order of operations is fixed (stages of
//! stride 1, 2, 4, …, each butterfly `(a, b) → (a + b, a − b)`, then one multiplication by
//! [`hadamard_scale`]) so that the kernels, which run the same steps, store the same bytes.

/// `1/√d` rounded to f64, for a power-of-two `d`: a power of two, or one times `1/√2`, exactly
/// (`1.0 / (d as f64).sqrt()` is one ulp low at d = 128).
pub fn hadamard_scale_f64(d: usize) -> f64 {
    debug_assert!(d.is_power_of_two());
    let k = d.trailing_zeros() as i32;
    let half = 0.5f64.powi(k / 2);
    if k % 2 == 0 {
        half
    } else {
        half * std::f64::consts::FRAC_1_SQRT_2
    }
}

/// `1/√d` rounded to f32, for a power-of-two `d`.
pub fn hadamard_scale(d: usize) -> f32 {
    hadamard_scale_f64(d) as f32
}

/// Rotates `x` in place by `H/√d`, `d = x.len()` a power of two.
pub fn hadamard(x: &mut [f32]) {
    butterflies(x);
    let scale = hadamard_scale(x.len());
    for v in x {
        *v *= scale;
    }
}

/// [`hadamard`] in f64: rotates rows back for reads, exact to an f64 rounding per element
/// instead of the f32 rounding of every stage.
pub fn hadamard_exact(x: &mut [f32]) {
    let mut wide: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
    butterflies(&mut wide);
    let scale = hadamard_scale_f64(x.len());
    for (v, w) in x.iter_mut().zip(wide) {
        *v = (w * scale) as f32;
    }
}

/// The unscaled stages of `H`: stride 1, 2, 4, …, each butterfly `(a, b) → (a + b, a − b)`.
fn butterflies<T: Copy + std::ops::Add<Output = T> + std::ops::Sub<Output = T>>(x: &mut [T]) {
    let d = x.len();
    debug_assert!(d.is_power_of_two());
    let mut h = 1;
    while h < d {
        for pair in x.chunks_exact_mut(2 * h) {
            let (lo, hi) = pair.split_at_mut(h);
            for (a, b) in lo.iter_mut().zip(hi) {
                (*a, *b) = (*a + *b, *a - *b);
            }
        }
        h *= 2;
    }
}

/// [`hadamard`] of every `head_dim`-long row of `x`.
pub fn hadamard_rows(x: &mut [f32], head_dim: usize) {
    for row in x.chunks_exact_mut(head_dim) {
        hadamard(row);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth::Rng;

    #[test]
    fn is_orthonormal_and_its_own_inverse() {
        let mut rng = Rng::new(7);
        for d in crate::scheme::HEAD_DIMS {
            let x: Vec<f32> = (0..d).map(|_| rng.normal()).collect();
            let mut y = x.clone();
            hadamard(&mut y);
            let norm = |v: &[f32]| v.iter().map(|a| f64::from(*a).powi(2)).sum::<f64>();
            assert!((norm(&x) - norm(&y)).abs() < 1e-4 * norm(&x), "d={d}");
            hadamard(&mut y);
            for (a, b) in x.iter().zip(&y) {
                assert!((a - b).abs() < 1e-5 * (1.0 + a.abs()), "d={d}: {a} vs {b}");
            }
            // In f64 the round trip is exact to an f32 rounding or two.
            let mut z = x.clone();
            hadamard_exact(&mut z);
            hadamard_exact(&mut z);
            for (a, b) in x.iter().zip(&z) {
                assert!(
                    (a - b).abs() <= 2.0 * f32::EPSILON * a.abs().max(1.0),
                    "d={d}"
                );
            }
        }
    }

    #[test]
    fn spreads_one_channel_over_all() {
        let mut x = vec![0f32; 64];
        x[5] = 8.0;
        hadamard(&mut x);
        assert!(x.iter().all(|v| v.abs() == 1.0), "{x:?}");
        // Row 0 of H is all ones: a constant row becomes one spike.
        let mut c = vec![1f32; 64];
        hadamard(&mut c);
        assert_eq!(c[0], 8.0);
        assert!(c[1..].iter().all(|&v| v == 0.0));
    }
}
