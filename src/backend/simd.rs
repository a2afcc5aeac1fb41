//! The arithmetic of the CPU kernels, written once over an 8-lane vector type (and a 16-lane
//! one, [`Kernel::W`], for the score and value loops' multiply-adds) and compiled three times,
//! chosen at run time (see [`Tier`]): a portable version; on x86-64 CPUs that have them, one
//! with AVX2, FMA and F16C, where the 16 lanes are two 256-bit registers; and one with AVX-512
//! F/VL/BW/DQ and VNNI enabled, for its 32 registers, `vpdpbusd`, and 512-bit registers as the
//! 16 lanes. Every packed format is decoded straight into vector registers, 8 or 16 channels at
//! a time, so dequantized values never go through memory. The 4-bit and 2-bit
//! decoders read 8 bytes, 16 or 32 channels, per load and hand out 8 lanes of them in an
//! interleaved order (see `nib8` and `crumb8`), which the attention loops follow.

use half::f16;

/// Eight-lane f32 primitives the CPU attention is built from.
pub(crate) trait Kernel: Copy {
    /// Eight f32 lanes.
    type V: Copy;

    /// Runs `f` as a function of its own, compiled for this arithmetic's instruction set.
    ///
    /// The attention loops enter one per (format, head_dim, loop), so each is unrolled for
    /// its constants without every copy landing in one giant function: code the compiler
    /// optimizes in a few seconds, not minutes, at one call per block of tokens.
    fn run<R, F: KernelFn<R>>(self, f: F) -> R;

    fn splat(self, x: f32) -> Self::V;
    /// Stores into `out[..8]`.
    #[inline(always)]
    fn store(self, v: Self::V, out: &mut [f32]) {
        assert!(out.len() >= 8);
        // SAFETY: 8 floats are in bounds.
        unsafe { self.store_ptr(v, out.as_mut_ptr()) }
    }
    /// Loads 8 floats.
    ///
    /// # Safety
    /// `p` points to 8 readable floats (any alignment).
    unsafe fn load_ptr(self, p: *const f32) -> Self::V;
    /// Stores 8 floats.
    ///
    /// # Safety
    /// `p` points to 8 writable floats (any alignment).
    unsafe fn store_ptr(self, v: Self::V, p: *mut f32);
    /// `a * b + c`, fused where the CPU can.
    fn fmadd(self, a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    fn mul(self, a: Self::V, b: Self::V) -> Self::V;
    /// The lanes of `a` and `b` alternated: `(a0 b0 a1 b1 a2 b2 a3 b3, a4 b4 … a7 b7)`, which
    /// puts rows decoded in a packed format's order back into channel order.
    fn interleave(self, a: Self::V, b: Self::V) -> (Self::V, Self::V);
    /// [`Kernel::interleave`] undone: the even lanes of `a` then `b`, and the odd ones,
    /// `(a0 a2 a4 a6 b0 b2 b4 b6, a1 a3 a5 a7 b1 b3 b5 b7)`, which puts rows in channel order
    /// into a packed format's order.
    fn deinterleave(self, a: Self::V, b: Self::V) -> (Self::V, Self::V);
    /// RoPE of four interleaved pairs `(x[2i], x[2i+1])` by `cs = [cos₀, sin₀, cos₁, sin₁, …]`:
    /// `(a·c − b·s, a·s + b·c)`, each product rounded, as [`crate::RopeTable::rotate`] computes
    /// it.
    fn rotate_pairs(self, x: Self::V, cs: Self::V) -> Self::V;
    /// RoPE of eight pairs `(a[i], b[i])` by their cosines `c` and sines `s`:
    /// `(a·c − b·s, a·s + b·c)`, each product rounded, as [`crate::RopeTable::rotate`]
    /// computes it.
    fn rotate_split(self, a: Self::V, b: Self::V, c: Self::V, s: Self::V) -> (Self::V, Self::V);
    /// [`Kernel::rotate_split`] of eight split pairs `(lo[i], hi[i])` by `cs0, cs1`, the
    /// pairs' 16 `cos, sin` floats as the RoPE table interleaves them.
    #[inline(always)]
    fn rotate_halves(
        self,
        lo: Self::V,
        hi: Self::V,
        cs0: Self::V,
        cs1: Self::V,
    ) -> (Self::V, Self::V) {
        let (c, s) = self.deinterleave(cs0, cs1);
        self.rotate_split(lo, hi, c, s)
    }
    /// Sum of the lanes of each of eight vectors, each as
    /// `((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7))`.
    fn hsum8(self, v: [Self::V; 8]) -> [f32; 8];
    /// Scalar `a * b + c`, fused where the CPU can (never a slow software FMA).
    fn fma(self, a: f32, b: f32, c: f32) -> f32;
    fn add(self, a: Self::V, b: Self::V) -> Self::V;

    /// Sixteen f32 lanes, two [`Kernel::V`] side by side: one 512-bit register in the
    /// AVX-512 build (whose CPUs issue two 512-bit FMAs a cycle), a pair of `V` in the others.
    /// The score and value loops multiply-add in it, so that one FMA covers 16 positions
    /// where the CPU has them; the decoders stay 8 lanes wide.
    type W: Copy;
    /// Positions the value loop accumulates per pass: 16 (two 8-lane accumulators per query
    /// row, what 16 registers hold) or 32 (two 16-lane ones, with 32 registers).
    const VALUE_PASS: usize;
    /// `lo` in lanes 0–7, `hi` in lanes 8–15.
    fn join(self, lo: Self::V, hi: Self::V) -> Self::W;
    fn wsplat(self, x: f32) -> Self::W;
    /// Loads 16 floats.
    ///
    /// # Safety
    /// `p` points to 16 readable floats (any alignment).
    unsafe fn wload_ptr(self, p: *const f32) -> Self::W;
    /// Stores 16 floats.
    ///
    /// # Safety
    /// `p` points to 16 writable floats (any alignment).
    unsafe fn wstore_ptr(self, w: Self::W, p: *mut f32);
    /// `a * b + c`, fused where the CPU can.
    fn wfmadd(self, a: Self::W, b: Self::W, c: Self::W) -> Self::W;
    fn wmul(self, a: Self::W, b: Self::W) -> Self::W;
    /// [`Kernel::rotate_split`] of `x = [a | b]` by `cs = [c | s]`: `[a·c − b·s | a·s + b·c]`.
    fn wrotate_split(self, x: Self::W, cs: Self::W) -> Self::W;
    /// [`Kernel::rotate_split`] of sixteen pairs `(a[i], b[i])` by their cosines `c` and sines
    /// `s`: `(a·c − b·s, a·s + b·c)`, each product rounded.
    fn wrotate_pairs(self, a: Self::W, b: Self::W, c: Self::W, s: Self::W) -> (Self::W, Self::W);
    /// Sum of the lanes of each of eight wide vectors. The pairs add their halves and then
    /// `hsum8`; the AVX-512 build adds in another order, across 512-bit shuffles.
    fn wsum8(self, w: [Self::W; 8]) -> [f32; 8];
    // Sixteen-lane decoders, each what two of the 8-lane ones below give, joined (the `# Safety`
    // of those, for the bytes named here).
    /// # Safety
    /// `p` points to 32 readable bytes.
    unsafe fn f16x16(self, p: *const u8) -> Self::W;
    /// # Safety
    /// `p` points to 16 readable bytes.
    unsafe fn i8x16(self, p: *const u8) -> Self::W;
    /// `nib8(p, false)` in lanes 0–7, `nib8(p, true)` in lanes 8–15.
    ///
    /// # Safety
    /// `p` points to 8 readable bytes.
    unsafe fn nib16(self, p: *const u8) -> Self::W;
    /// `scale · nib16(p) + min`, each lane one fused multiply-add as [`Kernel::fmadd`] rounds it.
    ///
    /// # Safety
    /// `p` points to 8 readable bytes.
    unsafe fn nib16_scaled(self, p: *const u8, scale: f32, min: f32) -> Self::W;
    /// `crumb8(p, 2·pass, ..)` in lanes 0–7, `crumb8(p, 2·pass + 1, ..)` in lanes 8–15
    /// (`pass < 2`), both of the table in lanes 0..8 of `table`, whose 16 lanes repeat lanes
    /// 0..4 (a table built from [`CRUMB_CODES`] or a codebook's `table()`).
    ///
    /// # Safety
    /// `p` points to 8 readable bytes.
    unsafe fn crumb16(self, p: *const u8, pass: u32, table: Self::W) -> Self::W;

    // The decoders below read packed data straight from a page.
    //
    // # Safety
    // `p` points to the bytes read: 16 for `f16x8`, 8 for the others.

    /// Eight little-endian f16.
    unsafe fn f16x8(self, p: *const u8) -> Self::V;
    /// Eight int8.
    unsafe fn i8x8(self, p: *const u8) -> Self::V;
    /// Eight fp8 e4m3 codes (none a NaN code) times 2^-8: their bits moved into f16s
    /// ([`crate::quant::e4m3_to_f32_scaled`]).
    unsafe fn e4m3x8(self, p: *const u8) -> Self::V;
    /// Eight 4-bit codes, one from each of 8 bytes: the low nibbles (channels 0, 2, .., 14 of
    /// the 16 the bytes hold) or, with `high`, the high nibbles (channels 1, 3, .., 15).
    unsafe fn nib8(self, p: *const u8, high: bool) -> Self::V;
    /// `table[code]` for the eight 4-bit codes `nib8` reads (a codebook's levels).
    unsafe fn nib8_table(self, p: *const u8, high: bool, table: &[f32; 16]) -> Self::V;
    /// `table[code]` for eight 2-bit codes, one from each of 8 bytes: bits `2j..2j + 2`
    /// (channels `j, 4 + j, .., 28 + j` of the 32 the bytes hold; `j < 4`). Lanes 4..8 of
    /// `table` must repeat lanes 0..4 (as [`CRUMB_CODES`] does).
    unsafe fn crumb8(self, p: *const u8, j: u32, table: Self::V) -> Self::V;

    // Integer dot products of the `iq` key scores (llama.cpp's CPU path): 32 int8 codes per
    // register, multiplied by an int8 query block and summed in 32-bit integers.

    /// 32 bytes: int8 codes or query values.
    type B: Copy;
    /// 32 bytes as they are.
    ///
    /// # Safety
    /// `p` points to 32 readable bytes.
    unsafe fn bytes32(self, p: *const u8) -> Self::B;
    /// `Σ a[i]·s[i]` of int8 `a` and `s` (each in `[-127, 127]`), exact in 32-bit integers, as
    /// 8 f32 lanes whose sum is the dot product (lane `j` holds products `4j..4j + 4`).
    fn dot_i8_i8(self, a: Self::B, s: Self::B) -> Self::V;

    // The token-lane `iq` scores of 4- and 2-bit keys: sixteen keys side by side, one per
    // 32-bit lane, so that one `vpdpbusd` multiplies four codes of each of sixteen keys by the
    // same four query bytes and each key's score ends in its own lane, with no lane sums.

    /// Sixteen i32 lanes, lane `t` for key `t`.
    type I: Copy;
    fn izero(self) -> Self::I;
    /// Sixteen runs of 16 bytes, run `t` at `p + t·stride`, transposed: lane `t` of vector
    /// `j` holds bytes `4j..4j + 4` of run `t` (little-endian).
    ///
    /// # Safety
    /// The 16 bytes of each run are readable.
    unsafe fn dwords16(self, p: *const u8, stride: usize) -> [Self::I; 4];
    /// `(x >> shift) & mask` in every byte (`shift < 8`, and `mask >> (8 - shift)` zero): one
    /// field of the codes packed in each byte.
    fn byte_field(self, x: Self::I, shift: u32, mask: u8) -> Self::I;
    /// `acc + Σ_{i<4} u[i]·q[i]` in every lane, of the lane's unsigned bytes `u[i]` (each
    /// below 128) and the int8 bytes of `q` (little-endian), exact in 32-bit integers.
    fn dot4(self, acc: Self::I, u: Self::I, q: i32) -> Self::I;
    /// The lanes as f32 (exact for magnitudes below 2^24).
    fn i_to_f32(self, x: Self::I) -> Self::W;
    /// Lane `t` is `*p.add(t · stride)`.
    ///
    /// # Safety
    /// `p.add(t · stride)` is readable for every `t < 16`.
    unsafe fn wgather(self, p: *const f32, stride: usize) -> Self::W;

    /// One [`QUERY_BLOCK`](crate::quant::QUERY_BLOCK)-channel block of a query, the 32 lanes
    /// of `x` in order, rounded to int8 as [`crate::quant::quantize_query`] rounds it, to the
    /// bit: returns the block's scale and its codes as 8 little-endian dwords (code `4j + i`
    /// in byte `i` of dword `j`). `iq` scores of per-channel keys round each page's folded
    /// query with it, so the vector forms must not drift from the reference.
    #[inline(always)]
    fn round_query_block(self, x: [Self::V; 4]) -> (f32, [i32; 8]) {
        let mut lanes = [0f32; 32];
        for (v, out) in x.iter().zip(lanes.chunks_exact_mut(8)) {
            self.store(*v, out);
        }
        let (mut codes, mut scale) = ([0i8; 32], [0f32]);
        crate::quant::quantize_query(&lanes, &mut codes, &mut scale);
        let dwords = std::array::from_fn(|j| {
            i32::from_le_bytes(std::array::from_fn(|i| codes[4 * j + i] as u8))
        });
        (scale[0], dwords)
    }

    /// Hints that `bytes` will be read soon. Pages are scattered in the pool and hardware
    /// prefetchers stop at 4 KiB boundaries, so attention fetches the next block ahead.
    #[inline(always)]
    fn prefetch(self, bytes: &[u8]) {
        for at in (0..bytes.len()).step_by(64) {
            self.prefetch_line(&bytes[at..]);
        }
    }

    /// Hints that the cache line holding `bytes[0]` will be read soon (`bytes` not empty).
    #[inline(always)]
    fn prefetch_line(self, bytes: &[u8]) {
        let _ = bytes;
    }

    /// Converts little-endian f16 bytes to f32.
    #[inline(always)]
    fn f16_to_f32(self, src: &[u8], out: &mut [f32]) {
        let done = out.len() / 8 * 8;
        let mut chunks = out.chunks_exact_mut(8);
        for (o, b) in (&mut chunks).zip(src.chunks_exact(16)) {
            // SAFETY: `b` holds 16 bytes.
            self.store(unsafe { self.f16x8(b.as_ptr()) }, o);
        }
        for (j, o) in chunks.into_remainder().iter_mut().enumerate() {
            let at = 2 * (done + j);
            *o = f16::from_le_bytes([src[at], src[at + 1]]).to_f32();
        }
    }

    /// `x = 2^x` in place (for `x ≤ 0`; `-inf` gives 0): Cephes' degree-6 polynomial on
    /// `[-0.5, 0.5]`, relative error below 2e-7, the same formula in every kernel.
    #[inline(always)]
    fn exp2_in_place(self, xs: &mut [f32]) {
        for x in xs.iter_mut() {
            *x = exp2_poly(self, *x);
        }
    }

    /// `2^x` of one value (`x ≤ 0`), by [`Kernel::exp2_in_place`]'s formula: the softmax's
    /// per-block rescale of a row, where a call into libm's `exp2f` cost a vector-state switch
    /// and the spills around it.
    #[inline(always)]
    fn exp2(self, x: f32) -> f32 {
        exp2_poly(self, x)
    }

    /// The largest of `xs` (`-inf` when empty or all `-inf`; no NaN expected).
    #[inline(always)]
    fn max_of(self, xs: &[f32]) -> f32 {
        xs.iter().copied().fold(f32::NEG_INFINITY, f32::max)
    }

    /// `x = 2^(x - m)` in place (every `x ≤ m`), returning the sum of the results: one
    /// softmax block's weights and their total.
    #[inline(always)]
    fn exp2_shifted_sum(self, xs: &mut [f32], m: f32) -> f32 {
        xs.iter_mut().for_each(|x| *x -= m);
        self.exp2_in_place(xs);
        xs.iter().sum()
    }
}

/// The 2-bit codes as the lanes of a [`Kernel::crumb8`] (first 8) or [`Kernel::crumb16`]
/// table: lane `i` holds code `i % 4`. A per-token table is `fmadd(codes, scale, min)`, like
/// every other affine decode.
pub(crate) static CRUMB_CODES: [f32; 16] = [
    0.0, 1.0, 2.0, 3.0, 0.0, 1.0, 2.0, 3.0, 0.0, 1.0, 2.0, 3.0, 0.0, 1.0, 2.0, 3.0,
];

/// Coefficients of `2^f - 1 ≈ f · P(f)` on `[-0.5, 0.5]` (Cephes `exp2f`).
const EXP2_POLY: [f32; 6] = [
    1.535_336_2e-4,
    1.339_887_4e-3,
    9.618_437e-3,
    5.550_332_5e-2,
    2.402_264_8e-1,
    6.931_472e-1,
];

/// Below this, `2^x` is flushed to 0 (it would be subnormal).
const EXP2_MIN: f32 = -126.0;

#[inline(always)]
fn exp2_poly<K: Kernel>(k: K, x: f32) -> f32 {
    if x < EXP2_MIN {
        return 0.0;
    }
    // Ties to even, as the vector forms round (`_MM_FROUND_TO_NEAREST_INT`), and one
    // instruction where `round` (ties away) is a call into libm.
    let i = x.round_ties_even();
    let f = x - i;
    let p = EXP2_POLY[1..]
        .iter()
        .fold(EXP2_POLY[0], |p, &c| k.fma(p, f, c));
    let y = k.fma(f, p, 1.0);
    f32::from_bits((y.to_bits() as i32 + ((i as i32) << 23)) as u32)
}

/// [`Kernel::W`] as a pair of 8-lane vectors `$v`, for the builds without 16-lane vectors:
/// the same instructions as two 8-lane loops.
macro_rules! wide_as_pairs {
    ($v:ty) => {
        type W = [$v; 2];
        const VALUE_PASS: usize = 16;

        #[inline(always)]
        fn join(self, lo: $v, hi: $v) -> [$v; 2] {
            [lo, hi]
        }

        #[inline(always)]
        fn wsplat(self, x: f32) -> [$v; 2] {
            [Kernel::splat(self, x); 2]
        }

        #[inline(always)]
        unsafe fn wload_ptr(self, p: *const f32) -> [$v; 2] {
            // SAFETY: the caller guarantees 16 readable floats.
            unsafe { [Kernel::load_ptr(self, p), Kernel::load_ptr(self, p.add(8))] }
        }

        #[inline(always)]
        unsafe fn wstore_ptr(self, w: [$v; 2], p: *mut f32) {
            // SAFETY: the caller guarantees 16 writable floats.
            unsafe {
                Kernel::store_ptr(self, w[0], p);
                Kernel::store_ptr(self, w[1], p.add(8));
            }
        }

        #[inline(always)]
        fn wfmadd(self, a: [$v; 2], b: [$v; 2], c: [$v; 2]) -> [$v; 2] {
            [
                Kernel::fmadd(self, a[0], b[0], c[0]),
                Kernel::fmadd(self, a[1], b[1], c[1]),
            ]
        }

        #[inline(always)]
        fn wmul(self, a: [$v; 2], b: [$v; 2]) -> [$v; 2] {
            [Kernel::mul(self, a[0], b[0]), Kernel::mul(self, a[1], b[1])]
        }

        #[inline(always)]
        fn wrotate_split(self, x: [$v; 2], cs: [$v; 2]) -> [$v; 2] {
            let (a, b) = Kernel::rotate_split(self, x[0], x[1], cs[0], cs[1]);
            [a, b]
        }

        #[inline(always)]
        fn wrotate_pairs(
            self,
            a: [$v; 2],
            b: [$v; 2],
            c: [$v; 2],
            s: [$v; 2],
        ) -> ([$v; 2], [$v; 2]) {
            let (x0, y0) = Kernel::rotate_split(self, a[0], b[0], c[0], s[0]);
            let (x1, y1) = Kernel::rotate_split(self, a[1], b[1], c[1], s[1]);
            ([x0, x1], [y0, y1])
        }

        #[inline(always)]
        fn wsum8(self, w: [[$v; 2]; 8]) -> [f32; 8] {
            let mut folded = [Kernel::splat(self, 0.0); 8];
            for (f, w) in folded.iter_mut().zip(w) {
                *f = Kernel::add(self, w[0], w[1]);
            }
            Kernel::hsum8(self, folded)
        }

        #[inline(always)]
        unsafe fn f16x16(self, p: *const u8) -> [$v; 2] {
            // SAFETY: the caller guarantees 32 readable bytes.
            unsafe { [Kernel::f16x8(self, p), Kernel::f16x8(self, p.add(16))] }
        }

        #[inline(always)]
        unsafe fn i8x16(self, p: *const u8) -> [$v; 2] {
            // SAFETY: the caller guarantees 16 readable bytes.
            unsafe { [Kernel::i8x8(self, p), Kernel::i8x8(self, p.add(8))] }
        }

        #[inline(always)]
        unsafe fn nib16(self, p: *const u8) -> [$v; 2] {
            // SAFETY: the caller guarantees 8 readable bytes.
            unsafe { [Kernel::nib8(self, p, false), Kernel::nib8(self, p, true)] }
        }

        #[inline(always)]
        unsafe fn nib16_scaled(self, p: *const u8, scale: f32, min: f32) -> [$v; 2] {
            let (scale, min) = (Kernel::splat(self, scale), Kernel::splat(self, min));
            // SAFETY: the caller guarantees 8 readable bytes.
            let [lo, hi] = unsafe { [Kernel::nib8(self, p, false), Kernel::nib8(self, p, true)] };
            [
                Kernel::fmadd(self, lo, scale, min),
                Kernel::fmadd(self, hi, scale, min),
            ]
        }

        #[inline(always)]
        unsafe fn crumb16(self, p: *const u8, pass: u32, table: [$v; 2]) -> [$v; 2] {
            // SAFETY: the caller guarantees 8 readable bytes.
            unsafe {
                [
                    Kernel::crumb8(self, p, 2 * pass, table[0]),
                    Kernel::crumb8(self, p, 2 * pass + 1, table[0]),
                ]
            }
        }
    };
}

/// Any CPU: plain arrays the compiler may vectorize, separate multiply and add.
#[derive(Clone, Copy)]
pub(crate) struct Portable;

impl Kernel for Portable {
    type V = [f32; 8];

    #[inline(never)]
    fn run<R, F: KernelFn<R>>(self, f: F) -> R {
        f.call(self)
    }

    #[inline(always)]
    fn splat(self, x: f32) -> [f32; 8] {
        [x; 8]
    }

    #[inline(always)]
    unsafe fn load_ptr(self, p: *const f32) -> [f32; 8] {
        // SAFETY: the caller guarantees 8 readable floats.
        unsafe { p.cast::<[f32; 8]>().read_unaligned() }
    }

    #[inline(always)]
    unsafe fn store_ptr(self, v: [f32; 8], p: *mut f32) {
        // SAFETY: the caller guarantees 8 writable floats.
        unsafe { p.cast::<[f32; 8]>().write_unaligned(v) }
    }

    #[inline(always)]
    fn fmadd(self, a: [f32; 8], b: [f32; 8], c: [f32; 8]) -> [f32; 8] {
        std::array::from_fn(|i| a[i] * b[i] + c[i])
    }

    #[inline(always)]
    fn mul(self, a: [f32; 8], b: [f32; 8]) -> [f32; 8] {
        std::array::from_fn(|i| a[i] * b[i])
    }

    #[inline(always)]
    fn interleave(self, a: [f32; 8], b: [f32; 8]) -> ([f32; 8], [f32; 8]) {
        let lane = |i: usize| {
            if i.is_multiple_of(2) {
                a[i / 2]
            } else {
                b[i / 2]
            }
        };
        (
            std::array::from_fn(lane),
            std::array::from_fn(|i| lane(i + 8)),
        )
    }

    #[inline(always)]
    fn deinterleave(self, a: [f32; 8], b: [f32; 8]) -> ([f32; 8], [f32; 8]) {
        let lane = |i: usize| if i < 4 { a[2 * i] } else { b[2 * i - 8] };
        (
            std::array::from_fn(lane),
            std::array::from_fn(|i| if i < 4 { a[2 * i + 1] } else { b[2 * i - 7] }),
        )
    }

    #[inline(always)]
    fn rotate_pairs(self, x: [f32; 8], cs: [f32; 8]) -> [f32; 8] {
        std::array::from_fn(|i| {
            let (a, b, c, s) = (x[i & !1], x[i | 1], cs[i & !1], cs[i | 1]);
            if i.is_multiple_of(2) {
                a * c - b * s
            } else {
                a * s + b * c
            }
        })
    }

    #[inline(always)]
    fn rotate_split(
        self,
        a: [f32; 8],
        b: [f32; 8],
        c: [f32; 8],
        s: [f32; 8],
    ) -> ([f32; 8], [f32; 8]) {
        (
            std::array::from_fn(|i| a[i] * c[i] - b[i] * s[i]),
            std::array::from_fn(|i| a[i] * s[i] + b[i] * c[i]),
        )
    }

    #[inline(always)]
    fn hsum8(self, v: [[f32; 8]; 8]) -> [f32; 8] {
        v.map(|v| ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7])))
    }

    #[inline(always)]
    fn fma(self, a: f32, b: f32, c: f32) -> f32 {
        a * b + c
    }

    #[inline(always)]
    fn add(self, a: [f32; 8], b: [f32; 8]) -> [f32; 8] {
        std::array::from_fn(|i| a[i] + b[i])
    }

    wide_as_pairs!([f32; 8]);

    #[inline(always)]
    unsafe fn f16x8(self, p: *const u8) -> [f32; 8] {
        // SAFETY: the caller guarantees 16 readable bytes.
        let b = unsafe { p.cast::<[u8; 16]>().read_unaligned() };
        std::array::from_fn(|i| f16::from_le_bytes([b[2 * i], b[2 * i + 1]]).to_f32())
    }

    #[inline(always)]
    unsafe fn i8x8(self, p: *const u8) -> [f32; 8] {
        // SAFETY: the caller guarantees 8 readable bytes.
        let b = unsafe { p.cast::<[u8; 8]>().read_unaligned() };
        b.map(|x| f32::from(x as i8))
    }

    #[inline(always)]
    unsafe fn e4m3x8(self, p: *const u8) -> [f32; 8] {
        // SAFETY: the caller guarantees 8 readable bytes.
        let b = unsafe { p.cast::<[u8; 8]>().read_unaligned() };
        b.map(crate::quant::e4m3_to_f32_scaled)
    }

    #[inline(always)]
    unsafe fn nib8(self, p: *const u8, high: bool) -> [f32; 8] {
        // SAFETY: the caller guarantees 8 readable bytes.
        let b = unsafe { p.cast::<[u8; 8]>().read_unaligned() };
        b.map(|x| f32::from(if high { x >> 4 } else { x & 15 }))
    }

    #[inline(always)]
    unsafe fn nib8_table(self, p: *const u8, high: bool, table: &[f32; 16]) -> [f32; 8] {
        // SAFETY: the caller guarantees 8 readable bytes.
        let b = unsafe { p.cast::<[u8; 8]>().read_unaligned() };
        b.map(|x| table[usize::from(if high { x >> 4 } else { x & 15 })])
    }

    #[inline(always)]
    unsafe fn crumb8(self, p: *const u8, j: u32, table: [f32; 8]) -> [f32; 8] {
        // SAFETY: the caller guarantees 8 readable bytes.
        let b = unsafe { p.cast::<[u8; 8]>().read_unaligned() };
        b.map(|x| table[usize::from((x >> (2 * j)) & 3)])
    }

    type B = [u8; 32];

    #[inline(always)]
    unsafe fn bytes32(self, p: *const u8) -> [u8; 32] {
        // SAFETY: the caller guarantees 32 readable bytes.
        unsafe { p.cast::<[u8; 32]>().read_unaligned() }
    }

    #[inline(always)]
    fn dot_i8_i8(self, a: [u8; 32], s: [u8; 32]) -> [f32; 8] {
        std::array::from_fn(|j| {
            (4 * j..4 * j + 4)
                .map(|i| i32::from(a[i] as i8) * i32::from(s[i] as i8))
                .sum::<i32>() as f32
        })
    }

    type I = [i32; 16];

    #[inline(always)]
    fn izero(self) -> [i32; 16] {
        [0; 16]
    }

    #[inline(always)]
    unsafe fn dwords16(self, p: *const u8, stride: usize) -> [[i32; 16]; 4] {
        std::array::from_fn(|j| {
            std::array::from_fn(|t| {
                // SAFETY: the caller guarantees the 16 bytes at `p + t·stride`.
                i32::from_le_bytes(unsafe { p.add(t * stride + 4 * j).cast::<[u8; 4]>().read() })
            })
        })
    }

    #[inline(always)]
    fn byte_field(self, x: [i32; 16], shift: u32, mask: u8) -> [i32; 16] {
        let mask = i32::from_le_bytes([mask; 4]);
        x.map(|v| ((v as u32) >> shift) as i32 & mask)
    }

    #[inline(always)]
    fn dot4(self, acc: [i32; 16], u: [i32; 16], q: i32) -> [i32; 16] {
        let q = q.to_le_bytes();
        std::array::from_fn(|t| {
            let u = u[t].to_le_bytes();
            acc[t]
                + (0..4)
                    .map(|i| i32::from(u[i]) * i32::from(q[i] as i8))
                    .sum::<i32>()
        })
    }

    #[inline(always)]
    fn i_to_f32(self, x: [i32; 16]) -> [[f32; 8]; 2] {
        [
            std::array::from_fn(|i| x[i] as f32),
            std::array::from_fn(|i| x[8 + i] as f32),
        ]
    }

    #[inline(always)]
    unsafe fn wgather(self, p: *const f32, stride: usize) -> [[f32; 8]; 2] {
        // SAFETY: the caller guarantees every `p + t·stride`, `t < 16`.
        let lane = |t: usize| unsafe { *p.add(t * stride) };
        [
            std::array::from_fn(lane),
            std::array::from_fn(|i| lane(8 + i)),
        ]
    }
}

/// x86-64 with AVX2, FMA and F16C, and with `AVX512` also AVX-512 F/VL/BW/DQ and VNNI; only
/// constructed after detecting them. Both run the same code: the AVX-512 build gains 32 vector
/// registers instead of 16, which the register-blocked loops fill without spilling, 512-bit
/// multiply-adds in the score and value loops (each 16-lane [`Kernel::W`] one register, not
/// two), and `vpdpbusd` for the integer dot products.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
pub(crate) struct X86<const AVX512: bool>(());

/// [`X86`] with AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
pub(crate) type Avx2 = X86<false>;

/// [`X86`] with AVX-512 F/VL/BW/DQ and VNNI as well.
#[cfg(target_arch = "x86_64")]
pub(crate) type Avx512 = X86<true>;

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{Avx2, Avx512, EXP2_MIN, EXP2_POLY, Kernel, KernelFn, X86, exp2_poly};

    /// The low (or, with `high`, the high) nibbles of 8 bytes, one per 32-bit lane.
    ///
    /// # Safety
    /// `p` points to 8 readable bytes, and this CPU has AVX2 (an `Avx2` value exists).
    #[inline(always)]
    unsafe fn nibbles(p: *const u8, high: bool) -> __m256i {
        // SAFETY: the caller's contract. One zero-extending load gives a byte per lane; both
        // halves of a chunk load the same address, which the compiler merges.
        unsafe {
            let bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.cast()));
            if high {
                _mm256_srli_epi32::<4>(bytes)
            } else {
                _mm256_and_si256(bytes, _mm256_set1_epi32(15))
            }
        }
    }

    // SAFETY (every `unsafe` block below): a value of `X86` exists only after AVX2, FMA and
    // F16C (and for `X86<true>` the AVX-512 features `with_avx512` enables) were detected on
    // this CPU (see `dispatch`); memory is accessed only where the caller of an `unsafe fn`
    // guarantees it may be, or inside a slice whose length is checked first.
    /// [`Kernel::W`] and its operations per build: the type depends on `AVX512`, which one
    /// generic `impl Kernel` cannot express.
    pub(crate) trait Wide: Copy {
        type W: Copy;
        const VALUE_PASS: usize;
        fn join(self, lo: __m256, hi: __m256) -> Self::W;
        fn wsplat(self, x: f32) -> Self::W;
        /// # Safety
        /// As [`Kernel::wload_ptr`].
        unsafe fn wload_ptr(self, p: *const f32) -> Self::W;
        /// # Safety
        /// As [`Kernel::wstore_ptr`].
        unsafe fn wstore_ptr(self, w: Self::W, p: *mut f32);
        fn wfmadd(self, a: Self::W, b: Self::W, c: Self::W) -> Self::W;
        fn wmul(self, a: Self::W, b: Self::W) -> Self::W;
        fn wrotate_split(self, x: Self::W, cs: Self::W) -> Self::W;
        fn wrotate_pairs(
            self,
            a: Self::W,
            b: Self::W,
            c: Self::W,
            s: Self::W,
        ) -> (Self::W, Self::W);
        fn wsum8(self, w: [Self::W; 8]) -> [f32; 8];
        /// # Safety
        /// As [`Kernel::f16x16`].
        unsafe fn f16x16(self, p: *const u8) -> Self::W;
        /// # Safety
        /// As [`Kernel::i8x16`].
        unsafe fn i8x16(self, p: *const u8) -> Self::W;
        /// # Safety
        /// As [`Kernel::nib16`].
        unsafe fn nib16(self, p: *const u8) -> Self::W;
        /// # Safety
        /// As [`Kernel::nib16_scaled`].
        unsafe fn nib16_scaled(self, p: *const u8, scale: f32, min: f32) -> Self::W;
        /// # Safety
        /// As [`Kernel::crumb16`].
        unsafe fn crumb16(self, p: *const u8, pass: u32, table: Self::W) -> Self::W;
        type I: Copy;
        fn izero(self) -> Self::I;
        /// # Safety
        /// As [`Kernel::dwords16`].
        unsafe fn dwords16(self, p: *const u8, stride: usize) -> [Self::I; 4];
        fn byte_field(self, x: Self::I, shift: u32, mask: u8) -> Self::I;
        fn dot4(self, acc: Self::I, u: Self::I, q: i32) -> Self::I;
        fn i_to_f32(self, x: Self::I) -> Self::W;
        /// # Safety
        /// As [`Kernel::wgather`].
        unsafe fn wgather(self, p: *const f32, stride: usize) -> Self::W;
    }

    impl Wide for Avx2 {
        wide_as_pairs!(__m256);

        /// Lanes 0–7 and 8–15.
        type I = [__m256i; 2];

        #[inline(always)]
        fn izero(self) -> [__m256i; 2] {
            // SAFETY: see the module note; register-only.
            unsafe { [_mm256_setzero_si256(); 2] }
        }

        #[inline(always)]
        unsafe fn dwords16(self, p: *const u8, stride: usize) -> [[__m256i; 2]; 4] {
            // SAFETY: see the module note; the caller guarantees the 16 bytes of each run.
            // Per half of 8 runs: `[run i | run i + 4]` in two 128-bit blocks, then a 4 × 4
            // transpose of the dwords inside each block.
            unsafe {
                let half = |h: usize| {
                    let run = |t: usize| _mm_loadu_si128(p.add((8 * h + t) * stride).cast());
                    let a: [__m256i; 4] = std::array::from_fn(|i| {
                        _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(run(i)), run(i + 4))
                    });
                    transpose4(a)
                };
                let (lo, hi) = (half(0), half(1));
                std::array::from_fn(|j| [lo[j], hi[j]])
            }
        }

        #[inline(always)]
        fn byte_field(self, x: [__m256i; 2], shift: u32, mask: u8) -> [__m256i; 2] {
            // SAFETY: see the module note; register-only.
            unsafe {
                let (count, mask) = (
                    _mm_cvtsi32_si128(shift as i32),
                    _mm256_set1_epi8(mask as i8),
                );
                x.map(|x| _mm256_and_si256(_mm256_srl_epi32(x, count), mask))
            }
        }

        #[inline(always)]
        fn dot4(self, acc: [__m256i; 2], u: [__m256i; 2], q: i32) -> [__m256i; 2] {
            // SAFETY: see the module note; register-only. Pairs of products fit in 16 bits
            // (`2 · 127 · 127 < 2^15`), so `maddubs` never saturates.
            unsafe {
                let (q, ones) = (_mm256_set1_epi32(q), _mm256_set1_epi16(1));
                std::array::from_fn(|h| {
                    let pairs = _mm256_maddubs_epi16(u[h], q);
                    _mm256_add_epi32(acc[h], _mm256_madd_epi16(pairs, ones))
                })
            }
        }

        #[inline(always)]
        fn i_to_f32(self, x: [__m256i; 2]) -> [__m256; 2] {
            // SAFETY: see the module note; register-only.
            unsafe { x.map(|x| _mm256_cvtepi32_ps(x)) }
        }

        #[inline(always)]
        unsafe fn wgather(self, p: *const f32, stride: usize) -> [__m256; 2] {
            // SAFETY: see the module note; the caller guarantees every `p + t·stride`.
            unsafe {
                let at = _mm256_mullo_epi32(
                    _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                    _mm256_set1_epi32(stride as i32),
                );
                [
                    _mm256_i32gather_ps::<4>(p, at),
                    _mm256_i32gather_ps::<4>(p.add(8 * stride), at),
                ]
            }
        }
    }

    /// The 4 × 4 transposes of the dwords inside each 128-bit block of `a`: block `m` of
    /// result `j` holds dword `j` of block `m` of `a[0]`, `a[1]`, `a[2]` and `a[3]`.
    ///
    /// # Safety
    /// This CPU has AVX2.
    #[inline(always)]
    unsafe fn transpose4(a: [__m256i; 4]) -> [__m256i; 4] {
        // SAFETY: the caller's contract; register-only.
        unsafe {
            let (t0, t1) = (
                _mm256_unpacklo_epi32(a[0], a[1]),
                _mm256_unpackhi_epi32(a[0], a[1]),
            );
            let (t2, t3) = (
                _mm256_unpacklo_epi32(a[2], a[3]),
                _mm256_unpackhi_epi32(a[2], a[3]),
            );
            [
                _mm256_unpacklo_epi64(t0, t2),
                _mm256_unpackhi_epi64(t0, t2),
                _mm256_unpacklo_epi64(t1, t3),
                _mm256_unpackhi_epi64(t1, t3),
            ]
        }
    }

    impl Wide for Avx512 {
        type W = __m512;
        const VALUE_PASS: usize = 32;

        #[inline(always)]
        fn join(self, lo: __m256, hi: __m256) -> __m512 {
            // SAFETY: see the module note; register-only.
            unsafe { _mm512_insertf32x8::<1>(_mm512_castps256_ps512(lo), hi) }
        }

        #[inline(always)]
        fn wsplat(self, x: f32) -> __m512 {
            // SAFETY: see the module note; register-only.
            unsafe { _mm512_set1_ps(x) }
        }

        #[inline(always)]
        unsafe fn wload_ptr(self, p: *const f32) -> __m512 {
            // SAFETY: see the module note; the caller guarantees 16 readable floats.
            unsafe { _mm512_loadu_ps(p) }
        }

        #[inline(always)]
        unsafe fn wstore_ptr(self, w: __m512, p: *mut f32) {
            // SAFETY: see the module note; the caller guarantees 16 writable floats.
            unsafe { _mm512_storeu_ps(p, w) }
        }

        #[inline(always)]
        fn wfmadd(self, a: __m512, b: __m512, c: __m512) -> __m512 {
            // SAFETY: see the module note; register-only.
            unsafe { _mm512_fmadd_ps(a, b, c) }
        }

        #[inline(always)]
        fn wmul(self, a: __m512, b: __m512) -> __m512 {
            // SAFETY: see the module note; register-only.
            unsafe { _mm512_mul_ps(a, b) }
        }

        #[inline(always)]
        fn wrotate_split(self, x: __m512, cs: __m512) -> __m512 {
            // SAFETY: see the module note; register-only. With `[a | b]` swapped to `[b | a]`,
            // `x·[c | c]` and `swap·[s | s]` hold `a·c, b·c` and `b·s, a·s`: their difference
            // in lanes 0–7 and their sum in lanes 8–15.
            unsafe {
                let swapped = _mm512_shuffle_f32x4::<0b01_00_11_10>(x, x);
                let c = _mm512_shuffle_f32x4::<0b01_00_01_00>(cs, cs);
                let s = _mm512_shuffle_f32x4::<0b11_10_11_10>(cs, cs);
                let (xc, ys) = (_mm512_mul_ps(x, c), _mm512_mul_ps(swapped, s));
                _mm512_mask_sub_ps(_mm512_add_ps(xc, ys), 0x00ff, xc, ys)
            }
        }

        #[inline(always)]
        fn wrotate_pairs(self, a: __m512, b: __m512, c: __m512, s: __m512) -> (__m512, __m512) {
            // SAFETY: see the module note; register-only.
            unsafe {
                (
                    _mm512_sub_ps(_mm512_mul_ps(a, c), _mm512_mul_ps(b, s)),
                    _mm512_add_ps(_mm512_mul_ps(a, s), _mm512_mul_ps(b, c)),
                )
            }
        }

        #[inline(always)]
        fn wsum8(self, w: [__m512; 8]) -> [f32; 8] {
            // SAFETY: see the module note; register-only. Each round adds the two halves of
            // every vector's partial sums, two vectors' halves per register: 16 lanes, then 8,
            // then 4 per vector; the last two rounds add within 128-bit blocks.
            unsafe {
                /// `[a0 a1 b0 b1] + [a2 a3 b2 b3]`, in 128-bit blocks.
                #[inline(always)]
                unsafe fn halves(a: __m512, b: __m512) -> __m512 {
                    // SAFETY: the caller's; register-only.
                    unsafe {
                        _mm512_add_ps(
                            _mm512_shuffle_f32x4::<0b01_00_01_00>(a, b),
                            _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b),
                        )
                    }
                }
                /// `[a0 a2 b0 b2] + [a1 a3 b1 b3]`: of two `halves`, block k the sum of a
                /// vector's two.
                #[inline(always)]
                unsafe fn quarters(a: __m512, b: __m512) -> __m512 {
                    // SAFETY: the caller's; register-only.
                    unsafe {
                        _mm512_add_ps(
                            _mm512_shuffle_f32x4::<0b10_00_10_00>(a, b),
                            _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b),
                        )
                    }
                }
                // Block k of `low` holds 4 partial sums of w[k], of `high` of w[4 + k].
                let low = quarters(halves(w[0], w[1]), halves(w[2], w[3]));
                let high = quarters(halves(w[4], w[5]), halves(w[6], w[7]));
                // Per block: (l0 + l1, l2 + l3, h0 + h1, h2 + h3), then lanes 0 and 2 the sums.
                let pairs = _mm512_add_ps(
                    _mm512_shuffle_ps::<0b10_00_10_00>(low, high),
                    _mm512_shuffle_ps::<0b11_01_11_01>(low, high),
                );
                let sums = _mm512_add_ps(pairs, _mm512_shuffle_ps::<0b10_11_00_01>(pairs, pairs));
                let mut lanes = [0f32; 16];
                _mm512_storeu_ps(lanes.as_mut_ptr(), sums);
                std::array::from_fn(|i| lanes[4 * (i % 4) + 2 * (i / 4)])
            }
        }

        #[inline(always)]
        unsafe fn f16x16(self, p: *const u8) -> __m512 {
            // SAFETY: see the module note; the caller guarantees 32 readable bytes.
            unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())) }
        }

        #[inline(always)]
        unsafe fn i8x16(self, p: *const u8) -> __m512 {
            // SAFETY: see the module note; the caller guarantees 16 readable bytes.
            unsafe { _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p.cast()))) }
        }

        #[inline(always)]
        unsafe fn nib16(self, p: *const u8) -> __m512 {
            // SAFETY: see the module note; the caller guarantees 8 readable bytes.
            unsafe { _mm512_permutexvar_ps(nibble_indices(p), levels16()) }
        }

        #[inline(always)]
        unsafe fn nib16_scaled(self, p: *const u8, scale: f32, min: f32) -> __m512 {
            // SAFETY: see the module note; the caller guarantees 8 readable bytes. The 16
            // possible values, `scale · code + min` for each code, then one lookup per lane:
            // a permute instead of a mask, a conversion and a multiply-add.
            unsafe {
                let table = _mm512_fmadd_ps(levels16(), _mm512_set1_ps(scale), _mm512_set1_ps(min));
                _mm512_permutexvar_ps(nibble_indices(p), table)
            }
        }

        #[inline(always)]
        unsafe fn crumb16(self, p: *const u8, pass: u32, table: __m512) -> __m512 {
            // SAFETY: see the module note; the caller guarantees 8 readable bytes. As
            // `crumb8`: the 16-lane permute reads the low 4 bits of each index, and the
            // table repeats itself every 4 lanes.
            unsafe {
                let bytes = _mm512_cvtepu8_epi32(twice(p));
                let first = (4 * pass) as i32;
                let shift = _mm512_add_epi32(
                    _mm512_set1_epi32(first),
                    _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2),
                );
                _mm512_permutexvar_ps(_mm512_srlv_epi32(bytes, shift), table)
            }
        }

        type I = __m512i;

        #[inline(always)]
        fn izero(self) -> __m512i {
            // SAFETY: see the module note; register-only.
            unsafe { _mm512_setzero_si512() }
        }

        #[inline(always)]
        unsafe fn dwords16(self, p: *const u8, stride: usize) -> [__m512i; 4] {
            // SAFETY: see the module note; the caller guarantees the 16 bytes of each run.
            // `[run i | run i + 4 | run i + 8 | run i + 12]` in four 128-bit blocks, then a
            // 4 × 4 transpose of the dwords inside each block: lane `4m + i` of result `j` is
            // dword `j` of run `4m + i`.
            unsafe {
                let run = |t: usize| _mm_loadu_si128(p.add(t * stride).cast());
                let a: [__m512i; 4] = std::array::from_fn(|i| {
                    let lo =
                        _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(run(i)), run(i + 4));
                    let hi = _mm256_inserti128_si256::<1>(
                        _mm256_castsi128_si256(run(i + 8)),
                        run(i + 12),
                    );
                    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
                });
                let (t0, t1) = (
                    _mm512_unpacklo_epi32(a[0], a[1]),
                    _mm512_unpackhi_epi32(a[0], a[1]),
                );
                let (t2, t3) = (
                    _mm512_unpacklo_epi32(a[2], a[3]),
                    _mm512_unpackhi_epi32(a[2], a[3]),
                );
                [
                    _mm512_unpacklo_epi64(t0, t2),
                    _mm512_unpackhi_epi64(t0, t2),
                    _mm512_unpacklo_epi64(t1, t3),
                    _mm512_unpackhi_epi64(t1, t3),
                ]
            }
        }

        #[inline(always)]
        fn byte_field(self, x: __m512i, shift: u32, mask: u8) -> __m512i {
            // SAFETY: see the module note; register-only.
            unsafe {
                let shifted = _mm512_srl_epi32(x, _mm_cvtsi32_si128(shift as i32));
                _mm512_and_si512(shifted, _mm512_set1_epi8(mask as i8))
            }
        }

        #[inline(always)]
        fn dot4(self, acc: __m512i, u: __m512i, q: i32) -> __m512i {
            // SAFETY: see the module note; register-only (`with_avx512` enables VNNI).
            unsafe { _mm512_dpbusd_epi32(acc, u, _mm512_set1_epi32(q)) }
        }

        #[inline(always)]
        fn i_to_f32(self, x: __m512i) -> __m512 {
            // SAFETY: see the module note; register-only.
            unsafe { _mm512_cvtepi32_ps(x) }
        }

        #[inline(always)]
        unsafe fn wgather(self, p: *const f32, stride: usize) -> __m512 {
            // SAFETY: see the module note; the caller guarantees every `p + t·stride`.
            unsafe {
                let at = _mm512_mullo_epi32(
                    _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                    _mm512_set1_epi32(stride as i32),
                );
                _mm512_i32gather_ps::<4>(at, p)
            }
        }
    }

    /// The codes 0, 1, .., 15 as floats.
    ///
    /// # Safety
    /// This CPU has AVX-512F.
    #[inline(always)]
    unsafe fn levels16() -> __m512 {
        // SAFETY: the caller's contract; register-only.
        unsafe {
            _mm512_setr_ps(
                0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0,
                15.0,
            )
        }
    }

    /// The 8 bytes at `p` in lanes 0–7 and, shifted right by 4, in lanes 8–15: as indices of
    /// a 16-lane permute, which reads the low 4 bits of each, the low nibbles and then the high
    /// ones (`nib8`'s order).
    ///
    /// # Safety
    /// `p` points to 8 readable bytes, and this CPU has AVX-512F.
    #[inline(always)]
    unsafe fn nibble_indices(p: *const u8) -> __m512i {
        // SAFETY: the caller's contract.
        unsafe {
            let shift = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4);
            _mm512_srlv_epi32(_mm512_cvtepu8_epi32(twice(p)), shift)
        }
    }

    /// The 8 bytes at `p` twice: bytes 0–7 and 8–15 of the result.
    ///
    /// # Safety
    /// `p` points to 8 readable bytes, and this CPU has AVX2.
    #[inline(always)]
    unsafe fn twice(p: *const u8) -> __m128i {
        // SAFETY: the caller's contract.
        unsafe { _mm_set1_epi64x(p.cast::<i64>().read_unaligned()) }
    }

    impl<const AVX512: bool> Kernel for X86<AVX512>
    where
        X86<AVX512>: Wide,
    {
        #[inline(always)]
        fn run<R, F: KernelFn<R>>(self, f: F) -> R {
            // Not inlined: a caller with the same features would otherwise take it back in.
            #[target_feature(enable = "avx2,fma,f16c")]
            #[inline(never)]
            fn with_avx2<R, F: KernelFn<R>>(k: Avx2, f: F) -> R {
                f.call(k)
            }
            #[target_feature(
                enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq,avx512vnni"
            )]
            #[inline(never)]
            fn with_avx512<R, F: KernelFn<R>>(k: Avx512, f: F) -> R {
                f.call(k)
            }
            if AVX512 {
                // SAFETY: `self` proves that this CPU has what `with_avx512` enables.
                unsafe { with_avx512(X86(()), f) }
            } else {
                // SAFETY: `self` proves that this CPU has what `with_avx2` enables.
                unsafe { with_avx2(X86(()), f) }
            }
        }

        type V = __m256;

        #[inline(always)]
        fn splat(self, x: f32) -> __m256 {
            // SAFETY: see the module note; register-only.
            unsafe { _mm256_set1_ps(x) }
        }

        #[inline(always)]
        unsafe fn load_ptr(self, p: *const f32) -> __m256 {
            // SAFETY: see the module note; the caller guarantees 8 readable floats.
            unsafe { _mm256_loadu_ps(p) }
        }

        #[inline(always)]
        unsafe fn store_ptr(self, v: __m256, p: *mut f32) {
            // SAFETY: see the module note; the caller guarantees 8 writable floats.
            unsafe { _mm256_storeu_ps(p, v) }
        }

        #[inline(always)]
        fn fmadd(self, a: __m256, b: __m256, c: __m256) -> __m256 {
            // SAFETY: see the module note; register-only.
            unsafe { _mm256_fmadd_ps(a, b, c) }
        }

        #[inline(always)]
        fn mul(self, a: __m256, b: __m256) -> __m256 {
            // SAFETY: see the module note; register-only.
            unsafe { _mm256_mul_ps(a, b) }
        }

        #[inline(always)]
        fn interleave(self, a: __m256, b: __m256) -> (__m256, __m256) {
            // SAFETY: see the module note; register-only. The unpacks alternate within each
            // 128-bit half (a0 b0 a1 b1 | a4 b4 a5 b5 and a2 b2 a3 b3 | a6 b6 a7 b7); the
            // half permutes put the halves in order.
            unsafe {
                let (lo, hi) = (_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
                (
                    _mm256_permute2f128_ps(lo, hi, 0x20),
                    _mm256_permute2f128_ps(lo, hi, 0x31),
                )
            }
        }

        #[inline(always)]
        fn deinterleave(self, a: __m256, b: __m256) -> (__m256, __m256) {
            // SAFETY: see the module note; register-only. The half permutes pair a's halves
            // and b's (a0..a3 b0..b3, a4..a7 b4..b7); the shuffles take the even and the odd
            // lanes of each pair of halves.
            unsafe {
                let lo = _mm256_permute2f128_ps(a, b, 0x20);
                let hi = _mm256_permute2f128_ps(a, b, 0x31);
                (
                    _mm256_shuffle_ps(lo, hi, 0x88),
                    _mm256_shuffle_ps(lo, hi, 0xdd),
                )
            }
        }

        #[inline(always)]
        fn rotate_pairs(self, x: __m256, cs: __m256) -> __m256 {
            // SAFETY: see the module note; register-only. `addsub` subtracts in the even lanes
            // and adds in the odd ones: `a·c − b·s` and `b·c + a·s`.
            unsafe {
                let (c, s) = (_mm256_moveldup_ps(cs), _mm256_movehdup_ps(cs));
                let swapped = _mm256_permute_ps::<0b10_11_00_01>(x);
                _mm256_addsub_ps(_mm256_mul_ps(x, c), _mm256_mul_ps(swapped, s))
            }
        }

        #[inline(always)]
        fn rotate_split(self, a: __m256, b: __m256, c: __m256, s: __m256) -> (__m256, __m256) {
            // SAFETY: see the module note; register-only.
            unsafe {
                (
                    _mm256_sub_ps(_mm256_mul_ps(a, c), _mm256_mul_ps(b, s)),
                    _mm256_add_ps(_mm256_mul_ps(a, s), _mm256_mul_ps(b, c)),
                )
            }
        }

        #[inline(always)]
        fn hsum8(self, v: [__m256; 8]) -> [f32; 8] {
            // SAFETY: see the module note; register-only. Two rounds of pairwise adds leave
            // each vector's low-half sum in the low lanes and its high-half sum in the high
            // lanes; one cross-lane add finishes all eight.
            unsafe {
                let h = |a, b| _mm256_hadd_ps(a, b);
                let lo4 = h(h(v[0], v[1]), h(v[2], v[3]));
                let hi4 = h(h(v[4], v[5]), h(v[6], v[7]));
                let sums = _mm256_add_ps(
                    _mm256_permute2f128_ps(lo4, hi4, 0x20),
                    _mm256_permute2f128_ps(lo4, hi4, 0x31),
                );
                let mut out = [0f32; 8];
                _mm256_storeu_ps(out.as_mut_ptr(), sums);
                out
            }
        }

        #[inline(always)]
        fn fma(self, a: f32, b: f32, c: f32) -> f32 {
            a.mul_add(b, c)
        }

        #[inline(always)]
        fn add(self, a: __m256, b: __m256) -> __m256 {
            // SAFETY: see the module note; register-only.
            unsafe { _mm256_add_ps(a, b) }
        }

        type W = <Self as Wide>::W;
        const VALUE_PASS: usize = <Self as Wide>::VALUE_PASS;

        #[inline(always)]
        fn join(self, lo: __m256, hi: __m256) -> Self::W {
            Wide::join(self, lo, hi)
        }

        #[inline(always)]
        fn wsplat(self, x: f32) -> Self::W {
            Wide::wsplat(self, x)
        }

        #[inline(always)]
        unsafe fn wload_ptr(self, p: *const f32) -> Self::W {
            // SAFETY: the caller's contract is `Wide::wload_ptr`'s.
            unsafe { Wide::wload_ptr(self, p) }
        }

        #[inline(always)]
        unsafe fn wstore_ptr(self, w: Self::W, p: *mut f32) {
            // SAFETY: the caller's contract is `Wide::wstore_ptr`'s.
            unsafe { Wide::wstore_ptr(self, w, p) }
        }

        #[inline(always)]
        fn wfmadd(self, a: Self::W, b: Self::W, c: Self::W) -> Self::W {
            Wide::wfmadd(self, a, b, c)
        }

        #[inline(always)]
        fn wmul(self, a: Self::W, b: Self::W) -> Self::W {
            Wide::wmul(self, a, b)
        }

        #[inline(always)]
        fn wrotate_split(self, x: Self::W, cs: Self::W) -> Self::W {
            Wide::wrotate_split(self, x, cs)
        }

        #[inline(always)]
        fn wrotate_pairs(
            self,
            a: Self::W,
            b: Self::W,
            c: Self::W,
            s: Self::W,
        ) -> (Self::W, Self::W) {
            Wide::wrotate_pairs(self, a, b, c, s)
        }

        #[inline(always)]
        fn wsum8(self, w: [Self::W; 8]) -> [f32; 8] {
            Wide::wsum8(self, w)
        }

        #[inline(always)]
        unsafe fn f16x16(self, p: *const u8) -> Self::W {
            // SAFETY: the caller's contract is `Wide::f16x16`'s.
            unsafe { Wide::f16x16(self, p) }
        }

        #[inline(always)]
        unsafe fn i8x16(self, p: *const u8) -> Self::W {
            // SAFETY: the caller's contract is `Wide::i8x16`'s.
            unsafe { Wide::i8x16(self, p) }
        }

        #[inline(always)]
        unsafe fn nib16(self, p: *const u8) -> Self::W {
            // SAFETY: the caller's contract is `Wide::nib16`'s.
            unsafe { Wide::nib16(self, p) }
        }

        #[inline(always)]
        unsafe fn nib16_scaled(self, p: *const u8, scale: f32, min: f32) -> Self::W {
            // SAFETY: the caller's contract is `Wide::nib16_scaled`'s.
            unsafe { Wide::nib16_scaled(self, p, scale, min) }
        }

        #[inline(always)]
        unsafe fn crumb16(self, p: *const u8, pass: u32, table: Self::W) -> Self::W {
            // SAFETY: the caller's contract is `Wide::crumb16`'s.
            unsafe { Wide::crumb16(self, p, pass, table) }
        }

        #[inline(always)]
        fn prefetch_line(self, bytes: &[u8]) {
            // SAFETY: a prefetch of an address inside `bytes`; it never faults.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(bytes.as_ptr().cast()) }
        }

        #[inline(always)]
        unsafe fn f16x8(self, p: *const u8) -> __m256 {
            // SAFETY: see the module note; the caller guarantees 16 readable bytes.
            unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
        }

        #[inline(always)]
        unsafe fn i8x8(self, p: *const u8) -> __m256 {
            // SAFETY: see the module note; the caller guarantees 8 readable bytes.
            unsafe {
                let b = _mm_loadl_epi64(p.cast());
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b))
            }
        }

        #[inline(always)]
        unsafe fn e4m3x8(self, p: *const u8) -> __m256 {
            // SAFETY: see the module note; the caller guarantees 8 readable bytes.
            unsafe {
                let b = _mm_cvtepu8_epi16(_mm_loadl_epi64(p.cast()));
                let sign = _mm_slli_epi16::<8>(_mm_and_si128(b, _mm_set1_epi16(0x80)));
                let magnitude = _mm_slli_epi16::<7>(_mm_and_si128(b, _mm_set1_epi16(0x7f)));
                _mm256_cvtph_ps(_mm_or_si128(sign, magnitude))
            }
        }

        #[inline(always)]
        unsafe fn nib8(self, p: *const u8, high: bool) -> __m256 {
            // SAFETY: the caller guarantees 8 readable bytes.
            unsafe { _mm256_cvtepi32_ps(nibbles(p, high)) }
        }

        #[inline(always)]
        unsafe fn nib8_table(self, p: *const u8, high: bool, table: &[f32; 16]) -> __m256 {
            // SAFETY: see the module note; the caller guarantees 8 readable bytes and `table`
            // holds 16 floats. Two 8-entry lane permutes read the low 3 bits of each code; bit
            // 3, shifted into the sign, picks between them.
            unsafe {
                let codes = nibbles(p, high);
                let low = _mm256_permutevar8x32_ps(_mm256_loadu_ps(table.as_ptr()), codes);
                let high_half =
                    _mm256_permutevar8x32_ps(_mm256_loadu_ps(table.as_ptr().add(8)), codes);
                let pick = _mm256_castsi256_ps(_mm256_slli_epi32::<28>(codes));
                _mm256_blendv_ps(low, high_half, pick)
            }
        }

        #[inline(always)]
        unsafe fn crumb8(self, p: *const u8, j: u32, table: __m256) -> __m256 {
            // SAFETY: see the module note; the caller guarantees 8 readable bytes. The lane
            // permute reads the low 3 bits of each index, of which bit 2 is the next code's:
            // the table repeats itself past lane 4, so only bits 0..2 matter.
            unsafe {
                let bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.cast()));
                let index = _mm256_srlv_epi32(bytes, _mm256_set1_epi32((2 * j) as i32));
                _mm256_permutevar8x32_ps(table, index)
            }
        }

        type B = __m256i;

        #[inline(always)]
        unsafe fn bytes32(self, p: *const u8) -> __m256i {
            // SAFETY: see the module note; the caller guarantees 32 readable bytes.
            unsafe { _mm256_loadu_si256(p.cast()) }
        }

        #[inline(always)]
        fn dot_i8_i8(self, a: __m256i, s: __m256i) -> __m256 {
            // SAFETY: see the module note; register-only (`vpdpbusd` only where `AVX512`, whose
            // `with_avx512` enables VNNI). `|a|` against `s` with `a`'s signs; pairs of
            // products fit in 16 bits (`2 · 127 · 127 < 2^15`), so `maddubs` never saturates.
            unsafe {
                let (u, s) = (_mm256_sign_epi8(a, a), _mm256_sign_epi8(s, a));
                let sums = if AVX512 {
                    _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s)
                } else {
                    let pairs = _mm256_maddubs_epi16(u, s);
                    _mm256_madd_epi16(pairs, _mm256_set1_epi16(1))
                };
                _mm256_cvtepi32_ps(sums)
            }
        }

        type I = <Self as Wide>::I;

        #[inline(always)]
        fn izero(self) -> Self::I {
            Wide::izero(self)
        }

        #[inline(always)]
        unsafe fn dwords16(self, p: *const u8, stride: usize) -> [Self::I; 4] {
            // SAFETY: the caller's contract is `Wide::dwords16`'s.
            unsafe { Wide::dwords16(self, p, stride) }
        }

        #[inline(always)]
        fn byte_field(self, x: Self::I, shift: u32, mask: u8) -> Self::I {
            Wide::byte_field(self, x, shift, mask)
        }

        #[inline(always)]
        fn dot4(self, acc: Self::I, u: Self::I, q: i32) -> Self::I {
            Wide::dot4(self, acc, u, q)
        }

        #[inline(always)]
        fn i_to_f32(self, x: Self::I) -> Self::W {
            Wide::i_to_f32(self, x)
        }

        #[inline(always)]
        unsafe fn wgather(self, p: *const f32, stride: usize) -> Self::W {
            // SAFETY: the caller's contract is `Wide::wgather`'s.
            unsafe { Wide::wgather(self, p, stride) }
        }

        #[inline(always)]
        fn round_query_block(self, x: [__m256; 4]) -> (f32, [i32; 8]) {
            // Loops, not `array::map`: a closure does not take the enclosing function's target
            // features, and the intrinsics in it would be calls.
            // SAFETY: see the module note; register-only but for the store into `dwords`,
            // which holds 32 bytes.
            unsafe {
                // Magnitudes compare as their bit patterns, and NaN and ±inf have the largest:
                // one integer maximum finds both the block's largest magnitude and whether it
                // holds a NaN or an infinity.
                let magnitude = _mm256_set1_epi32(i32::MAX);
                let mut m8 = _mm256_setzero_si256();
                for v in x {
                    m8 = _mm256_max_epi32(m8, _mm256_and_si256(_mm256_castps_si256(v), magnitude));
                }
                let m4 = _mm_max_epi32(
                    _mm256_castsi256_si128(m8),
                    _mm256_extracti128_si256::<1>(m8),
                );
                let m2 = _mm_max_epi32(m4, _mm_unpackhi_epi64(m4, m4));
                let m1 = _mm_max_epi32(m2, _mm_shuffle_epi32::<1>(m2));
                let bits = _mm_cvtsi128_si32(m1) as u32;
                if bits >= f32::INFINITY.to_bits() {
                    // As `QueryScale::code` gives: a NaN scale, zero codes.
                    return (f32::NAN, [0; 8]);
                }
                let scale = crate::quant::QueryScale::new(f32::from_bits(bits));
                if scale.s == 0.0 {
                    return (scale.s, [0; 8]);
                }
                // `round` rounds halves away from zero: `(x·p)·inv` plus the largest float
                // below one half, with `x`'s sign, truncated, is that (a tie's sum rounds up to
                // the next integer, anything less stays below it). `|(x·p)·inv| < 127.5`, so no
                // code needs the reference's clamp.
                let (p, inv) = (_mm256_set1_ps(scale.p), _mm256_set1_ps(scale.inv));
                let sign = _mm256_set1_ps(-0.0);
                let below_half = _mm256_set1_ps(0.5 - f32::EPSILON / 4.0);
                let mut codes = [_mm256_setzero_si256(); 4];
                for (code, v) in codes.iter_mut().zip(x) {
                    let y = _mm256_mul_ps(_mm256_mul_ps(v, p), inv);
                    let half = _mm256_or_ps(_mm256_and_ps(y, sign), below_half);
                    *code = _mm256_cvttps_epi32(_mm256_add_ps(y, half));
                }
                // Packing saturates nothing (|code| <= 127) but interleaves the 128-bit lanes:
                // dwords [a0..4, b0..4, c0..4, d0..4 | a4..8, b4..8, c4..8, d4..8].
                let bytes = _mm256_packs_epi16(
                    _mm256_packs_epi32(codes[0], codes[1]),
                    _mm256_packs_epi32(codes[2], codes[3]),
                );
                let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
                let mut dwords = [0i32; 8];
                _mm256_storeu_si256(
                    dwords.as_mut_ptr().cast(),
                    _mm256_permutevar8x32_epi32(bytes, order),
                );
                (scale.s, dwords)
            }
        }

        #[inline(always)]
        fn exp2_in_place(self, xs: &mut [f32]) {
            let mut chunks = xs.chunks_exact_mut(8);
            for x8 in &mut chunks {
                // SAFETY: see the module note; `x8` holds exactly 8 floats.
                unsafe {
                    let x = _mm256_loadu_ps(x8.as_ptr());
                    _mm256_storeu_ps(x8.as_mut_ptr(), exp2_ps(x));
                }
            }
            for x in chunks.into_remainder() {
                *x = exp2_poly(self, *x);
            }
        }

        #[inline(always)]
        fn max_of(self, xs: &[f32]) -> f32 {
            let mut chunks = xs.chunks_exact(8);
            // SAFETY: see the module note; each chunk holds exactly 8 floats.
            let mut m = unsafe { _mm256_set1_ps(f32::NEG_INFINITY) };
            for x8 in &mut chunks {
                // SAFETY: as above.
                m = unsafe { _mm256_max_ps(m, _mm256_loadu_ps(x8.as_ptr())) };
            }
            let mut lanes = [0f32; 8];
            // SAFETY: as above; `lanes` holds 8 floats.
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), m) };
            lanes
                .into_iter()
                .chain(chunks.remainder().iter().copied())
                .fold(f32::NEG_INFINITY, f32::max)
        }

        #[inline(always)]
        fn exp2_shifted_sum(self, xs: &mut [f32], m: f32) -> f32 {
            let mut chunks = xs.chunks_exact_mut(8);
            // SAFETY: see the module note; register-only.
            let (shift, mut sum) = unsafe { (_mm256_set1_ps(m), _mm256_setzero_ps()) };
            for x8 in &mut chunks {
                // SAFETY: see the module note; `x8` holds exactly 8 floats.
                unsafe {
                    let y = exp2_ps(_mm256_sub_ps(_mm256_loadu_ps(x8.as_ptr()), shift));
                    _mm256_storeu_ps(x8.as_mut_ptr(), y);
                    sum = _mm256_add_ps(sum, y);
                }
            }
            // SAFETY: see the module note; register-only.
            let mut total = unsafe {
                let half = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
                let pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
                _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)))
            };
            for x in chunks.into_remainder() {
                *x = exp2_poly(self, *x - m);
                total += *x;
            }
            total
        }
    }

    /// `2^x` lane by lane, as [`exp2_poly`] computes it.
    #[inline(always)]
    fn exp2_ps(x: __m256) -> __m256 {
        // SAFETY: see the module note; register-only, and only inlined into functions of
        // `Avx2`, which exists only where AVX2 and FMA were detected.
        unsafe {
            let keep = _mm256_cmp_ps(x, _mm256_set1_ps(EXP2_MIN), _CMP_GE_OQ);
            let x = _mm256_max_ps(x, _mm256_set1_ps(EXP2_MIN));
            let i = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            let f = _mm256_sub_ps(x, i);
            let mut p = _mm256_set1_ps(EXP2_POLY[0]);
            for &c in &EXP2_POLY[1..] {
                p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(c));
            }
            let y = _mm256_fmadd_ps(f, p, _mm256_set1_ps(1.0));
            let e = _mm256_slli_epi32(_mm256_cvtps_epi32(i), 23);
            let y = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(y), e));
            _mm256_and_ps(y, keep)
        }
    }
}

/// A computation generic over the kernel arithmetic.
pub(crate) trait KernelFn<R> {
    fn call<K: Kernel>(self, k: K) -> R;
}

/// The instruction sets the CPU kernels can be built for, slowest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Tier {
    Portable,
    /// [`Avx2`].
    Avx2,
    /// [`Avx512`].
    Avx512,
}

impl Tier {
    /// The fastest tier this CPU has, capped by `HIPKV_CPU_SIMD` (`portable` or `avx2`; the
    /// tests use it to check the slower builds on a machine that has a faster one). Detected
    /// once.
    pub(crate) fn detected() -> Tier {
        static TIER: std::sync::OnceLock<Tier> = std::sync::OnceLock::new();
        *TIER.get_or_init(|| {
            let cap = match std::env::var("HIPKV_CPU_SIMD").as_deref() {
                Ok("portable") => Tier::Portable,
                Ok("avx2") => Tier::Avx2,
                _ => Tier::Avx512,
            };
            Tier::of_this_cpu().min(cap)
        })
    }

    fn of_this_cpu() -> Tier {
        #[cfg(target_arch = "x86_64")]
        {
            use std::is_x86_feature_detected as has;
            if !(has!("avx2") && has!("fma") && has!("f16c")) {
                return Tier::Portable;
            }
            if has!("avx512f")
                && has!("avx512vl")
                && has!("avx512bw")
                && has!("avx512dq")
                && has!("avx512vnni")
            {
                return Tier::Avx512;
            }
            Tier::Avx2
        }
        #[cfg(not(target_arch = "x86_64"))]
        Tier::Portable
    }

    /// What the kernels of this tier are built for, as `hipkv info` and `hipkv bench` print it.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Tier::Portable => "portable",
            Tier::Avx2 => "AVX2+FMA+F16C",
            Tier::Avx512 => "AVX-512+VNNI",
        }
    }
}

/// Runs `f` with the fastest arithmetic this CPU supports (see [`Tier::detected`]).
#[inline]
pub(crate) fn dispatch<R, F: KernelFn<R>>(f: F) -> R {
    match Tier::detected() {
        // `Tier::detected` checked that this CPU has what `Avx512` and `Avx2` stand for.
        #[cfg(target_arch = "x86_64")]
        Tier::Avx512 => X86::<true>(()).run(f),
        #[cfg(target_arch = "x86_64")]
        Tier::Avx2 => X86::<false>(()).run(f),
        _ => Portable.run(f),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `make()` run on each build of the kernels this CPU has, portable first.
    fn on_every_tier<R, F: KernelFn<R>>(make: impl Fn() -> F) -> Vec<(Tier, R)> {
        let mut out = vec![(Tier::Portable, make().call(Portable))];
        #[cfg(target_arch = "x86_64")]
        {
            let best = Tier::of_this_cpu();
            if best >= Tier::Avx2 {
                out.push((Tier::Avx2, X86::<false>(()).run(make())));
            }
            if best >= Tier::Avx512 {
                out.push((Tier::Avx512, X86::<true>(()).run(make())));
            }
        }
        out
    }

    /// Every primitive on fixed inputs, for comparing the two implementations.
    struct Primitives;
    impl KernelFn<Vec<f32>> for Primitives {
        fn call<K: Kernel>(self, k: K) -> Vec<f32> {
            let a: Vec<f32> = (0..8).map(|i| i as f32 * 0.25 - 1.0).collect();
            let b: Vec<f32> = (0..8).map(|i| (i % 3) as f32 + 0.5).collect();
            let halves: Vec<u8> = a
                .iter()
                .flat_map(|x| f16::from_f32(*x).to_le_bytes())
                .collect();
            let bytes = [0x10u8, 0xf2, 0x7f, 0x80, 0x01, 0xff, 0x00, 0x5a];
            let fp8 = [0x10u8, 0xf2, 0x7e, 0x80, 0x01, 0xfe, 0x00, 0x5a];
            let crumb_levels: Vec<f32> = CRUMB_CODES.iter().map(|c| c * 0.5 - 1.0).collect();
            // SAFETY: `crumb_levels` holds 16 floats.
            let table = unsafe { k.load_ptr(crumb_levels.as_ptr()) };
            let levels: [f32; 16] = std::array::from_fn(|i| (i * i) as f32 * 0.0625);
            let mut out = Vec::new();
            let mut buf = [0f32; 8];
            // SAFETY: `a` and `b` hold 8 floats each.
            let (va, vb) = unsafe { (k.load_ptr(a.as_ptr()), k.load_ptr(b.as_ptr())) };
            for v in [
                k.fmadd(va, vb, k.splat(0.5)),
                k.mul(va, vb),
                // SAFETY: `halves` holds 16 bytes, `bytes` 8.
                unsafe { k.f16x8(halves.as_ptr()) },
                unsafe { k.i8x8(bytes.as_ptr()) },
                unsafe { k.nib8(bytes.as_ptr(), false) },
                unsafe { k.nib8(bytes.as_ptr(), true) },
                unsafe { k.nib8_table(bytes.as_ptr(), false, &levels) },
                unsafe { k.nib8_table(bytes.as_ptr(), true, &levels) },
                unsafe { k.crumb8(bytes.as_ptr(), 0, table) },
                unsafe { k.crumb8(bytes.as_ptr(), 1, table) },
                unsafe { k.crumb8(bytes.as_ptr(), 2, table) },
                unsafe { k.crumb8(bytes.as_ptr(), 3, table) },
            ] {
                k.store(v, &mut buf);
                out.extend(buf);
            }
            let (one, prod) = (k.splat(1.0), k.mul(va, vb));
            out.extend(k.hsum8([va, vb, prod, one, vb, prod, va, one]));
            let (lo, hi) = k.interleave(va, vb);
            let (even, odd) = k.deinterleave(va, vb);
            let (first, second) = k.rotate_split(va, vb, prod, k.add(va, one));
            for v in [lo, hi, even, odd, first, second] {
                k.store(v, &mut buf);
                out.extend(buf);
            }
            let mut e = vec![
                -0.5f32,
                -3.0,
                0.0,
                f32::NEG_INFINITY,
                -7.25,
                -1.0,
                -2.5,
                -0.1,
                -9.0,
            ];
            k.exp2_in_place(&mut e);
            out.extend(e);
            // SAFETY: `fp8` holds 8 bytes.
            k.store(unsafe { k.e4m3x8(fp8.as_ptr()) }, &mut buf);
            out.extend(buf);
            out
        }
    }

    /// Each 16-lane primitive, and what two 8-lane ones give for the same lanes.
    struct WidePrimitives;
    impl KernelFn<(Vec<f32>, Vec<f32>)> for WidePrimitives {
        fn call<K: Kernel>(self, k: K) -> (Vec<f32>, Vec<f32>) {
            let a: Vec<f32> = (0..16).map(|i| i as f32 * 0.25 - 1.5).collect();
            let b: Vec<f32> = (0..16).map(|i| (i % 5) as f32 - 1.75).collect();
            let halves: Vec<u8> = a
                .iter()
                .flat_map(|x| f16::from_f32(*x).to_le_bytes())
                .collect();
            let bytes = [
                0x10u8, 0xf2, 0x7f, 0x80, 0x01, 0xff, 0x00, 0x5a, 0x3c, 0xc3, 0x81, 0x7e, 0x55,
                0xaa, 0x0f, 0xf0,
            ];
            let levels: Vec<f32> = CRUMB_CODES.iter().map(|c| c * 0.5 - 1.0).collect();
            let (mut wide, mut pairs) = (Vec::new(), Vec::new());
            let mut buf = [0f32; 16];
            // SAFETY: `a` and `b` hold 16 floats, `halves` 32 bytes and `bytes` 16; `buf` 16
            // floats.
            unsafe {
                let (table, wide_table) =
                    (k.load_ptr(levels.as_ptr()), k.wload_ptr(levels.as_ptr()));
                let (wa, wb) = (k.wload_ptr(a.as_ptr()), k.wload_ptr(b.as_ptr()));
                let (a0, a1) = (k.load_ptr(a.as_ptr()), k.load_ptr(a.as_ptr().add(8)));
                let (b0, b1) = (k.load_ptr(b.as_ptr()), k.load_ptr(b.as_ptr().add(8)));
                let p = bytes.as_ptr();
                let (cos, sin) = (0.6, -0.8);
                let turned = k.wrotate_pairs(wa, wb, k.wsplat(cos), k.wsplat(sin));
                let (first, second) = (
                    k.rotate_split(a0, b0, k.splat(cos), k.splat(sin)),
                    k.rotate_split(a1, b1, k.splat(cos), k.splat(sin)),
                );
                for w in [
                    k.wfmadd(wa, wb, k.wsplat(0.5)),
                    k.wmul(wa, wb),
                    k.wrotate_split(wa, wb),
                    turned.0,
                    turned.1,
                    k.join(a0, b1),
                    k.f16x16(halves.as_ptr()),
                    k.i8x16(p),
                    k.nib16(p),
                    k.nib16(p.add(8)),
                    k.nib16_scaled(p, 0.37, -1.3),
                    k.crumb16(p, 0, wide_table),
                    k.crumb16(p, 1, wide_table),
                ] {
                    k.wstore_ptr(w, buf.as_mut_ptr());
                    wide.extend(buf);
                }
                for [lo, hi] in [
                    [k.fmadd(a0, b0, k.splat(0.5)), k.fmadd(a1, b1, k.splat(0.5))],
                    [k.mul(a0, b0), k.mul(a1, b1)],
                    {
                        let (first, second) = k.rotate_split(a0, a1, b0, b1);
                        [first, second]
                    },
                    [first.0, second.0],
                    [first.1, second.1],
                    [a0, b1],
                    [k.f16x8(halves.as_ptr()), k.f16x8(halves.as_ptr().add(16))],
                    [k.i8x8(p), k.i8x8(p.add(8))],
                    [k.nib8(p, false), k.nib8(p, true)],
                    [k.nib8(p.add(8), false), k.nib8(p.add(8), true)],
                    [
                        k.fmadd(k.nib8(p, false), k.splat(0.37), k.splat(-1.3)),
                        k.fmadd(k.nib8(p, true), k.splat(0.37), k.splat(-1.3)),
                    ],
                    [k.crumb8(p, 0, table), k.crumb8(p, 1, table)],
                    [k.crumb8(p, 2, table), k.crumb8(p, 3, table)],
                ] {
                    k.store(lo, &mut buf[..8]);
                    k.store(hi, &mut buf[8..]);
                    pairs.extend(buf);
                }
            }
            (wide, pairs)
        }
    }

    /// `wsum8` of eight 16-lane vectors of distinct values.
    struct WideSums;
    impl KernelFn<[f32; 8]> for WideSums {
        fn call<K: Kernel>(self, k: K) -> [f32; 8] {
            let mut w = [k.wsplat(0.0); 8];
            for (v, w) in w.iter_mut().enumerate() {
                let lanes: Vec<f32> = (0..16).map(|l| wide_sum_lane(v, l)).collect();
                // SAFETY: `lanes` holds 16 floats.
                *w = unsafe { k.wload_ptr(lanes.as_ptr()) };
            }
            k.wsum8(w)
        }
    }

    fn wide_sum_lane(v: usize, l: usize) -> f32 {
        ((v * 16 + l) as f32 * 0.37).sin() * (1 + v) as f32
    }

    #[test]
    fn every_tiers_wide_sums_add_each_vectors_lanes() {
        for (tier, sums) in on_every_tier(|| WideSums) {
            for (v, sum) in sums.iter().enumerate() {
                let exact: f64 = (0..16).map(|l| f64::from(wide_sum_lane(v, l))).sum();
                assert!(
                    (f64::from(*sum) - exact).abs() <= 1e-5,
                    "{tier:?}, vector {v}: {sum} vs {exact}"
                );
            }
        }
    }

    #[test]
    fn every_tiers_wide_primitives_are_two_narrow_ones_joined() {
        for (tier, (wide, pairs)) in on_every_tier(|| WidePrimitives) {
            assert_eq!(wide.len(), 13 * 16);
            for (i, (w, p)) in wide.iter().zip(&pairs).enumerate() {
                assert_eq!(w.to_bits(), p.to_bits(), "{tier:?}, value {i}: {w} vs {p}");
            }
        }
    }

    #[test]
    fn every_tiers_primitives_agree_with_the_portable_ones() {
        let tiers = on_every_tier(|| Primitives);
        let portable = &tiers[0].1;
        for (tier, fast) in &tiers[1..] {
            for (i, (f, p)) in fast.iter().zip(portable).enumerate() {
                assert!(
                    (f - p).abs() <= 1e-6 * p.abs().max(1.0),
                    "{tier:?}, value {i}: {f} vs {p}"
                );
            }
        }
        // Decoded codes: int8, then 4-bit (low nibbles, high nibbles) and 2-bit (bits 0..2,
        // .., bits 6..8 of each byte, through the table `0.5 · code - 1`).
        assert_eq!(
            &portable[24..32],
            &[16.0, -14.0, 127.0, -128.0, 1.0, -1.0, 0.0, 90.0]
        );
        assert_eq!(
            &portable[32..40],
            &[0.0, 2.0, 15.0, 0.0, 1.0, 15.0, 0.0, 10.0]
        );
        assert_eq!(
            &portable[40..48],
            &[1.0, 15.0, 7.0, 8.0, 0.0, 15.0, 0.0, 5.0]
        );
        // The nibbles looked up in the table of i²/16.
        let looked_up: Vec<f32> = portable[32..48].iter().map(|&c| c * c * 0.0625).collect();
        assert_eq!(&portable[48..64], &looked_up[..]);
        let crumbs: Vec<f32> = [
            [0, 2, 3, 0, 1, 3, 0, 2],
            [0, 0, 3, 0, 0, 3, 0, 2],
            [1, 3, 3, 0, 0, 3, 0, 1],
            [0, 3, 1, 2, 0, 3, 0, 1],
        ]
        .iter()
        .flatten()
        .map(|&c| 0.5 * c as f32 - 1.0)
        .collect();
        assert_eq!(&portable[64..96], &crumbs[..]);
        // `a` and `b` alternated, after the eight lane sums.
        let alternated: Vec<f32> = (0..8)
            .flat_map(|i| [i as f32 * 0.25 - 1.0, (i % 3) as f32 + 0.5])
            .collect();
        assert_eq!(&portable[104..120], &alternated[..]);
        // fp8 codes, each its e4m3 value times 2^-8.
        let fp8: Vec<f32> = [0x10u8, 0xf2, 0x7e, 0x80, 0x01, 0xfe, 0x00, 0x5a]
            .iter()
            .map(|&c| crate::quant::e4m3_to_f32(c) / 256.0)
            .collect();
        assert_eq!(&portable[portable.len() - 8..], &fp8[..]);
    }

    /// `(max_of, exp2_shifted_sum, the shifted values)` of some scores.
    struct SoftmaxBlock(Vec<f32>);
    impl KernelFn<(f32, f32, Vec<f32>)> for SoftmaxBlock {
        fn call<K: Kernel>(mut self, k: K) -> (f32, f32, Vec<f32>) {
            let m = k.max_of(&self.0);
            let sum = k.exp2_shifted_sum(&mut self.0, m);
            (m, sum, self.0)
        }
    }

    #[test]
    fn softmax_block_primitives_agree_and_handle_tails_and_masks() {
        // Lengths around the 8-lane width, a masked (-inf) tail, the maximum in the tail.
        for n in [1, 7, 8, 9, 31, 32, 33] {
            let mut xs: Vec<f32> = (0..n).map(|i| ((i * 7) % 11) as f32 * 0.75 - 4.0).collect();
            xs[n - 1] = 9.5;
            if n > 3 {
                xs[1] = f32::NEG_INFINITY;
            }
            let want_sum: f64 = xs.iter().map(|&x| f64::from(x - 9.5).exp2()).sum();
            for (_, (m, sum, ys)) in on_every_tier(|| SoftmaxBlock(xs.clone())) {
                assert_eq!(m, 9.5, "n = {n}");
                assert!(
                    ((f64::from(sum) - want_sum) / want_sum).abs() < 1e-6,
                    "n = {n}"
                );
                assert_eq!(ys[n - 1], 1.0);
                if n > 3 {
                    assert_eq!(ys[1], 0.0);
                }
            }
        }
        for (tier, empty) in on_every_tier(|| SoftmaxBlock(Vec::new())) {
            assert_eq!((empty.0, empty.1), (f32::NEG_INFINITY, 0.0), "{tier:?}");
        }
    }

    struct Exp2(Vec<f32>);
    impl KernelFn<Vec<f32>> for Exp2 {
        fn call<K: Kernel>(mut self, k: K) -> Vec<f32> {
            k.exp2_in_place(&mut self.0);
            self.0
        }
    }

    /// Each value through the one-value `Kernel::exp2`.
    struct Exp2Each(Vec<f32>);
    impl KernelFn<Vec<f32>> for Exp2Each {
        fn call<K: Kernel>(mut self, k: K) -> Vec<f32> {
            self.0.iter_mut().for_each(|x| *x = k.exp2(*x));
            self.0
        }
    }

    /// The one-value form gives the vector lanes' bits on every tier, ties included (`x` an
    /// odd multiple of 0.5, which the reduction rounds to even as the vector forms do).
    #[test]
    fn exp2_of_one_value_matches_the_lanes() {
        let xs: Vec<f32> = (0..4_001).map(|i| -(i as f32) * 0.031_25).collect();
        let lanes = on_every_tier(|| Exp2(xs.clone()));
        let each = on_every_tier(|| Exp2Each(xs.clone()));
        for ((tier, lanes), (_, each)) in lanes.into_iter().zip(each) {
            for ((&x, &a), &b) in xs.iter().zip(&lanes).zip(&each) {
                assert_eq!(a.to_bits(), b.to_bits(), "{tier:?}: 2^{x}");
            }
        }
    }

    #[test]
    fn exp2_is_accurate_on_the_softmax_range() {
        let xs: Vec<f32> = (0..20_001).map(|i| -(i as f32) * 0.006_25).collect();
        for (_, got) in on_every_tier(|| Exp2(xs.clone())) {
            for (&x, &y) in xs.iter().zip(&got) {
                let want = f64::from(x).exp2();
                let rel = ((f64::from(y) - want) / want).abs();
                assert!(rel < 2e-7, "2^{x}: {y} vs {want} (rel {rel:e})");
            }
        }
        let special = || {
            Exp2(vec![
                f32::NEG_INFINITY,
                -200.0,
                0.0,
                -1.0,
                3.0,
                -127.5,
                -126.0,
            ])
        };
        for (tier, got) in on_every_tier(special) {
            let want = vec![0.0, 0.0, 1.0, 0.5, 8.0, 0.0, 2f32.powi(-126)];
            assert_eq!(got, want, "{tier:?}");
        }
    }

    /// The integer dot products of `iq` on fixed codes and queries: 32 packed bytes read as
    /// int8, against queries at both ends of `[-127, 127]`.
    struct IntegerDots {
        packed: [u8; 32],
        query: [i8; 32],
    }
    impl KernelFn<Vec<f32>> for IntegerDots {
        fn call<K: Kernel>(self, k: K) -> Vec<f32> {
            let mut out = [0f32; 8];
            // SAFETY: `packed` and `query` hold 32 bytes each.
            unsafe {
                let q = k.bytes32(self.query.as_ptr().cast());
                k.store(k.dot_i8_i8(k.bytes32(self.packed.as_ptr()), q), &mut out);
            }
            out.to_vec()
        }
    }

    #[test]
    fn integer_dot_products_are_exact() {
        let mut rng = crate::synth::Rng::new(5);
        for case in 0..64 {
            let mut packed: [u8; 32] = std::array::from_fn(|_| rng.below(256) as u8);
            let query: [i8; 32] = std::array::from_fn(|_| match case {
                0 => 127,
                1 => -127,
                _ => (rng.below(255) as i32 - 127) as i8,
            });
            if case < 2 {
                // The largest magnitude of an int8 code, -128, against the largest queries.
                packed.fill(0x80);
            }
            let want: Vec<f32> = (0..8)
                .map(|j| {
                    (4 * j..4 * j + 4)
                        .map(|p| i32::from(packed[p] as i8) * i32::from(query[p]))
                        .sum::<i32>() as f32
                })
                .collect();
            for (tier, got) in on_every_tier(|| IntegerDots { packed, query }) {
                assert_eq!(got, want, "{tier:?}, case {case}");
            }
        }
    }

    /// The token-lane primitives: sixteen runs of 16 bytes at a stride, transposed, a code
    /// field masked out and multiplied by four query bytes, accumulated twice, converted; and
    /// a strided gather.
    struct TokenLanes {
        runs: Vec<u8>,
        stride: usize,
        shift: u32,
        mask: u8,
        query: [i32; 2],
        floats: Vec<f32>,
    }
    impl KernelFn<Vec<f32>> for TokenLanes {
        fn call<K: Kernel>(self, k: K) -> Vec<f32> {
            assert!(self.runs.len() >= 15 * self.stride + 16 && self.floats.len() > 15 * 3);
            let mut out = vec![0f32; 16 * 5];
            // SAFETY: every run's 16 bytes and every third float lie within the vectors
            // (checked above); `out` holds 5 × 16 floats.
            unsafe {
                let words = k.dwords16(self.runs.as_ptr(), self.stride);
                for (j, &w) in words.iter().enumerate() {
                    let field = k.byte_field(w, self.shift, self.mask);
                    let acc = k.dot4(k.izero(), field, self.query[0]);
                    let acc = k.dot4(acc, field, self.query[1]);
                    k.wstore_ptr(k.i_to_f32(acc), out.as_mut_ptr().add(16 * j));
                }
                let gathered = k.wgather(self.floats.as_ptr(), 3);
                k.wstore_ptr(gathered, out.as_mut_ptr().add(64));
            }
            out
        }
    }

    #[test]
    fn token_lanes_transpose_mask_and_multiply_exactly() {
        let mut rng = crate::synth::Rng::new(6);
        for (case, (shift, mask)) in [(0, 15), (4, 15), (0, 3), (2, 3), (4, 3), (6, 3), (0, 127)]
            .into_iter()
            .enumerate()
        {
            let stride = 16 + 8 * case;
            let mut runs: Vec<u8> = (0..16 * stride).map(|_| rng.below(256) as u8).collect();
            if case == 0 {
                // The largest products: all-ones codes.
                runs.fill(0xff);
            }
            let query: [i32; 2] = std::array::from_fn(|i| match (case, i) {
                (0, 0) => i32::from_le_bytes([127u8; 4]),
                (0, _) => i32::from_le_bytes([(-127i8) as u8; 4]),
                _ => {
                    i32::from_le_bytes(std::array::from_fn(|_| (rng.below(255) as i32 - 127) as u8))
                }
            });
            let floats: Vec<f32> = (0..48).map(|i| i as f32 * 0.5 - 3.0).collect();
            let mut want = Vec::new();
            for j in 0..4 {
                for t in 0..16 {
                    let bytes = &runs[t * stride + 4 * j..t * stride + 4 * j + 4];
                    let dot = |q: i32| -> i32 {
                        let q = q.to_le_bytes();
                        (0..4)
                            .map(|i| i32::from((bytes[i] >> shift) & mask) * i32::from(q[i] as i8))
                            .sum()
                    };
                    want.push((dot(query[0]) + dot(query[1])) as f32);
                }
            }
            want.extend((0..16).map(|t| floats[3 * t]));
            for (tier, got) in on_every_tier(|| TokenLanes {
                runs: runs.clone(),
                stride,
                shift,
                mask,
                query,
                floats: floats.clone(),
            }) {
                assert_eq!(got, want, "{tier:?}, case {case}");
            }
        }
    }

    /// Rounds every block of `blocks` with [`Kernel::round_query_block`].
    struct RoundQueryBlocks(Vec<[f32; 32]>);
    impl KernelFn<Vec<(f32, [i32; 8])>> for RoundQueryBlocks {
        fn call<K: Kernel>(self, k: K) -> Vec<(f32, [i32; 8])> {
            self.0
                .iter()
                .map(|block| {
                    // SAFETY: each block holds 32 floats, 8 per load.
                    let x =
                        std::array::from_fn(|i| unsafe { k.load_ptr(block.as_ptr().add(8 * i)) });
                    k.round_query_block(x)
                })
                .collect()
        }
    }

    #[test]
    fn every_tier_rounds_a_query_block_as_the_reference() {
        let blocks = crate::synth::query_rounding_blocks();
        let want: Vec<(f32, [i32; 8])> = blocks
            .iter()
            .map(|block| {
                let (mut codes, mut scale) = ([0i8; 32], [0f32]);
                crate::quant::quantize_query(block, &mut codes, &mut scale);
                let dwords = std::array::from_fn(|j| {
                    i32::from_le_bytes(std::array::from_fn(|i| codes[4 * j + i] as u8))
                });
                (scale[0], dwords)
            })
            .collect();
        for (tier, got) in on_every_tier(|| RoundQueryBlocks(blocks.clone())) {
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                let same_scale = g.0.to_bits() == w.0.to_bits() || (g.0.is_nan() && w.0.is_nan());
                assert!(
                    same_scale && g.1 == w.1,
                    "{tier:?}, block {i}: {g:?} vs {w:?}"
                );
            }
        }
    }
}
