//! The crate's error type. Every fallible call returns [`Result`]; an error never leaves the
//! cache half-written.

use crate::scheme::Stream;

/// Everything that can go wrong in hipkv.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum Error {
    #[error("cannot parse scheme: {0}")]
    ParseScheme(String),
    #[error("unsupported configuration: {0}")]
    Unsupported(String),
    #[error("{what}: expected {expected} elements, got {got}")]
    Shape {
        what: &'static str,
        expected: usize,
        got: usize,
    },
    #[error("{what} {index} out of range (< {limit})")]
    OutOfRange {
        what: &'static str,
        index: usize,
        limit: usize,
    },
    #[error(
        "non-finite or f16-overflowing {stream} {value} at token {token}, head {head}, channel {channel}"
    )]
    NonFinite {
        stream: Stream,
        token: usize,
        head: usize,
        channel: usize,
        value: f32,
    },
    #[error("non-finite query element {value} at token {token}, head {head}, channel {channel}")]
    NonFiniteQuery {
        token: usize,
        head: usize,
        channel: usize,
        value: f32,
    },
    #[error("softmax scale {0} is not finite")]
    BadSoftmaxScale(f32),
    #[error(
        "cache full: layer {layer} sequence {seq} holds {len} of {capacity} tokens, {requested} more requested"
    )]
    CacheFull {
        layer: usize,
        seq: usize,
        len: usize,
        capacity: usize,
        requested: usize,
    },
    #[error(
        "query chunk of {q_len} tokens exceeds the {len} tokens of layer {layer} sequence {seq}"
    )]
    QueryBeyondCache {
        layer: usize,
        seq: usize,
        q_len: usize,
        len: usize,
    },
    #[error(
        "outlier thresholds of head {head}, channel {channel} are not a finite range: [{lo}, {hi}]"
    )]
    InvalidOutlierThresholds {
        head: usize,
        channel: usize,
        lo: f32,
        hi: f32,
    },
    #[error("layer {layer} has no outlier thresholds: call calibrate_outliers first")]
    OutliersNotCalibrated { layer: usize },
    #[error("kernel {kernel} failed in the emulator: {message}")]
    Emulator { kernel: String, message: String },
    #[error("out of memory: {bytes} bytes asked of the {backend} backend")]
    OutOfMemory { bytes: u128, backend: &'static str },
    #[error(transparent)]
    HipUnavailable(#[from] crate::hip::LoadError),
    #[error(
        "the GPU is {device} but this build has kernels for {} only: rebuild with HIPKV_ARCHS={device}",
        if built.is_empty() { "no arch".to_string() } else { built.join(", ") }
    )]
    ArchNotBuilt { device: String, built: Vec<String> },
    #[error("the {backend} backend was asked for but cannot run here: {why}")]
    BackendUnavailable { backend: &'static str, why: String },
    #[error(transparent)]
    Hip(#[from] crate::hip::HipError),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
