//! Finding and opening `libamdhip64` once per process, and the `Result` tier over its calls.

use std::ffi::{CStr, c_char, c_int};
use std::path::Path;

use once_cell::sync::OnceCell;

use super::sys::{HipRuntime, hipDeviceProp_t, hipError_t};

/// Library names, newest ABI first; every call hipkv makes exists in all of them.
const NAMES: [&str; 3] = ["libamdhip64.so", "libamdhip64.so.6", "libamdhip64.so.5"];
/// Names the one library to open instead of searching (a path, or a name for the loader).
pub const LIBRARY_ENV: &str = "HIPKV_HIP_LIBRARY";

/// No HIP runtime could be opened: every candidate and why it failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("no HIP runtime could be loaded; tried {}", tried_list(.tried))]
pub struct LoadError {
    /// `(candidate, why it failed)`, in the order tried.
    pub tried: Vec<(String, String)>,
}

fn tried_list(tried: &[(String, String)]) -> String {
    let items: Vec<String> = tried
        .iter()
        .map(|(c, why)| format!("{c} ({why})"))
        .collect();
    items.join("; ")
}

/// A HIP runtime call that failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{call} failed: {name} ({code}): {message}")]
pub struct HipError {
    pub call: &'static str,
    /// The `hipError_t` value.
    pub code: u32,
    /// Its name, such as `hipErrorNoDevice`.
    pub name: String,
    /// The runtime's description of it.
    pub message: String,
}

impl HipError {
    /// `hipErrorNoDevice`: a runtime without a usable GPU.
    pub fn is_no_device(&self) -> bool {
        self.code == hipError_t::hipErrorNoDevice.0
    }
}

/// The opened HIP runtime library.
pub struct Runtime {
    api: HipRuntime,
    path: String,
}

/// The HIP runtime, opened on first use. Candidates, in order: `$HIPKV_HIP_LIBRARY` alone when
/// set; else each of `libamdhip64.so`, `.so.6`, `.so.5` under `$ROCM_PATH/lib`,
/// `$HIP_PATH/lib` and `/opt/rocm/lib`, then by name through the dynamic loader's search path.
pub fn runtime() -> Result<&'static Runtime, LoadError> {
    static RUNTIME: OnceCell<Result<Runtime, LoadError>> = OnceCell::new();
    RUNTIME.get_or_init(load).as_ref().map_err(Clone::clone)
}

/// Where [`runtime`] looks, in order.
pub fn candidates() -> Vec<String> {
    if let Ok(lib) = std::env::var(LIBRARY_ENV) {
        return vec![lib];
    }
    let mut dirs: Vec<String> = ["ROCM_PATH", "HIP_PATH"]
        .iter()
        .filter_map(|v| std::env::var(v).ok())
        .map(|root| format!("{}/lib", root.trim_end_matches('/')))
        .collect();
    dirs.push("/opt/rocm/lib".into());
    let mut all: Vec<String> = dirs
        .iter()
        .flat_map(|dir| NAMES.iter().map(move |n| format!("{dir}/{n}")))
        .collect();
    all.extend(NAMES.iter().map(|n| n.to_string()));
    all
}

fn load() -> Result<Runtime, LoadError> {
    let mut tried = Vec::new();
    for candidate in candidates() {
        if candidate.contains('/') && !Path::new(&candidate).exists() {
            tried.push((candidate, "no such file".into()));
            continue;
        }
        // SAFETY: opening the library runs its initializers, which are the HIP runtime's own;
        // every function hipkv calls is then resolved by name with the signature bindgen took
        // from the HIP header, and a library missing any of them is rejected here.
        match unsafe { HipRuntime::new(&candidate) } {
            Ok(api) => {
                return Ok(Runtime {
                    api,
                    path: candidate,
                });
            }
            Err(e) => tried.push((candidate, e.to_string())),
        }
    }
    Err(LoadError { tried })
}

/// `hipDeviceProp_t` with room after it: a runtime newer than the header hipkv was generated
/// from may write a longer struct (ROCm 6 keeps the 5.x layout under this symbol, but a few
/// KiB of slack cost nothing and rule out an overrun).
#[repr(C)]
struct PropsWithSlack {
    props: hipDeviceProp_t,
    slack: [u8; 4096],
}

impl Runtime {
    /// The path or name the library was opened by.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The function table.
    pub(crate) fn api(&self) -> &HipRuntime {
        &self.api
    }

    pub(crate) fn check(&self, call: &'static str, code: hipError_t) -> Result<(), HipError> {
        if code == hipError_t::hipSuccess {
            return Ok(());
        }
        let text = |f: unsafe extern "C" fn(hipError_t) -> *const c_char| {
            // SAFETY: both functions accept any error code and return null or a static
            // NUL-terminated string.
            let p = unsafe { f(code) };
            if p.is_null() {
                String::new()
            } else {
                // SAFETY: non-null, NUL-terminated, static (see above).
                unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
            }
        };
        Err(HipError {
            call,
            code: code.0,
            name: text(self.api.hipGetErrorName),
            message: text(self.api.hipGetErrorString),
        })
    }

    /// `hipRuntimeGetVersion`: `major·10⁷ + minor·10⁵ + patch` on ROCm.
    pub fn runtime_version(&self) -> Result<i32, HipError> {
        let mut v: c_int = 0;
        // SAFETY: writes one int through a valid pointer.
        let code = unsafe { (self.api.hipRuntimeGetVersion)(&mut v) };
        self.check("hipRuntimeGetVersion", code).map(|()| v)
    }

    /// `hipGetDeviceCount`; a runtime with no GPU answers `hipErrorNoDevice`.
    pub fn device_count(&self) -> Result<usize, HipError> {
        let mut n: c_int = 0;
        // SAFETY: writes one int through a valid pointer.
        let code = unsafe { (self.api.hipGetDeviceCount)(&mut n) };
        self.check("hipGetDeviceCount", code)
            .map(|()| usize::try_from(n).unwrap_or(0))
    }

    /// `hipSetDevice`: later allocations, streams and modules of this thread use device
    /// `ordinal`.
    pub fn set_device(&self, ordinal: usize) -> Result<(), HipError> {
        let ordinal = c_int::try_from(ordinal).unwrap_or(c_int::MAX);
        // SAFETY: takes a plain int; an unknown ordinal is an error code.
        let code = unsafe { (self.api.hipSetDevice)(ordinal) };
        self.check("hipSetDevice", code)
    }

    /// `hipGetDeviceProperties` of device `ordinal`.
    pub(crate) fn device_properties(&self, ordinal: usize) -> Result<hipDeviceProp_t, HipError> {
        let mut out = PropsWithSlack {
            props: hipDeviceProp_t::default(),
            slack: [0; 4096],
        };
        let ordinal = c_int::try_from(ordinal).unwrap_or(c_int::MAX);
        // SAFETY: `out` is a writable, zeroed `hipDeviceProp_t` followed by slack (see
        // `PropsWithSlack`); the runtime fills it and keeps no pointer to it.
        let code = unsafe { (self.api.hipGetDeviceProperties)(&mut out.props, ordinal) };
        self.check("hipGetDeviceProperties", code)
            .map(|()| out.props)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candidates_search_rocm_then_the_loader_path() {
        // The environment is the test runner's: only check the order of what is always there.
        let c = candidates();
        if std::env::var(LIBRARY_ENV).is_ok() {
            assert_eq!(c.len(), 1);
            return;
        }
        let rocm = c
            .iter()
            .position(|x| x == "/opt/rocm/lib/libamdhip64.so")
            .unwrap();
        let bare = c.iter().position(|x| x == "libamdhip64.so.5").unwrap();
        assert!(rocm < bare, "{c:?}");
        assert_eq!(c.last().unwrap(), "libamdhip64.so.5");
    }

    #[test]
    fn errors_name_every_candidate() {
        let e = LoadError {
            tried: vec![
                ("/opt/rocm/lib/libamdhip64.so".into(), "no such file".into()),
                (
                    "libamdhip64.so.5".into(),
                    "cannot open shared object file".into(),
                ),
            ],
        };
        let text = e.to_string();
        assert!(
            text.contains("/opt/rocm/lib/libamdhip64.so (no such file)"),
            "{text}"
        );
        assert!(text.contains("libamdhip64.so.5 (cannot open"), "{text}");
    }
}
