//! Byte checks of the strings every turn handles: ids a word (8 bytes) at a time, JSON strings
//! a vector block at a time.
//!
//! Why: every turn checks its ids for control characters and escapes them into four state keys,
//! and a byte-at-a-time search showed in every turn's profile (`bench/RESULTS.md`). Ids
//! are a few dozen bytes, too short for vector compares; a word at a time, with the classic
//! zero-byte tests, they take a few instructions per 8 bytes. JSON strings (the state, the
//! receipt's replies) are written by hand rather than by serde_json, which looks at every byte
//! on its own to find the few it must escape; [`needs_escape`] finds out first whether there
//! are any.

const ONES: u64 = u64::from_ne_bytes([0x01; 8]);
const HIGHS: u64 = u64::from_ne_bytes([0x80; 8]);

/// A word with every byte `b`.
pub(crate) const fn splat(b: u8) -> u64 {
    u64::from_ne_bytes([b; 8])
}

/// Nonzero exactly when some byte of `word` is below `n`, for `n` up to 0x80.
pub(crate) const fn byte_below(word: u64, n: u8) -> u64 {
    word.wrapping_sub(splat(n)) & !word & HIGHS
}

/// Nonzero exactly when some byte of `word` is `b`.
pub(crate) const fn byte_is(word: u64, b: u8) -> u64 {
    let x = word ^ splat(b);
    x.wrapping_sub(ONES) & !x & HIGHS
}

/// Whether `test` is nonzero for some word of `bytes`. The last, partial word is filled up with
/// `pad`, a byte `test` must not find.
pub(crate) fn any_word(bytes: &[u8], pad: u8, test: impl Fn(u64) -> u64) -> bool {
    let mut found = 0;
    let mut rest = bytes;
    while let Some((word, tail)) = rest.split_first_chunk::<8>() {
        found |= test(u64::from_ne_bytes(*word));
        rest = tail;
    }
    if !rest.is_empty() {
        let mut last = [pad; 8];
        last[..rest.len()].copy_from_slice(rest);
        found |= test(u64::from_ne_bytes(last));
    }
    found != 0
}

/// Whether JSON must escape any byte of `bytes`: a control character, `"` or `\` (what
/// serde_json escapes; it leaves DEL and every non-ASCII byte as they are). A string shorter
/// than a block (a member name, an id, a reply's text), and the tail of a longer one, is checked
/// a word at a time; each whole 64-byte block of a longer one (a turn's padded state) is scanned
/// without an early exit, which the compiler turns into 16-byte vector compares. Whole blocks
/// (`chunks_exact`), not `chunks`: the compiler cannot unroll a block of unknown length, and the
/// scan of a 1 KB string took a third longer (`bench/RESULTS.md`).
pub(crate) fn needs_escape(bytes: &[u8]) -> bool {
    // As in the blocks below, `b ^ 2 < 0x21` finds the control characters and `"` at once.
    let words = |bytes: &[u8]| {
        any_word(bytes, b'a', |w| {
            byte_below(w ^ splat(2), 0x21) | byte_is(w, b'\\')
        })
    };
    let mut blocks = bytes.chunks_exact(64);
    for block in &mut blocks {
        // `b ^ 2 <= 0x20` holds for the control characters (which `^ 2` maps among themselves)
        // and for `"` (0x22, mapped to 0x20) alone: one compare for both, a tenth fewer
        // instructions per block than two.
        let found = block
            .iter()
            .fold(false, |found, &b| found | (b ^ 2 <= 0x20) | (b == b'\\'));
        if found {
            return true;
        }
    }
    words(blocks.remainder())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_word_tests_agree_with_the_bytes_at_every_position() {
        for b in 0..=u8::MAX {
            for at in 0..8 {
                for fill in [0x00, 0x20, 0x7f, 0x80, 0xff] {
                    let mut word = [fill; 8];
                    word[at] = b;
                    let w = u64::from_ne_bytes(word);
                    for n in [0x01, 0x20, 0x80] {
                        assert_eq!(
                            byte_below(w, n) != 0,
                            word.iter().any(|&x| x < n),
                            "{word:?} below {n:#x}"
                        );
                    }
                    for probe in [0x00, 0x25, 0x2f, 0x7f, 0xc2, 0xff] {
                        assert_eq!(
                            byte_is(w, probe) != 0,
                            word.contains(&probe),
                            "{word:?} holding {probe:#x}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn every_byte_json_escapes_is_found_at_every_position_of_short_and_long_strings() {
        for special in (0u8..0x20).chain([b'"', b'\\']) {
            for len in (1..80).chain([127, 128, 129]) {
                for at in 0..len {
                    let mut bytes = vec![b'x'; len];
                    bytes[at] = special;
                    assert!(needs_escape(&bytes), "{special:#x} at {at} of {len}");
                }
            }
        }
        for clean in [0x20u8, 0x21, 0x23, 0x5b, 0x5d, 0x7f, 0x80, 0xc2, 0xff] {
            for len in [0, 1, 7, 8, 9, 63, 64, 65, 200] {
                assert!(!needs_escape(&vec![clean; len]), "{clean:#x} × {len}");
            }
        }
    }

    #[test]
    fn any_word_looks_at_every_byte_and_not_past_the_end() {
        for len in 0..40 {
            let clean = vec![b'x'; len];
            assert!(!any_word(&clean, b'x', |w| byte_is(w, b'%')));
            for at in 0..len {
                let mut bytes = clean.clone();
                bytes[at] = b'%';
                assert!(
                    any_word(&bytes, b'x', |w| byte_is(w, b'%')),
                    "{at} of {len}"
                );
            }
        }
    }
}
