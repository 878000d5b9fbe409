//! A fake, deterministic tokenizer.
//!
//! - A token is a maximal run of non-whitespace characters ("word"); whitespace is dropped.
//! - Every id in `3..VOCAB_SIZE` has a canonical word built from consonant-vowel syllables
//!   (`ba`, `be`, ... `zu`), so text the simulator generates encodes back to the same ids.
//!   That keeps multi-turn prompts ("previous prompt + previous output") prefix-cacheable.
//! - Any other word maps to `3 + fnv1a(word) % (VOCAB_SIZE - 3)`.
//! - Ids 0, 1, 2 are the special tokens `<unk>`, `<s>` (BOS) and `</s>` (EOS).
//! - Decoding renders every token as a space followed by its word, so decoded output can be
//!   appended to a prompt without gluing words together.

/// Size of the fake vocabulary.
pub const VOCAB_SIZE: u32 = 32000;
/// Unknown token (never generated).
pub const UNK_ID: u32 = 0;
/// Beginning-of-sequence token (used as the prompt of an empty text).
pub const BOS_ID: u32 = 1;
/// End-of-sequence token: the generator emits it to stop early.
pub const EOS_ID: u32 = 2;
/// First id that is an ordinary word.
pub const FIRST_WORD_ID: u32 = 3;

const CONSONANTS: &[u8; 16] = b"bdfghjklmnprstvz";
const VOWELS: &[u8; 5] = b"aeiou";
const SYLLABLES: u32 = 16 * 5;

/// 64-bit FNV-1a over bytes: tiny, stable across platforms and Rust versions.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

fn syllable_index(c: u8, v: u8) -> Option<u32> {
    let ci = CONSONANTS.iter().position(|x| *x == c)?;
    let vi = VOWELS.iter().position(|x| *x == v)?;
    u32::try_from(ci * 5 + vi).ok()
}

/// Parses a canonical word back to its id, if `word` is one.
fn parse_canonical(word: &str) -> Option<u32> {
    let b = word.as_bytes();
    if b.is_empty() || b.len() % 2 == 1 || b.len() > 6 {
        return None;
    }
    let mut value: u32 = 0;
    for (i, pair) in b.chunks_exact(2).enumerate() {
        let digit = syllable_index(pair[0], pair[1])?;
        if i == 0 && digit == 0 && b.len() > 2 {
            return None; // leading zero: not canonical
        }
        value = value * SYLLABLES + digit;
    }
    (FIRST_WORD_ID..VOCAB_SIZE).contains(&value).then_some(value)
}

/// Id of one word.
pub fn word_id(word: &str) -> u32 {
    match word {
        "<unk>" => UNK_ID,
        "<s>" => BOS_ID,
        "</s>" => EOS_ID,
        _ => parse_canonical(word).unwrap_or_else(|| {
            let span = u64::from(VOCAB_SIZE - FIRST_WORD_ID);
            // The remainder is < span, which fits in u32.
            FIRST_WORD_ID + u32::try_from(fnv1a(word.as_bytes()) % span).unwrap_or(0)
        }),
    }
}

/// Encodes text into token ids. Empty (or all-whitespace) text encodes to `[BOS_ID]`, so every
/// prompt has at least one token.
pub fn encode(text: &str) -> Vec<u32> {
    let ids: Vec<u32> = text.split_whitespace().map(word_id).collect();
    if ids.is_empty() {
        vec![BOS_ID]
    } else {
        ids
    }
}

/// Appends the text of one token (a space then its word) to `out`.
pub fn push_token_text(out: &mut String, id: u32, skip_special_tokens: bool) {
    match id {
        UNK_ID | BOS_ID | EOS_ID if skip_special_tokens => {}
        UNK_ID => out.push_str(" <unk>"),
        BOS_ID => out.push_str(" <s>"),
        EOS_ID => out.push_str(" </s>"),
        _ => {
            out.push(' ');
            push_word(out, id);
        }
    }
}

fn push_word(out: &mut String, id: u32) {
    // Out-of-vocabulary ids (possible with client-supplied input_ids) get a readable stand-in.
    if id >= VOCAB_SIZE {
        out.push_str(&format!("<oov{id}>"));
        return;
    }
    let mut digits = [0u32; 3];
    let mut n = 0;
    let mut v = id;
    loop {
        digits[n] = v % SYLLABLES;
        n += 1;
        v /= SYLLABLES;
        if v == 0 || n == digits.len() {
            break;
        }
    }
    for d in digits[..n].iter().rev() {
        let (c, vw) = ((d / 5) as usize, (d % 5) as usize);
        out.push(char::from(CONSONANTS[c]));
        out.push(char::from(VOWELS[vw]));
    }
}

/// Text of one token without the leading space (used in logprob entries).
pub fn token_text(id: u32) -> String {
    let mut s = String::new();
    push_token_text(&mut s, id, false);
    s.trim_start().to_string()
}

/// Decodes ids to text.
pub fn decode(ids: &[u32], skip_special_tokens: bool) -> String {
    let mut out = String::with_capacity(ids.len() * 5);
    for id in ids {
        push_token_text(&mut out, *id, skip_special_tokens);
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn encode_is_deterministic() {
        let a = encode("The capital of France is");
        let b = encode("The   capital of\nFrance is");
        assert_eq!(a, b);
        assert_eq!(a.len(), 5);
        assert!(a.iter().all(|id| (FIRST_WORD_ID..VOCAB_SIZE).contains(id)));
    }

    #[test]
    fn empty_text_is_bos() {
        assert_eq!(encode(""), vec![BOS_ID]);
        assert_eq!(encode("  \n"), vec![BOS_ID]);
    }

    #[test]
    fn every_word_id_round_trips() {
        for id in FIRST_WORD_ID..VOCAB_SIZE {
            let text = decode(&[id], true);
            assert_eq!(encode(&text), vec![id], "id {id} text {text:?}");
        }
    }

    #[test]
    fn special_tokens() {
        assert_eq!(decode(&[EOS_ID], true), "");
        assert_eq!(decode(&[EOS_ID], false), " </s>");
        assert_eq!(encode("</s>"), vec![EOS_ID]);
        assert_eq!(token_text(EOS_ID), "</s>");
    }

    #[test]
    fn decoded_output_appends_to_prompt() {
        let prompt = encode("hello world");
        let out = vec![100, 2000, 31999];
        let joined = format!("hello world{}", decode(&out, true));
        let mut expected = prompt.clone();
        expected.extend_from_slice(&out);
        assert_eq!(encode(&joined), expected);
    }

    #[test]
    fn out_of_vocab_ids_decode() {
        assert_eq!(token_text(40000), "<oov40000>");
    }
}
