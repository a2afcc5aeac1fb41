//! hipkv: quantized KV-cache attention for decode, with dequantization inside the attention loop.
//!
//! Keys and values are stored in 16, 8, 4 or 2 bits ([`Scheme`]), appended token by token to a
//! paged [`KvCache`], and attended over without ever staging a dequantized copy of the cache.

pub mod abi;
pub mod backend;
pub mod cache;
pub mod calibration;
pub mod capi;
pub mod codeobj;
pub mod cost;
pub mod error;
#[cfg(feature = "eval")]
pub mod eval;
pub mod hip;
pub mod kernels;
pub mod paged;
pub mod quant;
pub mod rope;
pub mod scheme;
pub mod synth;

pub use backend::{Backend, SplitPlan};
pub use cache::{CacheConfig, KvCache, Query};
pub use calibration::{Calibration, LayerCalibration};
pub use error::{Error, Result};
pub use quant::OutlierThresholds;
pub use rope::{Rope, RopeLayout, RopeTable};
pub use scheme::{ChannelGroup, Format, LowBits, Memory, Outliers, Scheme, Stream, StreamSet};
