//! Numbers in what the user typed: digits (`42`, `-7`, `3.5`, `1,000`) and English number words
//! (`one`, `twenty one`, `twenty-one`, `a hundred`, `one hundred and five`, `two thousand`,
//! `minus three`, `three point five`), found anywhere in a short message.

use std::marker::PhantomData;

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::{PromptOptions, Recognizer};
use crate::activity::Activity;

/// A number as recognized: whole numbers stay exact.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RecognizedNumber {
    /// A whole number.
    Integer(i64),
    /// A number with a fractional part (or one too large for `i64`); always finite.
    Decimal(f64),
}

/// The first number in `text`, in digits or English words.
pub fn recognize_number(text: &str) -> Option<RecognizedNumber> {
    let tokens = tokenize(text);
    (0..tokens.len()).find_map(|i| number_at(&tokens, i))
}

/// A type a number prompt can end with.
pub trait PromptNumber: Serialize + DeserializeOwned + Copy + Send + Sync + 'static {
    /// `n` as this type; `None` when it does not fit (a fraction for an integer type, say).
    fn from_recognized(n: RecognizedNumber) -> Option<Self>;
}

impl PromptNumber for f64 {
    fn from_recognized(n: RecognizedNumber) -> Option<Self> {
        Some(match n {
            RecognizedNumber::Integer(i) => i as f64,
            RecognizedNumber::Decimal(d) => d,
        })
    }
}

impl PromptNumber for i64 {
    fn from_recognized(n: RecognizedNumber) -> Option<Self> {
        match n {
            RecognizedNumber::Integer(i) => Some(i),
            // Only fractions are refused; a whole decimal outside i64's range is too.
            RecognizedNumber::Decimal(d)
                if d.fract() == 0.0 && d >= i64::MIN as f64 && d < i64::MAX as f64 =>
            {
                Some(d as i64)
            }
            RecognizedNumber::Decimal(_) => None,
        }
    }
}

macro_rules! narrow_integer {
    ($($t:ty),*) => {$(
        impl PromptNumber for $t {
            fn from_recognized(n: RecognizedNumber) -> Option<Self> {
                i64::from_recognized(n).and_then(|i| <$t>::try_from(i).ok())
            }
        }
    )*};
}
narrow_integer!(i32, u32, u64);

/// Recognizes a number of type `T` in a message's text.
pub struct NumberRecognizer<T>(PhantomData<fn() -> T>);

impl<T> Default for NumberRecognizer<T> {
    fn default() -> Self {
        Self(PhantomData)
    }
}

impl<T> std::fmt::Debug for NumberRecognizer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NumberRecognizer")
    }
}

impl<T: PromptNumber> Recognizer for NumberRecognizer<T> {
    type Value = T;

    fn recognize(&self, activity: &Activity, _options: &PromptOptions) -> Option<T> {
        recognize_number(activity.text.as_deref()?).and_then(T::from_recognized)
    }
}

#[derive(Debug, Clone, PartialEq)]
enum Token {
    Literal(RecognizedNumber),
    Word(String),
}

fn tokenize(text: &str) -> Vec<Token> {
    let mut tokens = Vec::new();
    for raw in text.split_whitespace() {
        if let Some(n) = literal(raw) {
            tokens.push(Token::Literal(n));
            continue;
        }
        for word in raw.split(['-', '–']) {
            let word = word
                .trim_matches(|c: char| !c.is_alphanumeric())
                .to_lowercase();
            if !word.is_empty() {
                tokens.push(Token::Word(word));
            }
        }
    }
    tokens
}

/// `42`, `-7`, `+3`, `3.5`, `.5`, `1,000`, `1,234.5`, with surrounding punctuation (`42.`,
/// `(3)`) ignored.
fn literal(raw: &str) -> Option<RecognizedNumber> {
    let t = raw
        .trim_start_matches(['(', '"', '\'', '“', '‘'])
        .trim_end_matches([')', '"', '\'', '”', '’', '.', ',', '!', '?', ';', ':']);
    let (negative, t) = match t.chars().next()? {
        '-' | '−' => (true, &t[t.chars().next()?.len_utf8()..]),
        '+' => (false, &t[1..]),
        _ => (false, t),
    };
    let (whole, fraction) = match t.split_once('.') {
        Some((w, f)) => (w, Some(f)),
        None => (t, None),
    };
    let digits: String = if whole.contains(',') {
        let mut groups = whole.split(',');
        let first = groups.next()?;
        if first.is_empty() || first.len() > 3 || !first.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        let mut digits = first.to_owned();
        for group in groups {
            if group.len() != 3 || !group.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            digits.push_str(group);
        }
        digits
    } else {
        if !whole.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        whole.to_owned()
    };
    let sign = if negative { "-" } else { "" };
    match fraction {
        None if digits.is_empty() => None,
        None => match format!("{sign}{digits}").parse::<i64>() {
            Ok(i) => Some(RecognizedNumber::Integer(i)),
            Err(_) => decimal(&format!("{sign}{digits}")),
        },
        Some(f) if f.is_empty() || !f.bytes().all(|b| b.is_ascii_digit()) => None,
        Some(f) => {
            let whole = if digits.is_empty() { "0" } else { &digits };
            decimal(&format!("{sign}{whole}.{f}"))
        }
    }
}

fn decimal(text: &str) -> Option<RecognizedNumber> {
    text.parse::<f64>()
        .ok()
        .filter(|d| d.is_finite())
        .map(RecognizedNumber::Decimal)
}

fn word(tokens: &[Token], i: usize) -> Option<&str> {
    match tokens.get(i) {
        Some(Token::Word(w)) => Some(w),
        _ => None,
    }
}

const UNITS: [&str; 20] = [
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
];
const TENS: [&str; 8] = [
    "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety",
];
const SCALES: [(&str, i64); 4] = [
    ("thousand", 1_000),
    ("million", 1_000_000),
    ("billion", 1_000_000_000),
    ("trillion", 1_000_000_000_000),
];

fn unit(w: Option<&str>) -> Option<i64> {
    let w = w?;
    UNITS.iter().position(|u| *u == w).map(|p| p as i64)
}

fn tens(w: Option<&str>) -> Option<i64> {
    let w = w?;
    TENS.iter()
        .position(|t| *t == w)
        .map(|p| (p as i64 + 2) * 10)
}

fn scale(w: Option<&str>) -> Option<i64> {
    let w = w?;
    SCALES.iter().find(|(s, _)| *s == w).map(|(_, v)| *v)
}

/// The number that starts at token `i`, if one does.
fn number_at(tokens: &[Token], i: usize) -> Option<RecognizedNumber> {
    match tokens.get(i)? {
        Token::Literal(n) => Some(*n),
        Token::Word(w) if w == "minus" || w == "negative" => match number_at(tokens, i + 1)? {
            RecognizedNumber::Integer(n) => Some(RecognizedNumber::Integer(n.checked_neg()?)),
            RecognizedNumber::Decimal(d) => Some(RecognizedNumber::Decimal(-d)),
        },
        Token::Word(_) => {
            let (whole, next) = words_number(tokens, i)?;
            // "three point one four"
            if word(tokens, next) == Some("point") {
                let digits: String = (next + 1..)
                    .map_while(|j| unit(word(tokens, j)).filter(|d| *d < 10))
                    .map(|d| char::from(b'0' + d as u8))
                    .collect();
                if !digits.is_empty() {
                    return decimal(&format!("{whole}.{digits}"));
                }
            }
            Some(RecognizedNumber::Integer(whole))
        }
    }
}

/// Number words from token `i`: the value and the index after them.
fn words_number(tokens: &[Token], i: usize) -> Option<(i64, usize)> {
    let mut total: i64 = 0;
    let mut j = i;
    let mut last_scale = i64::MAX;
    let mut found = false;
    loop {
        let (group, k) = match below_thousand(tokens, j) {
            Some(g) => g,
            // "a thousand"
            None if matches!(word(tokens, j), Some("a" | "an"))
                && scale(word(tokens, j + 1)).is_some() =>
            {
                (1, j + 1)
            }
            None => break,
        };
        match scale(word(tokens, k)) {
            Some(s) if s < last_scale => {
                total = total.checked_add(group.checked_mul(s)?)?;
                last_scale = s;
                found = true;
                j = k + 1;
                // "one thousand and five"
                if word(tokens, j) == Some("and") && below_thousand(tokens, j + 1).is_some() {
                    j += 1;
                }
            }
            _ => {
                total = total.checked_add(group)?;
                found = true;
                j = k;
                break;
            }
        }
    }
    found.then_some((total, j))
}

/// `[unit|a] hundred [and] [below hundred]` or `below hundred`.
fn below_thousand(tokens: &[Token], i: usize) -> Option<(i64, usize)> {
    let hundreds = match word(tokens, i) {
        Some("a" | "an") => Some(1),
        w => unit(w).filter(|u| (1..10).contains(u)),
    };
    if let Some(h) = hundreds.filter(|_| word(tokens, i + 1) == Some("hundred")) {
        let mut j = i + 2;
        if word(tokens, j) == Some("and") && below_hundred(tokens, j + 1).is_some() {
            j += 1;
        }
        return Some(match below_hundred(tokens, j) {
            Some((rest, k)) => (h * 100 + rest, k),
            None => (h * 100, j),
        });
    }
    below_hundred(tokens, i)
}

/// `zero`…`nineteen`, or `twenty`…`ninety` optionally followed by `one`…`nine`.
fn below_hundred(tokens: &[Token], i: usize) -> Option<(i64, usize)> {
    if let Some(u) = unit(word(tokens, i)) {
        return Some((u, i + 1));
    }
    let t = tens(word(tokens, i))?;
    match unit(word(tokens, i + 1)).filter(|u| (1..10).contains(u)) {
        Some(u) => Some((t + u, i + 2)),
        None => Some((t, i + 1)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use RecognizedNumber::{Decimal, Integer};

    #[test]
    fn digits_with_signs_decimals_and_separators() {
        for (text, expected) in [
            ("42", Integer(42)),
            ("64", Integer(64)),
            ("-7", Integer(-7)),
            ("+3", Integer(3)),
            ("3.5", Decimal(3.5)),
            ("-0.25", Decimal(-0.25)),
            (".5", Decimal(0.5)),
            ("1,000", Integer(1000)),
            ("1,234.5", Decimal(1234.5)),
            ("150", Integer(150)),
            ("42.", Integer(42)),
            ("I'd say 12, maybe", Integer(12)),
            ("(3)", Integer(3)),
        ] {
            assert_eq!(recognize_number(text), Some(expected), "{text}");
        }
    }

    #[test]
    fn english_number_words() {
        for (text, expected) in [
            ("One", 1),
            ("zero", 0),
            ("twelve", 12),
            ("twenty one", 21),
            ("twenty-one", 21),
            ("ninety nine", 99),
            ("a hundred", 100),
            ("one hundred", 100),
            ("one hundred and five", 105),
            ("three hundred forty-two", 342),
            ("a thousand", 1000),
            ("two thousand and twelve", 2012),
            ("one thousand two hundred and thirty four", 1234),
            ("seven million three thousand", 7_003_000),
            ("minus seven", -7),
            ("negative twenty", -20),
            ("I have twenty one apples", 21),
        ] {
            assert_eq!(recognize_number(text), Some(Integer(expected)), "{text}");
        }
        assert_eq!(recognize_number("three point five"), Some(Decimal(3.5)));
    }

    #[test]
    fn no_number_where_there_is_none() {
        for text in [
            "",
            "hello",
            "hello again",
            "apple",
            "a cat",
            "1.2.3",
            "12abc",
            "1,00",
            "-",
        ] {
            assert_eq!(recognize_number(text), None, "{text:?}");
        }
    }

    #[test]
    fn huge_numbers_are_finite_or_nothing() {
        assert_eq!(
            recognize_number("99999999999999999999"),
            Some(Decimal(1e20))
        );
        assert_eq!(recognize_number(&"9".repeat(400)), None);
    }

    #[test]
    fn typed_results() {
        assert_eq!(i64::from_recognized(Decimal(3.5)), None);
        assert_eq!(i64::from_recognized(Decimal(4.0)), Some(4));
        assert_eq!(i32::from_recognized(Integer(1 << 40)), None);
        assert_eq!(u32::from_recognized(Integer(-1)), None);
        assert_eq!(f64::from_recognized(Integer(64)), Some(64.0));
    }
}
