//! Choices: how a list of choices is shown inline, and which one the user picked — by its value
//! or a synonym (case-insensitive, alone or within a sentence), or by its position (`2`, `two`,
//! `the second`, `last`).

use serde::{Deserialize, Serialize};

use super::number::{RecognizedNumber, recognize_number};
use super::{ListStyle, PromptOptions, Recognizer, words};
use crate::activity::Activity;

/// One choice of a choice prompt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Choice {
    /// What is shown and returned.
    pub value: String,
    /// Other words that pick it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub synonyms: Vec<String>,
}

impl Choice {
    /// A choice `value` without synonyms.
    pub fn new(value: impl Into<String>) -> Self {
        Self {
            value: value.into(),
            synonyms: Vec::new(),
        }
    }

    /// With `synonyms`.
    #[must_use]
    pub fn synonyms(mut self, synonyms: impl IntoIterator<Item = impl Into<String>>) -> Self {
        self.synonyms = synonyms.into_iter().map(Into::into).collect();
        self
    }
}

impl From<&str> for Choice {
    fn from(value: &str) -> Self {
        Self::new(value)
    }
}

impl From<String> for Choice {
    fn from(value: String) -> Self {
        Self::new(value)
    }
}

/// The choice a user picked: a choice prompt's result.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FoundChoice {
    /// The choice's value.
    pub value: String,
    /// Its position in the list, from 0.
    pub index: usize,
    /// What the user said that picked it (the value, a synonym, or the position).
    pub synonym: String,
}

/// `text` followed by `choices` inline: `favorite color? (1) red, (2) green, or (3) blue`, and
/// `(1) Yes or (2) No` for two.
pub fn render_inline(text: &str, choices: &[Choice]) -> String {
    let mut list = String::new();
    for (i, choice) in choices.iter().enumerate() {
        let connector = match (i, choices.len()) {
            (0, _) => "",
            (_, 2) => " or ",
            (i, n) if i + 1 == n => ", or ",
            _ => ", ",
        };
        list.push_str(connector);
        list.push_str(&format!("({}) {}", i + 1, choice.value));
    }
    match (text.trim().is_empty(), list.is_empty()) {
        (_, true) => text.to_owned(),
        (true, false) => list,
        (false, false) => format!("{text} {list}"),
    }
}

const ORDINALS: [(&str, &str); 10] = [
    ("first", "1st"),
    ("second", "2nd"),
    ("third", "3rd"),
    ("fourth", "4th"),
    ("fifth", "5th"),
    ("sixth", "6th"),
    ("seventh", "7th"),
    ("eighth", "8th"),
    ("ninth", "9th"),
    ("tenth", "10th"),
];

/// The choice `text` picks, in this order: the whole text is a value or synonym; a value or
/// synonym appears in it as whole words (and only one choice's does); it names a position.
pub fn recognize_choice(text: &str, choices: &[Choice]) -> Option<FoundChoice> {
    let said = words(text);
    if said.is_empty() {
        return None;
    }
    let names = |choice: &Choice| {
        std::iter::once(choice.value.clone())
            .chain(choice.synonyms.iter().cloned())
            .collect::<Vec<_>>()
    };
    let found = |index: usize, synonym: String| FoundChoice {
        value: choices[index].value.clone(),
        index,
        synonym,
    };

    for (index, choice) in choices.iter().enumerate() {
        if let Some(name) = names(choice).into_iter().find(|n| words(n) == said) {
            return Some(found(index, name));
        }
    }

    let mut contained = choices.iter().enumerate().filter_map(|(index, choice)| {
        names(choice).into_iter().find_map(|name| {
            let name_words = words(&name);
            (!name_words.is_empty() && said.windows(name_words.len()).any(|w| w == name_words))
                .then_some((index, name))
        })
    });
    if let Some((index, name)) = contained.next() {
        if contained.next().is_none() {
            return Some(found(index, name));
        }
        return None;
    }

    let position = said
        .iter()
        .find_map(|w| {
            if w == "last" {
                return choices.len().checked_sub(1);
            }
            ORDINALS
                .iter()
                .position(|(word, short)| w == word || w == short)
        })
        .or_else(|| match recognize_number(text)? {
            RecognizedNumber::Integer(n) => usize::try_from(n).ok()?.checked_sub(1),
            RecognizedNumber::Decimal(_) => None,
        })?;
    (position < choices.len()).then(|| found(position, text.trim().to_owned()))
}

/// Recognizes the choice the user picked among the prompt options' choices, and shows them
/// inline after the prompt unless the style (the options' or this recognizer's) is
/// [`ListStyle::None`].
#[derive(Debug, Clone, Copy, Default)]
pub struct ChoiceRecognizer {
    /// The list style when the options name none.
    pub style: ListStyle,
}

impl Recognizer for ChoiceRecognizer {
    type Value = FoundChoice;

    fn recognize(&self, activity: &Activity, options: &PromptOptions) -> Option<FoundChoice> {
        recognize_choice(activity.text.as_deref()?, &options.choices)
    }

    fn render(&self, text: &str, options: &PromptOptions) -> String {
        match options.style.unwrap_or(self.style) {
            ListStyle::None => text.to_owned(),
            ListStyle::Inline => render_inline(text, &options.choices),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn colors() -> Vec<Choice> {
        vec![
            "red".into(),
            "green".into(),
            Choice::new("blue").synonyms(["azure"]),
        ]
    }

    fn pick(text: &str) -> Option<(String, usize)> {
        recognize_choice(text, &colors()).map(|f| (f.value, f.index))
    }

    #[test]
    fn renders_inline_like_bot_framework() {
        assert_eq!(
            render_inline("favorite color?", &colors()),
            "favorite color? (1) red, (2) green, or (3) blue"
        );
        assert_eq!(
            render_inline("Please confirm.", &["Yes".into(), "No".into()]),
            "Please confirm. (1) Yes or (2) No"
        );
        assert_eq!(render_inline("Pick", &["only".into()]), "Pick (1) only");
        assert_eq!(
            render_inline("", &["a".into(), "b".into()]),
            "(1) a or (2) b"
        );
        assert_eq!(render_inline("Nothing", &[]), "Nothing");
    }

    #[test]
    fn picks_by_value_case_insensitively_or_by_synonym() {
        assert_eq!(pick("red"), Some(("red".into(), 0)));
        assert_eq!(pick("GREEN"), Some(("green".into(), 1)));
        assert_eq!(pick("Blue!"), Some(("blue".into(), 2)));
        assert_eq!(pick("azure"), Some(("blue".into(), 2)));
        assert_eq!(pick("I'd like green please"), Some(("green".into(), 1)));
        assert_eq!(pick("the blue one"), Some(("blue".into(), 2)));
    }

    #[test]
    fn picks_by_position() {
        assert_eq!(pick("3"), Some(("blue".into(), 2)));
        assert_eq!(pick("1"), Some(("red".into(), 0)));
        assert_eq!(pick("two"), Some(("green".into(), 1)));
        assert_eq!(pick("the first"), Some(("red".into(), 0)));
        assert_eq!(pick("second one"), Some(("green".into(), 1)));
        assert_eq!(pick("the last one"), Some(("blue".into(), 2)));
        assert_eq!(pick("3rd"), Some(("blue".into(), 2)));
    }

    #[test]
    fn picks_nothing_when_nothing_or_several_match() {
        assert_eq!(pick("cat"), None);
        assert_eq!(pick(""), None);
        assert_eq!(pick("4"), None);
        assert_eq!(pick("0"), None);
        assert_eq!(pick("red or green"), None);
        assert_eq!(pick("fourth"), None);
    }
}
