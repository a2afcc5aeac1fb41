//! The SIMT emulator of `hip/emu`: the HIP kernels of `hip/` (append and attention), compiled
//! for the host, launched as a GPU launches them (a params struct, a grid and a workgroup
//! shape). The `emu` backend is the device-resident cache of [`super::device`] with host
//! allocations and this launcher, so the differential tests run the kernels' own code over the
//! device path.

use std::ffi::{CString, c_char, c_int, c_void};

use crate::error::{Error, Result};

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
pub(crate) fn launch<P: Copy>(
    name: &str,
    params: &P,
    grid: [u32; 3],
    block: [u32; 3],
) -> Result<()> {
    keep_units();
    let c_name = CString::new(name).expect("kernel names have no NUL");
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
    }

    fn run(mode: u32, groups: u32) -> (Vec<f32>, Result<()>) {
        let mut out = vec![0f32; (groups * HIPKV_THREADS) as usize];
        let params = SelftestParams {
            out: out.as_mut_ptr(),
            mode,
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
    fn launch_errors_name_the_problem() {
        let params = SelftestParams {
            out: std::ptr::null_mut(),
            mode: 0,
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
