//! Choosing a backend: the GPU when one is usable, otherwise the CPU, with the reason recorded;
//! `HIPKV_BACKEND` forces one.

use super::Backend;
use crate::error::{Error, Result};
use crate::hip::Devices;
use crate::kernels::{code_objects, gpu_build_skipped};

/// The environment variable that forces a backend: `cpu`, `emu` or `hip`.
pub const BACKEND_ENV: &str = "HIPKV_BACKEND";

/// What the HIP backend would need, as found on this machine.
#[derive(Clone, Debug, PartialEq)]
pub struct HipStatus {
    /// The archs this build embeds kernels for (empty: built without a HIP compiler).
    pub built_archs: Vec<&'static str>,
    /// The HIP runtime and its GPUs, or why there is no runtime.
    pub runtime: Result<Devices>,
}

impl HipStatus {
    /// Looks for kernels, the HIP runtime and its GPUs.
    pub fn probe() -> HipStatus {
        let mut built_archs: Vec<&'static str> = code_objects().iter().map(|o| o.arch).collect();
        built_archs.dedup();
        HipStatus {
            built_archs,
            runtime: Devices::probe(),
        }
    }

    /// Why the HIP backend cannot run here, the first obstacle found.
    pub fn obstacle(&self) -> String {
        if self.built_archs.is_empty() {
            let why = gpu_build_skipped().unwrap_or("no code objects were embedded");
            return format!("no GPU kernels in this build ({why})");
        }
        let found = match &self.runtime {
            Err(e) => return e.to_string(),
            Ok(found) => found,
        };
        match found
            .devices
            .iter()
            .find(|d| self.built_archs.contains(&d.arch.as_str()))
        {
            None if found.devices.is_empty() => format!(
                "the HIP runtime {} ({}) found no GPU",
                found.version_string(),
                found.library
            ),
            None => Error::ArchNotBuilt {
                device: found.devices[0].arch.clone(),
                built: self.built_archs.iter().map(ToString::to_string).collect(),
            }
            .to_string(),
            Some(d) => format!(
                "found {} ({}), but the device-resident cache (Backend::Hip) is not written yet",
                d.name, d.arch
            ),
        }
    }
}

impl Backend {
    /// The best backend on this machine and, when it is not a GPU, why not. The HIP backend is
    /// not written yet, so this is the CPU, with the first obstacle HIP would meet here.
    pub fn best() -> (Backend, String) {
        (Backend::Cpu, HipStatus::probe().obstacle())
    }

    /// The backend `HIPKV_BACKEND` names (`cpu`, `emu`, `hip`), or [`Backend::best`] when it
    /// is unset or empty; with the reason HIP was not chosen, if it was not. Asking for `hip`
    /// where it cannot run is [`Error::BackendUnavailable`], never a silent fallback.
    pub fn from_env() -> Result<(Backend, Option<String>)> {
        let forced = std::env::var(BACKEND_ENV).unwrap_or_default();
        match forced.trim() {
            "" => {
                let (backend, why) = Backend::best();
                Ok((backend, Some(why)))
            }
            "cpu" => Ok((Backend::Cpu, None)),
            "emu" => Ok((Backend::Emu, None)),
            "hip" => Err(Error::BackendUnavailable {
                backend: "hip",
                why: HipStatus::probe().obstacle(),
            }),
            other => Err(Error::Unsupported(format!(
                "{BACKEND_ENV}={other}: expected cpu, emu or hip"
            ))),
        }
    }
}
