//! The paged calls on the CPU backend: the same params structs the kernels take, with host
//! addresses in them, executed by the Rust reference quantizers and the CPU attention. Every
//! rule here is the kernels' rule (`hip/write.hip`, `hip/attention.hip`), byte for byte where
//! bytes are stored: which index is checked and how, which rows of a block are written, what a
//! skipped item leaves behind.

use half::f16;

use crate::abi::{
    HIPKV_BAD_BLOCK, HIPKV_BAD_POSITION, HIPKV_BAD_QUERY_LEN, HIPKV_BAD_QUERY_RANGE,
    HIPKV_BAD_SEQ_LEN, HIPKV_BAD_SEQ_SLOT, HIPKV_BAD_SLOT, HIPKV_BAD_SLOT_OFFSET,
    HIPKV_CHECK_ATTEND, HIPKV_CHECK_COPY_BLOCKS, HIPKV_CHECK_WRITE, HIPKV_DTYPE_BF16,
    HIPKV_DTYPE_F16, hipkv_attn_params, hipkv_copy_params, hipkv_device_error, hipkv_write_params,
};
use crate::paged::Layout;
use crate::quant::{self, Codebook, put_f16};
use crate::rope::RopeTable;
use crate::scheme::{Format, OUTLIER_COUNT_BYTES, OUTLIER_SLOT_BYTES, Stream, StreamLayout};

use super::super::device::{host_alloc, host_copy, host_download, host_upload};
use super::super::{Backend, DeviceMemory, Engine};
use super::{CacheView, ChunkQuery, PagedSeq};
use crate::error::Result;
use crate::hip::StreamHandle;
use crate::paged::AttendPlan;

/// `Backend::Cpu`: host memory, and the paged calls run here by the Rust kernels, done when they
/// return. A lock serializes the calls' use of the error word and the outlier counter.
#[derive(Default)]
pub(crate) struct CpuEngine {
    lock: std::sync::Mutex<()>,
}

impl CpuEngine {
    fn serialized<T>(&self, f: impl FnOnce() -> T) -> T {
        let _held = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        f()
    }
}

impl Engine for CpuEngine {
    fn backend(&self) -> Backend {
        Backend::Cpu
    }

    fn alloc(&self, bytes: usize) -> Result<DeviceMemory> {
        host_alloc(bytes, "cpu")
    }

    fn upload(&self, dst: &DeviceMemory, offset: usize, src: &[u8], _: StreamHandle) -> Result<()> {
        host_upload(dst, offset, src)
    }

    fn download(
        &self,
        src: &DeviceMemory,
        offset: usize,
        dst: &mut [u8],
        _: StreamHandle,
    ) -> Result<()> {
        host_download(src, offset, dst)
    }

    unsafe fn copy(&self, dst: u64, src: u64, bytes: usize, _: StreamHandle) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { host_copy(dst, src, bytes) };
        Ok(())
    }

    unsafe fn write_kv(
        &self,
        p: &hipkv_write_params,
        layout: &Layout,
        _: StreamHandle,
    ) -> Result<()> {
        // SAFETY: the caller's contract covers every address in `p`.
        self.serialized(|| unsafe { write_kv(p, layout) });
        Ok(())
    }

    unsafe fn attend(
        &self,
        p: &hipkv_attn_params,
        _: &AttendPlan,
        layout: &Layout,
        rope: Option<&RopeTable>,
        _: StreamHandle,
    ) -> Result<()> {
        // SAFETY: as above.
        self.serialized(|| unsafe { attend(p, layout, rope) });
        Ok(())
    }

    unsafe fn copy_blocks(&self, p: &hipkv_copy_params, _: StreamHandle) -> Result<()> {
        // SAFETY: as above.
        self.serialized(|| unsafe { copy_blocks(p) });
        Ok(())
    }
}

/// Records the first bad index since the last check, as the kernels' `report_bad_index`.
///
/// # Safety
/// `error` points to the cache's live error word.
unsafe fn report(
    error: *mut hipkv_device_error,
    what: u32,
    kernel: u32,
    item: usize,
    index: i64,
    limit: i64,
) {
    // SAFETY: the caller's contract; the CPU backend's calls hold the cache's lock.
    let e = unsafe { &mut *error };
    if e.what == 0 {
        *e = hipkv_device_error {
            what,
            kernel,
            item: item as u32,
            reserved: 0,
            index,
            limit,
        };
    }
}

/// A slice of `n` values at a host address from a params struct (empty for `n == 0`).
///
/// # Safety
/// `p` addresses `n` readable values for the lifetime chosen.
unsafe fn slice<'a, T>(p: *const T, n: usize) -> &'a [T] {
    if n == 0 {
        return &[];
    }
    // SAFETY: the caller's contract.
    unsafe { std::slice::from_raw_parts(p, n) }
}

/// As [`slice`], writable.
///
/// # Safety
/// `p` addresses `n` writable values, reached through no other reference meanwhile.
unsafe fn slice_mut<'a, T>(p: *mut T, n: usize) -> &'a mut [T] {
    if n == 0 {
        return &mut [];
    }
    // SAFETY: the caller's contract.
    unsafe { std::slice::from_raw_parts_mut(p, n) }
}

/// Element `i` of an input array of the ABI dtype, as f32.
///
/// # Safety
/// `x` addresses at least `i + 1` elements of `dtype`.
unsafe fn load(x: *const u8, dtype: u32, i: usize) -> f32 {
    // SAFETY: the caller's contract; unaligned reads, as inputs promise no alignment here.
    unsafe {
        match dtype {
            HIPKV_DTYPE_F16 => f16::from_bits(x.cast::<u16>().add(i).read_unaligned()).to_f32(),
            HIPKV_DTYPE_BF16 => {
                f32::from_bits(u32::from(x.cast::<u16>().add(i).read_unaligned()) << 16)
            }
            _ => x.cast::<f32>().add(i).read_unaligned(),
        }
    }
}

/// Where a checked token goes.
struct Target {
    seq_slot: usize,
    pos: usize,
    block: usize,
    offset: usize,
}

/// Checks the indices a server gave for one token, as the write kernel's `locate`.
fn locate(
    g: &crate::abi::hipkv_paged_geometry,
    seq: i32,
    slot: i64,
    pos: i32,
) -> Result<Target, (u32, i64, i64)> {
    let bt = i64::from(g.block_tokens);
    let slots = i64::from(g.num_blocks) * bt;
    let (seq, pos) = (i64::from(seq), i64::from(pos));
    if seq < 0 || seq >= i64::from(g.max_seqs) {
        return Err((HIPKV_BAD_SEQ_SLOT, seq, i64::from(g.max_seqs)));
    }
    if slot < 0 || slot >= slots {
        return Err((HIPKV_BAD_SLOT, slot, slots));
    }
    if pos < 0 || pos >= i64::from(g.max_positions) {
        return Err((HIPKV_BAD_POSITION, pos, i64::from(g.max_positions)));
    }
    if slot % bt != pos % bt {
        return Err((HIPKV_BAD_SLOT_OFFSET, slot, pos % bt));
    }
    Ok(Target {
        seq_slot: seq as usize,
        pos: pos as usize,
        block: (slot / bt) as usize,
        offset: (slot % bt) as usize,
    })
}

/// The codebook at `levels` of a stream stored in `format` (null: none).
///
/// # Safety
/// A non-null `levels` points to `2^bits` floats of the format.
unsafe fn codebook(levels: *const f32, format: Format) -> Option<Codebook> {
    let (Format::Tok { bits, .. } | Format::Chan { bits }) = format else {
        return None;
    };
    if levels.is_null() {
        return None;
    }
    // SAFETY: the caller's contract.
    let levels = unsafe { slice(levels, 1 << bits.bits()) };
    Some(Codebook::new(bits, levels).expect("codebooks are checked when set"))
}

/// `write_kv` of one stream, as `hipkv_write_<format>` then `hipkv_write_residual`.
///
/// # Safety
/// Every address in `p` is a host address of what its comment in `hipkv_abi.h` states, alive
/// and reached through no other reference during the call.
unsafe fn write_kv(p: &hipkv_write_params, layout: &Layout) {
    let g = &p.g;
    let n = p.tokens as usize;
    let (heads, d, bt) = (
        g.kv_heads as usize,
        g.head_dim as usize,
        g.block_tokens as usize,
    );
    let sinks = g.sinks as usize;
    let kind = if p.stream == 0 { Stream::K } else { Stream::V };
    let sl = *layout.head_layout().stream(kind);
    let head_bytes = g.head_block_bytes as usize;
    // SAFETY (the slices below): the caller's contract, with lengths from the same params.
    let (slots, seqs, positions) = unsafe {
        (
            slice(p.slot_mapping, n),
            slice(p.seq_slots, n),
            slice(p.positions, n),
        )
    };
    let cache = unsafe { slice_mut(p.cache, g.num_blocks as usize * g.block_bytes as usize) };
    let state = unsafe { slice_mut(p.state, g.max_seqs as usize * p.slot_state_bytes as usize) };
    let thresholds = (!p.outlier_lo.is_null()).then(|| unsafe {
        (
            slice(p.outlier_lo, heads * d),
            slice(p.outlier_hi, heads * d),
        )
    });
    // SAFETY: the caller's contract.
    let book = unsafe { codebook(p.levels, sl.format) };
    let x = p.x.cast::<u8>();
    let dtype = p.dtype;
    let rotated = layout.scheme().rotation.applies(kind);
    // Row `token` of `head` of the input (rotated where the scheme says), rounded to f16 as
    // stored.
    let input = |token: usize, head: usize| -> Vec<f32> {
        let at = (token * heads + head) * d;
        // SAFETY: the input holds `tokens × kv_heads × head_dim` elements.
        let mut row: Vec<f32> = (0..d).map(|c| unsafe { load(x, dtype, at + c) }).collect();
        if rotated {
            quant::hadamard(&mut row);
        }
        row.iter_mut().for_each(|v| *v = quant::round_f16(*v));
        row
    };
    let layer_state = |slot: usize| slot * p.slot_state_bytes as usize + p.layer_state as usize;
    let residual_at = |slot: usize, head: usize, row: usize| {
        layer_state(slot) + layout.residual_offset(kind) + ((head * bt + row) * d) * 2
    };
    // The value window's rows, as `write_window`: a token's row goes to row `pos % W` (W = R +
    // block_tokens) unless the batch's token W places later holds position pos + W of the
    // same sequence.
    let window = if kind == Stream::V {
        layout.scheme().window_rows()
    } else {
        0
    };
    let window_at = |slot: usize, head: usize, pos: usize| {
        layer_state(slot) + layout.window_row_offset(head, pos)
    };
    let in_window = |i: usize, t: &Target| {
        let j = i + window;
        !(j < n && seqs[j] as usize == t.seq_slot && positions[j] as usize == t.pos + window)
    };
    let targets: Vec<Option<Target>> = (0..n)
        .map(|i| match locate(g, seqs[i], slots[i], positions[i]) {
            Ok(t) => Some(t),
            Err((what, index, limit)) => {
                // SAFETY: the cache's error word.
                unsafe { report(p.error, what, HIPKV_CHECK_WRITE, i, index, limit) };
                None
            }
        })
        .collect();
    let mut dropped = 0u64;
    for (i, t) in targets.iter().enumerate() {
        let Some(t) = t else { continue };
        let to_window = window > 0 && t.pos >= sinks && in_window(i, t);
        for head in 0..heads {
            if t.pos < sinks {
                let at = layer_state(t.seq_slot)
                    + layout.sinks_offset(kind)
                    + ((head * sinks + t.pos) * d) * 2;
                write_f16_row(&mut state[at..at + 2 * d], &input(i, head));
                continue;
            }
            if to_window {
                let at = window_at(t.seq_slot, head, t.pos);
                write_f16_row(&mut state[at..at + 2 * d], &input(i, head));
            }
            let block =
                &mut cache[t.block * g.block_bytes as usize + head * head_bytes..][..head_bytes];
            let limits = thresholds.map(|(lo, hi)| (&lo[head * d..][..d], &hi[head * d..][..d]));
            match sl.format {
                Format::Chan { bits } => {
                    if t.offset + 1 != bt {
                        continue;
                    }
                    // The block this token completes: rows from this batch where a token of
                    // the same slot holds the position, from the residual window otherwise.
                    let first = t.pos - t.offset;
                    let skip = sinks.saturating_sub(first);
                    if skip >= bt {
                        continue;
                    }
                    let mut rows = Vec::with_capacity((bt - skip) * d);
                    for r in skip..bt {
                        let back = bt - 1 - r;
                        let pos = t.pos - back;
                        let from_batch = back <= i
                            && seqs[i - back] as usize == t.seq_slot
                            && positions[i - back] as usize == pos;
                        let mut row = if from_batch {
                            input(i - back, head)
                        } else {
                            let at = residual_at(t.seq_slot, head, r);
                            (0..d).map(|c| quant::get_f16(state, at + 2 * c)).collect()
                        };
                        dropped += store_outliers(block, &sl, r, &mut row, limits);
                        rows.extend(row);
                    }
                    let (codes, params) = block.split_at_mut(sl.params);
                    quant::quantize_chan(
                        bits,
                        &rows,
                        d,
                        &mut codes[sl.rows + skip * sl.row_bytes..sl.rows + bt * sl.row_bytes],
                        &mut params[..d * 4],
                        book.as_ref(),
                    );
                }
                format => {
                    let mut row = input(i, head);
                    dropped += store_outliers(block, &sl, t.offset, &mut row, limits);
                    let pb = format.params_bytes(1, d);
                    let (codes, params) = block.split_at_mut(sl.params);
                    quant::quantize_row(
                        format,
                        &row,
                        &mut codes[sl.rows + t.offset * sl.row_bytes..][..sl.row_bytes],
                        &mut params[t.offset * pb..(t.offset + 1) * pb],
                        book.as_ref(),
                    );
                }
            }
        }
    }
    if sl.format.is_grouped_by_tokens() {
        // Rows of blocks this batch leaves open go to the residual window.
        for (i, t) in targets.iter().enumerate() {
            let Some(t) = t else { continue };
            if t.pos < sinks {
                continue;
            }
            let ahead = bt - 1 - t.offset;
            let j = i + ahead;
            if j < n && seqs[j] as usize == t.seq_slot && positions[j] as usize == t.pos + ahead {
                continue;
            }
            for head in 0..heads {
                let at = residual_at(t.seq_slot, head, t.offset);
                write_f16_row(&mut state[at..at + 2 * d], &input(i, head));
            }
        }
    }
    if dropped > 0 {
        // SAFETY: the cache's counter.
        unsafe { *p.outliers_dropped += dropped };
    }
}

fn write_f16_row(out: &mut [u8], x: &[f32]) {
    for (j, &v) in x.iter().enumerate() {
        put_f16(out, 2 * j, f16::from_f32(v));
    }
}

/// Moves the outliers of `row` (row `slot` of a head block) into the sparse store, clipping
/// them in `row`. Returns how many were dropped for lack of slots.
fn store_outliers(
    block: &mut [u8],
    sl: &StreamLayout,
    slot: usize,
    row: &mut [f32],
    thresholds: Option<(&[f32], &[f32])>,
) -> u64 {
    let Some((lo, hi)) = thresholds else {
        return 0;
    };
    let (kept, dropped) = quant::split_outliers(row, lo, hi, sl.outlier_slots);
    let count_at = sl.counts + slot * OUTLIER_COUNT_BYTES;
    block[count_at..count_at + 2].copy_from_slice(&(kept.len() as u16).to_le_bytes());
    for (i, o) in kept.iter().enumerate() {
        let at = sl.slots + (slot * sl.outlier_slots + i) * OUTLIER_SLOT_BYTES;
        block[at..at + 2].copy_from_slice(&o.channel.to_le_bytes());
        put_f16(block, at + 2, f16::from_f32(o.value));
    }
    dropped as u64
}

/// `attend`, as `hipkv_attn_prep`, `hipkv_attn_*` and `hipkv_attn_combine`: outputs of every
/// query token, zero for those of a skipped sequence.
///
/// # Safety
/// As [`write_kv`].
unsafe fn attend(p: &hipkv_attn_params, layout: &Layout, rope: Option<&RopeTable>) {
    let g = &p.g;
    let spec = layout.spec();
    let (n_seqs, tokens) = (p.num_seqs as usize, p.tokens as usize);
    let width = spec.q_heads * spec.head_dim;
    let bt = layout.block_tokens();
    // SAFETY (the slices below): the caller's contract, with lengths from the same params.
    let (starts, lens, slots, tables) = unsafe {
        (
            slice(p.query_start_loc, n_seqs + 1),
            slice(p.seq_lens, n_seqs),
            slice(p.seq_slots, n_seqs),
            slice(p.block_tables, n_seqs * p.max_blocks_per_seq as usize),
        )
    };
    let cache = unsafe { slice(p.cache, g.num_blocks as usize * g.block_bytes as usize) };
    let state = unsafe { slice(p.state, g.max_seqs as usize * p.slot_state_bytes as usize) };
    let out = p.out.cast::<u8>();
    let window = if p.window == 0 {
        usize::MAX
    } else {
        p.window as usize
    };
    let mut seqs = Vec::new();
    let mut queries: Vec<(usize, Vec<f32>)> = Vec::new();
    for s in 0..n_seqs {
        let (start, end) = (i64::from(starts[s]), i64::from(starts[s + 1]));
        let (len, slot) = (i64::from(lens[s]), i64::from(slots[s]));
        let longest = (i64::from(p.max_blocks_per_seq) * bt as i64)
            .min(i64::from(p.max_seq_len))
            .min(i64::from(g.max_positions));
        let bad = if start < 0 || end < start || end > tokens as i64 {
            let index = if start < 0 || end < start { start } else { end };
            Some((HIPKV_BAD_QUERY_RANGE, index, tokens as i64 + 1))
        } else if end - start > i64::from(p.max_q_len) || end - start > len {
            Some((
                HIPKV_BAD_QUERY_LEN,
                end - start,
                i64::from(p.max_q_len).min(len) + 1,
            ))
        } else if len > longest {
            Some((HIPKV_BAD_SEQ_LEN, len, longest + 1))
        } else if slot < 0 || slot >= i64::from(g.max_seqs) {
            Some((HIPKV_BAD_SEQ_SLOT, slot, i64::from(g.max_seqs)))
        } else {
            // The blocks read: within a window, from the one holding the first query token's
            // first position, as the kernels read them.
            let first_visible = ((len - (end - start)) as usize + 1).saturating_sub(window);
            let row = &tables[s * p.max_blocks_per_seq as usize..][..(len as usize).div_ceil(bt)];
            row[first_visible / bt..]
                .iter()
                .find(|&&id| id < 0 || id as u32 >= g.num_blocks)
                .map(|&id| (HIPKV_BAD_BLOCK, i64::from(id), i64::from(g.num_blocks)))
        };
        if let Some((what, index, limit)) = bad {
            // SAFETY: the cache's error word.
            unsafe { report(p.error, what, HIPKV_CHECK_ATTEND, s, index, limit) };
            continue;
        }
        if end == start {
            continue;
        }
        let (start, q_len, len) = (start as usize, (end - start) as usize, len as usize);
        let at = slot as usize * p.slot_state_bytes as usize + p.layer_state as usize;
        seqs.push(PagedSeq {
            len,
            blocks: &tables[s * p.max_blocks_per_seq as usize..][..len.div_ceil(bt)],
            state: &state[at..at + layout.state_bytes()],
        });
        // SAFETY: `q` holds `tokens × q_heads × head_dim` elements of the dtype.
        let mut q: Vec<f32> = (start * width..(start + q_len) * width)
            .map(|i| unsafe { load(p.q.cast(), p.dtype, i) })
            .collect();
        if spec.scheme.rotation.applies(Stream::K) {
            q.chunks_exact_mut(spec.head_dim)
                .for_each(quant::hadamard_exact);
        }
        queries.push((start, q));
    }
    let mut outs: Vec<Vec<f32>> = queries.iter().map(|(_, q)| vec![0f32; q.len()]).collect();
    let mut batch: Vec<ChunkQuery<'_>> = queries
        .iter()
        .zip(&mut outs)
        .map(|((_, q), out)| ChunkQuery { q, out })
        .collect();
    // SAFETY: non-null levels hold their stream's 2^bits floats.
    let books = unsafe {
        [
            codebook(p.k_levels, spec.scheme.k),
            codebook(p.v_levels, spec.scheme.v),
        ]
    };
    let view = CacheView {
        layout,
        cache,
        rope,
        books: [books[0].as_ref(), books[1].as_ref()],
    };
    super::attend(&view, &seqs, &mut batch, p.softmax_scale, window);
    if spec.scheme.rotation.applies(Stream::V) {
        for o in &mut outs {
            o.chunks_exact_mut(spec.head_dim)
                .for_each(quant::hadamard_exact);
        }
    }
    // Every output row: a skipped sequence's are zero, as the kernels leave them.
    let mut rows = vec![0f32; tokens * width];
    for ((start, _), o) in queries.iter().zip(&outs) {
        rows[start * width..start * width + o.len()].copy_from_slice(o);
    }
    for (i, &v) in rows.iter().enumerate() {
        // SAFETY: `out` holds `tokens × q_heads × head_dim` elements of the dtype.
        unsafe {
            match p.dtype {
                HIPKV_DTYPE_F16 => out
                    .cast::<u16>()
                    .add(i)
                    .write_unaligned(f16::from_f32(v).to_bits()),
                HIPKV_DTYPE_BF16 => out
                    .cast::<u16>()
                    .add(i)
                    .write_unaligned(half::bf16::from_f32(v).to_bits()),
                _ => out.cast::<f32>().add(i).write_unaligned(v),
            }
        }
    }
}

/// `copy_blocks`, as `hipkv_copy_blocks`: a pair naming a block outside the layout copies
/// nothing and is reported.
///
/// # Safety
/// As [`write_kv`].
unsafe fn copy_blocks(p: &hipkv_copy_params) {
    let bytes = p.block_bytes as usize;
    // SAFETY: the caller's contract.
    let pairs = unsafe { slice(p.block_pairs, 2 * p.pairs as usize) };
    let cache = unsafe { slice_mut(p.cache, p.num_blocks as usize * bytes) };
    for (i, pair) in pairs.chunks_exact(2).enumerate() {
        let (src, dst) = (pair[0], pair[1]);
        let bad = if src < 0 || src as u32 >= p.num_blocks {
            src
        } else {
            dst
        };
        if bad < 0 || bad as u32 >= p.num_blocks {
            // SAFETY: the cache's error word.
            unsafe {
                report(
                    p.error,
                    HIPKV_BAD_BLOCK,
                    HIPKV_CHECK_COPY_BLOCKS,
                    i,
                    i64::from(bad),
                    i64::from(p.num_blocks),
                )
            };
            continue;
        }
        let (src, dst) = (src as usize * bytes, dst as usize * bytes);
        cache.copy_within(src..src + bytes, dst);
    }
}
