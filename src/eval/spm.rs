//! SentencePiece-style tokenization (GGUF `tokenizer.ggml.model = llama`), as llama.cpp's SPM
//! tokenizer does it, for Gemma's vocabulary:
//!
//! 1. user-defined tokens (type 4: Gemma's newline and space runs, HTML tags) are cut out of the
//!    text first, longest token first, and become their own ids;
//! 2. in what remains, spaces become `▁` and every character starts as one symbol; the adjacent
//!    pair whose concatenation is the vocabulary entry of highest score merges first (the
//!    leftmost on ties), until no pair is an entry;
//! 3. a symbol that is not an entry is spelled in byte tokens `<0xXX>` (byte fallback).

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

use super::EvalError;

/// GGUF token types (llama.cpp's `llama_token_type`).
const TOKEN_USER_DEFINED: i32 = 4;
const TOKEN_BYTE: i32 = 6;

/// The word-boundary marker SentencePiece writes for a space.
const SPACE: &str = "\u{2581}";

/// A SentencePiece vocabulary.
pub struct Spm {
    tokens: Vec<String>,
    scores: Vec<f32>,
    ids: HashMap<String, u32>,
    /// `<0xXX>` token of every byte, indexed by the byte.
    bytes: Vec<u32>,
    /// The byte of every `<0xXX>` token, by id.
    byte_of: HashMap<u32, u8>,
    /// User-defined tokens, longest text first.
    user_defined: Vec<(String, u32)>,
}

/// A candidate merge of the symbols at `left` and its right neighbour.
struct Bigram {
    score: f32,
    left: usize,
    /// The merged text's length in bytes when queued: a symbol that has grown since is stale.
    len: usize,
}

impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Bigram {}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Bigram {
    /// Higher score first, then the leftmost (a max-heap pops the greatest).
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}

/// One symbol of the text being merged: a byte range, linked to its live neighbours.
#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

impl Spm {
    /// The vocabulary of `tokens` with their `scores` and GGUF token `types`.
    pub fn new(tokens: Vec<String>, scores: Vec<f32>, types: &[i32]) -> Result<Spm, EvalError> {
        if scores.len() != tokens.len() || types.len() != tokens.len() {
            return Err(EvalError::UnsupportedModel {
                what: "tokenizer.ggml.scores and token_type (one per token)",
                value: format!(
                    "{} tokens, {} scores, {} types",
                    tokens.len(),
                    scores.len(),
                    types.len()
                ),
            });
        }
        let ids: HashMap<String, u32> = tokens
            .iter()
            .enumerate()
            .map(|(id, t)| (t.clone(), id as u32))
            .collect();
        let bytes = (0..=u8::MAX)
            .map(|b| {
                let name = format!("<0x{b:02X}>");
                match ids.get(&name) {
                    Some(&id) if types[id as usize] == TOKEN_BYTE => Ok(id),
                    _ => Err(EvalError::UnsupportedModel {
                        what: "SentencePiece vocabulary without byte fallback token",
                        value: name,
                    }),
                }
            })
            .collect::<Result<Vec<u32>, _>>()?;
        let byte_of = (0..=u8::MAX).zip(&bytes).map(|(b, &id)| (id, b)).collect();
        let mut user_defined: Vec<(String, u32)> = types
            .iter()
            .enumerate()
            .filter(|&(_, &t)| t == TOKEN_USER_DEFINED)
            .map(|(id, _)| (tokens[id].clone(), id as u32))
            .filter(|(text, _)| !text.is_empty())
            .collect();
        user_defined.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        Ok(Spm {
            tokens,
            scores,
            ids,
            bytes,
            byte_of,
            user_defined,
        })
    }

    /// Token ids of `text`.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        // Fragments of the text: `Ok(id)` a user-defined token, `Err(raw)` text still to merge.
        let mut fragments: Vec<Result<u32, &str>> = vec![Err(text)];
        for (token, id) in &self.user_defined {
            fragments = fragments
                .into_iter()
                .flat_map(|f| match f {
                    Err(raw) if raw.contains(token.as_str()) => {
                        let mut parts = Vec::new();
                        for (i, piece) in raw.split(token.as_str()).enumerate() {
                            if i > 0 {
                                parts.push(Ok(*id));
                            }
                            if !piece.is_empty() {
                                parts.push(Err(piece));
                            }
                        }
                        parts
                    }
                    other => vec![other],
                })
                .collect();
        }
        let mut ids = Vec::new();
        for f in fragments {
            match f {
                Ok(id) => ids.push(id),
                Err(raw) => self.merge(&raw.replace(' ', SPACE), &mut ids),
            }
        }
        ids
    }

    /// Merges `text` (spaces already `▁`) into tokens, appending their ids to `ids`.
    fn merge(&self, text: &str, ids: &mut Vec<u32>) {
        let chars: Vec<(usize, char)> = text.char_indices().collect();
        let mut symbols: Vec<Symbol> = chars
            .iter()
            .enumerate()
            .map(|(i, &(start, c))| Symbol {
                start,
                len: c.len_utf8(),
                prev: i.checked_sub(1),
                next: (i + 1 < chars.len()).then_some(i + 1),
            })
            .collect();
        let mut queue = BinaryHeap::new();
        let bigram = |symbols: &[Symbol], left: usize| -> Option<Bigram> {
            let right = symbols[left].next?;
            let (a, b) = (symbols[left], symbols[right]);
            let len = a.len + b.len;
            let id = *self.ids.get(&text[a.start..a.start + len])?;
            Some(Bigram {
                score: self.scores[id as usize],
                left,
                len,
            })
        };
        for left in 0..symbols.len() {
            queue.extend(bigram(&symbols, left));
        }
        while let Some(b) = queue.pop() {
            let left = b.left;
            let Some(right) = symbols[left].next else {
                continue;
            };
            // Stale: either side merged with something else since it was queued.
            if symbols[left].len == 0 || symbols[left].len + symbols[right].len != b.len {
                continue;
            }
            symbols[left].len = b.len;
            symbols[left].next = symbols[right].next;
            symbols[right].len = 0;
            if let Some(n) = symbols[right].next {
                symbols[n].prev = Some(left);
            }
            if let Some(p) = symbols[left].prev {
                queue.extend(bigram(&symbols, p));
            }
            queue.extend(bigram(&symbols, left));
        }
        let mut at = (!symbols.is_empty()).then_some(0);
        while let Some(i) = at {
            let s = symbols[i];
            let piece = &text[s.start..s.start + s.len];
            match self.ids.get(piece) {
                Some(&id) => ids.push(id),
                None => ids.extend(piece.bytes().map(|b| self.bytes[usize::from(b)])),
            }
            at = s.next;
        }
    }

    /// The text of `ids`: `▁` back to spaces, byte tokens joined into UTF-8 (invalid sequences
    /// replaced).
    pub fn decode(&self, ids: &[u32]) -> Result<String, EvalError> {
        let mut bytes = Vec::new();
        for &id in ids {
            let token = self
                .tokens
                .get(id as usize)
                .ok_or(EvalError::TokenOutOfVocab {
                    token: id as usize,
                    vocab: self.tokens.len(),
                })?;
            match self.byte_of.get(&id) {
                Some(&b) => bytes.push(b),
                None => bytes.extend_from_slice(token.replace(SPACE, " ").as_bytes()),
            }
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A toy vocabulary: the bytes, `a`, `b`, `▁`, merges `ab` (score −1), `▁a` (−2), `▁ab`
    /// (−3), and the user-defined `\n\n`.
    fn toy() -> Spm {
        let mut tokens: Vec<String> = (0..256).map(|b| format!("<0x{b:02X}>")).collect();
        let mut types = vec![TOKEN_BYTE; 256];
        let mut scores = vec![0.0; 256];
        for (t, s, ty) in [
            ("a", -10.0, 1),
            ("b", -11.0, 1),
            (SPACE, -12.0, 1),
            ("ab", -1.0, 1),
            ("\u{2581}a", -2.0, 1),
            ("\u{2581}ab", -3.0, 1),
            ("\n\n", -1000.0, TOKEN_USER_DEFINED),
        ] {
            tokens.push(t.to_string());
            scores.push(s);
            types.push(ty);
        }
        Spm::new(tokens, scores, &types).unwrap()
    }

    #[test]
    fn merges_by_score_and_falls_back_to_bytes() {
        let spm = toy();
        let id = |t: &str| spm.ids[t];
        // `ab` (−1) merges before `▁a` (−2); then `▁` + `ab` is `▁ab`.
        assert_eq!(spm.encode(" ab"), vec![id("\u{2581}ab")]);
        // `c` is no token: its byte.
        assert_eq!(spm.encode("ac"), vec![id("a"), u32::from(b'c')]);
        // A two-byte character without a token: both bytes, and it decodes back.
        let ids = spm.encode("é");
        assert_eq!(ids, vec![0xC3, 0xA9]);
        assert_eq!(spm.decode(&ids).unwrap(), "é");
    }

    #[test]
    fn user_defined_tokens_are_cut_out_first() {
        let spm = toy();
        let id = |t: &str| spm.ids[t];
        let ids = spm.encode("ab\n\n ab");
        assert_eq!(ids, vec![id("ab"), id("\n\n"), id("\u{2581}ab")]);
        assert_eq!(spm.decode(&ids).unwrap(), "ab\n\n ab");
        // A lone newline is not the user-defined pair: its byte.
        assert_eq!(spm.encode("\n"), vec![u32::from(b'\n')]);
    }

    #[test]
    fn a_vocabulary_without_byte_tokens_is_refused() {
        let err = Spm::new(vec!["a".into()], vec![0.0], &[1]).err().unwrap();
        assert!(matches!(err, EvalError::UnsupportedModel { .. }), "{err}");
    }
}
