//! The HIP runtime as this machine has it. CI installs Debian's `libamdhip64-5` on a machine
//! without an AMD GPU and sets `HIPKV_REQUIRE_HIP=1`: there the runtime must open, report no
//! device, and leave the CPU as the backend, saying so. Elsewhere the test checks whichever
//! outcome the machine gives for consistency.

use hipkv::backend::HipStatus;
use hipkv::hip::{DeviceBuffer, Event, Module, Stream};
use hipkv::{Backend, Error};

fn required() -> bool {
    std::env::var("HIPKV_REQUIRE_HIP").as_deref() == Ok("1")
}

#[test]
fn the_runtime_opens_finds_no_gpu_and_the_cpu_is_chosen() {
    let status = HipStatus::probe();
    let (backend, why) = Backend::best();
    assert_eq!(backend, Backend::Cpu, "no HIP backend exists yet");
    assert_eq!(why, status.obstacle());
    match &status.runtime {
        Err(Error::HipUnavailable(e)) if !required() => {
            eprintln!("skipped: no HIP runtime here ({e})");
            assert!(!e.tried.is_empty());
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
        Err(e) if !required() => {
            eprintln!("skipped: no HIP runtime here ({e})");
            return;
        }
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
