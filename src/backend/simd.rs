//! The arithmetic of the CPU kernels, written once and compiled twice: a portable version and,
//! on x86-64 CPUs that have them, one with AVX2, FMA and F16C enabled, chosen at run time.

use half::f16;

use crate::scheme::LowBits;

/// Element-wise primitives the CPU attention is built from. Loops are written with 32
/// independent lanes so the compiler vectorizes them and hides FMA latency.
pub(crate) trait Kernel: Copy {
    /// `a * b + c`, fused where the CPU can.
    fn fma(self, a: f32, b: f32, c: f32) -> f32;

    /// Converts little-endian f16 bytes to f32.
    #[inline(always)]
    fn f16_to_f32(self, src: &[u8], out: &mut [f32]) {
        for (o, b) in out.iter_mut().zip(src.chunks_exact(2)) {
            *o = f16::from_le_bytes([b[0], b[1]]).to_f32();
        }
    }

    #[inline(always)]
    fn dot(self, a: &[f32], b: &[f32]) -> f32 {
        let mut acc = [0f32; 32];
        for (x, y) in a.chunks_exact(32).zip(b.chunks_exact(32)) {
            for i in 0..32 {
                acc[i] = self.fma(x[i], y[i], acc[i]);
            }
        }
        let tail = a.len() / 32 * 32;
        let mut sum = acc.iter().sum::<f32>();
        for (x, y) in a[tail..].iter().zip(&b[tail..]) {
            sum = self.fma(*x, *y, sum);
        }
        sum
    }

    /// `y += a * x`.
    #[inline(always)]
    fn axpy(self, a: f32, x: &[f32], y: &mut [f32]) {
        for (y, x) in y.iter_mut().zip(x) {
            *y = self.fma(a, *x, *y);
        }
    }

    /// `out = scale * int8(src)`.
    #[inline(always)]
    fn i8_scaled(self, src: &[u8], scale: f32, out: &mut [f32]) {
        for (o, &b) in out.iter_mut().zip(src) {
            *o = scale * f32::from(b as i8);
        }
    }

    /// `out = min + scale * code` for packed low-bit codes (low bits first).
    #[inline(always)]
    fn unpack_affine(self, bits: LowBits, src: &[u8], scale: f32, min: f32, out: &mut [f32]) {
        match bits {
            LowBits::Four => {
                for (o, &b) in out.chunks_exact_mut(2).zip(src) {
                    o[0] = self.fma(scale, f32::from(b & 15), min);
                    o[1] = self.fma(scale, f32::from(b >> 4), min);
                }
            }
            LowBits::Two => {
                for (o, &b) in out.chunks_exact_mut(4).zip(src) {
                    o[0] = self.fma(scale, f32::from(b & 3), min);
                    o[1] = self.fma(scale, f32::from((b >> 2) & 3), min);
                    o[2] = self.fma(scale, f32::from((b >> 4) & 3), min);
                    o[3] = self.fma(scale, f32::from(b >> 6), min);
                }
            }
        }
    }
}

/// Any CPU: separate multiply and add (a software FMA would be slow).
#[derive(Clone, Copy)]
pub(crate) struct Portable;

impl Kernel for Portable {
    #[inline(always)]
    fn fma(self, a: f32, b: f32, c: f32) -> f32 {
        a * b + c
    }
}

/// x86-64 with AVX2, FMA and F16C; only constructed after detecting them.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
pub(crate) struct Avx2(());

#[cfg(target_arch = "x86_64")]
impl Kernel for Avx2 {
    #[inline(always)]
    fn fma(self, a: f32, b: f32, c: f32) -> f32 {
        a.mul_add(b, c)
    }

    #[inline(always)]
    fn f16_to_f32(self, src: &[u8], out: &mut [f32]) {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm256_cvtph_ps, _mm256_storeu_ps};
        let mut chunks = out.chunks_exact_mut(8);
        for (o, b) in (&mut chunks).zip(src.chunks_exact(16)) {
            // SAFETY: `Avx2` exists only where F16C was detected; `b` holds 16 bytes and `o`
            // 8 floats, and both accesses are unaligned loads/stores.
            unsafe {
                let h = _mm_loadu_si128(b.as_ptr().cast::<__m128i>());
                _mm256_storeu_ps(o.as_mut_ptr(), _mm256_cvtph_ps(h));
            }
        }
        let done = out.len() / 8 * 8;
        for (o, b) in out[done..].iter_mut().zip(src[done * 2..].chunks_exact(2)) {
            *o = f16::from_le_bytes([b[0], b[1]]).to_f32();
        }
    }
}

/// A computation generic over the kernel arithmetic.
pub(crate) trait KernelFn<R> {
    fn call<K: Kernel>(self, k: K) -> R;
}

/// Runs `f` with the fastest arithmetic this CPU supports.
#[inline]
pub(crate) fn dispatch<R, F: KernelFn<R>>(f: F) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2,fma,f16c")]
        fn with_avx2<R, F: KernelFn<R>>(f: F) -> R {
            f.call(Avx2(()))
        }
        if std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
            && std::is_x86_feature_detected!("f16c")
        {
            // SAFETY: the features `with_avx2` enables were detected on this CPU just above.
            return unsafe { with_avx2(f) };
        }
    }
    f.call(Portable)
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Both;
    impl KernelFn<(f32, Vec<f32>, Vec<f32>)> for Both {
        fn call<K: Kernel>(self, k: K) -> (f32, Vec<f32>, Vec<f32>) {
            let a: Vec<f32> = (0..72).map(|i| i as f32 * 0.25 - 3.0).collect();
            let b: Vec<f32> = (0..72).map(|i| (i % 7) as f32).collect();
            let halves: Vec<u8> = a
                .iter()
                .flat_map(|x| f16::from_f32(*x).to_le_bytes())
                .collect();
            let mut h = vec![0f32; 72];
            k.f16_to_f32(&halves, &mut h);
            let mut u = vec![0f32; 8];
            k.unpack_affine(
                LowBits::Two,
                &[0b11_10_01_00, 0b00_01_10_11],
                2.0,
                -1.0,
                &mut u,
            );
            (k.dot(&a, &b), h, u)
        }
    }

    #[test]
    fn dispatched_and_portable_kernels_agree() {
        let (dot, h, u) = dispatch(Both);
        let (dot_p, h_p, u_p) = Both.call(Portable);
        assert_eq!(h, h_p);
        assert_eq!(u, u_p);
        assert_eq!(u, vec![-1.0, 1.0, 3.0, 5.0, 5.0, 3.0, 1.0, -1.0]);
        let exact: f64 = (0..72)
            .map(|i| (i as f64 * 0.25 - 3.0) * (i % 7) as f64)
            .sum();
        assert!((f64::from(dot) - exact).abs() < 1e-3 && (f64::from(dot_p) - exact).abs() < 1e-3);
    }
}
