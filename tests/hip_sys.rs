//! `src/hip/sys.rs` is what bindgen makes of the HIP runtime header (Debian 12's
//! `libamdhip64-dev`, HIP 5.2) today: the functions hipkv calls, as a table loaded at run time
//! with `libloading`. A stale copy fails here; regenerate with `scripts/regen-hip-sys.sh`.
//! Without the header or libclang the check is skipped, unless `HIPKV_REQUIRE_HIP=1`.

#[path = "common/bindings.rs"]
mod bindings;
#[path = "common/toolchain.rs"]
mod toolchain;

use std::path::Path;

/// Debian's HIP header, which the committed bindings come from (and CI installs).
const HEADER: &str = "/usr/include/hip/hip_runtime_api.h";

/// The runtime functions hipkv calls.
const FUNCTIONS: &[&str] = &[
    "hipRuntimeGetVersion",
    "hipDriverGetVersion",
    "hipGetErrorName",
    "hipGetErrorString",
    "hipGetDeviceCount",
    "hipGetDeviceProperties",
    "hipSetDevice",
    "hipMemGetInfo",
    "hipMalloc",
    "hipFree",
    "hipMemcpy",
    "hipMemcpyAsync",
    "hipMemset",
    "hipMemsetAsync",
    "hipStreamCreate",
    "hipStreamDestroy",
    "hipStreamSynchronize",
    "hipEventCreate",
    "hipEventDestroy",
    "hipEventRecord",
    "hipEventSynchronize",
    "hipEventElapsedTime",
    "hipModuleLoadData",
    "hipModuleUnload",
    "hipModuleGetFunction",
    "hipModuleLaunchKernel",
];

/// The bindings as `scripts/regen-hip-sys.sh` writes them.
fn generate() -> Result<String, String> {
    if !Path::new(HEADER).is_file() {
        return Err(format!("{HEADER} missing (Debian package libamdhip64-dev)"));
    }
    let mut builder = bindgen::Builder::default()
        .header(HEADER)
        .clang_args(["-D__HIP_PLATFORM_AMD__", "-x", "c++", "-std=c++17"])
        .allowlist_type("hipDeviceProp_t")
        .allowlist_type("hipMemcpyKind")
        // Feature bits hipkv never reads: a blob of the right size, not 60 bitfield accessors.
        .allowlist_type("hipDeviceArch_t")
        .opaque_type("hipDeviceArch_t")
        .default_enum_style(bindgen::EnumVariation::NewType {
            is_bitfield: false,
            is_global: false,
        })
        .dynamic_library_name("HipRuntime")
        .dynamic_link_require_all(true)
        .wrap_unsafe_ops(true)
        .derive_default(true)
        .derive_debug(true)
        .generate_comments(false)
        .layout_tests(true);
    for f in FUNCTIONS {
        builder = builder.allowlist_function(f);
    }
    builder
        .generate()
        .map(|b| b.to_string())
        .map_err(|e| e.to_string())
}

#[test]
fn committed_hip_bindings_match_the_header() {
    bindings::check_committed("src/hip/sys.rs", generate, "scripts/regen-hip-sys.sh");
}
