//! The SIMT emulator of `hip/emu`: the HIP kernels of `hip/` (append and attention), compiled
//! for the host, launched as a GPU launches them (a params struct, a grid and a workgroup
//! shape). The `emu` backend is the device-resident cache of [`super::device`] with host
//! allocations and this launcher, so the differential tests run the kernels' own code over the
//! device path.

use std::any::Any;
use std::cell::RefCell;
use std::ffi::{CString, c_char, c_int, c_void};

use crate::abi::{hipkv_attn_params, hipkv_paged_geometry, hipkv_write_params};
use crate::error::{Error, Result};

/// What a traced launch loaded from one region of memory (`hipkv_emu_load_counts`, emu.h).
/// A wave-level load is the loads of a wave's lanes from one load instruction.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LoadCounts {
    /// Loads by single work-items.
    pub lane_loads: u64,
    /// Wave-level load instructions.
    pub wave_loads: u64,
    /// Bytes requested, summed over work-items.
    pub bytes: u64,
    /// Distinct 128-byte lines per wave-level load, summed.
    pub line_reads: u64,
    /// Distinct 128-byte lines over the launch.
    pub lines: u64,
    /// Distinct bytes over the launch.
    pub unique_bytes: u64,
    /// The most distinct lines one wave loads between two of its lane exchanges or barriers:
    /// what its caches must hold for its loads to reuse lines (a wave's working set).
    pub span_lines: u64,
}

/// `hipkv_emu_trace` (emu.h).
#[repr(C)]
struct TraceRequest {
    regions: *const u64,
    num_regions: u32,
    counts: *mut LoadCounts,
}

/// The loads of one traced launch, by where they read: the KV blocks of the layer (`cache`),
/// the slot states (`state`: sinks and f16 windows), the RoPE table of a `pre_rope` step
/// (`rope`), and everything else (queries, workspace, block tables and sequence metadata).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelLoads {
    pub kernel: String,
    pub cache: LoadCounts,
    pub state: LoadCounts,
    pub rope: LoadCounts,
    pub other: LoadCounts,
}

unsafe extern "C" {
    fn hipkv_emu_launch(
        name: *const c_char,
        params: *const c_void,
        params_size: u32,
        grid: *const u32,
        block: *const u32,
        threads: u32,
        trace: *const TraceRequest,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
}

thread_local! {
    /// The launches traced so far on this thread, while [`trace_loads`] runs.
    static TRACED: RefCell<Option<Vec<KernelLoads>>> = const { RefCell::new(None) };
}

/// Runs `f`, tracing the global loads of every emulated kernel it launches on this thread, and
/// returns its result with the launches' loads, in launch order. Should `f` panic, the
/// thread's tracing is as it was before the call (the loads `f` traced are dropped).
pub fn trace_loads<R>(f: impl FnOnce() -> R) -> (R, Vec<KernelLoads>) {
    /// Puts back the trace that was running before, however the call is left.
    struct Restore(Option<Vec<KernelLoads>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let outer = self.0.take();
            TRACED.with(|t| t.replace(outer));
        }
    }
    let restore = Restore(TRACED.with(|t| t.replace(Some(Vec::new()))));
    let result = f();
    let traced = TRACED.with(|t| t.borrow_mut().take()).unwrap_or_default();
    drop(restore);
    (result, traced)
}

/// The cache, slot-state and RoPE-table ranges a launch's params point at, as `[begin, end)`
/// address pairs (empty for kernels that read none of them; the table's only where a
/// `pre_rope` step passes one).
fn regions(params: &dyn Any) -> [u64; 6] {
    let ranges = |cache: u64, g: &hipkv_paged_geometry, state: u64, slot_state_bytes: u64| {
        let cache_end = cache + g.num_blocks as u64 * g.block_bytes;
        [
            cache,
            cache_end,
            state,
            state + g.max_seqs as u64 * slot_state_bytes,
        ]
    };
    if let Some(p) = params.downcast_ref::<hipkv_attn_params>() {
        let [c, ce, s, se] = ranges(p.cache as u64, &p.g, p.state as u64, p.slot_state_bytes);
        let table = p.rope_cos_sin as u64;
        let table_bytes = u64::from(p.g.max_positions) * u64::from(p.g.head_dim) * 4;
        let table_end = if table == 0 { 0 } else { table + table_bytes };
        [c, ce, s, se, table, table_end]
    } else if let Some(p) = params.downcast_ref::<hipkv_write_params>() {
        let [c, ce, s, se] = ranges(p.cache as u64, &p.g, p.state as u64, p.slot_state_bytes);
        [c, ce, s, se, 0, 0]
    } else {
        [0; 6]
    }
}

include!(concat!(env!("OUT_DIR"), "/emu_units.rs"));

/// Refers to every emulated kernel unit, so that a program linking hipkv's static library
/// keeps them (and their kernels' registrations).
fn keep_units() {
    for anchor in EMU_UNITS {
        // SAFETY: each anchor is an empty `extern "C"` function of the emulator archive.
        unsafe { anchor() };
    }
}

/// Launches `name` with `params` over `grid` workgroups of `block` work-items, on every core.
/// When [`trace_loads`] is running on this thread, counts the launch's loads into it.
pub(crate) fn launch<P: Copy + 'static>(
    name: &str,
    params: &P,
    grid: [u32; 3],
    block: [u32; 3],
) -> Result<()> {
    keep_units();
    let c_name = CString::new(name).expect("kernel names have no NUL");
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()) as u32;
    let mut err = vec![0 as c_char; 1024];
    let tracing = TRACED.with(|t| t.borrow().is_some());
    let ranges = regions(params);
    let mut counts = [LoadCounts::default(); 4];
    let request = TraceRequest {
        regions: ranges.as_ptr(),
        num_regions: 3,
        counts: counts.as_mut_ptr(),
    };
    let trace: *const TraceRequest = if tracing { &request } else { std::ptr::null() };
    // SAFETY: `params` is a `#[repr(C)]` ABI struct of `size_of::<P>()` bytes whose pointers
    // reference buffers alive for this call; the launcher checks the size against the kernel's
    // own params type, runs every workgroup before it returns, and writes at most `err.len()`
    // bytes, NUL-terminated, into `err`. A non-null `trace` points at `request`, whose three
    // regions and four counts live until the call returns. No C++ exception crosses the
    // boundary (built with -fno-exceptions; errors are return codes).
    let rc = unsafe {
        hipkv_emu_launch(
            c_name.as_ptr(),
            (params as *const P).cast(),
            size_of::<P>() as u32,
            grid.as_ptr(),
            block.as_ptr(),
            threads,
            trace,
            err.as_mut_ptr(),
            err.len(),
        )
    };
    if rc == 0 {
        if tracing {
            let [cache, state, rope, other] = counts;
            let loads = KernelLoads {
                kernel: name.to_string(),
                cache,
                state,
                rope,
                other,
            };
            TRACED.with(|t| t.borrow_mut().as_mut().map(|v| v.push(loads)));
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::abi::HIPKV_THREADS;

    /// `hipkv_emu_selftest_params` of `hip/emu/selftest.cpp`.
    #[repr(C)]
    #[derive(Clone, Copy)]
    struct SelftestParams {
        out: *mut f32,
        mode: u32,
        input: *const f32,
    }

    fn run(mode: u32, groups: u32) -> (Vec<f32>, Result<()>) {
        run_with(mode, groups, std::ptr::null())
    }

    fn run_with(mode: u32, groups: u32, input: *const f32) -> (Vec<f32>, Result<()>) {
        let mut out = vec![0f32; (groups * HIPKV_THREADS) as usize];
        let params = SelftestParams {
            out: out.as_mut_ptr(),
            mode,
            input,
        };
        let result = launch(
            "hipkv_emu_selftest",
            &params,
            [groups, 1, 1],
            [HIPKV_THREADS, 1, 1],
        );
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
    fn the_trace_groups_lanes_into_wave_loads() {
        // 1024 floats from a 128-byte boundary (a line), whatever the allocation's alignment.
        let buffer = vec![1f32; 1024 + 32];
        let skip = buffer.as_ptr().align_offset(128);
        let input = buffer[skip..].as_ptr();
        let groups = 3;
        let ((out, result), launches) = trace_loads(|| run_with(5, groups, input));
        result.unwrap();
        for (i, x) in out.iter().enumerate() {
            assert_eq!(*x, 2.0 + (i % 32 % 4) as f32, "work-item {i}");
        }
        assert_eq!(launches.len(), 1);
        let loads = &launches[0];
        assert_eq!(loads.kernel, "hipkv_emu_selftest");
        // The selftest's params name no cache or state: every load is elsewhere.
        assert_eq!(loads.cache, LoadCounts::default());
        assert_eq!(loads.state, LoadCounts::default());
        let waves = (groups * HIPKV_THREADS / 32) as u64;
        let lane_loads = 32 + 32 + (24 + 16 + 8);
        assert_eq!(
            loads.other,
            LoadCounts {
                lane_loads: waves * lane_loads,
                wave_loads: waves * (2 + 3),
                bytes: waves * lane_loads * 4,
                // One line, 32 lines, then one line per loop iteration.
                line_reads: waves * (1 + 32 + 3),
                lines: 32,
                // Line 0 whole, and the first float of each of the 31 others.
                unique_bytes: 128 + 31 * 4,
                // Every load of a wave is in one epoch: lines 0 to 31.
                span_lines: 32,
            }
        );
        // Launches outside `trace_loads` are not traced.
        assert!(trace_loads(|| ()).1.is_empty());
        run(0, 1).1.unwrap();
    }

    #[test]
    fn a_panicking_trace_stops_tracing() {
        let unwound = std::panic::catch_unwind(|| {
            trace_loads(|| {
                run(0, 1).1.unwrap();
                panic!("the traced closure fails");
            })
        });
        assert!(unwound.is_err());
        assert!(TRACED.with(|t| t.borrow().is_none()));
        // Nested traces: the outer one gets its own launches back after an inner one unwinds.
        let (inner, outer) = trace_loads(|| {
            let inner = std::panic::catch_unwind(|| trace_loads(|| panic!("inner")));
            run(0, 1).1.unwrap();
            inner
        });
        assert!(inner.is_err());
        assert_eq!(outer.len(), 1);
    }

    #[test]
    fn launch_errors_name_the_problem() {
        let params = SelftestParams {
            out: std::ptr::null_mut(),
            mode: 0,
            input: std::ptr::null(),
        };
        let missing = launch(
            "hipkv_no_such_kernel",
            &params,
            [1, 1, 1],
            [HIPKV_THREADS, 1, 1],
        )
        .unwrap_err();
        assert!(
            missing
                .to_string()
                .contains("no kernel named hipkv_no_such_kernel")
        );
        let wrong_size =
            launch("hipkv_emu_selftest", &0u8, [1, 1, 1], [HIPKV_THREADS, 1, 1]).unwrap_err();
        assert!(
            wrong_size.to_string().contains("bytes of params"),
            "{wrong_size}"
        );
    }
}
