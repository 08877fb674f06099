//! Yes or no: the common English ways of saying either, alone or in a short sentence, and —
//! when the choices are shown — their positions (`1` for yes, `2` for no).

use super::choice::{Choice, recognize_choice, render_inline};
use super::{ListStyle, PromptOptions, Recognizer, words};
use crate::activity::Activity;

const YES: [&str; 15] = [
    "yes",
    "y",
    "yeah",
    "yea",
    "yep",
    "yup",
    "sure",
    "ok",
    "okay",
    "true",
    "correct",
    "affirmative",
    "certainly",
    "absolutely",
    "definitely",
];
const NO: [&str; 9] = [
    "no", "n", "nope", "nah", "false", "negative", "not", "never", "cancel",
];

/// `Some(true)` for a yes, `Some(false)` for a no, `None` when the text says neither (or both).
pub fn recognize_confirm(text: &str) -> Option<bool> {
    let said = words(text);
    let yes = said.iter().any(|w| YES.contains(&w.as_str()))
        || said.windows(2).any(|w| w == ["of", "course"]);
    let no = said.iter().any(|w| NO.contains(&w.as_str()));
    match (yes, no) {
        (true, false) => Some(true),
        (false, true) => Some(false),
        _ => None,
    }
}

/// Recognizes yes or no; shows `(1) Yes or (2) No` after the prompt unless the style (the
/// options' or this recognizer's) is [`ListStyle::None`].
#[derive(Debug, Clone)]
pub struct ConfirmRecognizer {
    /// The list style when the options name none.
    pub style: ListStyle,
    /// The labels of yes and no when shown.
    pub labels: (String, String),
}

impl Default for ConfirmRecognizer {
    fn default() -> Self {
        Self {
            style: ListStyle::Inline,
            labels: ("Yes".to_owned(), "No".to_owned()),
        }
    }
}

impl ConfirmRecognizer {
    /// A recognizer showing its choices in `style`.
    pub fn with_style(style: ListStyle) -> Self {
        Self {
            style,
            ..Self::default()
        }
    }

    fn choices(&self) -> [Choice; 2] {
        [
            Choice::new(self.labels.0.clone()),
            Choice::new(self.labels.1.clone()),
        ]
    }
}

impl Recognizer for ConfirmRecognizer {
    type Value = bool;

    fn recognize(&self, activity: &Activity, options: &PromptOptions) -> Option<bool> {
        let text = activity.text.as_deref()?;
        recognize_confirm(text).or_else(|| {
            if options.style.unwrap_or(self.style) == ListStyle::None {
                return None;
            }
            recognize_choice(text, &self.choices()).map(|found| found.index == 0)
        })
    }

    fn render(&self, text: &str, options: &PromptOptions) -> String {
        match options.style.unwrap_or(self.style) {
            ListStyle::None => text.to_owned(),
            ListStyle::Inline => render_inline(text, &self.choices()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn yes_and_its_synonyms() {
        for text in [
            "yes",
            "Yes",
            "YES!",
            "y",
            "yeah",
            "yep",
            "sure",
            "ok",
            "Okay",
            "true",
            "yes please",
            "of course",
            "sure thing",
        ] {
            assert_eq!(recognize_confirm(text), Some(true), "{text}");
        }
    }

    #[test]
    fn no_and_its_synonyms() {
        for text in [
            "no",
            "No.",
            "n",
            "nope",
            "false",
            "no thanks",
            "NOPE",
            "not now",
        ] {
            assert_eq!(recognize_confirm(text), Some(false), "{text}");
        }
    }

    #[test]
    fn neither_or_both_is_not_an_answer() {
        for text in ["hello", "", "maybe", "yes and no", "not sure", "yesterday"] {
            assert_eq!(recognize_confirm(text), None, "{text}");
        }
    }

    #[test]
    fn positions_count_only_when_the_choices_are_shown() {
        let shown = ConfirmRecognizer::default();
        let hidden = ConfirmRecognizer::with_style(ListStyle::None);
        let options = PromptOptions::new("Please confirm.");
        let one = Activity::message("1");
        let two = Activity::message("2");
        assert_eq!(shown.recognize(&one, &options), Some(true));
        assert_eq!(shown.recognize(&two, &options), Some(false));
        assert_eq!(hidden.recognize(&one, &options), None);
        assert_eq!(
            shown.render("Please confirm.", &options),
            "Please confirm. (1) Yes or (2) No"
        );
        assert_eq!(
            hidden.render("Please confirm.", &options),
            "Please confirm."
        );
    }
}
