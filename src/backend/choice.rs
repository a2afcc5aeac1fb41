//! Choosing a backend: the GPU when one is usable, otherwise the CPU, with the reason recorded;
//! `HIPKV_BACKEND` forces one.

use super::Backend;
use crate::error::{Error, Result};
use crate::hip::{Device, Devices};
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

    /// The GPU the HIP backend runs on: the first the runtime lists whose arch this build has
    /// kernels for.
    pub fn usable_device(&self) -> Option<&Device> {
        self.runtime
            .as_ref()
            .ok()?
            .devices
            .iter()
            .find(|d| self.built_archs.contains(&d.arch.as_str()))
    }

    /// Why the HIP backend cannot run here, the first obstacle found; `None` when it can.
    pub fn obstacle(&self) -> Option<String> {
        if self.built_archs.is_empty() {
            let why = gpu_build_skipped().unwrap_or("no code objects were embedded");
            return Some(format!("no GPU kernels in this build ({why})"));
        }
        let found = match &self.runtime {
            Err(e) => return Some(e.to_string()),
            Ok(found) => found,
        };
        if self.usable_device().is_some() {
            return None;
        }
        Some(match found.devices.first() {
            None => format!(
                "the HIP runtime {} ({}) found no GPU",
                found.version_string(),
                found.library
            ),
            Some(d) => Error::ArchNotBuilt {
                device: d.arch.clone(),
                built: self.built_archs.iter().map(ToString::to_string).collect(),
            }
            .to_string(),
        })
    }
}

impl Backend {
    /// The best backend on this machine: the GPU when one is usable, else the CPU with the
    /// first obstacle the GPU met.
    pub fn best() -> (Backend, Option<String>) {
        match HipStatus::probe().obstacle() {
            None => (Backend::Hip, None),
            Some(why) => (Backend::Cpu, Some(why)),
        }
    }

    /// The backend `HIPKV_BACKEND` names (`cpu`, `emu`, `hip`), or [`Backend::best`] when it
    /// is unset or empty; with the reason HIP was not chosen, if it was not. Asking for `hip`
    /// where it cannot run is [`Error::BackendUnavailable`], never a silent fallback.
    pub fn from_env() -> Result<(Backend, Option<String>)> {
        let forced = std::env::var(BACKEND_ENV).unwrap_or_default();
        match forced.trim() {
            "" => Ok(Backend::best()),
            "cpu" => Ok((Backend::Cpu, None)),
            "emu" => Ok((Backend::Emu, None)),
            "hip" => match HipStatus::probe().obstacle() {
                None => Ok((Backend::Hip, None)),
                Some(why) => Err(Error::BackendUnavailable {
                    backend: "hip",
                    why,
                }),
            },
            other => Err(Error::Unsupported(format!(
                "{BACKEND_ENV}={other}: expected cpu, emu or hip"
            ))),
        }
    }

    /// The name `HIPKV_BACKEND` takes.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Cpu => "cpu",
            Backend::Emu => "emu",
            Backend::Hip => "hip",
        }
    }
}
