"""The ``clean.profile`` presets: rule thresholds for kinds of text the web rules do not fit, and why each differs.

``web`` is the rules' published settings (Gopher, C4, FineWeb: tuned to drop boilerplate and spam from crawled
pages). Technical and conversational text fails them for what it is, not for being bad: a manual repeats
headings and option lines, code is all braces and short lines, a chat turn is one short line. Each profile
changes only the thresholds that misfire on its kind of text, with the reason; every other rule stays as on the
web. A value set explicitly in ``clean`` (preset or override) wins over the profile's.
"""

from __future__ import annotations

from typing import Any

from lmforge.config.base import deep_merge


def _ngrams(*pairs: tuple[int, float]) -> list[dict[str, Any]]:
    return [{"n": n, "max_fraction": f} for n, f in pairs]


CLEAN_PROFILES: dict[str, dict[str, tuple[Any, str]]] = {
    "web": {},
    "docs": {
        "c4.filter_curly_bracket": (False, "synopses ({a|b}), examples and config snippets hold braces"),
        "c4.min_words_per_line": (0, "headings, option lines (-a, --all) and table rows are short lines of content"),
        "c4.min_num_sentences": (2, "a short page (a man page for one flag) has few sentences"),
        "fineweb.line_punct_thr": (None, "headings, options, code and tables do not end in punctuation"),
        "fineweb.short_line_thr": (None, "wrapped, indented text and option lists are mostly short lines"),
        "fineweb.char_duplicates_ratio": (
            None,
            "at 1 % one repeated heading drops a page; Gopher's duplicate-line rules (below) bound repeats",
        ),
        "fineweb.new_line_ratio": (None, "hard-wrapped text has a newline every ~10 words"),
        "gopher_repetition.dup_line_frac": (
            0.7,
            "API docs repeat lines (signatures, 'Methods defined here:', inherited members per class)",
        ),
        "gopher_repetition.dup_line_char_frac": (0.5, "as dup_line_frac, by characters"),
        "gopher_repetition.dup_para_frac": (0.5, "reference pages repeat short paragraphs (return types, notes)"),
        "gopher_repetition.dup_para_char_frac": (0.4, "as dup_para_frac, by characters"),
        "gopher_repetition.top_n_grams": (
            _ngrams((2, 0.3), (3, 0.25), (4, 0.2)),
            "a page about one API names it throughout",
        ),
        "gopher_repetition.dup_n_grams": (
            _ngrams((5, 0.5), (6, 0.48), (7, 0.46), (8, 0.44), (9, 0.42), (10, 0.4)),
            "signatures, parameter lists and option phrases recur",
        ),
        "gopher_quality.max_non_alpha_words_ratio": (0.6, "option flags, numbers, paths and symbols are words here"),
        "gopher_quality.max_symbol_word_ratio": (0.3, "'#' starts markdown headings and shell comments"),
    },
    "code": {
        "language.enabled": (False, "a language detector reads source code as noise or a random language"),
        "c4.enabled": (False, "C4 drops lines under 3 words and any text with a '{': most of a program"),
        "fineweb.enabled": (False, "punctuation and short-line rules describe prose, not code"),
        "gopher_quality.min_doc_words": (10, "a small module or function is a complete document"),
        "gopher_quality.max_avg_word_length": (None, "identifiers and dotted names are long words"),
        "gopher_quality.max_symbol_word_ratio": (None, "'#' starts comments and directives"),
        "gopher_quality.max_bullet_lines_ratio": (None, "'*' and '-' start lines in comments and expressions"),
        "gopher_quality.max_non_alpha_words_ratio": (0.5, "operators, numbers and brackets stand alone as words"),
        "gopher_quality.min_stop_words": (None, "code has few English stop words"),
        "gopher_repetition.dup_line_frac": (0.5, "code repeats lines ('}', 'return None', decorators)"),
        "gopher_repetition.dup_line_char_frac": (0.4, "as dup_line_frac, by characters"),
        "gopher_repetition.dup_para_frac": (0.5, "blocks repeat (similar functions, tests)"),
        "gopher_repetition.dup_para_char_frac": (0.4, "as dup_para_frac, by characters"),
        "gopher_repetition.top_n_grams": (
            _ngrams((2, 0.4), (3, 0.35), (4, 0.3)),
            "a module repeats its own names ('self.x', 'return self')",
        ),
        "gopher_repetition.dup_n_grams": (
            _ngrams((5, 0.6), (6, 0.58), (7, 0.56), (8, 0.54), (9, 0.52), (10, 0.5)),
            "parameter lists and call patterns recur; generated or copied files still fail",
        ),
    },
    "chat": {
        "gopher_quality.min_doc_words": (5, "a conversation or ticket can be a few short turns"),
        "gopher_quality.min_stop_words": (None, "short replies ('Sure, done.', 'How are you?') hold no stop word"),
        "c4.min_words_per_line": (0, "one-word turns ('Thanks!') and 'User: hi' are content"),
        "c4.min_num_sentences": (0, "a turn is often one sentence or none ('ok')"),
        "c4.filter_curly_bracket": (False, "tickets paste JSON, logs and code"),
        "fineweb.line_punct_thr": (None, "chat lines often end without punctuation"),
        "fineweb.short_line_thr": (None, "turns are short lines"),
        "fineweb.new_line_ratio": (None, "every turn is a line"),
        "fineweb.char_duplicates_ratio": (0.2, "'ok', 'thanks' and greetings recur"),
        "gopher_repetition.dup_line_frac": (0.5, "turns repeat in short conversations"),
        "gopher_repetition.dup_line_char_frac": (0.4, "as dup_line_frac, by characters"),
        "gopher_repetition.top_n_grams": (
            _ngrams((2, 0.4), (3, 0.35), (4, 0.3)),
            "role prefixes ('User:', 'Agent:') recur in every turn of a short text",
        ),
    },
}
"""Per profile: dotted ``clean`` field → (value, why it differs from ``web``)."""


def profile_settings(profile: str) -> dict[str, Any]:
    """The nested ``clean`` settings a profile sets (empty for ``web`` and unknown names)."""
    nested: dict[str, Any] = {}
    for path, (value, _) in CLEAN_PROFILES.get(profile, {}).items():
        leaf: Any = value
        for part in reversed(path.split(".")):
            leaf = {part: leaf}
        nested = deep_merge(nested, leaf)
    return nested
