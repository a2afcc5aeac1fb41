//! The C ABI of `include/hipkv.h`: opaque handles over [`PagedCache`], status codes, a per-thread
//! last-error message, `hipStream_t` as an opaque pointer. Every function catches what it calls:
//! an error becomes a status and a message, a panic (a bug) `HIPKV_ERROR_INTERNAL`; nothing
//! unwinds across the boundary.
//!
//! The types come from the header itself (`header.rs`, bindgen's reading of it, committed and
//! checked fresh by `tests/capi.rs`), and `signatures_match_the_header` below makes the compiler
//! hold every function here to the header's declaration.

#[allow(non_camel_case_types, non_upper_case_globals, dead_code, clippy::all)]
mod header;

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{CStr, CString, c_char, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Mutex;

pub use header::{
    HIPKV_BACKEND_CPU, HIPKV_BACKEND_EMU, HIPKV_BACKEND_HIP, HIPKV_DTYPE_BF16, HIPKV_DTYPE_F16,
    HIPKV_DTYPE_F32, HIPKV_ERROR_BACKEND_UNAVAILABLE, HIPKV_ERROR_DEVICE_INDEX,
    HIPKV_ERROR_INTERNAL, HIPKV_ERROR_INVALID_ARGUMENT, HIPKV_ERROR_OUT_OF_MEMORY,
    HIPKV_ERROR_OUT_OF_RANGE, HIPKV_ERROR_RUNTIME, HIPKV_OK, hipkv_backend, hipkv_cache,
    hipkv_dtype, hipkv_kv_batch, hipkv_layout_desc, hipkv_query_batch, hipkv_status,
};

use crate::backend::Backend;
use crate::calibration::Calibration;
use crate::error::{Error, Result};
use crate::hip::StreamHandle;
use crate::paged::{
    BatchLimits, DType, DeviceMemory, KvBatch, Layout, LayoutSpec, PagedCache, QueryBatch,
    Workspace,
};
use crate::quant::{Codebook, OutlierThresholds};
use crate::rope::{Rope, RopeLayout};
use crate::scheme::Stream;

/// What a `hipkv_cache *` points to.
struct Handle {
    paged: PagedCache,
    /// Memory handed out by `hipkv_alloc`, by address.
    memory: Mutex<HashMap<u64, DeviceMemory>>,
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_last_error(message: String) {
    let message = CString::new(message.replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|e| *e.borrow_mut() = message);
}

fn status_of(e: &Error) -> hipkv_status {
    match e {
        Error::OutOfRange { .. } | Error::CacheFull { .. } | Error::QueryBeyondCache { .. } => {
            HIPKV_ERROR_OUT_OF_RANGE
        }
        Error::OutOfMemory { .. } => HIPKV_ERROR_OUT_OF_MEMORY,
        Error::HipUnavailable(_)
        | Error::ArchNotBuilt { .. }
        | Error::BackendUnavailable { .. } => HIPKV_ERROR_BACKEND_UNAVAILABLE,
        Error::DeviceIndex { .. } => HIPKV_ERROR_DEVICE_INDEX,
        Error::Hip(_) | Error::Emulator { .. } => HIPKV_ERROR_RUNTIME,
        _ => HIPKV_ERROR_INVALID_ARGUMENT,
    }
}

/// Runs `f`, turning its error into a status and this thread's last error, and a panic into
/// `HIPKV_ERROR_INTERNAL`.
fn guard(f: impl FnOnce() -> Result<()>) -> hipkv_status {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => HIPKV_OK,
        Ok(Err(e)) => {
            set_last_error(e.to_string());
            status_of(&e)
        }
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            set_last_error(format!(
                "internal error in hipkv (a bug; please report it): {what}"
            ));
            HIPKV_ERROR_INTERNAL
        }
    }
}

fn invalid(what: &str) -> Error {
    Error::Unsupported(format!("{what} (C ABI)"))
}

/// The handle behind `cache`.
///
/// # Safety
/// `cache` is null or came from `hipkv_cache_create` and was not destroyed.
unsafe fn handle<'a>(cache: *const hipkv_cache) -> Result<&'a Handle> {
    // SAFETY: the caller's contract.
    unsafe { cache.cast::<Handle>().as_ref() }.ok_or_else(|| invalid("a null hipkv_cache"))
}

fn dtype(d: hipkv_dtype) -> Result<DType> {
    match d {
        HIPKV_DTYPE_F16 => Ok(DType::F16),
        HIPKV_DTYPE_BF16 => Ok(DType::BF16),
        HIPKV_DTYPE_F32 => Ok(DType::F32),
        other => Err(invalid(&format!("dtype {other}"))),
    }
}

fn stream(s: *mut c_void) -> StreamHandle {
    // SAFETY: the header's contract: a hipStream_t of the loaded runtime, or null.
    unsafe { StreamHandle::from_raw(s) }
}

#[unsafe(no_mangle)]
pub extern "C" fn hipkv_last_error() -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}

/// # Safety
/// `desc` points to a layout whose `scheme` is a NUL-terminated string; `out` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hipkv_cache_create(
    desc: *const hipkv_layout_desc,
    layers: u32,
    backend: hipkv_backend,
    out: *mut *mut hipkv_cache,
) -> hipkv_status {
    guard(|| {
        // SAFETY: the caller's contract.
        let (desc, out) = unsafe { (desc.as_ref(), out.as_mut()) };
        let (desc, out) = desc.zip(out).ok_or_else(|| invalid("a null argument"))?;
        if desc.scheme.is_null() {
            return Err(invalid("a null scheme"));
        }
        // SAFETY: a NUL-terminated string, by the caller's contract.
        let scheme = unsafe { CStr::from_ptr(desc.scheme) }
            .to_str()
            .map_err(|_| Error::ParseScheme("not UTF-8".into()))?;
        let backend = match backend {
            HIPKV_BACKEND_CPU => Backend::Cpu,
            HIPKV_BACKEND_EMU => Backend::Emu,
            HIPKV_BACKEND_HIP => Backend::Hip,
            other => return Err(invalid(&format!("backend {other}"))),
        };
        let rope = (desc.rope_base > 0.0).then_some(Rope {
            base: desc.rope_base,
            layout: if desc.rope_interleaved != 0 {
                RopeLayout::Interleaved
            } else {
                RopeLayout::Halves
            },
        });
        let layout = Layout::new(LayoutSpec {
            scheme: scheme.parse()?,
            kv_heads: desc.kv_heads as usize,
            q_heads: desc.q_heads as usize,
            head_dim: desc.head_dim as usize,
            num_blocks: desc.num_blocks as usize,
            max_seqs: desc.max_seqs as usize,
            max_positions: desc.max_positions as usize,
            rope,
        })?;
        let handle = Handle {
            paged: PagedCache::new(layout, layers as usize, backend)?,
            memory: Mutex::new(HashMap::new()),
        };
        *out = Box::into_raw(Box::new(handle)).cast();
        Ok(())
    })
}

/// # Safety
/// `cache` is null or a live handle, not used after this call.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hipkv_cache_destroy(cache: *mut hipkv_cache) {
    if !cache.is_null() {
        // SAFETY: made by `Box::into_raw` in `hipkv_cache_create`, freed once.
        let _ = catch_unwind(AssertUnwindSafe(|| {
            drop(unsafe { Box::from_raw(cache.cast::<Handle>()) })
        }));
    }
}

/// A size of the handle's layout, 0 for a null handle.
///
/// # Safety
/// `cache` is null or a live handle.
unsafe fn size(cache: *const hipkv_cache, f: impl Fn(&Layout) -> usize) -> usize {
    // SAFETY: the caller's contract.
    unsafe { handle(cache) }.map_or(0, |h| f(h.paged.layout()))
}

/// # Safety
/// `cache` is null or a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hipkv_block_bytes(cache: *const hipkv_cache) -> usize {
    // SAFETY: the caller's contract.
    unsafe { size(cache, Layout::block_bytes) }
}

/// # Safety
/// `cache` is null or a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hipkv_cache_bytes(cache: *const hipkv_cache) -> usize {
    // SAFETY: the caller's contract.
    unsafe { size(cache, Layout::cache_bytes) }
}

/// # Safety
/// `cache` is null or a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hipkv_state_bytes(cache: *const hipkv_cache) -> usize {
    // SAFETY: the caller's contract.
    unsafe { size(cache, Layout::state_bytes) }
}

/// # Safety
/// `cache` is null or a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hipkv_workspace_bytes(
    cache: *const hipkv_cache,
    max_tokens: u32,
) -> usize {
    let limits = BatchLimits {
        max_tokens: max_tokens as usize,
    };
    // SAFETY: the caller's contract.
    unsafe { size(cache, |l| l.workspace_bytes(limits)) }
}

/// # Safety
/// `cache` is null or a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hipkv_block_tokens(cache: *const hipkv_cache) -> u32 {
    // SAFETY: the caller's contract.
    unsafe { size(cache, Layout::block_tokens) as u32 }
}

/// # Safety
/// `cache` is a live handle; each non-null threshold array holds `kv_heads × head_dim` floats.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hipkv_set_outlier_thresholds(
    cache: *mut hipkv_cache,
    layer: u32,
    k_lo: *const f32,
    k_hi: *const f32,
    v_lo: *const f32,
    v_hi: *const f32,
) -> hipkv_status {
    guard(|| {
        if cache.is_null() {
            return Err(invalid("a null hipkv_cache"));
        }
        // SAFETY: a live handle, used by this thread only during the call (the header's
        // setup-time contract).
        let h = unsafe { &mut *cache.cast::<Handle>() };
        let spec = *h.paged.layout().spec();
        let n = spec.kv_heads * spec.head_dim;
        let read = |lo: *const f32, hi: *const f32| -> Result<OutlierThresholds> {
            if lo.is_null() || hi.is_null() {
                return Err(invalid("a null threshold array"));
            }
            // SAFETY: `n` floats each, by the caller's contract.
            let (lo, hi) = unsafe {
                (
                    std::slice::from_raw_parts(lo, n).to_vec(),
                    std::slice::from_raw_parts(hi, n).to_vec(),
                )
            };
            Ok(OutlierThresholds {
                heads: spec.kv_heads,
                head_dim: spec.head_dim,
                lo,
                hi,
            })
        };
        let k = read(k_lo, k_hi)?;
        let v = if v_lo.is_null() && v_hi.is_null() {
            None
        } else {
            Some(read(v_lo, v_hi)?)
        };
        h.paged
            .set_outlier_thresholds(layer as usize, &k, v.as_ref())
    })
}

/// # Safety
/// `cache` is a live handle; each non-null level array holds `2^bits` floats, `bits` its
/// stream's code width.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hipkv_set_codebooks(
    cache: *mut hipkv_cache,
    layer: u32,
    k_levels: *const f32,
    v_levels: *const f32,
) -> hipkv_status {
    guard(|| {
        if cache.is_null() {
            return Err(invalid("a null hipkv_cache"));
        }
        // SAFETY: a live handle, used by this thread only during the call (the header's
        // setup-time contract).
        let h = unsafe { &mut *cache.cast::<Handle>() };
        let scheme = h.paged.layout().scheme();
        let read = |stream: Stream, levels: *const f32| -> Result<Option<Codebook>> {
            if levels.is_null() {
                return Ok(None);
            }
            let bits = scheme.low_bits(stream).ok_or_else(|| {
                Error::Unsupported(format!(
                    "scheme {scheme} stores {stream} without 4- or 2-bit codes: no codebook"
                ))
            })?;
            // SAFETY: `2^bits` floats, by the caller's contract.
            let levels = unsafe { std::slice::from_raw_parts(levels, 1 << bits.bits()) };
            Codebook::new(bits, levels).map(Some)
        };
        let (k, v) = (read(Stream::K, k_levels)?, read(Stream::V, v_levels)?);
        h.paged
            .set_codebooks(layer as usize, k.as_ref(), v.as_ref())
    })
}

/// # Safety
/// `cache` is a live handle; `text` is a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hipkv_apply_calibration(
    cache: *mut hipkv_cache,
    text: *const c_char,
) -> hipkv_status {
    guard(|| {
        if cache.is_null() || text.is_null() {
            return Err(invalid("a null argument"));
        }
        // SAFETY: a live handle, used by this thread only during the call (the header's
        // setup-time contract).
        let h = unsafe { &mut *cache.cast::<Handle>() };
        // SAFETY: a NUL-terminated string, by the caller's contract.
        let text = unsafe { CStr::from_ptr(text) }
            .to_str()
            .map_err(|_| invalid("a calibration text that is not UTF-8"))?;
        h.paged.apply_calibration(&Calibration::parse(text)?)
    })
}

/// # Safety
/// `cache` is a live handle; `out` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hipkv_alloc(
    cache: *mut hipkv_cache,
    bytes: usize,
    out: *mut *mut c_void,
) -> hipkv_status {
    guard(|| {
        // SAFETY: the caller's contract.
        let h = unsafe { handle(cache)? };
        // SAFETY: as above.
        let out = unsafe { out.as_mut() }.ok_or_else(|| invalid("a null out pointer"))?;
        let mem = h.paged.alloc(bytes)?;
        *out = mem.addr() as *mut c_void;
        h.memory
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(mem.addr(), mem);
        Ok(())
    })
}

/// # Safety
/// `cache` is a live handle; `memory` is null or came from its `hipkv_alloc` and is no longer
/// used by queued work.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hipkv_free(cache: *mut hipkv_cache, memory: *mut c_void) {
    let _ = guard(|| {
        // SAFETY: the caller's contract.
        let h = unsafe { handle(cache)? };
        h.memory
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&(memory as u64));
        Ok(())
    });
}

/// The allocation `memory` came from, for copies into or out of it.
fn with_memory<T>(
    h: &Handle,
    memory: u64,
    f: impl FnOnce(&DeviceMemory) -> Result<T>,
) -> Result<T> {
    let map = h.memory.lock().unwrap_or_else(|e| e.into_inner());
    let mem = map
        .get(&memory)
        .ok_or_else(|| invalid("memory that hipkv_alloc did not give"))?;
    f(mem)
}

/// # Safety
/// `cache` is a live handle; `src` holds `bytes` readable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hipkv_upload(
    cache: *mut hipkv_cache,
    memory: *mut c_void,
    offset: usize,
    src: *const c_void,
    bytes: usize,
) -> hipkv_status {
    guard(|| {
        // SAFETY: the caller's contract.
        let h = unsafe { handle(cache)? };
        if src.is_null() && bytes > 0 {
            return Err(invalid("a null source"));
        }
        // SAFETY: `bytes` readable bytes, by the caller's contract.
        let src = unsafe { std::slice::from_raw_parts(src.cast::<u8>(), bytes) };
        with_memory(h, memory as u64, |m| {
            h.paged.upload(m, offset, src, StreamHandle::DEFAULT)
        })
    })
}

/// # Safety
/// `cache` is a live handle; `dst` holds `bytes` writable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hipkv_download(
    cache: *mut hipkv_cache,
    memory: *const c_void,
    offset: usize,
    dst: *mut c_void,
    bytes: usize,
) -> hipkv_status {
    guard(|| {
        // SAFETY: the caller's contract.
        let h = unsafe { handle(cache)? };
        if dst.is_null() && bytes > 0 {
            return Err(invalid("a null destination"));
        }
        // SAFETY: `bytes` writable bytes, by the caller's contract.
        let dst = unsafe { std::slice::from_raw_parts_mut(dst.cast::<u8>(), bytes) };
        with_memory(h, memory as u64, |m| {
            h.paged.download(m, offset, dst, StreamHandle::DEFAULT)
        })
    })
}

/// # Safety
/// `cache` is a live handle; `layer_cache` and every pointer in `batch` address what the header
/// states in the handle's backend memory, alive until the queued work completes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hipkv_write_kv(
    cache: *mut hipkv_cache,
    layer: u32,
    layer_cache: *mut c_void,
    batch: *const hipkv_kv_batch,
    stream_: *mut c_void,
) -> hipkv_status {
    guard(|| {
        // SAFETY: the caller's contract.
        let (h, b) = unsafe { (handle(cache)?, batch.as_ref()) };
        let b = b.ok_or_else(|| invalid("a null batch"))?;
        let batch = KvBatch {
            tokens: b.tokens as usize,
            dtype: dtype(b.dtype)?,
            k: b.k as u64,
            v: b.v as u64,
            slot_mapping: b.slot_mapping as u64,
            seq_slots: b.seq_slots as u64,
            positions: b.positions as u64,
        };
        // SAFETY: the caller's contract.
        unsafe {
            h.paged
                .write_kv(layer as usize, layer_cache as u64, &batch, stream(stream_))
        }
    })
}

/// # Safety
/// As `hipkv_write_kv`; `workspace` holds `hipkv_workspace_bytes(cache, workspace_max_tokens)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hipkv_attend(
    cache: *mut hipkv_cache,
    layer: u32,
    layer_cache: *const c_void,
    batch: *const hipkv_query_batch,
    workspace: *mut c_void,
    workspace_max_tokens: u32,
    stream_: *mut c_void,
) -> hipkv_status {
    guard(|| {
        // SAFETY: the caller's contract.
        let (h, b) = unsafe { (handle(cache)?, batch.as_ref()) };
        let b = b.ok_or_else(|| invalid("a null batch"))?;
        let batch = QueryBatch {
            num_seqs: b.num_seqs as usize,
            tokens: b.tokens as usize,
            max_q_len: b.max_q_len as usize,
            max_seq_len: b.max_seq_len as usize,
            max_blocks_per_seq: b.max_blocks_per_seq as usize,
            dtype: dtype(b.dtype)?,
            softmax_scale: b.softmax_scale,
            window: (b.window != 0).then_some(b.window as usize),
            q: b.q as u64,
            out: b.out as u64,
            query_start_loc: b.query_start_loc as u64,
            seq_lens: b.seq_lens as u64,
            block_tables: b.block_tables as u64,
            seq_slots: b.seq_slots as u64,
        };
        let workspace = Workspace {
            addr: workspace as u64,
            limits: BatchLimits {
                max_tokens: workspace_max_tokens as usize,
            },
        };
        // SAFETY: the caller's contract.
        unsafe {
            h.paged.attend(
                layer as usize,
                layer_cache as u64,
                &batch,
                &workspace,
                stream(stream_),
            )
        }
    })
}

/// # Safety
/// `cache` is a live handle; `layer_cache` and `pairs` (`2n` i32) live in its backend's memory
/// until the queued work completes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hipkv_copy_blocks(
    cache: *mut hipkv_cache,
    layer_cache: *mut c_void,
    pairs: *const i32,
    n: u32,
    stream_: *mut c_void,
) -> hipkv_status {
    guard(|| {
        // SAFETY: the caller's contract.
        let h = unsafe { handle(cache)? };
        // SAFETY: as above.
        unsafe {
            h.paged.copy_blocks(
                layer_cache as u64,
                pairs as u64,
                n as usize,
                stream(stream_),
            )
        }
    })
}

/// # Safety
/// `cache` is a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hipkv_fork(
    cache: *mut hipkv_cache,
    src_slot: u32,
    dst_slot: u32,
    stream_: *mut c_void,
) -> hipkv_status {
    guard(|| {
        // SAFETY: the caller's contract.
        let h = unsafe { handle(cache)? };
        h.paged
            .fork(src_slot as usize, dst_slot as usize, stream(stream_))
    })
}

/// # Safety
/// `cache` is a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hipkv_check(
    cache: *mut hipkv_cache,
    stream_: *mut c_void,
) -> hipkv_status {
    guard(|| {
        // SAFETY: the caller's contract.
        let h = unsafe { handle(cache)? };
        h.paged.check(stream(stream_))
    })
}

/// Holds every function above to the header's declaration: each pair must coerce to one
/// function-pointer type, or this does not compile.
#[allow(dead_code)]
fn signatures_match_the_header() {
    macro_rules! same {
        ($($name:ident ($($arg:tt)*);)*) => {$(
            let _ = [
                header::$name as unsafe extern "C" fn($($arg)*) -> _,
                $name as unsafe extern "C" fn($($arg)*) -> _,
            ];
        )*};
    }
    same! {
        hipkv_last_error();
        hipkv_cache_create(_, _, _, _);
        hipkv_cache_destroy(_);
        hipkv_block_bytes(_);
        hipkv_cache_bytes(_);
        hipkv_state_bytes(_);
        hipkv_workspace_bytes(_, _);
        hipkv_block_tokens(_);
        hipkv_set_outlier_thresholds(_, _, _, _, _, _);
        hipkv_set_codebooks(_, _, _, _);
        hipkv_apply_calibration(_, _);
        hipkv_alloc(_, _, _);
        hipkv_free(_, _);
        hipkv_upload(_, _, _, _, _);
        hipkv_download(_, _, _, _, _);
        hipkv_write_kv(_, _, _, _, _);
        hipkv_attend(_, _, _, _, _, _, _);
        hipkv_copy_blocks(_, _, _, _, _);
        hipkv_fork(_, _, _, _);
        hipkv_check(_, _);
    }
}
