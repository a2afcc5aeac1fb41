//! The model's tokenizer, built from the GGUF's own vocabulary and merges.
//!
//! GGUF `gpt2` tokenizers are byte-level BPE. SmolLM2's (`tokenizer.ggml.pre = smollm`) splits
//! every digit on its own before the GPT-2 pre-tokenizer regex, as llama.cpp's `smollm`
//! pre-tokenizer and the model's Hugging Face `tokenizer.json` do (`Digits(individual)` then
//! `ByteLevel`); the `tokenizers` crate does the BPE itself.

use std::collections::HashMap;

use candle_core::quantized::gguf_file::Content;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;

use super::{EvalError, metadata};

/// Pre-tokenizers this module reproduces, by their `tokenizer.ggml.pre` name.
const PRE_TOKENIZERS: [&str; 3] = ["smollm", "gpt2", "default"];

/// Text to token ids and back.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
}

impl Tokenizer {
    /// Builds the tokenizer a GGUF file describes (`tokenizer.ggml.*`).
    pub fn from_gguf(content: &Content) -> Result<Tokenizer, EvalError> {
        let model = metadata(content, "tokenizer.ggml.model")?
            .to_string()
            .map_err(EvalError::Gguf)?;
        if model != "gpt2" {
            return Err(EvalError::UnsupportedModel {
                what: "tokenizer.ggml.model (byte-level BPE `gpt2` only)",
                value: model.clone(),
            });
        }
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
        let tokens = metadata(content, "tokenizer.ggml.tokens")?
            .to_vec()
            .map_err(EvalError::Gguf)?;
        let vocab: Vocab = tokens
            .iter()
            .enumerate()
            .map(|(id, t)| Ok((t.to_string()?.clone(), id as u32)))
            .collect::<candle_core::Result<HashMap<_, _>>>()
            .map_err(EvalError::Gguf)?
            .into_iter()
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
        Ok(Tokenizer { inner })
    }

    /// Token ids of `text`, without a beginning-of-sequence token (SmolLM2's GGUF sets
    /// `add_bos_token = false`).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, EvalError> {
        Ok(self
            .inner
            .encode(text, false)
            .map_err(EvalError::Tokenizer)?
            .get_ids()
            .to_vec())
    }

    /// The text of token ids.
    pub fn decode(&self, ids: &[u32]) -> Result<String, EvalError> {
        self.inner.decode(ids, false).map_err(EvalError::Tokenizer)
    }

    /// Vocabulary size.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}
