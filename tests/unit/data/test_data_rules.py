"""Cleaning rules as units: hand-computed thresholds of Gopher, C4 and FineWeb, PII and language ID."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from lmforge.config import (
    C4Config,
    FineWebConfig,
    GopherQualityConfig,
    GopherRepetitionConfig,
    LanguageIdConfig,
    PiiConfig,
)
from lmforge.data.pii import PiiRedactor, luhn_valid
from lmforge.data.rules import C4Lines, FineWebLines, GopherQuality, GopherRepetition, LanguageFilter, TextView
from lmforge.data.rules.gopher_quality import _LETTERLESS_WORD, _is_numeral, alphabetic_words
from lmforge.data.rules.gopher_repetition import _top_ngram_chars, duplicate_ngram_chars, top_ngram_chars
from lmforge.data.rules.text_view import _NGRAM_MULTIPLIERS, PUNCTUATION, ngram_hashes, stable_hashes

PROSE = (
    "The committee met on Tuesday to review the budget and the plans that have been proposed. "
    "Members agreed that the schedule was too tight, and that more time should be given to testing. "
    "A revised timeline will be shared with the whole team by the end of the week. "
    "Questions about the proposal can be sent to the chair of the committee before the next meeting. "
    "Everyone thanked the volunteers who have helped with the preparation of the documents."
)


def test_text_view_splits_once_and_shares_word_hashes():
    view = TextView("Hello, world!\n\nHello world")
    assert view.bare_words == ["hello", "world", "hello", "world"]
    assert view.word_hashes is view.word_hashes  # cached, not recomputed
    assert view.paragraphs == ["Hello, world!", "Hello world"]
    assert list(view.word_hashes[:2]) == list(view.word_hashes[2:])
    view.replace_text("other text")
    assert view.bare_words == ["other", "text"]


def test_stable_hashes_do_not_depend_on_the_process():
    assert stable_hashes(["abc"]).tolist() == [891568578]  # zlib.crc32(b"abc")


def test_gopher_quality_passes_prose_and_names_each_failure():
    rule = GopherQuality(GopherQualityConfig())
    assert rule(TextView(PROSE)) is None
    assert rule("too short with the and of").startswith("gopher_short_doc 6 words < 50")
    long_words = " ".join(["internationalization"] * 60)
    assert rule(long_words).startswith("gopher_above_avg_threshold")
    hashes = " ".join(["the word #tag"] * 20)
    assert rule(hashes).startswith("gopher_too_many_symbols 0.333")
    no_stop = " ".join(["apple banana cherry"] * 20)
    assert rule(no_stop).startswith("gopher_enough_stop_words 0 stop words < 2")
    numbers = PROSE + " " + " ".join(["12345"] * 40)
    assert rule(numbers).startswith("gopher_below_alpha_threshold")
    assert rule.removed == 5 and rule.reasons["gopher_short_doc"] == 1


def test_gopher_quality_names_its_word_count_length_and_line_failures():
    rule = GopherQuality(GopherQualityConfig(max_doc_words=70))
    assert rule(PROSE + " " + PROSE).startswith("gopher_long_doc 158 words > 70")
    assert rule(" ".join(["to be or of an"] * 12)) == "gopher_below_avg_threshold mean word length 2.00 < 3.0"
    bullets = "\n".join(f"- the {word} item with the details" for word in PROSE.split()[:10])
    assert rule(bullets) == "gopher_too_many_bullets 1.00 of lines > 0.9"
    trailing = "\n".join(f"{PROSE[:60]} and so on…" for _ in range(4))
    assert rule(trailing) == "gopher_too_many_end_ellipsis 1.00 of lines > 0.3"
    no_floor = GopherQuality(GopherQualityConfig(min_doc_words=None))
    assert no_floor("!!! ???") == "gopher_short_doc no words"


def test_gopher_quality_min_stop_words_zero_keeps_a_text_without_stop_words():
    rule = GopherQuality(GopherQualityConfig(min_stop_words=0))
    assert rule(" ".join(["apple banana cherry"] * 20)) is None


def test_gopher_quality_is_switchable_per_threshold_and_language():
    rule = GopherQuality(GopherQualityConfig(min_doc_words=None, min_stop_words=None))
    assert rule("too short") is None
    zh_only = GopherQuality(GopherQualityConfig(languages=["en"]))
    assert zh_only(TextView("短文", lang="zh")) is None


def test_gopher_repetition_names_duplicated_paragraphs_and_line_characters():
    paragraphs = "p one\n\np one\n\nq"  # 15 chars; "p one" (5 chars) repeats: 1 of 3 paragraphs, 5 of 15 chars
    assert GopherRepetition(GopherRepetitionConfig())(paragraphs) == "dup_para_frac 0.33 > 0.3"
    by_chars = GopherRepetitionConfig(dup_para_frac=None)
    assert GopherRepetition(by_chars)(paragraphs) == "dup_para_char_frac 0.33 > 0.2"
    lines = "a long repeated line\na long repeated line\nx\ny\nz"  # 47 chars, 20 of them in the repeat
    assert GopherRepetition(GopherRepetitionConfig(dup_line_frac=None))(lines) == "dup_line_char_frac 0.43 > 0.2"
    # with the four off, the n-gram tests decide: "p one" is 8 of the 15 chars as a repeated 2-gram
    off = GopherRepetitionConfig(
        dup_para_frac=None, dup_para_char_frac=None, dup_line_frac=None, dup_line_char_frac=None
    )
    assert GopherRepetition(off)(paragraphs) == "top_2_gram 0.53 of chars > 0.2"


def test_gopher_repetition_duplicated_lines_and_ngrams():
    rule = GopherRepetition(GopherRepetitionConfig())
    assert rule(TextView(PROSE)) is None
    lines = "\n".join(["same line here"] * 4 + ["a different line", "and another"])
    assert rule(lines).startswith("dup_line_frac 0.50 > 0.3")
    # 10 distinct words repeated twice: every 5..10-gram of the second half repeats the first half.
    words = [f"w{i}x" for i in range(10)]
    view = TextView(" ".join(words * 2))
    h, n = view.word_hashes, view.bare_word_lengths
    assert duplicate_ngram_chars(h, n, 5) == 30  # words 10..19 counted once each, 3 chars each
    assert top_ngram_chars(h, n, 2) == 2 * 6  # each 2-gram occurs twice: count 2 x 6 chars
    assert rule(view) == "top_3_gram 0.23 of chars > 0.18"  # 2-grams: 12 of 79 chars, 3-grams: 18


def test_bare_words_casefold_the_whole_text_like_each_word():
    # TextView casefolds the whole text once; that equals casefolding word by word because casefold never
    # turns a character into whitespace or PUNCTUATION, nor changes either (checked over all of Unicode).
    every = [chr(i) for i in range(sys.maxunicode + 1)]
    assert all(c.casefold() == c for c in PUNCTUATION)
    assert [c for c in every if not c.isspace() and c not in PUNCTUATION and _edge_changes(c)] == []
    text = "Straße ΣΑΣ İstanbul “Quoted,” don't -- ... ﬁne K word.\n\n(Paren) x²"
    expected = [s for s in (w.strip(PUNCTUATION).casefold() for w in text.split()) if s]
    assert TextView(text).bare_words == expected


def _edge_changes(c: str) -> bool:
    folded = c.casefold()
    return any(f.isspace() or f in PUNCTUATION for f in folded)


def test_alphabetic_word_count_matches_isalpha_everywhere():
    # The regex count relies on [\W\d_]-or-not being isalpha except for numerals; check every code point.
    for i in range(sys.maxunicode + 1):
        c = chr(i)
        if not c.isspace():
            assert (_LETTERLESS_WORD.fullmatch(c) is None) == (c.isalpha() or _is_numeral(c)), hex(i)
    for text in ["12 ab 3c -- ... Ⅻ ½ x² ٣٤ _a_ __ ok", "no numerals: 12 34 -- a", "汉字 12 ab", "", "  \n "]:
        view = TextView(text)
        assert alphabetic_words(view) == sum(any(c.isalpha() for c in w) for w in view.words), text


def test_ngram_hashes_of_each_size_match_the_direct_formula():
    view = TextView("a b c d e f g a b c")
    hashes = view.word_hashes
    for n in [1, 3, 2, 5, 10, 12, 4]:  # out of order: each size builds on the largest one already known
        grams = view.ngram_hashes(n)
        assert np.array_equal(grams, ngram_hashes(hashes, n))
        size = min(n, len(hashes))
        mask = (1 << 64) - 1
        for i, gram in enumerate(grams.tolist()):
            value = 0
            for k in range(size):
                value = (value + int(hashes[i + k]) * int(_NGRAM_MULTIPLIERS[k])) & mask
                value ^= value >> 29
            assert gram == value
    assert len(TextView("").ngram_hashes(5)) == 0


def test_top_ngram_bound_only_skips_documents_the_rule_keeps():
    rng = np.random.default_rng(0)
    for _ in range(200):
        view = TextView(" ".join(f"w{x}" for x in rng.integers(0, 6, rng.integers(2, 40))))
        offsets, size = view.bare_word_offsets, len(view.text)
        exact = top_ngram_chars(view.word_hashes, view.bare_word_lengths, 2)
        bounded = _top_ngram_chars(view.ngram_hashes(2), offsets, 2, 0.2, size)
        assert bounded == exact or (bounded == 0 and exact / size <= 0.2)


def _kept_text(rule: C4Lines, text: str) -> str:
    """The text of a view of ``text`` after ``rule``, which must keep the document."""
    view = TextView(text)
    assert rule(view) is None
    return view.text


def test_c4_drops_boilerplate_lines_and_rewrites_the_view():
    rule = C4Lines(C4Config(min_num_sentences=2))
    text = "A fine first sentence here.\nShort line\nPlease enable javascript now ok.\nAnother good one [1]."
    assert _kept_text(rule, text) == "A fine first sentence here.\nAnother good one ."
    assert rule.lines_removed == 2
    assert rule("Here is code { x } in a line. More. And more.") == "c4_curly_bracket"
    assert rule("Lorem ipsum dolor sit amet.") == "c4_lorem_ipsum"
    assert rule("Only one sentence here.").startswith("c4_too_few_sentences")


def test_c4_phrase_checks_see_lines_after_citation_removal():
    rule = C4Lines(C4Config(min_num_sentences=1))
    text = "Please enable java[1]script to go on.\nA good sentence stays here.\nRead our terms of [edit]use."
    assert _kept_text(rule, text) == "A good sentence stays here."
    assert rule.lines_removed == 2


def test_fineweb_line_rules():
    rule = FineWebLines(FineWebConfig())
    assert rule(TextView(PROSE)) is None
    no_punct = "\n".join(f"a line of words number {i} without any stop" for i in range(10))
    assert rule(no_punct).startswith("line_punct_ratio 0.00 < 0.12")
    short = "\n".join(f"short {i}." for i in range(10))
    assert rule(short).startswith("short_line_ratio 1.00 > 0.67")
    dup = PROSE + "\n" + "\n".join(["This line is repeated a couple of times."] * 3)
    assert rule(dup).startswith("char_dup_ratio")


def test_luhn():
    assert luhn_valid("4111111111111111") and luhn_valid("79927398713")
    assert not luhn_valid("4111111111111112")


@pytest.mark.parametrize(
    ("text", "expected", "kind"),
    [
        ("write to jane.doe+news@example.co.uk today", "write to <EMAIL> today", "email"),
        ("card 4111 1111 1111 1111 expires", "card <CARD_NUMBER> expires", "card"),
        ("card 4111-1111-1111-1112 is not Luhn-valid", "card 4111-1111-1111-1112 is not Luhn-valid", None),
        ("host 192.168.10.1 is up", "host <IP_ADDRESS> is up", "ip"),
        ("host 2001:db8::8a2e:370:7334 is up", "host <IP_ADDRESS> is up", "ip"),
        ("call +1 415-555-2671 now", "call <PHONE> now", "phone"),
        ("call (212) 555-1234 now", "call <PHONE> now", "phone"),
        ("Act 3, scene 2 in 1599 at 10:30", "Act 3, scene 2 in 1599 at 10:30", None),
        ("version 1.2.3 and 999.1.1.1", "version 1.2.3 and 999.1.1.1", None),
    ],
)
def test_pii_redaction_uses_typed_placeholders_and_counts(text, expected, kind):
    redact = PiiRedactor(PiiConfig())
    assert redact(text) == expected
    assert sum(redact.counts.values()) == (1 if kind else 0)
    if kind:
        assert redact.counts[kind] == 1 and redact.docs == 1


def test_pii_types_are_switchable():
    redact = PiiRedactor(PiiConfig(email=False))
    assert redact("mail a@b.org from 10.0.0.1") == "mail a@b.org from <IP_ADDRESS>"


def test_language_filter_keeps_english_and_chinese_and_drops_french():
    rule = LanguageFilter(LanguageIdConfig())
    en, zh = TextView(PROSE), TextView("今天天气很好，我们一起去公园散步吧。这是一个简单的中文句子，用来测试语言识别。")
    assert rule(en) is None and en.lang == "en"
    assert rule(zh) is None and zh.lang == "zh"
    fr = TextView("Le comité s'est réuni mardi pour examiner le budget et les projets proposés par les membres.")
    assert rule(fr).startswith("language_not_allowed fr")
    assert rule.removed == 1


def test_unknown_language_code_is_a_config_error():
    from lmforge.errors import ConfigError

    with pytest.raises(ConfigError, match=r"clean.language.allowed: unknown ISO 639-1 code\(s\) \['xx'\]"):
        LanguageFilter(LanguageIdConfig(allowed=["xx"]))


def test_minhash_signature_is_the_minimum_of_each_universal_hash():
    from lmforge.config import NearDedupConfig
    from lmforge.data.minhash import MinHasher

    hasher = MinHasher(NearDedupConfig(ngram=2, bands=4, rows=3))
    words = stable_hashes(["to", "be", "or", "not", "to", "be", "that", "is", "the", "question"])
    shingles = ngram_hashes(words, 2).tolist()
    expected = [
        min(((int(a) * x + int(b)) % 2**64) >> 32 for x in shingles)
        for a, b in zip(hasher._a.tolist(), hasher._b.tolist(), strict=True)
    ]
    assert hasher.signature(words).tolist() == expected
    assert hasher.view_signature(TextView("to be or not to be that is the question")).tolist() == expected
    assert (hasher.signature(np.empty(0, np.uint64)) == 2**32 - 1).all()


def test_minhash_agreement_tracks_jaccard():
    from lmforge.config import NearDedupConfig
    from lmforge.data.minhash import MinHasher, candidate_probability

    hasher = MinHasher(NearDedupConfig(ngram=1, bands=32, rows=8))
    a = stable_hashes([f"w{i}" for i in range(200)])
    b = stable_hashes([f"w{i}" for i in range(50, 250)])  # Jaccard 150/250 = 0.6
    agree = float(np.mean(hasher.signature(a) == hasher.signature(b)))
    assert abs(agree - 0.6) < 0.1
    assert hasher.band_keys(hasher.signature(a)).shape == (1, 32)
    assert candidate_probability(0.72, 14, 8) == pytest.approx(0.65, abs=0.02)
