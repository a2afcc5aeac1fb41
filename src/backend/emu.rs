//! The `emu` backend: the HIP kernels of `hip/` (append and attention), compiled for the host,
//! run by the SIMT emulator of `hip/emu` through the launch path a GPU takes (a params struct, a
//! grid and a workgroup shape). It reads and writes the cache where the CPU backend does, so the
//! differential tests compare the kernels' own code with the reference on the same bytes.

use std::ffi::{CString, c_char, c_int, c_void};

use crate::abi::{
    HIPKV_MAX_GQA, HIPKV_THREADS, hipkv_append_params, hipkv_attn_params, hipkv_combine_params,
    hipkv_rows, hipkv_stream_layout,
};
use crate::cache::{CacheConfig, Query, SeqState};
use crate::error::{Error, Result};
use crate::kernels::{append_kernel_name, attention_kernel_name};
use crate::quant::OutlierThresholds;
use crate::rope::RopeLayout;
use crate::scheme::{Format, HeadLayout, Stream, StreamLayout};

use super::cpu::{CacheView, prepare_queries};
use super::split::{GFX1201_COMPUTE_UNITS, SplitPlan};

unsafe extern "C" {
    fn hipkv_emu_launch(
        name: *const c_char,
        params: *const c_void,
        params_size: u32,
        grid: *const u32,
        block: *const u32,
        threads: u32,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
}

/// Launches `name` with `params` over `grid` workgroups of one wave, on every core.
fn launch<P: Copy>(name: &str, params: &P, grid: [u32; 3]) -> Result<()> {
    let c_name = CString::new(name).expect("kernel names have no NUL");
    let block = [HIPKV_THREADS, 1, 1];
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()) as u32;
    let mut err = vec![0 as c_char; 1024];
    // SAFETY: `params` is a `#[repr(C)]` ABI struct of `size_of::<P>()` bytes whose pointers
    // reference buffers alive for this call; the launcher checks the size against the kernel's
    // own params type, runs every workgroup before it returns, and writes at most `err.len()`
    // bytes, NUL-terminated, into `err`. No C++ exception crosses the boundary (built with
    // -fno-exceptions; errors are return codes).
    let rc = unsafe {
        hipkv_emu_launch(
            c_name.as_ptr(),
            (params as *const P).cast(),
            size_of::<P>() as u32,
            grid.as_ptr(),
            block.as_ptr(),
            threads,
            err.as_mut_ptr(),
            err.len(),
        )
    };
    if rc == 0 {
        return Ok(());
    }
    let bytes: Vec<u8> = err
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    Err(Error::Emulator {
        kernel: name.to_string(),
        message: String::from_utf8_lossy(&bytes).into_owned(),
    })
}

fn stream_abi(l: &StreamLayout, head_dim: usize) -> hipkv_stream_layout {
    let group = match l.format {
        Format::Tok { group, .. } => group.size(head_dim),
        _ => head_dim,
    };
    let u = |x: usize| u32::try_from(x).expect("page offsets fit in u32");
    hipkv_stream_layout {
        rows: u(l.rows),
        row_bytes: u(l.row_bytes),
        params: u(l.params),
        counts: u(l.counts),
        slots: u(l.slots),
        outlier_slots: u(l.outlier_slots),
        group: u(group),
        residual: u32::from(l.format.is_grouped_by_tokens()),
    }
}

/// One layer's storage of one sequence, as the append kernels write it.
pub(crate) struct AppendTarget<'a> {
    pub(crate) config: &'a CacheConfig,
    pub(crate) layout: &'a HeadLayout,
    pub(crate) page_bytes: usize,
    pub(crate) pool: &'a mut [u8],
    /// The sequence, its pages for the new tokens already taken from the pool.
    pub(crate) seq: &'a mut SeqState,
}

/// Appends `n` tokens (`k` and `v`: `n × kv_heads × head_dim` f16 bits, in their stored form)
/// at position `first_pos` with the append kernels, one stream at a time. `thresholds` are the
/// layer's outlier thresholds of each stream that has a store. Returns the outliers dropped.
pub(crate) fn append(
    target: AppendTarget<'_>,
    thresholds: [Option<&OutlierThresholds>; 2],
    k: &[u16],
    v: &[u16],
    first_pos: usize,
) -> Result<u64> {
    let cfg = target.config;
    let d = cfg.head_dim;
    let tokens = k.len() / (cfg.kv_heads * d);
    let grid = [tokens as u32, cfg.kv_heads as u32, 1];
    let mut dropped = 0u64;
    for (i, (stream, x)) in [(Stream::K, k), (Stream::V, v)].into_iter().enumerate() {
        let layout = target.layout.stream(stream);
        let (lo, hi) = thresholds[i].map_or((std::ptr::null(), std::ptr::null()), |t| {
            (t.lo.as_ptr(), t.hi.as_ptr())
        });
        let params = hipkv_append_params {
            pool: target.pool.as_mut_ptr(),
            page_bytes: target.page_bytes as u64,
            head_block_bytes: target.layout.bytes as u32,
            kv_heads: cfg.kv_heads as u32,
            head_dim: d as u32,
            group_tokens: cfg.scheme.group_tokens as u32,
            sinks: cfg.scheme.sinks as u32,
            first_pos: first_pos as u32,
            tokens: tokens as u32,
            layout: stream_abi(layout, d),
            block_table: target.seq.pages.as_ptr(),
            x: x.as_ptr(),
            sink_buf: target.seq.sinks[i].as_mut_ptr().cast(),
            residual: target.seq.residual[i].as_mut_ptr().cast(),
            outlier_lo: lo,
            outlier_hi: hi,
            outliers_dropped: &mut dropped,
        };
        launch(&append_kernel_name(layout.format, d), &params, grid)?;
        if layout.format.is_grouped_by_tokens() {
            launch("hipkv_append_residual", &params, grid)?;
        }
    }
    Ok(dropped)
}

/// Decode attention (one new token per query) with the emulated kernels.
pub(crate) fn attend(
    view: &CacheView<'_>,
    seqs: &[&SeqState],
    queries: &mut [Query<'_>],
    scale: f32,
) -> Result<()> {
    let cfg = view.config;
    let scheme = &cfg.scheme;
    let (d, gqa) = (cfg.head_dim, cfg.gqa());
    let width = cfg.q_heads * d;
    if queries.iter().any(|q| q.q.len() != width) {
        return Err(Error::Unsupported(
            "the emu backend attends one decode token per query".into(),
        ));
    }
    if gqa > HIPKV_MAX_GQA as usize {
        return Err(Error::Unsupported(format!(
            "GQA {gqa} on the emu backend (at most {HIPKV_MAX_GQA})"
        )));
    }
    let prepared = prepare_queries(view, seqs, queries, scale);
    let k_group = stream_abi(&view.layout.k, d).group as usize;
    let q: Vec<f32> = prepared
        .iter()
        .flatten()
        .flat_map(|h| h.rows.iter().copied())
        .collect();
    // Σ q over each key parameter group (for per-token key minimums), laid out
    // [query][KV head][group][row].
    let groups = d / k_group;
    let q_group_sums: Vec<f32> = q
        .chunks_exact(gqa * d)
        .flat_map(|head| {
            (0..groups).flat_map(move |g| {
                (0..gqa).map(move |r| head[r * d + g * k_group..][..k_group].iter().sum::<f32>())
            })
        })
        .collect();
    let rope_cos_sin = view.rope.map(|r| r.flat()).unwrap_or_default();

    let pages = |len: usize| {
        len.saturating_sub(scheme.sinks)
            .div_ceil(scheme.group_tokens)
    };
    let max_pages = seqs.iter().map(|s| pages(s.len)).max().unwrap_or(0);
    let row_groups = (gqa as u32).div_ceil(hipkv_rows(d as u32));
    let workgroups = queries.len() * cfg.kv_heads * row_groups as usize;
    let plan = SplitPlan::new(max_pages, workgroups, GFX1201_COMPUTE_UNITS);
    let splits = plan.splits;
    let seq_len: Vec<u32> = seqs.iter().map(|s| s.len as u32).collect();
    let block_table: Vec<*const u32> = seqs.iter().map(|s| s.pages.as_ptr()).collect();
    let f16_ptrs = |i: usize, sinks: bool| -> Vec<*const u16> {
        seqs.iter()
            .map(|s| {
                let buf = if sinks { &s.sinks[i] } else { &s.residual[i] };
                buf.as_ptr().cast()
            })
            .collect()
    };
    let (sinks_k, sinks_v) = (f16_ptrs(0, true), f16_ptrs(1, true));
    let (residual_k, residual_v) = (f16_ptrs(0, false), f16_ptrs(1, false));
    let rows = queries.len() * cfg.kv_heads * gqa;
    let mut partial_acc = vec![0f32; rows * splits * d];
    let mut partial_max = vec![0f32; rows * splits];
    let mut partial_sum = vec![0f32; rows * splits];

    let params = hipkv_attn_params {
        pool: view.pool.as_ptr(),
        page_bytes: view.page_bytes as u64,
        head_block_bytes: view.layout.bytes as u32,
        kv_heads: cfg.kv_heads as u32,
        gqa: gqa as u32,
        head_dim: d as u32,
        group_tokens: scheme.group_tokens as u32,
        sinks: scheme.sinks as u32,
        splits: splits as u32,
        pages_per_split: plan.pages_per_split as u32,
        pre_rope: u32::from(scheme.pre_rope),
        rope_pairs_interleaved: u32::from(
            view.rope
                .is_none_or(|r| r.layout() == RopeLayout::Interleaved),
        ),
        k: stream_abi(&view.layout.k, d),
        v: stream_abi(&view.layout.v, d),
        seq_len: seq_len.as_ptr(),
        block_table: block_table.as_ptr(),
        sinks_k: sinks_k.as_ptr(),
        sinks_v: sinks_v.as_ptr(),
        residual_k: residual_k.as_ptr(),
        residual_v: residual_v.as_ptr(),
        q: q.as_ptr(),
        q_group_sums: q_group_sums.as_ptr(),
        rope_cos_sin: rope_cos_sin.as_ptr(),
        partial_acc: partial_acc.as_mut_ptr(),
        partial_max: partial_max.as_mut_ptr(),
        partial_sum: partial_sum.as_mut_ptr(),
    };
    let name = attention_kernel_name(scheme.k, scheme.v, d);
    let grid = [
        splits as u32,
        cfg.kv_heads as u32 * row_groups,
        queries.len() as u32,
    ];
    launch(&name, &params, grid)?;

    let mut out = vec![0f32; rows * d];
    let combine = hipkv_combine_params {
        partial_acc: partial_acc.as_ptr(),
        partial_max: partial_max.as_ptr(),
        partial_sum: partial_sum.as_ptr(),
        out: out.as_mut_ptr(),
        rows: rows as u32,
        gqa: gqa as u32,
        splits: splits as u32,
        head_dim: d as u32,
    };
    launch("hipkv_attn_combine", &combine, [rows as u32, 1, 1])?;
    for (query, o) in queries.iter_mut().zip(out.chunks_exact(width)) {
        query.out.copy_from_slice(o);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `hipkv_emu_selftest_params` of `hip/emu/selftest.cpp`.
    #[repr(C)]
    #[derive(Clone, Copy)]
    struct SelftestParams {
        out: *mut f32,
        mode: u32,
    }

    fn run(mode: u32, groups: u32) -> (Vec<f32>, Result<()>) {
        let mut out = vec![0f32; (groups * HIPKV_THREADS) as usize];
        let params = SelftestParams {
            out: out.as_mut_ptr(),
            mode,
        };
        let result = launch("hipkv_emu_selftest", &params, [groups, 1, 1]);
        (out, result)
    }

    fn error_of(mode: u32) -> String {
        match run(mode, 3).1 {
            Err(Error::Emulator { message, .. }) => message,
            other => panic!("mode {mode}: expected an emulator error, got {other:?}"),
        }
    }

    #[test]
    fn lanes_exchange_in_lockstep() {
        let (out, result) = run(0, 4);
        result.unwrap();
        for (i, x) in out.iter().enumerate() {
            let lane = i % 32;
            assert_eq!(*x, (lane ^ 1) as f32 + 1000.0 * 496.0, "work-item {i}");
        }
    }

    #[test]
    fn shared_memory_and_barriers_are_per_workgroup() {
        let (out, result) = run(1, 5);
        result.unwrap();
        // Σ 0..32 in every work-item of every workgroup, whichever OS thread ran it.
        assert!(out.iter().all(|&x| x == 496.0), "{out:?}");
    }

    #[test]
    fn divergence_is_an_error_not_a_hang() {
        assert!(
            error_of(2).contains("finished while others wait"),
            "{}",
            error_of(2)
        );
        assert!(error_of(3).contains("lockstep"), "{}", error_of(3));
        assert!(
            error_of(4).contains("different barriers"),
            "{}",
            error_of(4)
        );
    }

    #[test]
    fn launch_errors_name_the_problem() {
        let params = SelftestParams {
            out: std::ptr::null_mut(),
            mode: 0,
        };
        let missing = launch("hipkv_no_such_kernel", &params, [1, 1, 1]).unwrap_err();
        assert!(
            missing
                .to_string()
                .contains("no kernel named hipkv_no_such_kernel")
        );
        let wrong_size = launch("hipkv_emu_selftest", &0u8, [1, 1, 1]).unwrap_err();
        assert!(
            wrong_size.to_string().contains("bytes of params"),
            "{wrong_size}"
        );
    }
}
