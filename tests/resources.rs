//! The gfx1201 resource report of the embedded kernels: every attention and write kernel is
//! there, none spills or uses scratch, and every decode kernel keeps at least 8 waves per SIMD. Without
//! embedded kernels (no HIP compiler at build time) the checks are skipped and say why, unless
//! `HIPKV_REQUIRE_HIP=1`, which makes that a failure.

use std::sync::atomic::{AtomicBool, Ordering};

use hipkv::codeobj::{KernelResources, embedded_kernels, parse, resource_table};
use hipkv::kernels::{
    KernelSource, attention_kernel_name, code_object_for, code_objects, gpu_build_skipped,
    write_kernel_name,
};
use hipkv::scheme::{HEAD_DIMS, KERNEL_FORMATS as FORMATS};

#[path = "common/toolchain.rs"]
mod toolchain;

/// Decode attention is latency-bound on its loads: it needs this many waves per SIMD in flight.
const MIN_DECODE_WAVES: u32 = 8;
const ARCH: &str = "gfx1201";

/// The gfx1201 kernels, or `None` (after saying why, once per run) when the build embedded none.
fn gfx1201_kernels() -> Option<Vec<KernelResources>> {
    let skip = |why: String| {
        static SAID: AtomicBool = AtomicBool::new(false);
        if toolchain::required() || !SAID.swap(true, Ordering::Relaxed) {
            toolchain::skip(
                &format!("the {ARCH} resource checks of tests/resources.rs"),
                why,
            );
        }
        None
    };
    if code_objects().is_empty() {
        let why = gpu_build_skipped().unwrap_or("no code objects were embedded");
        return skip(format!("this build has no GPU kernels: {why}"));
    }
    let all = embedded_kernels().expect("the embedded code objects parse");
    let ours: Vec<KernelResources> = all.into_iter().filter(|k| k.arch == ARCH).collect();
    if ours.is_empty() {
        // The arch list is the builder's choice (HIPKV_ARCHS); gfx1201 is the default target.
        let archs: Vec<&str> = code_objects().iter().map(|o| o.arch).collect();
        return skip(format!(
            "no {ARCH} code object (kernels built for {archs:?})"
        ));
    }
    Some(ours)
}

/// Asserts `ok`, printing the whole resource table when it fails.
fn check(kernels: &[KernelResources], ok: bool, what: String) {
    assert!(ok, "{what}\n\n{}", resource_table(kernels));
}

#[test]
fn every_attention_kernel_is_built() {
    let Some(kernels) = gfx1201_kernels() else {
        return;
    };
    let has = |name: &str| kernels.iter().any(|k| k.name == name);
    let mut missing = Vec::new();
    for k in FORMATS {
        for v in FORMATS {
            for d in HEAD_DIMS {
                let name = attention_kernel_name(k.parse().unwrap(), v.parse().unwrap(), d);
                if !has(&name) {
                    missing.push(name);
                }
            }
        }
    }
    for name in ["hipkv_attn_prep", "hipkv_attn_combine"] {
        if !has(name) {
            missing.push(name.into());
        }
    }
    check(
        &kernels,
        missing.is_empty(),
        format!("missing kernels: {missing:?}"),
    );
}

#[test]
fn every_write_kernel_is_built() {
    let Some(kernels) = gfx1201_kernels() else {
        return;
    };
    let has = |name: &str| kernels.iter().any(|k| k.name == name);
    let mut missing: Vec<String> = FORMATS
        .iter()
        .flat_map(|f| HEAD_DIMS.map(|d| write_kernel_name(f.parse().unwrap(), d)))
        .chain(HEAD_DIMS.map(|d| format!("hipkv_write_residual_d{d}")))
        .filter(|name| !has(name))
        .collect();
    if !has("hipkv_copy_blocks") {
        missing.push("hipkv_copy_blocks".into());
    }
    check(
        &kernels,
        missing.is_empty(),
        format!("missing kernels: {missing:?}"),
    );
}

/// The HIP backend loads one code object per kernel source, that of its cache's head_dim, and
/// looks up every kernel it launches there in the object of that kernel's source: each object
/// must hold them all, the kernels shared by every head_dim (`hipkv_attn_prep`,
/// `hipkv_attn_combine`, `hipkv_copy_blocks`) included.
#[test]
fn each_head_dims_code_objects_hold_every_kernel_launched_there() {
    let Some(kernels) = gfx1201_kernels() else {
        return;
    };
    let mut missing = Vec::new();
    for d in HEAD_DIMS {
        let pairs = FORMATS
            .iter()
            .flat_map(|k| FORMATS.iter().map(move |v| (k, v)))
            .map(|(k, v)| attention_kernel_name(k.parse().unwrap(), v.parse().unwrap(), d));
        let writes = FORMATS
            .iter()
            .map(|f| write_kernel_name(f.parse().unwrap(), d));
        let shared = ["hipkv_attn_prep", "hipkv_attn_combine", "hipkv_copy_blocks"];
        let launched: Vec<String> = pairs
            .chain(writes)
            .chain([format!("hipkv_write_residual_d{d}")])
            .chain(shared.map(String::from))
            .collect();
        for name in launched {
            let object = code_object_for(ARCH, KernelSource::of_kernel(&name), d)
                .expect("every source has an object per head_dim");
            let held = parse(object.bytes).expect("the embedded code objects parse");
            if !held.iter().any(|k| k.name == name) {
                missing.push(format!("{name} in {}", object.source));
            }
        }
    }
    check(
        &kernels,
        missing.is_empty(),
        format!("kernels missing from the object the backend looks in: {missing:?}"),
    );
}

#[test]
fn no_spills_and_no_scratch() {
    let Some(kernels) = gfx1201_kernels() else {
        return;
    };
    let bad: Vec<&str> = kernels
        .iter()
        .filter(|k| {
            k.vgpr_spill_count != 0 || k.sgpr_spill_count != 0 || k.private_segment_fixed_size != 0
        })
        .map(|k| k.name.as_str())
        .collect();
    check(
        &kernels,
        bad.is_empty(),
        format!("kernels that spill or use scratch: {bad:?}"),
    );
}

#[test]
fn decode_kernels_keep_eight_waves_per_simd() {
    let Some(kernels) = gfx1201_kernels() else {
        return;
    };
    let decode: Vec<&KernelResources> = kernels.iter().filter(|k| is_decode(&k.name)).collect();
    let expected = FORMATS.len() * FORMATS.len() * HEAD_DIMS.len();
    check(
        &kernels,
        decode.len() == expected,
        format!("{} decode kernels, expected {expected}", decode.len()),
    );
    let low: Vec<String> = decode
        .iter()
        .filter(|k| {
            k.occupancy_waves_per_simd
                .is_none_or(|o| o < MIN_DECODE_WAVES)
        })
        .map(|k| format!("{} ({:?})", k.name, k.occupancy_waves_per_simd))
        .collect();
    check(
        &kernels,
        low.is_empty(),
        format!("decode kernels below {MIN_DECODE_WAVES} waves per SIMD: {low:?}"),
    );
}

/// `hipkv_attn_<k>_<v>_d<head_dim>`, not `hipkv_attn_prep` or `hipkv_attn_combine`.
fn is_decode(name: &str) -> bool {
    name.strip_prefix("hipkv_attn_")
        .and_then(|rest| rest.rsplit_once("_d"))
        .is_some_and(|(_, d)| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
}

#[test]
fn decode_kernel_names() {
    assert!(is_decode("hipkv_attn_q8_0_q2_chan_d256"));
    assert!(is_decode("hipkv_attn_f16_f16_d64"));
    assert!(!is_decode("hipkv_attn_combine"));
    assert!(!is_decode("hipkv_attn_prep"));
    assert!(!is_decode("hipkv_attn_f16_f16_d"));
}
