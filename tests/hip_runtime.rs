//! The HIP runtime as this machine has it. CI installs Debian's `libamdhip64-5` on a machine
//! without an AMD GPU and sets `HIPKV_REQUIRE_HIP=1`: there the runtime must open, report no
//! device, and leave the CPU as the backend, saying so; a cache asked for on the GPU must be a
//! typed error that loses nothing. Elsewhere the tests check whichever outcome the machine gives
//! for consistency.

use hipkv::backend::HipStatus;
use hipkv::hip::{DeviceBuffer, Event, Module, Stream};
use hipkv::{Backend, CacheConfig, Error, KvCache};

#[path = "common/toolchain.rs"]
mod toolchain;

use toolchain::required;

#[test]
fn the_runtime_opens_finds_no_gpu_and_the_cpu_is_chosen() {
    let status = HipStatus::probe();
    let (backend, why) = Backend::best();
    assert_eq!(why, status.obstacle());
    assert_eq!(backend == Backend::Hip, why.is_none(), "{why:?}");
    assert_eq!(why.is_none(), status.usable_device().is_some(), "{why:?}");
    match &status.runtime {
        Err(Error::HipUnavailable(e)) if !required() => {
            assert!(!e.tried.is_empty());
            toolchain::skip("the HIP runtime checks", e);
        }
        Err(e) => panic!("HIPKV_REQUIRE_HIP=1 but the HIP runtime did not answer: {e}"),
        Ok(found) => {
            assert!(found.library.contains("libamdhip64"), "{found:?}");
            assert!(found.runtime_version > 0, "{found:?}");
            if required() {
                // CI: Debian's HIP 5.2 on a machine with no AMD GPU.
                assert!(found.devices.is_empty(), "CI has no GPU: {found:?}");
                assert!(found.version_string().starts_with("5.2."), "{found:?}");
                assert!(!status.built_archs.is_empty(), "CI builds the kernels");
                assert_eq!(backend, Backend::Cpu);
                let why = why.unwrap();
                assert!(
                    why.starts_with("the HIP runtime 5.2.") && why.ends_with("found no GPU"),
                    "{why}"
                );
            }
            for d in &found.devices {
                assert!(d.arch.starts_with("gfx") && !d.arch.contains(':'), "{d:?}");
                assert!(d.compute_units > 0 && d.memory_bytes > 0, "{d:?}");
            }
        }
    }
}

/// Without a GPU every device resource is a typed error from the call that failed, never a
/// panic or a crash; with one, a buffer round-trips and a module's kernels resolve.
#[test]
fn device_resources_are_typed_errors_without_a_gpu() {
    let found = match hipkv::hip::Devices::probe() {
        Ok(found) => found,
        Err(e) if !required() => return toolchain::skip("the HIP runtime's typed errors", e),
        Err(e) => panic!("HIPKV_REQUIRE_HIP=1 but the HIP runtime did not answer: {e}"),
    };
    if found.devices.is_empty() {
        let hip_call = |r: Error| match r {
            Error::Hip(e) => e.call,
            other => panic!("expected a HIP call error, got {other}"),
        };
        assert_eq!(
            hip_call(DeviceBuffer::<f32>::new(1024).err().unwrap()),
            "hipMalloc"
        );
        assert_eq!(hip_call(Stream::new().err().unwrap()), "hipStreamCreate");
        assert_eq!(hip_call(Event::new().err().unwrap()), "hipEventCreate");
        if let Some(object) = hipkv::kernels::code_objects().first() {
            assert_eq!(
                hip_call(Module::load(object).err().unwrap()),
                "hipModuleLoadData"
            );
        }
        return;
    }
    let values: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5).collect();
    let buf = DeviceBuffer::from_slice(&values).unwrap();
    assert_eq!(buf.to_vec().unwrap(), values);
    buf.write_at(990, &[-1.0; 10]).unwrap();
    let mut tail = [0f32; 12];
    buf.read_at(988, &mut tail).unwrap();
    assert_eq!(tail[..2], values[988..990]);
    assert!(tail[2..].iter().all(|&x| x == -1.0), "{tail:?}");
    assert!(matches!(
        buf.write_at(995, &[0.0; 10]),
        Err(Error::Shape { .. })
    ));
    let err = DeviceBuffer::<f32>::from_slice(&values)
        .unwrap()
        .copy_from_host(&values[..10])
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::Shape {
                expected: 1000,
                got: 10,
                ..
            }
        ),
        "{err}"
    );
    let arch = &found.devices[0].arch;
    if let Ok(objects) = hipkv::kernels::code_objects_for(arch) {
        let module = Module::load(objects[0]).unwrap();
        assert!(module.function("hipkv_no_such_kernel").is_err());
    }
}

/// A cache asked for on the GPU where none is usable is a typed error naming why; a cache moved
/// there keeps its tokens on the CPU and goes on working.
#[test]
fn a_gpu_cache_without_a_gpu_is_an_error_that_loses_nothing() {
    let status = HipStatus::probe();
    let Some(why) = status.obstacle() else {
        eprintln!("skipped: this machine has a usable GPU (tests/device_cache.rs runs on it)");
        return;
    };
    let cfg = CacheConfig {
        layers: 1,
        sequences: 1,
        kv_heads: 2,
        q_heads: 4,
        head_dim: 64,
        capacity: 64,
        scheme: "kivi4".parse().unwrap(),
        rope: None,
    };
    match KvCache::with_backend(cfg, Backend::Hip) {
        Err(Error::BackendUnavailable { backend, why: got }) => {
            assert_eq!(backend, "hip");
            assert_eq!(got, why);
        }
        other => panic!("expected BackendUnavailable, got {other:?}"),
    }
    if required() {
        assert!(why.ends_with("found no GPU"), "{why}");
    }

    let mut cache = KvCache::new(cfg).unwrap();
    let x: Vec<f32> = (0..40 * 2 * 64)
        .map(|i| (i % 17) as f32 * 0.1 - 0.8)
        .collect();
    cache.append(0, 0, &x, &x).unwrap();
    let before = cache.stored_bytes(0, 0).unwrap();
    assert!(matches!(
        cache.set_backend(Backend::Hip),
        Err(Error::BackendUnavailable { .. })
    ));
    assert_eq!(cache.backend(), Backend::Cpu);
    assert_eq!(cache.stored_bytes(0, 0).unwrap(), before);
    cache.append(0, 0, &x[..2 * 64], &x[..2 * 64]).unwrap();
    assert_eq!(cache.len(0, 0).unwrap(), 41);
}
