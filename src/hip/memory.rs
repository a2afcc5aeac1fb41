//! Safe types over device memory, streams, events and modules. Each owns its handle and releases
//! it on drop (ignoring a failure there: `Drop` never panics); every call returns a typed error.

use std::ffi::{CString, c_void};
use std::marker::PhantomData;

use super::loader::{Runtime, runtime};
use super::sys::{hipEvent_t, hipFunction_t, hipMemcpyKind, hipModule_t, hipStream_t};
use super::traffic::{count_allocation, count_copy, count_synchronization};
use crate::error::{Error, Result};
use crate::kernels::CodeObject;

/// Plain data that may be copied to and from the device as bytes: every bit pattern is a valid
/// value and there is no padding.
///
/// # Safety
/// Implement only for such types.
pub unsafe trait DeviceCopy: Copy + 'static {}

// SAFETY: primitive integers and floats: no padding, every bit pattern valid.
unsafe impl DeviceCopy for u8 {}
// SAFETY: as above.
unsafe impl DeviceCopy for u16 {}
// SAFETY: as above.
unsafe impl DeviceCopy for u32 {}
// SAFETY: as above.
unsafe impl DeviceCopy for u64 {}
// SAFETY: as above.
unsafe impl DeviceCopy for i8 {}
// SAFETY: as above.
unsafe impl DeviceCopy for i32 {}
// SAFETY: as above.
unsafe impl DeviceCopy for i64 {}
// SAFETY: as above.
unsafe impl DeviceCopy for f32 {}

/// `len` values of `T` in device memory, freed on drop.
pub struct DeviceBuffer<T: DeviceCopy> {
    rt: &'static Runtime,
    ptr: *mut c_void,
    len: usize,
    _values: PhantomData<T>,
}

// SAFETY: the buffer is a device allocation owned by this value; HIP calls on it are thread-safe.
unsafe impl<T: DeviceCopy> Send for DeviceBuffer<T> {}
// SAFETY: `&self` methods only read device memory (or pass its address).
unsafe impl<T: DeviceCopy> Sync for DeviceBuffer<T> {}

impl<T: DeviceCopy> DeviceBuffer<T> {
    /// Allocates `len` values (uninitialized device memory; zero them with [`zero`](Self::zero)).
    pub fn new(len: usize) -> Result<Self> {
        let rt = runtime()?;
        let bytes = len.checked_mul(size_of::<T>()).ok_or_else(|| {
            Error::Unsupported(format!(
                "a device buffer of {len} × {} bytes",
                size_of::<T>()
            ))
        })?;
        let mut ptr = std::ptr::null_mut();
        count_allocation();
        // SAFETY: hipMalloc writes one pointer through a valid out-pointer.
        let code = unsafe { (rt.api().hipMalloc)(&mut ptr, bytes) };
        rt.check("hipMalloc", code)?;
        Ok(DeviceBuffer {
            rt,
            ptr,
            len,
            _values: PhantomData,
        })
    }

    /// A buffer holding a copy of `values`.
    pub fn from_slice(values: &[T]) -> Result<Self> {
        let mut buf = DeviceBuffer::new(values.len())?;
        buf.copy_from_host(values)?;
        Ok(buf)
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device address, for a kernel's params struct.
    pub fn device_ptr(&self) -> *mut c_void {
        self.ptr
    }

    fn check_len(&self, what: &'static str, got: usize) -> Result<()> {
        if got == self.len {
            Ok(())
        } else {
            Err(Error::Shape {
                what,
                expected: self.len,
                got,
            })
        }
    }

    /// The element range `offset..offset + n`, or a shape error naming `what`.
    fn check_range(&self, what: &'static str, offset: usize, n: usize) -> Result<()> {
        match offset.checked_add(n) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(Error::Shape {
                what,
                expected: self.len.saturating_sub(offset),
                got: n,
            }),
        }
    }

    /// Copies `src` (as long as the buffer) to the device, synchronously.
    pub fn copy_from_host(&mut self, src: &[T]) -> Result<()> {
        self.check_len(
            "host source of a device copy (the buffer's length)",
            src.len(),
        )?;
        self.write_at(0, src)
    }

    /// Copies `src` to elements `offset..offset + src.len()`, synchronously.
    pub fn write_at(&self, offset: usize, src: &[T]) -> Result<()> {
        self.check_range(
            "host source of a device copy (past the buffer's end)",
            offset,
            src.len(),
        )?;
        count_copy();
        // SAFETY: `src` is readable and the range lies inside this allocation (checked); the
        // copy is complete when hipMemcpy returns. Device memory is written through its
        // address, as a kernel would, so a shared borrow suffices.
        let code = unsafe {
            (self.rt.api().hipMemcpy)(
                self.ptr.cast::<T>().add(offset).cast(),
                src.as_ptr().cast(),
                size_of_val(src),
                hipMemcpyKind::hipMemcpyHostToDevice,
            )
        };
        Ok(self.rt.check("hipMemcpy", code)?)
    }

    /// Copies the buffer into `dst` (as long as the buffer), synchronously.
    pub fn copy_to_host(&self, dst: &mut [T]) -> Result<()> {
        self.check_len(
            "host destination of a device copy (the buffer's length)",
            dst.len(),
        )?;
        self.read_at(0, dst)
    }

    /// Copies elements `offset..offset + dst.len()` into `dst`, synchronously.
    pub fn read_at(&self, offset: usize, dst: &mut [T]) -> Result<()> {
        self.check_range(
            "host destination of a device copy (past the buffer's end)",
            offset,
            dst.len(),
        )?;
        count_copy();
        // SAFETY: as in `write_at`, the other way; any bytes are a valid `T` (`DeviceCopy`).
        let code = unsafe {
            (self.rt.api().hipMemcpy)(
                dst.as_mut_ptr().cast(),
                self.ptr.cast::<T>().add(offset).cast(),
                size_of_val(dst),
                hipMemcpyKind::hipMemcpyDeviceToHost,
            )
        };
        Ok(self.rt.check("hipMemcpy", code)?)
    }

    /// The buffer's values.
    pub fn to_vec(&self) -> Result<Vec<T>> {
        // SAFETY: every bit pattern, all-zero included, is a valid `T` (`DeviceCopy`).
        let zero: T = unsafe { std::mem::zeroed() };
        let mut out = vec![zero; self.len];
        self.copy_to_host(&mut out)?;
        Ok(out)
    }

    /// Sets every byte to zero, asynchronously on `stream`.
    pub fn zero(&mut self, stream: &Stream) -> Result<()> {
        count_copy();
        // SAFETY: `len · size_of::<T>()` bytes of this allocation; the stream orders the write
        // before later work on it, and the buffer outlives the call (drop frees only after
        // hipFree, which waits for the device).
        let code = unsafe {
            (self.rt.api().hipMemsetAsync)(self.ptr, 0, self.len * size_of::<T>(), stream.raw)
        };
        Ok(self.rt.check("hipMemsetAsync", code)?)
    }
}

impl<T: DeviceCopy> Drop for DeviceBuffer<T> {
    fn drop(&mut self) {
        if !self.ptr.is_null() {
            // SAFETY: `ptr` came from hipMalloc and is freed once.
            let _ = unsafe { (self.rt.api().hipFree)(self.ptr) };
        }
    }
}

/// A HIP stream: work on it runs in order.
pub struct Stream {
    rt: &'static Runtime,
    raw: hipStream_t,
}

// SAFETY: HIP streams may be used from any thread; the runtime serializes its own state.
unsafe impl Send for Stream {}
// SAFETY: as above: queuing work on one stream from several threads is allowed.
unsafe impl Sync for Stream {}

impl Stream {
    pub fn new() -> Result<Stream> {
        let rt = runtime()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: writes one handle through a valid out-pointer.
        let code = unsafe { (rt.api().hipStreamCreate)(&mut raw) };
        rt.check("hipStreamCreate", code)?;
        Ok(Stream { rt, raw })
    }

    /// Waits until all work on the stream is done; a kernel fault surfaces here.
    pub fn synchronize(&self) -> Result<()> {
        self.handle().synchronize()
    }

    /// The stream as a [`StreamHandle`], for calls that take a server's stream.
    pub fn handle(&self) -> StreamHandle {
        StreamHandle(self.raw)
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: a live handle, destroyed once.
        let _ = unsafe { (self.rt.api().hipStreamDestroy)(self.raw) };
    }
}

/// A HIP stream someone else owns (a server's `hipStream_t`; null is the default stream), on
/// which hipkv only queues work. CPU and emulated backends ignore it: their calls are done when
/// they return.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(transparent)]
pub struct StreamHandle(pub(crate) hipStream_t);

// SAFETY: a stream handle may be used from any thread (see `Stream`).
unsafe impl Send for StreamHandle {}
// SAFETY: as above.
unsafe impl Sync for StreamHandle {}

impl StreamHandle {
    /// The default (null) stream.
    pub const DEFAULT: StreamHandle = StreamHandle(std::ptr::null_mut());

    /// Wraps a `hipStream_t`.
    ///
    /// # Safety
    /// `raw` is null or a live stream of the HIP runtime hipkv loaded, and stays live while
    /// hipkv queues work on it.
    pub unsafe fn from_raw(raw: *mut std::ffi::c_void) -> StreamHandle {
        StreamHandle(raw.cast())
    }

    /// The `hipStream_t`.
    pub fn as_raw(self) -> *mut std::ffi::c_void {
        self.0.cast()
    }

    /// Waits until all work on the stream is done; a kernel fault surfaces here.
    pub fn synchronize(self) -> Result<()> {
        let rt = runtime()?;
        count_synchronization();
        // SAFETY: a live (or the default) stream, by the handle's contract.
        let code = unsafe { (rt.api().hipStreamSynchronize)(self.0) };
        Ok(rt.check("hipStreamSynchronize", code)?)
    }

    /// Queues a copy of `bytes` bytes between two places in device memory.
    ///
    /// # Safety
    /// Both ranges lie in live device allocations until the copy completes, and do not overlap.
    pub unsafe fn copy_device(self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        let rt = runtime()?;
        // SAFETY: the caller's contract; a device-to-device copy queued on the stream.
        let code = unsafe {
            (rt.api().hipMemcpyAsync)(
                dst as *mut std::ffi::c_void,
                src as *const std::ffi::c_void,
                bytes,
                hipMemcpyKind::hipMemcpyDeviceToDevice,
                self.0,
            )
        };
        Ok(rt.check("hipMemcpyAsync", code)?)
    }
}

/// A HIP event, for timing work on a stream.
pub struct Event {
    rt: &'static Runtime,
    raw: hipEvent_t,
}

// SAFETY: HIP events may be recorded and queried from any thread.
unsafe impl Send for Event {}
// SAFETY: as above.
unsafe impl Sync for Event {}

impl Event {
    pub fn new() -> Result<Event> {
        let rt = runtime()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: writes one handle through a valid out-pointer.
        let code = unsafe { (rt.api().hipEventCreate)(&mut raw) };
        rt.check("hipEventCreate", code)?;
        Ok(Event { rt, raw })
    }

    /// Records the event after the work queued on `stream` so far.
    pub fn record(&self, stream: StreamHandle) -> Result<()> {
        // SAFETY: live event and stream handles (the handle's contract).
        let code = unsafe { (self.rt.api().hipEventRecord)(self.raw, stream.0) };
        Ok(self.rt.check("hipEventRecord", code)?)
    }

    /// Milliseconds from `start` to this event, both recorded; waits for this one.
    pub fn elapsed_ms_since(&self, start: &Event) -> Result<f32> {
        count_synchronization();
        // SAFETY: a live event handle.
        let code = unsafe { (self.rt.api().hipEventSynchronize)(self.raw) };
        self.rt.check("hipEventSynchronize", code)?;
        let mut ms = 0f32;
        // SAFETY: live handles; writes one float.
        let code = unsafe { (self.rt.api().hipEventElapsedTime)(&mut ms, start.raw, self.raw) };
        self.rt.check("hipEventElapsedTime", code)?;
        Ok(ms)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: a live handle, destroyed once.
        let _ = unsafe { (self.rt.api().hipEventDestroy)(self.raw) };
    }
}

/// A loaded code object.
pub struct Module {
    rt: &'static Runtime,
    raw: hipModule_t,
}

/// A kernel of a loaded [`Module`].
#[derive(Clone, Copy)]
pub struct Function<'m> {
    raw: hipFunction_t,
    _module: PhantomData<&'m Module>,
}

// SAFETY: a loaded module is immutable runtime state, usable from any thread.
unsafe impl Send for Module {}
// SAFETY: as above.
unsafe impl Sync for Module {}

impl Module {
    /// Loads an embedded code object (see [`crate::kernels::code_objects_for`]).
    pub fn load(object: &CodeObject) -> Result<Module> {
        let rt = runtime()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: `bytes` is a complete code object, alive for the program's lifetime; the
        // runtime copies what it needs.
        let code = unsafe { (rt.api().hipModuleLoadData)(&mut raw, object.bytes.as_ptr().cast()) };
        rt.check("hipModuleLoadData", code)?;
        Ok(Module { rt, raw })
    }

    /// The kernel named `name`.
    pub fn function(&self, name: &str) -> Result<Function<'_>> {
        let c_name = CString::new(name)
            .map_err(|_| Error::Unsupported(format!("kernel name {name:?} holds a NUL")))?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: a live module and a NUL-terminated name; writes one handle.
        let code =
            unsafe { (self.rt.api().hipModuleGetFunction)(&mut raw, self.raw, c_name.as_ptr()) };
        self.rt.check("hipModuleGetFunction", code)?;
        Ok(Function {
            raw,
            _module: PhantomData,
        })
    }

    /// Queues `function` on `stream` over `grid` workgroups of `block` work-items, with its
    /// params struct passed by value (every hipkv kernel takes one).
    ///
    /// # Safety
    /// `P` is the kernel's `#[repr(C)]` params type, and every device address in `params`
    /// stays valid (and is not freed) until the work completes.
    pub unsafe fn launch<P: Copy>(
        &self,
        function: Function<'_>,
        grid: [u32; 3],
        block: [u32; 3],
        params: &P,
        stream: StreamHandle,
    ) -> Result<()> {
        let mut args = [(params as *const P).cast_mut().cast::<c_void>()];
        // SAFETY: the caller guarantees the params; the runtime copies the argument block
        // before returning, so `args` may go out of scope after.
        let code = unsafe {
            (self.rt.api().hipModuleLaunchKernel)(
                function.raw,
                grid[0],
                grid[1],
                grid[2],
                block[0],
                block[1],
                block[2],
                0,
                stream.0,
                args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        Ok(self.rt.check("hipModuleLaunchKernel", code)?)
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        // SAFETY: a live handle, unloaded once.
        let _ = unsafe { (self.rt.api().hipModuleUnload)(self.raw) };
    }
}
