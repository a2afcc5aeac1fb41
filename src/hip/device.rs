//! Safe types over the HIP runtime: the GPUs it sees.

use std::ffi::{CStr, c_char};

use super::loader::runtime;
use crate::error::Result;

/// A GPU the HIP runtime sees.
#[derive(Clone, Debug, PartialEq)]
pub struct Device {
    pub ordinal: usize,
    /// The product name, such as `AMD Radeon RX 9070 XT`.
    pub name: String,
    /// The arch kernels must be built for, such as `gfx1201` (target features such as
    /// `:xnack-` stripped).
    pub arch: String,
    pub compute_units: usize,
    /// Peak shader clock in kHz, as the runtime reports it.
    pub clock_khz: u64,
    pub memory_bytes: u64,
    /// Peak memory clock in kHz, as the runtime reports it.
    pub memory_clock_khz: u64,
    pub memory_bus_bits: u64,
}

impl Device {
    /// Peak DRAM bandwidth in GB/s from the memory clock and bus width, `2 · clock · width / 8`
    /// (two transfers per clock), the formula of the HIP and CUDA bandwidth samples.
    pub fn peak_bandwidth_gbs(&self) -> f64 {
        2.0 * self.memory_clock_khz as f64 * 1e3 * self.memory_bus_bits as f64 / 8.0 / 1e9
    }
}

/// The HIP runtime hipkv opened and the GPUs it offers.
#[derive(Clone, Debug, PartialEq)]
pub struct Devices {
    /// The library's path or name.
    pub library: String,
    /// `hipRuntimeGetVersion`, such as 50221153 for HIP 5.2.
    pub runtime_version: i32,
    /// Empty when the runtime found no GPU.
    pub devices: Vec<Device>,
}

impl Devices {
    /// Opens the HIP runtime and lists its GPUs. A runtime that answers `hipErrorNoDevice` (as
    /// on a machine without an AMD GPU) gives an empty list; no runtime at all is
    /// [`Error::HipUnavailable`](crate::Error::HipUnavailable), any other failure
    /// [`Error::Hip`](crate::Error::Hip).
    pub fn probe() -> Result<Devices> {
        let rt = runtime()?;
        let runtime_version = rt.runtime_version()?;
        let count = match rt.device_count() {
            Ok(n) => n,
            Err(e) if e.is_no_device() => 0,
            Err(e) => return Err(e.into()),
        };
        let devices = (0..count)
            .map(|ordinal| {
                let p = rt.device_properties(ordinal)?;
                let arch = c_text(&p.gcnArchName);
                Ok(Device {
                    ordinal,
                    name: c_text(&p.name),
                    arch: arch.split(':').next().unwrap_or_default().to_string(),
                    compute_units: usize::try_from(p.multiProcessorCount).unwrap_or(0),
                    clock_khz: u64::try_from(p.clockRate).unwrap_or(0),
                    memory_bytes: p.totalGlobalMem as u64,
                    memory_clock_khz: u64::try_from(p.memoryClockRate).unwrap_or(0),
                    memory_bus_bits: u64::try_from(p.memoryBusWidth).unwrap_or(0),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Devices {
            library: rt.path().to_string(),
            runtime_version,
            devices,
        })
    }

    /// `major.minor.patch` of [`runtime_version`](Self::runtime_version).
    pub fn version_string(&self) -> String {
        let v = self.runtime_version;
        format!("{}.{}.{}", v / 10_000_000, v / 100_000 % 100, v % 100_000)
    }
}

/// A fixed-size C string field, up to its NUL.
fn c_text(field: &[c_char]) -> String {
    let bytes: Vec<u8> = field.iter().map(|&c| c as u8).collect();
    CStr::from_bytes_until_nul(&bytes)
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|_| String::from_utf8_lossy(&bytes).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bandwidth_is_two_transfers_per_clock_over_the_bus() {
        // 1.6 GHz HBM2e on an 8192-bit bus (an MI250X): 3276.8 GB/s.
        let d = Device {
            ordinal: 0,
            name: "AMD Instinct MI250X".into(),
            arch: "gfx90a".into(),
            compute_units: 110,
            clock_khz: 1_700_000,
            memory_bytes: 64 << 30,
            memory_clock_khz: 1_600_000,
            memory_bus_bits: 8192,
        };
        assert!((d.peak_bandwidth_gbs() - 3276.8).abs() < 1e-9);
    }

    #[test]
    fn c_strings_stop_at_nul() {
        let mut field = [0 as c_char; 16];
        for (i, b) in b"gfx1201:xnack-".iter().enumerate() {
            field[i] = *b as c_char;
        }
        assert_eq!(c_text(&field), "gfx1201:xnack-");
        assert_eq!(c_text(&[b'a' as c_char; 3]), "aaa");
    }
}
