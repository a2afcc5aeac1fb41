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
    #[error("a sliding window of 0 tokens: a query attends at least to its own position")]
    EmptyWindow,
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
    #[error(
        "layer {layer} has no outlier thresholds: calibrate them (KvCache::calibrate), set them \
         (set_outlier_thresholds, hipkv_set_outlier_thresholds) or apply a calibration file \
         (apply_calibration, hipkv_apply_calibration) first"
    )]
    OutliersNotCalibrated { layer: usize },
    #[error("codebook of {bits}-bit codes: {problem}")]
    InvalidCodebook { bits: usize, problem: &'static str },
    #[error(
        "layer {layer} has no codebooks: calibrate them (KvCache::calibrate), set them \
         (set_codebooks, hipkv_set_codebooks) or apply a calibration file (apply_calibration, \
         hipkv_apply_calibration) first"
    )]
    CodebooksNotCalibrated { layer: usize },
    #[error("calibration file, line {line}: {problem}")]
    BadCalibration { line: usize, problem: &'static str },
    #[error("calibration of layer {layer} does not hold what scheme {scheme} needs")]
    CalibrationIncomplete { layer: usize, scheme: String },
    #[error("calibration of {what} {file} does not fit a cache of {what} {cache}")]
    CalibrationMismatch {
        what: &'static str,
        file: String,
        cache: String,
    },
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
    #[error(
        "{kernel} skipped {item_kind} {item}: {what} {index} out of range ({})",
        if *what == "slot offset" { format!("expected {limit}") } else { format!("< {limit}") }
    )]
    DeviceIndex {
        /// The call whose kernel found it: `write_kv`, `attend` or `copy_blocks`.
        kernel: &'static str,
        /// `token`, `sequence` or `block pair`: what the kernel skipped.
        item_kind: &'static str,
        /// Its index in the call's batch.
        item: usize,
        /// What was out of range, such as `block id` or `sequence slot`.
        what: &'static str,
        index: i64,
        /// The bound it broke (exclusive), or for a slot offset the offset expected.
        limit: i64,
    },
}

impl Error {
    /// The typed error of a sticky device error word.
    pub(crate) fn from_device(e: &crate::abi::hipkv_device_error) -> Error {
        use crate::abi::*;
        let (kernel, item_kind) = match e.kernel {
            HIPKV_CHECK_WRITE => ("write_kv", "token"),
            HIPKV_CHECK_ATTEND => ("attend", "sequence"),
            HIPKV_CHECK_COPY_BLOCKS => ("copy_blocks", "block pair"),
            _ => ("an unknown kernel", "item"),
        };
        let what = match e.what {
            HIPKV_BAD_SEQ_SLOT => "sequence slot",
            HIPKV_BAD_SLOT => "cache slot",
            HIPKV_BAD_POSITION => "position",
            HIPKV_BAD_SLOT_OFFSET => "slot offset",
            HIPKV_BAD_QUERY_RANGE => "query start",
            HIPKV_BAD_QUERY_LEN => "query length",
            HIPKV_BAD_SEQ_LEN => "sequence length",
            HIPKV_BAD_BLOCK => "block id",
            _ => "index",
        };
        Error::DeviceIndex {
            kernel,
            item_kind,
            item: e.item as usize,
            what,
            index: e.index,
            limit: e.limit,
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
