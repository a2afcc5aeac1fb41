//! KV formats, schemes and the memory math: the single Rust definition of every byte layout.
//!
//! A [`Scheme`] picks a [`Format`] for keys and one for values independently, plus the options
//! that change what is stored: the token group (page) size, f16 attention sinks, KIVI's f16 window
//! of the most recent values, pre-RoPE keys, the dense-and-sparse outlier store and a
//! Walsh–Hadamard rotation of each head. Schemes parse from and print to strings such as
//! `kivi2`, `q8_0`, `q4_tok,rot` or
//! `k=q2_chan,v=q4_tok@64,g=64,sinks=4,rv=128,pre_rope,outliers`.
//!
//! Storage unit: a *page* holds `group_tokens` consecutive tokens of one layer for every KV head.
//! Inside a page each head owns one contiguous [`HeadLayout`] block: the K stream then the V stream,
//! each made of packed codes, quantization parameters, and (with outliers) per-token outlier counts
//! and slots. Every section starts on a 16-byte boundary so kernels can use 128-bit loads.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

/// Alignment of every section inside a page, in bytes (one 128-bit load).
pub const SECTION_ALIGN: usize = 16;
/// Elements per llama.cpp `q8_0` block.
pub const Q8_0_BLOCK: usize = 32;
/// Bytes per llama.cpp `q8_0` block: an f16 scale then 32 int8 codes.
pub const Q8_0_BLOCK_BYTES: usize = 34;
/// Head dimensions the cache and kernels support.
pub const HEAD_DIMS: [usize; 3] = [64, 128, 256];
/// The largest of [`HEAD_DIMS`].
pub const MAX_HEAD_DIM: usize = 256;
/// Token group sizes (page sizes) a scheme may use.
pub const GROUP_TOKENS: [usize; 2] = [32, 64];
/// Channel group sizes a per-token low-bit format may use (besides the whole head).
pub const CHANNEL_GROUPS: [usize; 3] = [32, 64, 128];
/// Bytes of one outlier slot: a u16 channel index then the f16 value.
pub const OUTLIER_SLOT_BYTES: usize = 4;
/// Bytes of one per-token outlier count.
pub const OUTLIER_COUNT_BYTES: usize = 2;
/// Value window lengths (`rv=`) a scheme may use: 0 (none) or a multiple of its page size.
pub const VALUE_WINDOWS: [usize; 5] = [0, 32, 64, 128, 256];
/// KIVI's default residual length, the value window of the `kivi*` presets.
pub const KIVI_VALUE_WINDOW: usize = 128;
/// Attention sinks of the sub-8-bit presets: on SmolLM2 (docs/accuracy.md) keeping the first 4
/// tokens f16 lowered the mean KL of every one of them.
pub const PRESET_SINKS: usize = 4;

/// Bit width of a low-bit asymmetric format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LowBits {
    Two,
    Four,
}

impl LowBits {
    pub const fn bits(self) -> usize {
        match self {
            LowBits::Two => 2,
            LowBits::Four => 4,
        }
    }

    /// The largest code, `2^bits - 1`.
    pub const fn max_code(self) -> u8 {
        match self {
            LowBits::Two => 3,
            LowBits::Four => 15,
        }
    }

    /// Codes packed into one byte.
    pub const fn codes_per_byte(self) -> usize {
        8 / self.bits()
    }
}

/// Channels sharing one scale/minimum pair in a per-token format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ChannelGroup {
    /// A fixed number of consecutive channels (32, 64 or 128).
    Channels(usize),
    /// The whole head: one pair per token per head.
    Head,
}

impl ChannelGroup {
    /// Channels per group for a given head dimension.
    pub fn size(self, head_dim: usize) -> usize {
        match self {
            ChannelGroup::Channels(n) => n.min(head_dim),
            ChannelGroup::Head => head_dim,
        }
    }
}

/// The storage formats' names in kernel names, by their ABI number: every format the kernels
/// are built for (one scheme spelling each).
pub const KERNEL_FORMATS: [&str; 8] = [
    "f16", "q8", "q8_0", "q4_tok", "q2_tok", "q4_chan", "q2_chan", "fp8",
];

/// How one stream (K or V) of one token-head is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Format {
    /// IEEE half precision, unquantized.
    F16,
    /// int8 symmetric, one f16 scale per token per head: `x = scale * q`, `q ∈ [-127, 127]`.
    Q8,
    /// llama.cpp `q8_0`: blocks of 32 channels, each `{f16 d; i8 qs[32]}` (34 bytes).
    Q8_0,
    /// OCP fp8 e4m3 (production servers' fp8 cache), one f16 scale per token per head:
    /// `x = scale * e4m3(q)`, `scale = max|x| / 448` ([`crate::quant::e4m3_from_f32`]).
    Fp8,
    /// Asymmetric per token, over groups of channels: `x = min + scale * q`, `q ∈ [0, 2^b - 1]`.
    Tok { bits: LowBits, group: ChannelGroup },
    /// Asymmetric per channel over the `group_tokens` tokens of a page (KIVI keys). The tokens of
    /// a page that is not yet full stay f16 in the residual window.
    Chan { bits: LowBits },
}

impl Format {
    /// Nominal bits per element, not counting parameters.
    pub fn nominal_bits(self) -> usize {
        match self {
            Format::F16 => 16,
            Format::Q8 | Format::Q8_0 | Format::Fp8 => 8,
            Format::Tok { bits, .. } | Format::Chan { bits } => bits.bits(),
        }
    }

    /// The format's number in the device ABI (`enum hipkv_format` in `hip/include/hipkv_abi.h`).
    pub fn abi_code(self) -> u32 {
        match self {
            Format::F16 => 0,
            Format::Q8 => 1,
            Format::Q8_0 => 2,
            Format::Tok {
                bits: LowBits::Four,
                ..
            } => 3,
            Format::Tok {
                bits: LowBits::Two, ..
            } => 4,
            Format::Chan {
                bits: LowBits::Four,
            } => 5,
            Format::Chan { bits: LowBits::Two } => 6,
            Format::Fp8 => 7,
        }
    }

    /// The format's name in kernel names (`hipkv_attn_<key>_<value>_d<head_dim>`).
    pub fn kernel_name(self) -> &'static str {
        KERNEL_FORMATS[self.abi_code() as usize]
    }

    /// Whether tokens wait in the f16 residual window until their page is full.
    pub fn is_grouped_by_tokens(self) -> bool {
        matches!(self, Format::Chan { .. })
    }

    /// Bytes of the packed codes of one token of one head (f16 data for `F16`, whole blocks for
    /// `Q8_0`).
    pub fn row_bytes(self, head_dim: usize) -> usize {
        match self {
            Format::F16 => head_dim * 2,
            Format::Q8 | Format::Fp8 => head_dim,
            Format::Q8_0 => head_dim / Q8_0_BLOCK * Q8_0_BLOCK_BYTES,
            Format::Tok { bits, .. } | Format::Chan { bits } => head_dim / bits.codes_per_byte(),
        }
    }

    /// Bytes of quantization parameters stored outside the rows, for one page of one head.
    pub fn params_bytes(self, tokens: usize, head_dim: usize) -> usize {
        match self {
            Format::F16 | Format::Q8_0 => 0,
            Format::Q8 | Format::Fp8 => tokens * 2,
            Format::Tok { group, .. } => tokens * (head_dim / group.size(head_dim)) * 4,
            Format::Chan { .. } => head_dim * 4,
        }
    }

    fn validate(self, head_dim: usize) -> Result<()> {
        let ok = match self {
            Format::Q8_0 => head_dim.is_multiple_of(Q8_0_BLOCK),
            Format::Tok { group, .. } => head_dim.is_multiple_of(group.size(head_dim)),
            _ => true,
        };
        if ok {
            Ok(())
        } else {
            Err(Error::Unsupported(format!(
                "format {self} with head_dim {head_dim}"
            )))
        }
    }
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Format::F16 => f.write_str("f16"),
            Format::Q8 => f.write_str("q8"),
            Format::Q8_0 => f.write_str("q8_0"),
            Format::Fp8 => f.write_str("fp8"),
            Format::Tok { bits, group } => {
                write!(f, "q{}_tok", bits.bits())?;
                match group {
                    ChannelGroup::Channels(32) => Ok(()),
                    ChannelGroup::Channels(n) => write!(f, "@{n}"),
                    ChannelGroup::Head => f.write_str("@head"),
                }
            }
            Format::Chan { bits } => write!(f, "q{}_chan", bits.bits()),
        }
    }
}

impl FromStr for Format {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let bad = || Error::ParseScheme(format!("unknown format `{s}`"));
        let (name, group) = match s.split_once('@') {
            Some((name, group)) => (name, Some(group)),
            None => (s, None),
        };
        let low = |b: &str| match b {
            "2" => Ok(LowBits::Two),
            "4" => Ok(LowBits::Four),
            _ => Err(bad()),
        };
        let format = match name {
            "f16" => Format::F16,
            "q8" => Format::Q8,
            "q8_0" => Format::Q8_0,
            "fp8" => Format::Fp8,
            _ => {
                let body = name.strip_prefix('q').ok_or_else(bad)?;
                if let Some(b) = body.strip_suffix("_tok") {
                    let group = match group {
                        None => ChannelGroup::Channels(32),
                        Some("head") => ChannelGroup::Head,
                        Some(n) => {
                            let n: usize = n.parse().map_err(|_| bad())?;
                            if !CHANNEL_GROUPS.contains(&n) {
                                return Err(Error::ParseScheme(format!(
                                    "channel group {n} in `{s}`: expected one of {CHANNEL_GROUPS:?} or `head`"
                                )));
                            }
                            ChannelGroup::Channels(n)
                        }
                    };
                    return Ok(Format::Tok {
                        bits: low(b)?,
                        group,
                    });
                } else if let Some(b) = body.strip_suffix("_chan") {
                    Format::Chan { bits: low(b)? }
                } else {
                    return Err(bad());
                }
            }
        };
        if group.is_some() {
            return Err(Error::ParseScheme(format!(
                "`@group` applies only to q*_tok formats, not `{s}`"
            )));
        }
        Ok(format)
    }
}

/// Which streams keep a dense-and-sparse outlier store.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Outliers {
    /// Fraction of each channel's calibration samples treated as outliers, split evenly between
    /// the highest and the lowest (0.01 = the 0.5% highest and 0.5% lowest).
    pub fraction: f32,
    /// Whether values get an outlier store too (keys always do).
    pub values: bool,
    /// Outlier slots per token per head; `None` derives `ceil(3 · fraction · head_dim)`.
    pub capacity: Option<usize>,
}

impl Default for Outliers {
    fn default() -> Self {
        Outliers {
            fraction: 0.01,
            values: false,
            capacity: None,
        }
    }
}

impl Outliers {
    /// Outlier slots per token per head for a head dimension.
    pub fn slots(&self, head_dim: usize) -> usize {
        self.capacity
            .unwrap_or_else(|| ((3.0 * self.fraction * head_dim as f32).ceil() as usize).max(1))
    }
}

/// A set of streams an option applies to: none, keys, values or both.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum StreamSet {
    #[default]
    None,
    /// `=k`
    Keys,
    /// `=v`
    Values,
    /// No value, or `=kv`
    Both,
}

impl StreamSet {
    /// Whether `stream` is in the set.
    pub fn applies(self, stream: Stream) -> bool {
        matches!(
            (self, stream),
            (StreamSet::Both, _) | (StreamSet::Keys, Stream::K) | (StreamSet::Values, Stream::V)
        )
    }

    /// The ABI's bit set (`hipkv_paged_geometry::rotate`): 1 keys, 2 values.
    pub fn abi_bits(self) -> u32 {
        u32::from(self.applies(Stream::K)) | (u32::from(self.applies(Stream::V)) << 1)
    }

    /// Parses the value of `name[=k|v|kv]`.
    fn parse(value: Option<&str>) -> Option<StreamSet> {
        match value {
            None | Some("kv") => Some(StreamSet::Both),
            Some("k") => Some(StreamSet::Keys),
            Some("v") => Some(StreamSet::Values),
            Some(_) => None,
        }
    }

    /// Writes `,name`, `,name=k` or `,name=v` (nothing for the empty set).
    fn write(self, f: &mut fmt::Formatter<'_>, name: &str) -> fmt::Result {
        match self {
            StreamSet::None => Ok(()),
            StreamSet::Keys => write!(f, ",{name}=k"),
            StreamSet::Values => write!(f, ",{name}=v"),
            StreamSet::Both => write!(f, ",{name}"),
        }
    }
}

/// A complete KV storage scheme: key format, value format and the options around them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Scheme {
    pub k: Format,
    pub v: Format,
    /// Tokens per page, and per key group of a per-channel format (G).
    pub group_tokens: usize,
    /// The first `sinks` tokens of a sequence are kept f16 (attention sinks).
    pub sinks: usize,
    /// KIVI's residual: the values of a sequence's last `value_window` positions (and of the
    /// rest of the page holding the oldest of them) are also kept f16, per sequence, and
    /// attention reads those instead of the quantized rows (0: none).
    pub value_window: usize,
    /// Keys are stored before RoPE and rotated inside attention (needs RoPE in the cache config).
    pub pre_rope: bool,
    /// Dense-and-sparse outlier store.
    pub outliers: Option<Outliers>,
    /// Streams stored rotated by the orthonormal Walsh–Hadamard transform `H/√d` of each head
    /// (`quant::hadamard`). Rotation spreads an outlier channel's energy over every channel, so
    /// a per-token group's range is set by the row's norm rather than by its largest channel.
    /// Attention rotates the query once per step for rotated keys (`(Hq)·(Hk) = q·k`) and its
    /// output once per step for rotated values (`H·Σ p·Hv = Σ p·v`): nothing changes in the
    /// inner loop.
    pub rotation: StreamSet,
    /// Low-bit streams whose codes decode through a per-layer codebook (`quant::Codebook`,
    /// KVQuant's nuq) calibrated on the model, instead of uniformly.
    pub nuq: StreamSet,
    /// Keys are scored against the query rounded to int8 per 32-channel block (one f32 scale
    /// each, `quant::quantize_query`), in integer dot products, as llama.cpp's CPU and GPU vec
    /// kernels do: storage is unchanged, attention trades the query's last bits for the key
    /// decode to f32 (`iq`; every backend: docs/kernels.md, "Integer-query key scores").
    /// Per-channel keys round the query with each page's scales folded in, once per page
    /// ([`Scheme::rounds_query_per_step`]).
    pub int_query: bool,
}

/// Named presets, in the order `hipkv info` and `hipkv bench` list them.
pub const PRESETS: [&str; 8] = [
    "f16", "q8", "q8_0", "fp8", "q4_tok", "q2_tok", "kivi4", "kivi2",
];

/// The frontier's winners, named (docs/accuracy.md, "The frontier"): at 4.5, 3.5 and 2.5 bits
/// per element, the measured scheme of least KL on both evaluated models. All three store keys
/// before RoPE, so a cache of them needs RoPE; `kv3` and `kv2` decode through codebooks, so
/// each layer must be calibrated ([`crate::KvCache::calibrate`] or a calibration file) before
/// its first append. Kept apart from [`PRESETS`], which need neither.
pub const FRONTIER_PRESETS: [&str; 3] = ["kv4", "kv3", "kv2"];

/// Every preset's name: [`PRESETS`], then [`FRONTIER_PRESETS`].
pub fn preset_names() -> impl Iterator<Item = &'static str> {
    PRESETS.iter().chain(&FRONTIER_PRESETS).copied()
}

impl Scheme {
    /// Both streams in the same format, default options.
    pub const fn uniform(format: Format) -> Scheme {
        Scheme::new(format, format)
    }

    /// Keys and values in the given formats, default options (G = 32, no sinks, no value
    /// window, no outliers).
    pub const fn new(k: Format, v: Format) -> Scheme {
        Scheme {
            k,
            v,
            group_tokens: 32,
            sinks: 0,
            value_window: 0,
            pre_rope: false,
            outliers: None,
            rotation: StreamSet::None,
            nuq: StreamSet::None,
            int_query: false,
        }
    }

    /// Every preset scheme.
    pub fn presets() -> Vec<Scheme> {
        PRESETS.iter().map(|p| p.parse().unwrap()).collect()
    }

    fn preset(name: &str) -> Option<Scheme> {
        let tok_in = |bits, channels| Format::Tok {
            bits,
            group: ChannelGroup::Channels(channels),
        };
        let tok = |bits| tok_in(bits, 32);
        let chan = |bits| Format::Chan { bits };
        Some(match name {
            "f16" => Scheme::uniform(Format::F16),
            "q8" => Scheme::uniform(Format::Q8),
            "q8_0" => Scheme::uniform(Format::Q8_0),
            "fp8" => Scheme::uniform(Format::Fp8),
            "q4_tok" => Scheme::uniform(tok(LowBits::Four)).per_token_preset(),
            "q2_tok" => Scheme::uniform(tok(LowBits::Two)).per_token_preset(),
            "kivi4" => Scheme::new(chan(LowBits::Four), tok(LowBits::Four)).kivi_preset(),
            "kivi2" => Scheme::new(chan(LowBits::Two), tok(LowBits::Two)).kivi_preset(),
            "kv4" => Scheme::new(chan(LowBits::Four), tok_in(LowBits::Four, 64))
                .frontier(StreamSet::None),
            "kv3" => Scheme::new(chan(LowBits::Four), tok_in(LowBits::Two, 64))
                .frontier(StreamSet::Values),
            "kv2" => {
                Scheme::new(chan(LowBits::Two), tok_in(LowBits::Two, 64)).frontier(StreamSet::Both)
            }
            _ => return None,
        })
    }

    /// Where both models' frontiers agree below 8 bits: KIVI's window and sinks, 64-token key
    /// pages (64-channel value groups are the formats'), pre-RoPE keys, rotated values, and
    /// codebooks for the 2-bit streams (`nuq`).
    const fn frontier(mut self, nuq: StreamSet) -> Scheme {
        self.group_tokens = 64;
        self.pre_rope = true;
        self.rotation = StreamSet::Values;
        self.nuq = nuq;
        self.kivi()
    }

    /// Whether `self` can be written as preset `p` plus options: the same formats, and every
    /// option that has no spelling for "off" (`pre_rope`, `rot`, `nuq`) either off in `p` or
    /// the same in both.
    fn extends(&self, p: &Scheme) -> bool {
        (self.k, self.v) == (p.k, p.v)
            && (!p.pre_rope || self.pre_rope)
            && (p.rotation == StreamSet::None || p.rotation == self.rotation)
            && (p.nuq == StreamSet::None || p.nuq == self.nuq)
    }

    const fn with_sinks(mut self) -> Scheme {
        self.sinks = PRESET_SINKS;
        self
    }

    /// `q4_tok` and `q2_tok`: sinks, and keys scored from the int8 query (`iq`), which adds
    /// under 10% to their KL on both evaluated models and makes them faster than `q8`
    /// (docs/accuracy.md, "Integer-query key scores").
    const fn per_token_preset(mut self) -> Scheme {
        self.int_query = true;
        self.with_sinks()
    }

    /// `kivi4` and `kivi2`: KIVI's window and sinks, and keys scored from each page's folded
    /// query rounded to int8 (`iq`), which adds under 10% to their KL on both evaluated models
    /// (docs/accuracy.md, "Integer-query key scores") and issues fewer instructions on gfx1201
    /// and the CPU (docs/performance.md, "The folded query rounded a word per lane"). Storage
    /// is KIVI's.
    const fn kivi_preset(mut self) -> Scheme {
        self.int_query = true;
        self.kivi()
    }

    /// Whether a scheme derived from preset `p` scores keys from the int8 query unless told:
    /// where `p` does and `iq` applies to this scheme (not with `pre_rope` or `nuq` keys).
    fn int_query_by_default(&self, p: &Scheme) -> bool {
        p.int_query && self.int_query_applies()
    }

    /// KIVI as published keeps the most recent values f16 as well as the open key page.
    const fn kivi(mut self) -> Scheme {
        self.value_window = KIVI_VALUE_WINDOW;
        self.with_sinks()
    }

    /// Checks the scheme against a head dimension (and whether the cache applies RoPE).
    pub fn validate(&self, head_dim: usize, has_rope: bool) -> Result<()> {
        if !HEAD_DIMS.contains(&head_dim) {
            return Err(Error::Unsupported(format!(
                "head_dim {head_dim}: expected one of {HEAD_DIMS:?}"
            )));
        }
        if !GROUP_TOKENS.contains(&self.group_tokens) {
            return Err(Error::Unsupported(format!(
                "group of {} tokens: expected one of {GROUP_TOKENS:?}",
                self.group_tokens
            )));
        }
        self.k.validate(head_dim)?;
        self.v.validate(head_dim)?;
        if self.value_window != 0 {
            if !VALUE_WINDOWS.contains(&self.value_window)
                || !self.value_window.is_multiple_of(self.group_tokens)
            {
                return Err(Error::Unsupported(format!(
                    "value window rv={}: expected one of {VALUE_WINDOWS:?}, a multiple of g={}",
                    self.value_window, self.group_tokens
                )));
            }
            if self.v == Format::F16 {
                return Err(Error::Unsupported(
                    "a value window (rv=) with f16 values: they are f16 already".into(),
                ));
            }
        }
        if self.pre_rope && !has_rope {
            return Err(Error::Unsupported(
                "pre_rope needs RoPE configured in the cache".into(),
            ));
        }
        if self.rotation != StreamSet::None {
            if self.outliers.is_some() {
                return Err(Error::Unsupported(
                    "rot with outliers: outlier thresholds are per stored channel, and rotation \
                     is the alternative to a sparse store"
                        .into(),
                ));
            }
            if self.pre_rope && self.rotation.applies(Stream::K) {
                return Err(Error::Unsupported(
                    "rotated keys (rot, rot=k) with pre_rope: RoPE acts on unrotated channels"
                        .into(),
                ));
            }
        }
        for stream in [Stream::K, Stream::V] {
            if self.nuq.applies(stream) && self.low_bits(stream).is_none() {
                return Err(Error::Unsupported(format!(
                    "nuq for {} {}: codebooks are for the 4- and 2-bit formats",
                    self.format(stream),
                    stream
                )));
            }
        }
        if self.int_query && !self.int_query_applies() {
            return Err(Error::Unsupported(format!(
                "iq with {} keys{}: integer dot products need uniform integer codes (q8, \
                 q8_0, q4_tok, q2_tok, q4_chan, q2_chan keys), scored as stored",
                self.k,
                match (self.nuq.applies(Stream::K), self.pre_rope) {
                    (true, _) => " and nuq",
                    (_, true) => " and pre_rope",
                    _ => "",
                }
            )));
        }
        if let Some(o) = self.outliers {
            if !(o.fraction > 0.0 && o.fraction < 0.5) {
                return Err(Error::Unsupported(format!(
                    "outlier fraction {}: expected 0 < fraction < 0.5",
                    o.fraction
                )));
            }
            let slots = o.slots(head_dim);
            if slots == 0 || slots > head_dim {
                return Err(Error::Unsupported(format!(
                    "{slots} outlier slots per token for head_dim {head_dim}"
                )));
            }
        }
        Ok(())
    }

    /// Whether the two schemes store, and are calibrated, alike: they differ at most in how
    /// attention rounds the query (`iq`), which changes no byte of the cache.
    pub fn stores_like(&self, other: &Scheme) -> bool {
        let stored = |s: &Scheme| Scheme {
            int_query: false,
            ..*s
        };
        stored(self) == stored(other)
    }

    /// Whether `iq` can score this scheme's keys: uniform integer codes, scored as stored (no
    /// codebook, no RoPE applied after decoding).
    pub fn int_query_applies(&self) -> bool {
        matches!(
            self.k,
            Format::Q8 | Format::Q8_0 | Format::Tok { .. } | Format::Chan { .. }
        ) && !self.nuq.applies(Stream::K)
            && !self.pre_rope
    }

    /// Whether `iq` rounds the query once per step (8-bit and per-token keys). Per-channel keys
    /// (`q*_chan`) are scored against the query with each page's channel scales folded in
    /// (`q ∘ s`), so `iq` rounds that folded query, once per page, and the step's query stays
    /// f32 (docs/kernels.md, "Integer-query key scores").
    pub fn rounds_query_per_step(&self) -> bool {
        self.int_query && !matches!(self.k, Format::Chan { .. })
    }

    /// Whether the given stream keeps an outlier store.
    pub fn has_outliers(&self, stream: Stream) -> bool {
        match (self.outliers, stream) {
            (Some(_), Stream::K) => true,
            (Some(o), Stream::V) => o.values,
            (None, _) => false,
        }
    }

    /// The code width of a stream in a 4- or 2-bit format.
    pub fn low_bits(&self, stream: Stream) -> Option<LowBits> {
        match self.format(stream) {
            Format::Tok { bits, .. } | Format::Chan { bits } => Some(bits),
            _ => None,
        }
    }

    /// The codes' width of the codebook the scheme takes for `stream`: where `nuq` applies,
    /// the stream's low-bit width (`validate` refuses `nuq` on any other format); else none.
    pub fn codebook_bits(&self, stream: Stream) -> Option<LowBits> {
        self.low_bits(stream).filter(|_| self.nuq.applies(stream))
    }

    /// Format of a stream.
    pub fn format(&self, stream: Stream) -> Format {
        match stream {
            Stream::K => self.k,
            Stream::V => self.v,
        }
    }

    /// Outlier slots per token per head of a stream (0 without an outlier store).
    pub fn outlier_slots(&self, stream: Stream, head_dim: usize) -> usize {
        match self.outliers {
            Some(o) if self.has_outliers(stream) => o.slots(head_dim),
            _ => 0,
        }
    }

    /// Byte layout of one head's block inside a page.
    pub fn head_layout(&self, head_dim: usize) -> HeadLayout {
        let k = StreamLayout::new(
            self.k,
            self.group_tokens,
            head_dim,
            self.outlier_slots(Stream::K, head_dim),
            0,
        );
        let v = StreamLayout::new(
            self.v,
            self.group_tokens,
            head_dim,
            self.outlier_slots(Stream::V, head_dim),
            k.end,
        );
        HeadLayout { bytes: v.end, k, v }
    }

    /// Exact storage of one sequence of `capacity` tokens for one KV head, as the cache allocates
    /// it: sinks, pages (with parameters and outlier slots; the sinks' rows in them included,
    /// never read), the residual window and the value window.
    pub fn memory(&self, head_dim: usize, capacity: usize) -> Memory {
        let f16_row = head_dim * 2;
        let sinks = self.sinks.min(capacity);
        let pages = capacity.div_ceil(self.group_tokens);
        let layout = self.head_layout(head_dim);
        let residual = |f: Format| {
            if f.is_grouped_by_tokens() && pages > 0 {
                self.group_tokens * f16_row
            } else {
                0
            }
        };
        Memory {
            capacity,
            sink_bytes: 2 * sinks * f16_row,
            page_bytes: pages * layout.bytes,
            residual_bytes: residual(self.k) + residual(self.v),
            window_bytes: self.window_rows() * f16_row,
        }
    }

    /// Rows of the f16 value window of one sequence and KV head: `rv` plus one page, so that
    /// every position of the pages holding the last `rv` fits (0 without a window).
    pub fn window_rows(&self) -> usize {
        if self.value_window == 0 {
            0
        } else {
            self.value_window + self.group_tokens
        }
    }

    /// Bytes read by attention per cached token per KV head, once the pages are full (K and V
    /// with their parameters and outlier stores, without sinks, residual or value window).
    pub fn bytes_per_token(&self, head_dim: usize) -> f64 {
        self.head_layout(head_dim).bytes as f64 / self.group_tokens as f64
    }
}

impl fmt::Display for Scheme {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The preset this scheme extends, whose options are the defaults not printed.
        let preset = preset_names().find_map(|p| {
            Scheme::preset(p)
                .filter(|s| self.extends(s))
                .map(|s| (p, s))
        });
        let defaults = match preset {
            Some((name, s)) => {
                f.write_str(name)?;
                s
            }
            None => {
                write!(f, "k={},v={}", self.k, self.v)?;
                Scheme::new(self.k, self.v)
            }
        };
        if self.group_tokens != defaults.group_tokens {
            write!(f, ",g={}", self.group_tokens)?;
        }
        if self.sinks != defaults.sinks {
            write!(f, ",sinks={}", self.sinks)?;
        }
        if self.value_window != defaults.value_window {
            write!(f, ",rv={}", self.value_window)?;
        }
        if self.pre_rope && !defaults.pre_rope {
            f.write_str(",pre_rope")?;
        }
        if let Some(o) = self.outliers {
            f.write_str(if o.values {
                ",outliers=kv"
            } else {
                ",outliers"
            })?;
            if o.fraction != Outliers::default().fraction {
                write!(f, ",outlier_frac={}", o.fraction)?;
            }
            if let Some(c) = o.capacity {
                write!(f, ",outlier_slots={c}")?;
            }
        }
        if self.rotation != defaults.rotation {
            self.rotation.write(f, "rot")?;
        }
        if self.nuq != defaults.nuq {
            self.nuq.write(f, "nuq")?;
        }
        if self.int_query != self.int_query_by_default(&defaults) {
            f.write_str(if self.int_query { ",iq" } else { ",iq=0" })?;
        }
        Ok(())
    }
}

impl FromStr for Scheme {
    type Err = Error;

    /// Parses `preset[,option…]` or `k=FMT,v=FMT[,option…]`. Options: `g=32|64`, `sinks=N`,
    /// `rv=N` (value window; the `kivi*` presets' default is 128, others' 0), `pre_rope`,
    /// `outliers` (keys) or `outliers=kv`, `outlier_frac=F`, `outlier_slots=N`, `rot` (keys and
    /// values), `rot=k` or `rot=v`, `nuq` (keys and values), `nuq=k` or `nuq=v`, `iq` or `iq=0`
    /// (the `q4_tok`, `q2_tok`, `kivi4` and `kivi2` presets' default is `iq` where it applies,
    /// others' `iq=0`).
    fn from_str(s: &str) -> Result<Self> {
        let mut k = None;
        let mut v = None;
        let mut scheme = Scheme::uniform(Format::F16);
        let mut outliers: Option<Outliers> = None;
        let mut outlier_frac = None;
        let mut outlier_slots = None;
        let mut value_window = None;
        let mut int_query = None;
        let num = |key: &str, val: &str| -> Result<usize> {
            val.parse()
                .map_err(|_| Error::ParseScheme(format!("`{key}={val}`: expected an integer")))
        };
        for (i, item) in s.split(',').map(str::trim).enumerate() {
            let (key, val) = match item.split_once('=') {
                Some((key, val)) => (key, Some(val)),
                None => (item, None),
            };
            match (key, val) {
                (name, None) if i == 0 && Scheme::preset(name).is_some() => {
                    scheme = Scheme::preset(name).unwrap();
                    k = Some(scheme.k);
                    v = Some(scheme.v);
                }
                ("k", Some(f)) => k = Some(f.parse()?),
                ("v", Some(f)) => v = Some(f.parse()?),
                ("g", Some(n)) => scheme.group_tokens = num(key, n)?,
                ("sinks", Some(n)) => scheme.sinks = num(key, n)?,
                ("rv", Some(n)) => value_window = Some(num(key, n)?),
                ("pre_rope", None) => scheme.pre_rope = true,
                ("outliers", None | Some("k")) => outliers = Some(Outliers::default()),
                ("outliers", Some("kv")) => {
                    outliers = Some(Outliers {
                        values: true,
                        ..Outliers::default()
                    })
                }
                ("outlier_frac", Some(f)) => {
                    outlier_frac =
                        Some(f.parse::<f32>().map_err(|_| {
                            Error::ParseScheme(format!("`{item}`: expected a number"))
                        })?)
                }
                ("outlier_slots", Some(n)) => outlier_slots = Some(num(key, n)?),
                ("rot", v) if StreamSet::parse(v).is_some() => {
                    scheme.rotation = StreamSet::parse(v).unwrap()
                }
                ("nuq", v) if StreamSet::parse(v).is_some() => {
                    scheme.nuq = StreamSet::parse(v).unwrap()
                }
                ("iq", None | Some("1")) => int_query = Some(true),
                ("iq", Some("0")) => int_query = Some(false),
                _ => {
                    return Err(Error::ParseScheme(format!(
                        "unknown item `{item}` in `{s}` (presets: {})",
                        preset_names().collect::<Vec<_>>().join(", ")
                    )));
                }
            }
        }
        let (Some(k), Some(v)) = (k, v) else {
            return Err(Error::ParseScheme(format!(
                "`{s}` names no preset and not both `k=` and `v=`"
            )));
        };
        scheme.k = k;
        scheme.v = v;
        scheme.int_query = int_query.unwrap_or_else(|| scheme.int_query_by_default(&scheme));
        if let Some(n) = value_window {
            scheme.value_window = n;
        }
        if !VALUE_WINDOWS.contains(&scheme.value_window) {
            return Err(Error::ParseScheme(format!(
                "rv={}: expected one of {VALUE_WINDOWS:?}",
                scheme.value_window
            )));
        }
        if !GROUP_TOKENS.contains(&scheme.group_tokens) {
            return Err(Error::ParseScheme(format!(
                "g={}: expected one of {GROUP_TOKENS:?}",
                scheme.group_tokens
            )));
        }
        if outliers.is_none() && (outlier_frac.is_some() || outlier_slots.is_some()) {
            return Err(Error::ParseScheme(format!(
                "`{s}`: outlier options need `outliers`"
            )));
        }
        scheme.outliers = outliers.map(|o| Outliers {
            fraction: outlier_frac.unwrap_or(o.fraction),
            capacity: outlier_slots,
            ..o
        });
        Ok(scheme)
    }
}

/// The key or the value stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Stream {
    K,
    V,
}

impl fmt::Display for Stream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Stream::K => "key",
            Stream::V => "value",
        })
    }
}

/// Offsets (from the start of the head block) of one stream's sections in a page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamLayout {
    pub format: Format,
    /// Packed rows, token-major: `tokens × row_bytes`.
    pub rows: usize,
    pub row_bytes: usize,
    /// Quantization parameters (scales, minimums).
    pub params: usize,
    /// Per-token outlier counts (u16); equal to `slots` when there is no outlier store.
    pub counts: usize,
    /// Outlier slots `{u16 channel, f16 value}`, `outlier_slots` per token.
    pub slots: usize,
    pub outlier_slots: usize,
    /// One past the end of the stream's last section.
    pub end: usize,
}

impl StreamLayout {
    fn new(
        format: Format,
        tokens: usize,
        head_dim: usize,
        outlier_slots: usize,
        start: usize,
    ) -> StreamLayout {
        let align = |n: usize| n.next_multiple_of(SECTION_ALIGN);
        let row_bytes = format.row_bytes(head_dim);
        let rows = start;
        let params = rows + align(tokens * row_bytes);
        let counts = params + align(format.params_bytes(tokens, head_dim));
        let (slots, end) = if outlier_slots == 0 {
            (counts, counts)
        } else {
            let slots = counts + align(tokens * OUTLIER_COUNT_BYTES);
            (
                slots,
                slots + align(tokens * outlier_slots * OUTLIER_SLOT_BYTES),
            )
        };
        StreamLayout {
            format,
            rows,
            row_bytes,
            params,
            counts,
            slots,
            outlier_slots,
            end,
        }
    }
}

/// Byte layout of one KV head's block in a page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeadLayout {
    pub k: StreamLayout,
    pub v: StreamLayout,
    /// Bytes of the whole head block; a page is `kv_heads × bytes`.
    pub bytes: usize,
}

impl HeadLayout {
    pub fn stream(&self, stream: Stream) -> &StreamLayout {
        match stream {
            Stream::K => &self.k,
            Stream::V => &self.v,
        }
    }
}

/// Storage of one sequence for one KV head of one layer (see [`Scheme::memory`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Memory {
    pub capacity: usize,
    pub sink_bytes: usize,
    pub page_bytes: usize,
    pub residual_bytes: usize,
    /// The f16 value window (`rv=`), allocated whole whatever the sequence's length.
    pub window_bytes: usize,
}

impl Memory {
    pub fn total(&self) -> usize {
        self.sink_bytes + self.page_bytes + self.residual_bytes + self.window_bytes
    }

    /// Bytes per token, everything included, amortised over the capacity.
    pub fn bytes_per_token(&self) -> f64 {
        self.total() as f64 / self.capacity.max(1) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_round_trip_through_strings() {
        for name in preset_names() {
            let s: Scheme = name.parse().unwrap();
            assert_eq!(s.to_string(), name);
        }
    }

    #[test]
    fn frontier_presets_are_the_frontier_winners() {
        // docs/accuracy.md, "The frontier": the winners at 72, 56 and 40 bytes per token and
        // KV head at head_dim 64, on SmolLM2 and on Gemma-3 alike.
        for (name, explicit, bytes) in [
            (
                "kv4",
                "k=q4_chan,v=q4_tok@64,g=64,sinks=4,rv=128,pre_rope,rot=v",
                72.0,
            ),
            (
                "kv3",
                "k=q4_chan,v=q2_tok@64,g=64,sinks=4,rv=128,pre_rope,rot=v,nuq=v",
                56.0,
            ),
            (
                "kv2",
                "k=q2_chan,v=q2_tok@64,g=64,sinks=4,rv=128,pre_rope,rot=v,nuq",
                40.0,
            ),
        ] {
            let s: Scheme = name.parse().unwrap();
            assert_eq!(s, explicit.parse().unwrap(), "{name}");
            assert_eq!(s.bytes_per_token(64), bytes, "{name}");
            assert!(s.validate(64, true).is_ok(), "{name}");
            assert!(s.validate(64, false).is_err(), "{name} needs RoPE");
        }
    }

    #[test]
    fn frontier_presets_print_what_differs_and_nothing_they_cannot_undo() {
        for (text, printed) in [
            ("kv4,g=32", "kv4,g=32"),
            ("kv3,sinks=0,rv=0", "kv3,sinks=0,rv=0"),
            ("kv2,outliers", "kv2,outliers"),
            ("kv4,nuq", "kv4,nuq"),
            // `rot` on keys too, or `nuq` widened: no longer the preset's, so written out.
            (
                "kv4,rot",
                "k=q4_chan,v=q4_tok@64,g=64,sinks=4,rv=128,pre_rope,rot",
            ),
            (
                "kv3,nuq",
                "k=q4_chan,v=q2_tok@64,g=64,sinks=4,rv=128,pre_rope,rot=v,nuq",
            ),
            // Without pre-RoPE keys the formats are kv4's, but it is not kv4 plus options.
            (
                "k=q4_chan,v=q4_tok@64,g=64,sinks=4,rv=128,rot=v",
                "k=q4_chan,v=q4_tok@64,g=64,sinks=4,rv=128,rot=v",
            ),
        ] {
            let s: Scheme = text.parse().unwrap();
            assert_eq!(s.to_string(), printed, "{text}");
            assert_eq!(printed.parse::<Scheme>().unwrap(), s, "{text}");
        }
    }

    #[test]
    fn options_round_trip_through_strings() {
        for text in [
            "kivi2,g=64,sinks=2,pre_rope,outliers",
            "kivi4,rv=0",
            "q2_tok,sinks=0",
            "k=q4_chan,v=q4_tok@64,g=64,sinks=4,rv=128",
            "kivi2,g=64,rv=64",
            "q4_tok,rv=32",
            "k=q4_chan,v=q8_0,outliers=kv,outlier_frac=0.02,outlier_slots=3",
            "k=q2_tok@head,v=q4_tok@128",
            "k=f16,v=q2_chan,sinks=1",
            "q4_tok,rot",
            "k=q4_chan,v=q4_tok@64,rv=128,rot=v",
            "k=q4_tok@64,v=q2_tok@64,g=64,rot=k",
            "kivi2,nuq",
            "kv3,sinks=0",
            "k=q2_chan,v=q8,nuq=k",
            "q4_tok,iq=0",
            "q2_tok,sinks=0,iq=0",
            "q8_0,iq",
            "k=q4_tok,v=q2_tok,iq",
        ] {
            let s: Scheme = text.parse().unwrap();
            assert_eq!(s.to_string(), text);
            assert_eq!(s.to_string().parse::<Scheme>().unwrap(), s);
        }
        // The explicit form takes no preset's options: KIVI's value window and the sub-8-bit
        // presets' sinks are the presets'.
        let explicit: Scheme = "k=q2_chan,v=q2_tok@32".parse().unwrap();
        assert_eq!(explicit.to_string(), "kivi2,sinks=0,rv=0,iq=0");
        let kivi: Scheme = "k=q2_chan,v=q2_tok@32,sinks=4,rv=128,iq".parse().unwrap();
        assert_eq!(kivi.to_string(), "kivi2");
        assert_eq!(kivi, "kivi2".parse().unwrap());
        let q8: Scheme = "q8".parse().unwrap();
        assert_eq!((q8.sinks, q8.value_window), (0, 0));
    }

    #[test]
    fn low_bit_presets_score_keys_from_the_int8_query_where_it_applies() {
        let iq = |text: &str| text.parse::<Scheme>().unwrap().int_query;
        for text in [
            "q4_tok",
            "q2_tok",
            "q4_tok,rot",
            "q2_tok,outliers=kv",
            "q4_tok,nuq=v",
            "kivi4",
            "kivi2,outliers",
            "kivi4,rv=0",
        ] {
            assert!(iq(text), "{text}");
        }
        // Off where it does not apply, where said, in the explicit form and in other presets.
        for text in [
            "q4_tok,pre_rope",
            "q2_tok,nuq",
            "q4_tok,iq=0",
            "k=q4_tok,v=q4_tok",
            "q8",
            "q8_0",
            "kivi4,pre_rope",
            "kivi2,nuq=k",
            "kivi2,iq=0",
            "k=q4_chan,v=q4_tok",
            "kv4",
        ] {
            assert!(!iq(text), "{text}");
        }
        for (text, printed) in [
            ("q4_tok,iq", "q4_tok"),
            ("q4_tok,iq=1", "q4_tok"),
            ("q4_tok,pre_rope", "q4_tok,pre_rope"),
            ("k=q4_tok,v=q4_tok", "q4_tok,sinks=0,iq=0"),
            ("k=q4_tok,v=q4_tok,sinks=4", "q4_tok,iq=0"),
            ("kivi4,iq", "kivi4"),
            ("k=q4_chan,v=q4_tok,sinks=4,rv=128", "kivi4,iq=0"),
        ] {
            let s: Scheme = text.parse().unwrap();
            assert_eq!(s.to_string(), printed, "{text}");
            assert_eq!(printed.parse::<Scheme>().unwrap(), s, "{text}");
        }
        let asked: Scheme = "q4_tok,pre_rope,iq".parse().unwrap();
        assert!(matches!(
            asked.validate(64, true),
            Err(Error::Unsupported(_))
        ));
        assert!(matches!(
            "q4_tok,iq=2".parse::<Scheme>(),
            Err(Error::ParseScheme(_))
        ));
    }

    #[test]
    fn bad_strings_are_rejected_with_a_reason() {
        for text in [
            "q3_tok",
            "k=q8",
            "kivi2,g=16",
            "q8,outlier_frac=0.1",
            "k=q4_tok@48,v=f16",
            "k=q8@32,v=f16",
            "q8,sinks=-1",
            "q8,q8",
            "kivi2,rv=100",
            "kivi2,rv=-1",
            "q4_tok,rot=q",
            "q4_tok,nuq=x",
        ] {
            assert!(
                matches!(text.parse::<Scheme>(), Err(Error::ParseScheme(_))),
                "{text}"
            );
        }
    }

    #[test]
    fn q8_0_block_matches_llama_cpp() {
        assert_eq!(Format::Q8_0.row_bytes(128), 4 * 34);
    }

    #[test]
    fn sections_are_aligned_for_wide_loads() {
        for name in PRESETS {
            let mut s: Scheme = name.parse().unwrap();
            s.outliers = Some(Outliers {
                values: true,
                ..Outliers::default()
            });
            for d in HEAD_DIMS {
                let l = s.head_layout(d);
                for st in [l.k, l.v] {
                    for off in [st.rows, st.params, st.counts, st.slots, st.end] {
                        assert_eq!(off % SECTION_ALIGN, 0, "{s} d={d}");
                    }
                    // The attention kernels read every row but q8_0's 16 bytes at a time.
                    if st.format != Format::Q8_0 {
                        assert_eq!(st.row_bytes % 16, 0, "{s} d={d}");
                    }
                }
            }
        }
    }

    #[test]
    fn bytes_per_token_of_presets() {
        // head_dim 128, G = 32: K and V rows plus parameters, per token per KV head.
        let expect = [
            ("f16", 512.0),
            ("q8", 256.0 + 4.0),
            ("q8_0", 2.0 * 136.0),
            ("q4_tok", 2.0 * (64.0 + 16.0)),
            ("q2_tok", 2.0 * (32.0 + 16.0)),
            ("kivi4", 64.0 + 512.0 / 32.0 + 64.0 + 16.0),
            ("kivi2", 32.0 + 512.0 / 32.0 + 32.0 + 16.0),
        ];
        for (name, bytes) in expect {
            let s: Scheme = name.parse().unwrap();
            assert_eq!(s.bytes_per_token(128), bytes, "{name}");
        }
    }

    #[test]
    fn memory_counts_sinks_and_residual_window() {
        let s: Scheme = "kivi2".parse().unwrap();
        assert_eq!(s.sinks, PRESET_SINKS);
        let m = s.memory(64, 100);
        assert_eq!(m.sink_bytes, 2 * 4 * 128);
        assert_eq!(m.page_bytes, 4 * s.head_layout(64).bytes);
        assert_eq!(m.residual_bytes, 32 * 128);
        assert_eq!(m.window_bytes, (KIVI_VALUE_WINDOW + 32) * 128);
        assert_eq!(
            m.total(),
            m.sink_bytes + m.page_bytes + m.residual_bytes + m.window_bytes
        );
    }

    #[test]
    fn rotation_excludes_pre_rope_keys_and_outliers() {
        let check = |text: &str| text.parse::<Scheme>().unwrap().validate(64, true);
        for ok in ["q4_tok,rot", "kivi2,pre_rope,rot=v", "q8,rot=k"] {
            assert!(check(ok).is_ok(), "{ok}");
        }
        for bad in [
            "q4_tok,rot,pre_rope",
            "kivi2,rot=k,pre_rope",
            "q4_tok,rot=v,outliers",
        ] {
            assert!(matches!(check(bad), Err(Error::Unsupported(_))), "{bad}");
        }
        let both: Scheme = "q4_tok,rot=kv".parse().unwrap();
        assert_eq!(both.rotation.abi_bits(), 3);
        assert_eq!(both.to_string(), "q4_tok,rot");
    }

    #[test]
    fn codebooks_are_for_low_bit_streams() {
        let check = |text: &str| text.parse::<Scheme>().unwrap().validate(64, true);
        for ok in [
            "kivi2,nuq",
            "k=q8,v=q2_tok,nuq=v",
            "k=q4_chan,v=f16,nuq=k,pre_rope",
        ] {
            assert!(check(ok).is_ok(), "{ok}");
        }
        for bad in ["q8,nuq", "k=q8,v=q2_tok,nuq", "k=q4_chan,v=f16,nuq=v"] {
            assert!(matches!(check(bad), Err(Error::Unsupported(_))), "{bad}");
        }
    }

    #[test]
    fn value_windows_are_whole_pages_of_quantized_values() {
        let check = |text: &str| text.parse::<Scheme>().unwrap().validate(64, false);
        assert!(check("kivi2,g=64,rv=128").is_ok());
        assert!(check("q4_tok,rv=32").is_ok());
        for bad in ["kivi2,g=64,rv=32", "f16,rv=32", "k=q8,v=f16,rv=64"] {
            assert!(matches!(check(bad), Err(Error::Unsupported(_))), "{bad}");
        }
    }
}
