//! The model's tokenizer, built from the GGUF's own vocabulary (and merges).
//!
//! GGUF `llama` tokenizers are SentencePiece vocabularies with scores (Gemma's), merged by
//! [`Spm`]. GGUF `gpt2` tokenizers are byte-level BPE. SmolLM2's (`tokenizer.ggml.pre = smollm`) splits
//! every digit on its own before the GPT-2 pre-tokenizer regex, as llama.cpp's `smollm`
//! pre-tokenizer and the model's Hugging Face `tokenizer.json` do (`Digits(individual)` then
//! `ByteLevel`); the `tokenizers` crate does the BPE itself.

use candle_core::quantized::gguf_file::{Content, Value};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;

use super::spm::Spm;
use super::{EvalError, metadata};

/// Pre-tokenizers this module reproduces, by their `tokenizer.ggml.pre` name.
const PRE_TOKENIZERS: [&str; 3] = ["smollm", "gpt2", "default"];

/// Text to token ids and back.
pub struct Tokenizer {
    inner: Inner,
    /// The beginning-of-sequence token, when the file asks for one (`add_bos_token`).
    bos: Option<u32>,
}

enum Inner {
    Bpe(Box<tokenizers::Tokenizer>),
    Spm(Spm),
}

/// The elements of a GGUF array, each converted by `get`.
fn array<T>(
    content: &Content,
    key: &str,
    get: impl Fn(&Value) -> candle_core::Result<T>,
) -> Result<Vec<T>, EvalError> {
    metadata(content, key)?
        .to_vec()
        .map_err(EvalError::Gguf)?
        .iter()
        .map(get)
        .collect::<candle_core::Result<_>>()
        .map_err(EvalError::Gguf)
}

fn strings(content: &Content, key: &str) -> Result<Vec<String>, EvalError> {
    array(content, key, |v| v.to_string().cloned())
}

impl Tokenizer {
    /// Builds the tokenizer a GGUF file describes (`tokenizer.ggml.*`).
    pub fn from_gguf(content: &Content) -> Result<Tokenizer, EvalError> {
        let model = metadata(content, "tokenizer.ggml.model")?
            .to_string()
            .map_err(EvalError::Gguf)?;
        let inner = match model.as_str() {
            "gpt2" => Inner::Bpe(Box::new(bpe(content)?)),
            "llama" => Inner::Spm(spm(content)?),
            _ => {
                return Err(EvalError::UnsupportedModel {
                    what: "tokenizer.ggml.model (byte-level BPE `gpt2` or SentencePiece `llama`)",
                    value: model.clone(),
                });
            }
        };
        let add_bos = match content.metadata.get("tokenizer.ggml.add_bos_token") {
            Some(v) => v.to_bool().map_err(EvalError::Gguf)?,
            None => false,
        };
        let bos = if add_bos {
            let id = metadata(content, "tokenizer.ggml.bos_token_id")?
                .to_u32()
                .map_err(EvalError::Gguf)?;
            Some(id)
        } else {
            None
        };
        Ok(Tokenizer { inner, bos })
    }

    /// Token ids of `text`, after the beginning-of-sequence token when the file asks for one
    /// (Gemma's does; SmolLM2's sets `add_bos_token = false`).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, EvalError> {
        let mut ids: Vec<u32> = self.bos.into_iter().collect();
        match &self.inner {
            Inner::Bpe(t) => ids.extend_from_slice(
                t.encode(text, false)
                    .map_err(EvalError::Tokenizer)?
                    .get_ids(),
            ),
            Inner::Spm(s) => ids.extend(s.encode(text)),
        }
        Ok(ids)
    }

    /// The text of token ids (a beginning-of-sequence token decodes to nothing).
    pub fn decode(&self, ids: &[u32]) -> Result<String, EvalError> {
        let ids = match (self.bos, ids.first()) {
            (Some(bos), Some(&first)) if first == bos => &ids[1..],
            _ => ids,
        };
        match &self.inner {
            Inner::Bpe(t) => t.decode(ids, false).map_err(EvalError::Tokenizer),
            Inner::Spm(s) => s.decode(ids),
        }
    }

    /// Vocabulary size.
    pub fn vocab_size(&self) -> usize {
        match &self.inner {
            Inner::Bpe(t) => t.get_vocab_size(true),
            Inner::Spm(s) => s.vocab_size(),
        }
    }
}

/// A SentencePiece tokenizer from `tokenizer.ggml.{tokens,scores,token_type}`.
fn spm(content: &Content) -> Result<Spm, EvalError> {
    let tokens = strings(content, "tokenizer.ggml.tokens")?;
    let scores = array(content, "tokenizer.ggml.scores", Value::to_f32)?;
    let types = array(content, "tokenizer.ggml.token_type", Value::to_i32)?;
    Spm::new(tokens, scores, &types)
}

/// A byte-level BPE tokenizer from `tokenizer.ggml.{tokens,merges,pre}`.
fn bpe(content: &Content) -> Result<tokenizers::Tokenizer, EvalError> {
    let pre = match content.metadata.get("tokenizer.ggml.pre") {
        Some(v) => v.to_string().map_err(EvalError::Gguf)?.as_str(),
        None => "default",
    };
    if !PRE_TOKENIZERS.contains(&pre) {
        return Err(EvalError::UnsupportedModel {
            what: "tokenizer.ggml.pre (smollm, gpt2 or default)",
            value: pre.to_string(),
        });
    }
    let vocab: Vocab = strings(content, "tokenizer.ggml.tokens")?
        .into_iter()
        .enumerate()
        .map(|(id, t)| (t, id as u32))
        .collect();
    let merges = metadata(content, "tokenizer.ggml.merges")?
        .to_vec()
        .map_err(EvalError::Gguf)?
        .iter()
        .map(|m| {
            let m = m.to_string().map_err(EvalError::Gguf)?;
            match m.split_once(' ') {
                Some((a, b)) => Ok((a.to_string(), b.to_string())),
                None => Err(EvalError::UnsupportedModel {
                    what: "tokenizer.ggml.merges entry (two tokens separated by a space)",
                    value: m.clone(),
                }),
            }
        })
        .collect::<Result<Vec<_>, _>>()?;
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(EvalError::Tokenizer)?;
    let mut inner = tokenizers::Tokenizer::new(bpe);
    let byte_level = ByteLevel::new(false, true, true);
    let pre_tokenizer = if pre == "smollm" {
        Sequence::new(vec![Digits::new(true).into(), byte_level.into()])
    } else {
        Sequence::new(vec![byte_level.into()])
    };
    inner
        .with_pre_tokenizer(Some(pre_tokenizer))
        .with_decoder(Some(ByteLevelDecoder::default()));
    Ok(inner)
}
