//! Each format's rows decoded into vector registers, 8 channels at a time, in the channel order
//! the format packs them in; and the parameters of a run of rows converted to f32 once.

use std::marker::PhantomData;

use crate::quant::{Codebook, get_f16};
use crate::scheme::{Format, LowBits, Q8_0_BLOCK, Q8_0_BLOCK_BYTES};

use super::super::simd::{CRUMB_CODES, Kernel};
use super::view::StreamBlock;

/// Binds `$rows` to the [`Rows`] decoder of stream block `$s` (its parameters converted into
/// `$buf`) and evaluates `$body`, monomorphized for each format.
macro_rules! with_rows {
    ($k:expr, $s:expr, $n:expr, $buf:ident, |$rows:ident| $body:expr) => {{
        let s: &StreamBlock<'_> = &$s;
        let d = s.head_dim;
        assert_eq!(s.row_bytes, s.format.row_bytes(d));
        s.params_f32($k, $n, &mut $buf);
        let packed = Packed::new(s.rows, s.row_bytes, $n);
        match s.format {
            Format::F16 => {
                let $rows = F16Rows { packed };
                $body
            }
            Format::Q8 => {
                assert!($buf.len() >= $n);
                let $rows = ScaledRows::<Int8> {
                    packed,
                    scales: &$buf,
                    code: ::std::marker::PhantomData,
                };
                $body
            }
            Format::Fp8 => {
                assert!($buf.len() >= $n);
                let $rows = ScaledRows::<E4m3> {
                    packed,
                    scales: &$buf,
                    code: ::std::marker::PhantomData,
                };
                $body
            }
            Format::Q8_0 => {
                let blocks = d / Q8_0_BLOCK;
                assert!($buf.len() >= $n * blocks);
                let $rows = Q80Rows {
                    packed,
                    scales: &$buf,
                    blocks,
                };
                $body
            }
            Format::Tok { bits, group } => {
                let group = group.size(d);
                let (groups, group_shift) = (d / group, group.trailing_zeros());
                assert!(group.is_power_of_two() && $buf.len() >= 2 * groups * $n);
                let params = &$buf;
                assert!(group >= 32 && d.is_multiple_of(32));
                match bits {
                    LowBits::Four => {
                        let $rows = TokRows::<4> {
                            codes: ChanCodes {
                                packed,
                                book: s.book,
                            },
                            params,
                            groups,
                            group_shift,
                        };
                        $body
                    }
                    LowBits::Two => {
                        let $rows = TokRows::<2> {
                            codes: ChanCodes {
                                packed,
                                book: s.book,
                            },
                            params,
                            groups,
                            group_shift,
                        };
                        $body
                    }
                }
            }
            Format::Chan { bits } => {
                let (scale, min) = $buf.split_at(d);
                assert!(min.len() == d && d.is_multiple_of(32));
                match bits {
                    LowBits::Four => {
                        let codes = ChanCodes::<4> {
                            packed,
                            book: s.book,
                        };
                        let $rows = ChanRows { codes, scale, min };
                        $body
                    }
                    LowBits::Two => {
                        let codes = ChanCodes::<2> {
                            packed,
                            book: s.book,
                        };
                        let $rows = ChanRows { codes, scale, min };
                        $body
                    }
                }
            }
        }
    }};
}
pub(super) use with_rows;

/// The order in which the attention loops see a stream's channels. A 4-bit or 2-bit code row
/// decodes 16 or 32 channels per 8-byte load only in an interleaved order, so the loops keep
/// the queries (keys) and the output accumulators (values) in the order of the stream's format
/// and put the accumulators back once per work item: dot products and per-channel sums do not
/// care about order. Every chunk of 16 or 32 channels stays in place, and so within one
/// quantization group (groups have at least 32 channels).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Order {
    /// Channel `c` at position `c`.
    Natural,
    /// 4-bit codes, 16 channels per 8 bytes: each chunk's even channels (the low nibbles),
    /// then its odd channels (the high nibbles).
    Nibbles,
    /// 2-bit codes, 32 channels per 8 bytes: each chunk's channels `4i` (bits 0..2 of the
    /// bytes), then `4i + 1`, `4i + 2` and `4i + 3`.
    Crumbs,
}

impl Order {
    pub(super) fn of(format: Format) -> Order {
        match format {
            Format::Tok {
                bits: LowBits::Four,
                ..
            }
            | Format::Chan {
                bits: LowBits::Four,
            } => Order::Nibbles,
            Format::Tok {
                bits: LowBits::Two, ..
            }
            | Format::Chan { bits: LowBits::Two } => Order::Crumbs,
            Format::F16 | Format::Q8 | Format::Q8_0 | Format::Fp8 => Order::Natural,
        }
    }

    /// The channel at position `p` ([`Order::position`] inverted; the loops only need that).
    #[cfg(test)]
    pub(super) fn channel(self, p: usize) -> usize {
        match self {
            Order::Natural => p,
            Order::Nibbles => (p & !15) + 2 * (p & 7) + ((p >> 3) & 1),
            Order::Crumbs => (p & !31) + 4 * (p & 7) + ((p >> 3) & 3),
        }
    }

    /// The position of channel `c`.
    pub(super) fn position(self, c: usize) -> usize {
        match self {
            Order::Natural => c,
            Order::Nibbles => (c & !15) + 8 * (c & 1) + ((c & 15) >> 1),
            Order::Crumbs => (c & !31) + 8 * (c & 3) + ((c & 31) >> 2),
        }
    }

    /// Rows of `d` natural-order values put into this order: `out[p] = x[channel(p)]`. Runs
    /// over every block of the f16 value window and sinks every step, so it moves 8 values per
    /// instruction: in a chunk of 16 (nibbles), the even channels then the odd ones; in a chunk
    /// of 32 (crumbs), the same twice over, which leaves channels `4i + j` at `8j + i`.
    #[inline(always)]
    pub(super) fn permute<K: Kernel>(self, k: K, x: &[f32], d: usize, out: &mut Vec<f32>) {
        assert!(d.is_multiple_of(32) && x.len().is_multiple_of(d));
        // Every value is overwritten below: a buffer reused at the same size is not cleared.
        out.resize(x.len(), 0.0);
        let chunk = self.chunk();
        for (src, dst) in x.chunks_exact(chunk).zip(out.chunks_exact_mut(chunk)) {
            let mut v = [k.splat(0.0); 4];
            for (i, v) in v.iter_mut().take(chunk / 8).enumerate() {
                // SAFETY: `src` holds `chunk` floats, so 8 from `8i`.
                *v = unsafe { k.load_ptr(src.as_ptr().add(8 * i)) };
            }
            let ordered = self.order_chunk(k, v);
            for (i, v) in ordered.into_iter().take(chunk / 8).enumerate() {
                k.store(v, &mut dst[8 * i..]);
            }
        }
    }

    /// Channels per chunk of this order, in which [`Order::order_chunk`] moves them: 8, 16
    /// or 32.
    pub(super) fn chunk(self) -> usize {
        match self {
            Order::Natural => 8,
            Order::Nibbles => 16,
            Order::Crumbs => 32,
        }
    }

    /// One chunk of [`Order::chunk`] natural-order values, in its first 1, 2 or 4 vectors,
    /// put into this order.
    #[inline(always)]
    fn order_chunk<K: Kernel>(self, k: K, v: [K::V; 4]) -> [K::V; 4] {
        match self {
            Order::Natural => v,
            Order::Nibbles => {
                let (even, odd) = k.deinterleave(v[0], v[1]);
                [even, odd, v[2], v[3]]
            }
            Order::Crumbs => {
                let (e0, o0) = k.deinterleave(v[0], v[1]);
                let (e1, o1) = k.deinterleave(v[2], v[3]);
                let (c0, c2) = k.deinterleave(e0, e1);
                let (c1, c3) = k.deinterleave(o0, o1);
                [c0, c1, c2, c3]
            }
        }
    }

    /// Rows of `d` values in this order put back into natural order, in place. Runs once per
    /// work item, so like `permute` it copies with constant strides and allocates nothing.
    pub(super) fn unpermute(self, x: &mut [f32], d: usize) {
        assert!(d.is_multiple_of(32) && x.len().is_multiple_of(d));
        match self {
            Order::Natural => {}
            Order::Nibbles => scatter_chunks::<2>(x),
            Order::Crumbs => scatter_chunks::<4>(x),
        }
    }
}

/// Token rows of one stream, dequantized eight channels at a time into a vector register, in
/// the [`Order`] of the stream's format.
///
/// Each implementation is built for `n` tokens of `d` channels, `d` a multiple of 32, and
/// checks, when built, that its slices hold them; `row8` then reads without further checks.
pub(super) trait Rows {
    /// Positions decoded from one load (8, 16 or 32); the loops step over positions by a
    /// multiple of it, so that `j` below is a constant in each unrolled copy.
    const CHUNK: usize;

    /// Positions `c0 + 8j .. c0 + 8j + 8` of token `t`.
    ///
    /// # Safety
    /// `t < n`, `c0` is a multiple of `CHUNK` and `c0 + 8j + 8 <= d`.
    unsafe fn row8<K: Kernel>(&self, k: K, t: usize, c0: usize, j: usize) -> K::V;

    /// Positions `c0 + 16·pass .. + 16` of token `t`: `row8` for `j = 2·pass` and
    /// `2·pass + 1`, joined, or one 16-lane decode where the format has one.
    ///
    /// # Safety
    /// `t < n`, `c0` is a multiple of `CHUNK.max(16)` and `c0 + 16·pass + 16 <= d`.
    #[inline(always)]
    unsafe fn row16<K: Kernel>(&self, k: K, t: usize, c0: usize, pass: usize) -> K::W {
        // SAFETY: `row8`'s contract for both `j`, as `c0` is a multiple of `CHUNK` too.
        unsafe {
            k.join(
                self.row8(k, t, c0, 2 * pass),
                self.row8(k, t, c0, 2 * pass + 1),
            )
        }
    }
}

/// Already dequantized rows (pre-RoPE keys after rotation, reordered sink values).
pub(super) struct F32Rows<'a> {
    pub(super) data: &'a [f32],
    pub(super) d: usize,
}

impl<'a> F32Rows<'a> {
    pub(super) fn new(data: &'a [f32], n: usize, d: usize) -> Self {
        assert!(data.len() >= n * d);
        F32Rows { data, d }
    }
}

impl Rows for F32Rows<'_> {
    const CHUNK: usize = 8;

    #[inline(always)]
    unsafe fn row8<K: Kernel>(&self, k: K, t: usize, c0: usize, j: usize) -> K::V {
        // SAFETY: `data` holds `n × d` floats (checked in `new`) and the contract of `row8`
        // keeps `t·d + c0 + 8j + 8` within them.
        unsafe { k.load_ptr(self.data.as_ptr().add(t * self.d + c0 + 8 * j)) }
    }

    #[inline(always)]
    unsafe fn row16<K: Kernel>(&self, k: K, t: usize, c0: usize, pass: usize) -> K::W {
        // SAFETY: as in `row8`, for `t·d + c0 + 16·pass + 16` floats.
        unsafe { k.wload_ptr(self.data.as_ptr().add(t * self.d + c0 + 16 * pass)) }
    }
}

/// Packed rows of a block: `n` rows of `row_bytes`, checked to be in the slice.
#[derive(Clone, Copy)]
pub(super) struct Packed<'a> {
    pub(super) rows: &'a [u8],
    pub(super) row_bytes: usize,
}

impl<'a> Packed<'a> {
    pub(super) fn new(rows: &'a [u8], row_bytes: usize, n: usize) -> Self {
        assert!(rows.len() >= n * row_bytes);
        Packed { rows, row_bytes }
    }

    /// Pointer to byte `offset` of row `t`.
    ///
    /// # Safety
    /// `t < n` and `offset < row_bytes`.
    #[inline(always)]
    pub(super) unsafe fn at(&self, t: usize, offset: usize) -> *const u8 {
        // SAFETY: within the `n × row_bytes` bytes checked in `new`.
        unsafe { self.rows.as_ptr().add(t * self.row_bytes + offset) }
    }
}

pub(super) struct F16Rows<'a> {
    pub(super) packed: Packed<'a>,
}

impl Rows for F16Rows<'_> {
    const CHUNK: usize = 8;

    #[inline(always)]
    unsafe fn row8<K: Kernel>(&self, k: K, t: usize, c0: usize, j: usize) -> K::V {
        // SAFETY: an f16 row has `2d` bytes; `c0 + 8j + 8 <= d` keeps the 16 bytes read
        // inside it.
        unsafe { k.f16x8(self.packed.at(t, 2 * (c0 + 8 * j))) }
    }

    #[inline(always)]
    unsafe fn row16<K: Kernel>(&self, k: K, t: usize, c0: usize, pass: usize) -> K::W {
        // SAFETY: as in `row8`, for the 32 bytes of 16 positions.
        unsafe { k.f16x16(self.packed.at(t, 2 * (c0 + 16 * pass))) }
    }
}

/// How a row of one-byte codes scaled per token decodes eight of them: int8 (`q8`) or e4m3
/// (`fp8`).
pub(super) trait ByteCode {
    /// What the token's scale is multiplied by.
    const SCALE: f32;

    /// The eight codes at `at`, as values before scaling.
    ///
    /// # Safety
    /// `at` addresses 8 readable bytes.
    unsafe fn load8<K: Kernel>(k: K, at: *const u8) -> K::V;

    /// The sixteen codes at `at`.
    ///
    /// # Safety
    /// `at` addresses 16 readable bytes.
    #[inline(always)]
    unsafe fn load16<K: Kernel>(k: K, at: *const u8) -> K::W {
        // SAFETY: the caller's contract, 8 bytes each.
        unsafe { k.join(Self::load8(k, at), Self::load8(k, at.add(8))) }
    }
}

/// `q8`'s codes: `scale[t] · int8`.
pub(super) struct Int8;

impl ByteCode for Int8 {
    const SCALE: f32 = 1.0;

    #[inline(always)]
    unsafe fn load8<K: Kernel>(k: K, at: *const u8) -> K::V {
        // SAFETY: the caller's contract.
        unsafe { k.i8x8(at) }
    }

    #[inline(always)]
    unsafe fn load16<K: Kernel>(k: K, at: *const u8) -> K::W {
        // SAFETY: the caller's contract.
        unsafe { k.i8x16(at) }
    }
}

/// `fp8`'s codes: `scale[t] · e4m3`, converted through f16 (`Kernel::e4m3x8`: the value times
/// 2^-8, the 2^8 multiplied into the scale, exactly).
pub(super) struct E4m3;

impl ByteCode for E4m3 {
    const SCALE: f32 = 256.0;

    #[inline(always)]
    unsafe fn load8<K: Kernel>(k: K, at: *const u8) -> K::V {
        // SAFETY: the caller's contract.
        unsafe { k.e4m3x8(at) }
    }
}

/// `q8` and `fp8`: one byte per element, one scale per token.
pub(super) struct ScaledRows<'a, C> {
    pub(super) packed: Packed<'a>,
    pub(super) scales: &'a [f32],
    pub(super) code: PhantomData<C>,
}

impl<C: ByteCode> Rows for ScaledRows<'_, C> {
    const CHUNK: usize = 8;

    #[inline(always)]
    unsafe fn row8<K: Kernel>(&self, k: K, t: usize, c0: usize, j: usize) -> K::V {
        // SAFETY: a row has `d` bytes; `c0 + 8j + 8 <= d` keeps the 8 bytes read inside it;
        // `scales` holds one per token (checked where built).
        unsafe {
            k.mul(
                C::load8(k, self.packed.at(t, c0 + 8 * j)),
                k.splat(*self.scales.get_unchecked(t) * C::SCALE),
            )
        }
    }

    #[inline(always)]
    unsafe fn row16<K: Kernel>(&self, k: K, t: usize, c0: usize, pass: usize) -> K::W {
        // SAFETY: as in `row8`, for the 16 bytes of 16 positions.
        unsafe {
            k.wmul(
                C::load16(k, self.packed.at(t, c0 + 16 * pass)),
                k.wsplat(*self.scales.get_unchecked(t) * C::SCALE),
            )
        }
    }
}

/// `q8_0`: `d[t][block] · int8`, the scale inside each 34-byte block.
pub(super) struct Q80Rows<'a> {
    pub(super) packed: Packed<'a>,
    pub(super) scales: &'a [f32],
    pub(super) blocks: usize,
}

impl Rows for Q80Rows<'_> {
    const CHUNK: usize = 8;

    #[inline(always)]
    unsafe fn row8<K: Kernel>(&self, k: K, t: usize, c0: usize, j: usize) -> K::V {
        let c = c0 + 8 * j;
        let (b, i) = (c / Q8_0_BLOCK, c % Q8_0_BLOCK);
        // SAFETY: block `b < d / 32` of the row holds 2 + 32 bytes and `i + 8 <= 32`; `scales`
        // holds `n × blocks` (checked where built).
        unsafe {
            let codes = k.i8x8(self.packed.at(t, b * Q8_0_BLOCK_BYTES + 2 + i));
            k.mul(
                codes,
                k.splat(*self.scales.get_unchecked(t * self.blocks + b)),
            )
        }
    }

    #[inline(always)]
    unsafe fn row16<K: Kernel>(&self, k: K, t: usize, c0: usize, pass: usize) -> K::W {
        let c = c0 + 16 * pass;
        let (b, i) = (c / Q8_0_BLOCK, c % Q8_0_BLOCK);
        // SAFETY: as in `row8`, with `i + 16 <= 32` (`c` is a multiple of 16).
        unsafe {
            let codes = k.i8x16(self.packed.at(t, b * Q8_0_BLOCK_BYTES + 2 + i));
            k.wmul(
                codes,
                k.wsplat(*self.scales.get_unchecked(t * self.blocks + b)),
            )
        }
    }
}

/// Bare low-bit codes: 16 (4-bit) or 32 (2-bit) positions per 8-byte load, in the
/// [`Order::Nibbles`] or [`Order::Crumbs`] order, as the codes themselves or, with a codebook
/// (`nuq`), as its levels. Used alone for per-channel keys, whose parameters are folded into
/// the queries.
#[derive(Clone, Copy)]
pub(super) struct ChanCodes<'a, const BITS: usize> {
    pub(super) packed: Packed<'a>,
    pub(super) book: Option<&'a Codebook>,
}

impl<'a, const BITS: usize> ChanCodes<'a, BITS> {
    /// The 16 levels codes decode to in units of the scale: the codebook's, or for 2-bit
    /// codes without one the codes themselves, repeated over 16 lanes as the crumb lookups
    /// read them. One load from a loop-invariant address, where choosing between the two
    /// inside the loops cost a branch and register copies per table.
    #[inline(always)]
    fn levels(&self) -> &'a [f32; 16] {
        self.book.map_or(&CRUMB_CODES, |b| b.table())
    }

    /// The `crumb8` table of `scale · level + min` for this stream's levels.
    #[inline(always)]
    pub(super) fn crumb_table<K: Kernel>(&self, k: K, scale: f32, min: f32) -> K::V {
        // SAFETY: `levels` holds 16 floats.
        let levels = unsafe { k.load_ptr(self.levels().as_ptr()) };
        k.fmadd(levels, k.splat(scale), k.splat(min))
    }

    /// The `crumb16` table of `scale · level + min` for this stream's levels.
    #[inline(always)]
    pub(super) fn crumb_wtable<K: Kernel>(&self, k: K, scale: f32, min: f32) -> K::W {
        // SAFETY: `levels` holds 16 floats.
        let levels = unsafe { k.wload_ptr(self.levels().as_ptr()) };
        k.wfmadd(levels, k.wsplat(scale), k.wsplat(min))
    }

    /// `table[code]` for positions `c0 + 8j ..+ 8` of row `t` (`table` is used by 2-bit codes
    /// only; 4-bit codes are converted, or looked up in the codebook).
    ///
    /// # Safety
    /// As [`Rows::row8`], for rows of `d · BITS / 8` bytes and `d` a multiple of 32.
    #[inline(always)]
    pub(super) unsafe fn lookup<K: Kernel>(
        &self,
        k: K,
        t: usize,
        c0: usize,
        j: usize,
        table: K::V,
    ) -> K::V {
        let chunk = <Self as Rows>::CHUNK;
        let per_load = chunk / 8;
        // The load that holds position `c0 + 8j`, and which of its vectors that is.
        let (base, j) = (c0 + j / per_load * chunk, j % per_load);
        // SAFETY: `d` is a multiple of `CHUNK`, so the chunk at `base` lies within the row,
        // whose `base · BITS / 8 .. + 8` bytes hold it.
        unsafe {
            let p = self.packed.at(t, base * BITS / 8);
            if BITS == 4 {
                match self.book {
                    Some(b) => k.nib8_table(p, j == 1, b.table()),
                    None => k.nib8(p, j == 1),
                }
            } else {
                k.crumb8(p, j as u32, table)
            }
        }
    }

    /// [`ChanCodes::lookup`] for the 16 positions of [`Rows::row16`].
    ///
    /// # Safety
    /// As [`Rows::row16`], for rows of `d · BITS / 8` bytes and `d` a multiple of 32.
    #[inline(always)]
    pub(super) unsafe fn lookup16<K: Kernel>(
        &self,
        k: K,
        t: usize,
        c0: usize,
        pass: usize,
        table: K::W,
    ) -> K::W {
        // SAFETY: `c0` is a multiple of `CHUNK` (16 or 32 positions, 8 bytes), whose load
        // holds positions `c0 + 16·pass .. + 16`.
        unsafe {
            let p = self.packed.at(t, c0 * BITS / 8);
            match (BITS, self.book) {
                (4, None) => k.nib16(p),
                (4, Some(b)) => k.join(
                    k.nib8_table(p, false, b.table()),
                    k.nib8_table(p, true, b.table()),
                ),
                _ => k.crumb16(p, pass as u32, table),
            }
        }
    }
}

impl<const BITS: usize> Rows for ChanCodes<'_, BITS> {
    const CHUNK: usize = 64 / BITS;

    #[inline(always)]
    unsafe fn row8<K: Kernel>(&self, k: K, t: usize, c0: usize, j: usize) -> K::V {
        // SAFETY: forwarded contract.
        unsafe { self.lookup(k, t, c0, j, self.crumb_table(k, 1.0, 0.0)) }
    }

    #[inline(always)]
    unsafe fn row16<K: Kernel>(&self, k: K, t: usize, c0: usize, pass: usize) -> K::W {
        // SAFETY: forwarded contract; `levels` holds 16 floats.
        unsafe {
            let levels = k.wload_ptr(self.levels().as_ptr());
            self.lookup16(k, t, c0, pass, levels)
        }
    }
}

/// `q*_tok`: `min[t][group] + scale[t][group] · code`.
pub(super) struct TokRows<'a, const BITS: usize> {
    pub(super) codes: ChanCodes<'a, BITS>,
    /// `(scale, min)` per token per group.
    pub(super) params: &'a [f32],
    pub(super) groups: usize,
    /// log2 of the channels per group (group sizes are powers of two, at least 32).
    pub(super) group_shift: u32,
}

impl<const BITS: usize> TokRows<'_, BITS> {
    /// The group of the chunk at position `c0` (a chunk lies within one group).
    #[inline(always)]
    fn group(&self, c0: usize) -> usize {
        // Groups hold at least 32 channels, so rounding `c0` down to 32 names the same one, and
        // gives the unrolled loops one expression, hence one parameter load and one level table,
        // per 32 channels where `c0 >> group_shift` gave one per 16 (the shift is not a
        // constant, so the compiler cannot see that `0 >> s` and `16 >> s` agree).
        (c0 & !31) >> self.group_shift
    }
}

impl<const BITS: usize> Rows for TokRows<'_, BITS> {
    const CHUNK: usize = 64 / BITS;

    #[inline(always)]
    unsafe fn row8<K: Kernel>(&self, k: K, t: usize, c0: usize, j: usize) -> K::V {
        let p = 2 * (t * self.groups + self.group(c0));
        // SAFETY: forwarded contract; `params` holds `2 × groups` per token (checked where
        // built) and `c0 >> group_shift < groups`.
        unsafe {
            let (scale, min) = (
                *self.params.get_unchecked(p),
                *self.params.get_unchecked(p + 1),
            );
            if BITS == 4 {
                let codes = self.codes.lookup(k, t, c0, j, k.splat(0.0));
                k.fmadd(codes, k.splat(scale), k.splat(min))
            } else {
                // The table holds the four dequantized values.
                let table = self.codes.crumb_table(k, scale, min);
                self.codes.lookup(k, t, c0, j, table)
            }
        }
    }

    #[inline(always)]
    unsafe fn row16<K: Kernel>(&self, k: K, t: usize, c0: usize, pass: usize) -> K::W {
        let p = 2 * (t * self.groups + self.group(c0));
        // SAFETY: as in `row8`.
        unsafe {
            if BITS == 4 && self.codes.book.is_some() {
                // The parameters after the codes: each load then broadcasts from memory.
                let codes = self.codes.lookup16(k, t, c0, pass, k.wsplat(0.0));
                let scale = k.wsplat(*self.params.get_unchecked(p));
                k.wfmadd(codes, scale, k.wsplat(*self.params.get_unchecked(p + 1)))
            } else {
                let (scale, min) = (
                    *self.params.get_unchecked(p),
                    *self.params.get_unchecked(p + 1),
                );
                if BITS == 4 {
                    k.nib16_scaled(self.codes.packed.at(t, c0 / 2), scale, min)
                } else {
                    let table = self.codes.crumb_wtable(k, scale, min);
                    self.codes.lookup16(k, t, c0, pass, table)
                }
            }
        }
    }
}

/// `q*_chan`: `min[c] + scale[c] · code`, parameters shared by the page's tokens (for the
/// outlier corrections and pre-RoPE keys; scores fold the parameters into the queries).
pub(super) struct ChanRows<'a, const BITS: usize> {
    pub(super) codes: ChanCodes<'a, BITS>,
    /// Per position, in the codes' order.
    pub(super) scale: &'a [f32],
    pub(super) min: &'a [f32],
}

impl<const BITS: usize> Rows for ChanRows<'_, BITS> {
    const CHUNK: usize = 64 / BITS;

    #[inline(always)]
    unsafe fn row8<K: Kernel>(&self, k: K, t: usize, c0: usize, j: usize) -> K::V {
        let c = c0 + 8 * j;
        // SAFETY: forwarded contract; `scale` and `min` hold `d` floats (checked where built).
        unsafe {
            let codes = self.codes.row8(k, t, c0, j);
            let scale = k.load_ptr(self.scale.as_ptr().add(c));
            k.fmadd(codes, scale, k.load_ptr(self.min.as_ptr().add(c)))
        }
    }

    #[inline(always)]
    unsafe fn row16<K: Kernel>(&self, k: K, t: usize, c0: usize, pass: usize) -> K::W {
        let c = c0 + 16 * pass;
        // SAFETY: as in `row8`, for positions `c .. c + 16`.
        unsafe {
            let codes = self.codes.row16(k, t, c0, pass);
            let scale = k.wload_ptr(self.scale.as_ptr().add(c));
            k.wfmadd(codes, scale, k.wload_ptr(self.min.as_ptr().add(c)))
        }
    }
}

/// Pre-RoPE key rows rotated as they are decoded, each by the RoPE row of its index `t` in
/// the block (the query is turned back to the block's first position), in the codes' order
/// ([`Order::Nibbles`] or [`Order::Crumbs`]) with interleaved RoPE pairs `(2i, 2i + 1)`: there
/// every 8 positions of a chunk that hold channels `2i` are followed by the 8 that hold their
/// partners `2i + 1`, so a pair's two elements sit in the same lane of two neighbouring
/// vectors. `cs` holds the `[cos, sin]` rows put into the same order (a row of pairs permuted
/// as a row of channels puts each pair's cosine where its first element goes).
pub(super) struct RotatedRows<'a, R> {
    pub(super) rows: &'a R,
    /// At least `n × d`: the RoPE table's first rows, in the codes' order.
    pub(super) cs: &'a [f32],
    pub(super) d: usize,
}

impl<R: Rows> Rows for RotatedRows<'_, R> {
    const CHUNK: usize = R::CHUNK;

    #[inline(always)]
    unsafe fn row8<K: Kernel>(&self, k: K, t: usize, c0: usize, j: usize) -> K::V {
        let (first, second) = (j & !1, j | 1);
        // SAFETY: forwarded contract for the pair's two vectors of the same chunk; `cs` holds
        // `n × d` floats (checked where built), and `t < n`, `c0 + 8·second + 8 <= d`.
        unsafe {
            let a = self.rows.row8(k, t, c0, first);
            let b = self.rows.row8(k, t, c0, second);
            let cs = self.cs.as_ptr().add(t * self.d + c0);
            let (c, s) = (
                k.load_ptr(cs.add(8 * first)),
                k.load_ptr(cs.add(8 * second)),
            );
            let (a, b) = k.rotate_split(a, b, c, s);
            if j == first { a } else { b }
        }
    }

    #[inline(always)]
    unsafe fn row16<K: Kernel>(&self, k: K, t: usize, c0: usize, pass: usize) -> K::W {
        // SAFETY: as in `row8`: the 16 positions are one pair of vectors.
        unsafe {
            let x = self.rows.row16(k, t, c0, pass);
            let cs = k.wload_ptr(self.cs.as_ptr().add(t * self.d + c0 + 16 * pass));
            k.wrotate_split(x, cs)
        }
    }
}

/// [`RotatedRows`] for RoPE pairs `(i, i + d/2)`: position `p` of a chunk in the first half
/// and position `p` of the chunk `d/2` channels on hold a pair (`d/2` is a whole number of
/// chunks, and every chunk is ordered alike), so each is rotated with its partner, decoded
/// beside it. `cs` holds, per row `t`, the pairs' cosines then their sines (`d/2` each), each
/// half put into the codes' order.
pub(super) struct HalvesRotatedRows<'a, R> {
    pub(super) rows: &'a R,
    /// At least `n × d`: the RoPE table's first rows, as above.
    pub(super) cs: &'a [f32],
    pub(super) d: usize,
}

impl<R: Rows> HalvesRotatedRows<'_, R> {
    /// The first-half chunk of the pair that the chunk at `c0` belongs to, and whether `c0` is
    /// its second half.
    #[inline(always)]
    fn pair_chunk(&self, c0: usize) -> (usize, bool) {
        let half = self.d / 2;
        if c0 < half {
            (c0, false)
        } else {
            (c0 - half, true)
        }
    }
}

impl<R: Rows> Rows for HalvesRotatedRows<'_, R> {
    const CHUNK: usize = R::CHUNK;

    #[inline(always)]
    unsafe fn row8<K: Kernel>(&self, k: K, t: usize, c0: usize, j: usize) -> K::V {
        let (lo, second) = self.pair_chunk(c0);
        let half = self.d / 2;
        // SAFETY: forwarded contract for the chunks at `lo` and `lo + d/2`, both within the
        // row; `cs` holds `n × d` floats (checked where built), and `t < n`,
        // `half + lo + 8j + 8 <= d`.
        unsafe {
            let a = self.rows.row8(k, t, lo, j);
            let b = self.rows.row8(k, t, lo + half, j);
            let cs = self.cs.as_ptr().add(t * self.d + lo + 8 * j);
            let (x, y) = k.rotate_split(a, b, k.load_ptr(cs), k.load_ptr(cs.add(half)));
            if second { y } else { x }
        }
    }

    #[inline(always)]
    unsafe fn row16<K: Kernel>(&self, k: K, t: usize, c0: usize, pass: usize) -> K::W {
        let (lo, second) = self.pair_chunk(c0);
        let half = self.d / 2;
        // SAFETY: as in `row8`, for 16 positions from `lo + 16·pass`.
        unsafe {
            let a = self.rows.row16(k, t, lo, pass);
            let b = self.rows.row16(k, t, lo + half, pass);
            let cs = self.cs.as_ptr().add(t * self.d + lo + 16 * pass);
            let (x, y) = k.wrotate_pairs(a, b, k.wload_ptr(cs), k.wload_ptr(cs.add(half)));
            if second { y } else { x }
        }
    }
}

impl StreamBlock<'_> {
    /// Converts the f16 parameters of the first `n` tokens to f32 in `out`, laid out as the
    /// format's [`Rows`] reads them.
    #[inline(always)]
    pub(super) fn params_f32<K: Kernel>(&self, k: K, n: usize, out: &mut Vec<f32>) {
        let d = self.head_dim;
        match self.format {
            Format::F16 => out.clear(),
            Format::Q8 | Format::Fp8 | Format::Tok { .. } => {
                let bytes = n * self.format.params_bytes(1, d);
                k.f16_to_f32(&self.params[..bytes], overwritten(out, bytes / 2));
            }
            Format::Q8_0 => {
                out.clear();
                out.extend((0..n).flat_map(|t| {
                    (0..d / Q8_0_BLOCK)
                        .map(move |b| get_f16(self.rows, t * self.row_bytes + b * Q8_0_BLOCK_BYTES))
                }));
            }
            Format::Chan { .. } => planar_params(
                k,
                Order::of(self.format),
                self.params,
                overwritten(out, 2 * d),
            ),
        }
    }
}

/// `out` at `len` floats, all of which the caller overwrites: zeroed only where it grows, as
/// one buffer serves every page of a work item (clearing it cost a memset per page).
fn overwritten(out: &mut Vec<f32>, len: usize) -> &mut [f32] {
    if out.len() < len {
        out.resize(len, 0.0);
    }
    out.truncate(len);
    out
}

/// [`Order::permute`] undone in place: in each chunk of `8 · LANES` values, the value at
/// `8j + i` goes back to `LANES · i + j`.
#[inline(always)]
fn scatter_chunks<const LANES: usize>(x: &mut [f32]) {
    let chunk = 8 * LANES;
    let mut src = [0f32; 32];
    for dst in x.chunks_exact_mut(chunk) {
        src[..chunk].copy_from_slice(dst);
        for j in 0..LANES {
            for i in 0..8 {
                dst[LANES * i + j] = src[8 * j + i];
            }
        }
    }
}

/// The `d` `(scale, min)` pairs of a per-channel page, f16 in natural channel order, as its
/// scales then its minimums in `order`: `out[p]` the scale of channel `order.channel(p)`,
/// `out[d + p]` its minimum. Eight values per step, as this runs once per page and per call
/// for every head: the element-wise copies it replaced cost `kivi4` about 4% of a step.
#[inline(always)]
pub(super) fn planar_params<K: Kernel>(k: K, order: Order, pairs: &[u8], out: &mut [f32]) {
    let (d, chunk) = (out.len() / 2, order.chunk());
    assert!(pairs.len() >= 4 * d && d.is_multiple_of(chunk));
    let (scales, mins) = out.split_at_mut(d);
    for c in (0..d).step_by(chunk) {
        // SAFETY: `c + chunk <= d`, and `pairs` holds the `4d` bytes of `d` pairs (checked
        // above).
        let (s, m) = unsafe { planar_chunk(k, order, pairs, c) };
        for i in 0..chunk / 8 {
            k.store(s[i], &mut scales[c + 8 * i..]);
            k.store(m[i], &mut mins[c + 8 * i..]);
        }
    }
}

/// The scales and the minimums of positions `c .. c + order.chunk()` of a per-channel page
/// (as [`planar_params`] lays them out), in the first `chunk / 8` vectors of each.
///
/// # Safety
/// `c` is a multiple of `order.chunk()` and `pairs` holds the 4 bytes of every channel below
/// `c + order.chunk()`.
#[inline(always)]
pub(super) unsafe fn planar_chunk<K: Kernel>(
    k: K,
    order: Order,
    pairs: &[u8],
    c: usize,
) -> ([K::V; 4], [K::V; 4]) {
    let (mut s, mut m) = ([k.splat(0.0); 4], [k.splat(0.0); 4]);
    for i in 0..order.chunk() / 8 {
        // SAFETY: channels `c + 8i .. + 8` lie within the chunk, and their pairs are the 32
        // bytes at `4(c + 8i)` (the caller's contract).
        let (a, b) = unsafe {
            let p = pairs.as_ptr().add(4 * (c + 8 * i));
            (k.f16x8(p), k.f16x8(p.add(16)))
        };
        (s[i], m[i]) = k.deinterleave(a, b);
    }
    (order.order_chunk(k, s), order.order_chunk(k, m))
}

#[cfg(test)]
mod tests {
    use super::super::super::simd::Portable;
    use super::*;

    #[test]
    fn permute_puts_rows_in_each_order_and_unpermute_undoes_it() {
        let d = 64;
        let x: Vec<f32> = (0..3 * d).map(|i| i as f32).collect();
        for order in [Order::Natural, Order::Nibbles, Order::Crumbs] {
            let mut out = vec![f32::NAN; 5];
            order.permute(Portable, &x, d, &mut out);
            assert_eq!(out.len(), x.len());
            for (t, row) in out.chunks_exact(d).enumerate() {
                for (p, &v) in row.iter().enumerate() {
                    assert_eq!(v, x[t * d + order.channel(p)], "{order:?} row {t} at {p}");
                }
            }
            order.unpermute(&mut out, d);
            assert_eq!(out, x, "{order:?}");
        }
    }

    #[test]
    fn planar_parameters_follow_each_order() {
        let d = 128;
        let pairs: Vec<u8> = (0..2 * d)
            .flat_map(|i| half::f16::from_f32(i as f32).to_le_bytes())
            .collect();
        for order in [Order::Natural, Order::Nibbles, Order::Crumbs] {
            let mut planar = vec![f32::NAN; 2 * d];
            planar_params(Portable, order, &pairs, &mut planar);
            let (scales, mins) = planar.split_at(d);
            for c in 0..d {
                let p = order.position(c);
                assert_eq!(order.channel(p), c);
                assert_eq!(
                    (scales[p], mins[p]),
                    ((2 * c) as f32, (2 * c + 1) as f32),
                    "{order:?} {c}"
                );
            }
        }
    }
}
