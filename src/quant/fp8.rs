//! OCP fp8 e4m3 ("e4m3fn"): 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits; no
//! infinities, NaN at `S.1111.111`, largest finite ±448, subnormals down to 2^-9. The format
//! of production fp8 KV caches and of gfx12's `v_cvt_pk_fp8_f32` / `v_cvt_f32_fp8`.

/// The largest finite e4m3 magnitude.
pub const E4M3_MAX: f32 = 448.0;

/// The e4m3 code of `x`: round to nearest, ties to even, saturating at ±448 (the hardware's
/// conversion behind a clamp), the sign kept (a value that rounds to zero gives ±0). Finite
/// inputs only: the quantizers reject the others before converting.
pub fn e4m3_from_f32(x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs().min(E4M3_MAX);
    if a < f32::powi(2.0, -6) {
        // Subnormal: multiples of 2^-9. A value that rounds up to 2^-6 becomes the first
        // normal, whose code is the next integer (8) as well.
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    // Normal: round the f32 exponent and mantissa fields to 3 mantissa bits, ties to even (a
    // carry moves into the exponent), then rebias 127 → 7.
    let bits = a.to_bits();
    let rounded = (bits + 0x7_ffff + ((bits >> 20) & 1)) >> 20;
    sign | (rounded - ((127 - 7) << 3)) as u8
}

/// The value of e4m3 code `c` (NaN for the two NaN codes). Exact: an e4m3 code, moved into an
/// f16's sign, exponent and mantissa fields, is the value times 2^-8 (subnormals included).
pub fn e4m3_to_f32(c: u8) -> f32 {
    if c & 0x7f == 0x7f {
        return f32::NAN;
    }
    e4m3_to_f32_scaled(c) * 256.0
}

/// The value of a non-NaN code times 2^-8: its bits moved into an f16, what the CPU kernels
/// convert with the f16 instructions (the 2^8 goes into the scale).
pub fn e4m3_to_f32_scaled(c: u8) -> f32 {
    let c = u16::from(c);
    half::f16::from_bits(((c & 0x80) << 8) | ((c & 0x7f) << 7)).to_f32()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The value of a code from the format's definition.
    fn by_definition(c: u8) -> f32 {
        let sign = if c & 0x80 != 0 { -1.0 } else { 1.0 };
        let (e, m) = (i32::from((c >> 3) & 15), f32::from(c & 7));
        if e == 15 && m == 7.0 {
            return f32::NAN;
        }
        if e == 0 {
            sign * m / 8.0 * f32::powi(2.0, -6)
        } else {
            sign * (1.0 + m / 8.0) * f32::powi(2.0, e - 7)
        }
    }

    #[test]
    fn every_code_decodes_as_defined_and_encodes_back() {
        for c in 0..=255u8 {
            let (got, want) = (e4m3_to_f32(c), by_definition(c));
            if want.is_nan() {
                assert!(got.is_nan(), "code {c:#04x}");
                continue;
            }
            assert_eq!(got.to_bits(), want.to_bits(), "code {c:#04x}");
            assert_eq!(e4m3_from_f32(got), c, "code {c:#04x} = {got}");
        }
        assert_eq!(e4m3_to_f32(0x7e), E4M3_MAX);
    }

    #[test]
    fn rounding_is_to_nearest_even_and_saturates() {
        // Every pair of neighbouring finite codes of one sign: the midpoint goes to the even
        // code, anything beside it to the nearer one.
        for c in 0..0x7eu8 {
            let (lo, hi) = (e4m3_to_f32(c), e4m3_to_f32(c + 1));
            let mid = (lo + hi) / 2.0;
            let even = if c % 2 == 0 { c } else { c + 1 };
            for sign in [1.0f32, -1.0] {
                let s = if sign < 0.0 { 0x80 } else { 0 };
                assert_eq!(e4m3_from_f32(sign * mid), s | even, "{mid}");
                assert_eq!(e4m3_from_f32(sign * mid.next_down()), s | c, "{mid}");
                assert_eq!(e4m3_from_f32(sign * mid.next_up()), s | (c + 1), "{mid}");
            }
        }
        for big in [448.0f32, 460.0, 464.0, 1e6, f32::MAX] {
            assert_eq!(e4m3_from_f32(big), 0x7e, "{big}");
            assert_eq!(e4m3_from_f32(-big), 0xfe, "{big}");
        }
        assert_eq!(e4m3_from_f32(-0.0), 0x80);
        assert_eq!(e4m3_from_f32(-1e-30), 0x80);
        assert_eq!(
            e4m3_from_f32(f32::powi(2.0, -10)),
            0,
            "a tie below the least subnormal"
        );
        assert_eq!(e4m3_from_f32(f32::powi(2.0, -10).next_up()), 1);
    }
}
