"""Configs of the data stages: cleaning rules (``clean`` and its fan-out steps) and ``tokenize``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from lmforge.config.base import StrictModel, deep_merge
from lmforge.config.clean_profiles import profile_settings


class LanguageIdConfig(StrictModel):
    """Language identification (lingua): keep documents in the allowed languages only."""

    enabled: bool = Field(True, description="Detect each document's language and drop disallowed ones.")
    allowed: list[str] = Field(
        default_factory=lambda: ["en", "zh"],
        min_length=1,
        description="ISO 639-1 codes of the languages to keep (lingua supports 75).",
    )
    min_confidence: float = Field(
        0.65, ge=0.0, le=1.0, description="Drop a document whose top language confidence is below this."
    )
    candidates: list[str] | None = Field(
        default_factory=lambda: [
            "en",
            "zh",
            "de",
            "fr",
            "es",
            "it",
            "pt",
            "nl",
            "sv",
            "da",
            "nb",
            "pl",
            "cs",
            "ru",
            "uk",
            "tr",
            "ar",
            "fa",
            "hi",
            "ja",
            "ko",
            "vi",
            "id",
            "la",
            "el",
            "fi",
            "hu",
            "ro",
        ],
        description="Languages the detector chooses among (plus the allowed ones); null means all 75 "
        "lingua languages (about 3x slower).",
    )
    sample_chars: int = Field(
        1000,
        gt=0,
        description="Characters from the start of a document given to the detector; its time grows linearly "
        "with them. On the demo corpus 1000 decides as the whole text does, 500 drops 1 of 769 English "
        "scenes as Latin, 300 drops 3.",
    )


class GopherQualityConfig(StrictModel):
    """Gopher quality rules (Rae et al. 2021, as in datatrove/FineWeb); a bound of null disables it."""

    enabled: bool = Field(True, description="Apply the Gopher quality rules.")
    languages: list[str] = Field(
        default_factory=lambda: ["en"], description="Apply only to documents detected as these languages."
    )
    min_doc_words: int | None = Field(50, ge=0, description="Drop documents with fewer words.")
    max_doc_words: int | None = Field(100_000, ge=0, description="Drop documents with more words.")
    min_avg_word_length: float | None = Field(3.0, ge=0.0, description="Drop if mean word length is below.")
    max_avg_word_length: float | None = Field(10.0, ge=0.0, description="Drop if mean word length is above.")
    max_symbol_word_ratio: float | None = Field(
        0.1, ge=0.0, description="Drop if ('#' + ellipsis) count per word exceeds this."
    )
    max_bullet_lines_ratio: float | None = Field(
        0.9, ge=0.0, le=1.0, description="Drop if more lines than this start with a bullet."
    )
    max_ellipsis_lines_ratio: float | None = Field(
        0.3, ge=0.0, le=1.0, description="Drop if more lines than this end with an ellipsis."
    )
    max_non_alpha_words_ratio: float | None = Field(
        0.8,
        ge=0.0,
        le=1.0,
        description="Drop if the fraction of words holding an alphabetic character is below this "
        "(datatrove's name for the rule).",
    )
    min_stop_words: int | None = Field(2, ge=0, description="Drop if fewer stop words than this occur.")
    stop_words: list[str] = Field(
        default_factory=lambda: ["the", "be", "to", "of", "and", "that", "have", "with"],
        description="Stop words counted by min_stop_words.",
    )


class NGramFraction(StrictModel):
    """A word n-gram size and the largest share of characters it may cover."""

    n: int = Field(gt=0, description="N-gram size in words.")
    max_fraction: float = Field(ge=0.0, le=1.0, description="Largest fraction of characters allowed.")


def _ngram_fractions(pairs: list[tuple[int, float]]) -> list[NGramFraction]:
    return [NGramFraction(n=n, max_fraction=f) for n, f in pairs]


class GopherRepetitionConfig(StrictModel):
    """Gopher repetition rules (duplicate lines, paragraphs and n-grams); a bound of null disables it."""

    enabled: bool = Field(True, description="Apply the Gopher repetition rules.")
    languages: list[str] = Field(
        default_factory=lambda: ["en"], description="Apply only to documents detected as these languages."
    )
    dup_line_frac: float | None = Field(0.3, ge=0.0, le=1.0, description="Max fraction of duplicated lines.")
    dup_para_frac: float | None = Field(0.3, ge=0.0, le=1.0, description="Max fraction of duplicated paragraphs.")
    dup_line_char_frac: float | None = Field(
        0.2, ge=0.0, le=1.0, description="Max fraction of characters in duplicated lines."
    )
    dup_para_char_frac: float | None = Field(
        0.2, ge=0.0, le=1.0, description="Max fraction of characters in duplicated paragraphs."
    )
    top_n_grams: list[NGramFraction] = Field(
        default_factory=lambda: _ngram_fractions([(2, 0.2), (3, 0.18), (4, 0.16)]),
        description="Max character share of the most frequent word n-gram, per n.",
    )
    dup_n_grams: list[NGramFraction] = Field(
        default_factory=lambda: _ngram_fractions([(5, 0.15), (6, 0.14), (7, 0.13), (8, 0.12), (9, 0.11), (10, 0.10)]),
        description="Max character share of all duplicated word n-grams, per n.",
    )


class C4Config(StrictModel):
    """C4 rules (Raffel et al. 2020) with FineWeb's choice: terminal-punctuation line filter off."""

    enabled: bool = Field(True, description="Apply the C4 rules.")
    languages: list[str] = Field(
        default_factory=lambda: ["en"], description="Apply only to documents detected as these languages."
    )
    remove_citations: bool = Field(True, description="Delete Wikipedia-style citation marks like [1], [edit].")
    filter_no_terminal_punct: bool = Field(
        False, description="Drop lines not ending in terminal punctuation (C4: on; FineWeb: off)."
    )
    min_words_per_line: int = Field(3, ge=0, description="Drop lines with fewer words (0 disables).")
    max_word_length: int = Field(1000, gt=0, description="Drop lines holding a longer word.")
    filter_javascript: bool = Field(True, description="Drop lines mentioning 'javascript'.")
    filter_policy: bool = Field(True, description="Drop lines with cookie/privacy/terms-of-use boilerplate.")
    filter_lorem_ipsum: bool = Field(True, description="Drop documents containing 'lorem ipsum'.")
    filter_curly_bracket: bool = Field(True, description="Drop documents containing '{' (code).")
    min_num_sentences: int = Field(5, ge=0, description="Drop documents with fewer sentences after line removal.")


class FineWebConfig(StrictModel):
    """FineWeb's extra line-level rules (Penedo et al. 2024)."""

    enabled: bool = Field(True, description="Apply the FineWeb rules.")
    languages: list[str] = Field(
        default_factory=lambda: ["en"], description="Apply only to documents detected as these languages."
    )
    line_punct_thr: float | None = Field(
        0.12, ge=0.0, le=1.0, description="Drop if fewer lines than this fraction end in terminal punctuation."
    )
    line_punct_exclude_zero: bool = Field(False, description="Exempt documents where no line ends in punctuation.")
    short_line_thr: float | None = Field(
        0.67, ge=0.0, le=1.0, description="Drop if more lines than this fraction are short."
    )
    short_line_length: int = Field(30, ge=0, description="A line of at most this many characters is short.")
    char_duplicates_ratio: float | None = Field(
        0.01, ge=0.0, le=1.0, description="Max fraction of characters in duplicated lines."
    )
    new_line_ratio: float | None = Field(0.3, ge=0.0, description="Max newlines per word.")


class PiiConfig(StrictModel):
    """PII redaction: matches are replaced by typed placeholders and counted."""

    enabled: bool = Field(True, description="Redact PII.")
    email: bool = Field(True, description="Redact e-mail addresses as <EMAIL>.")
    phone: bool = Field(True, description="Redact phone numbers as <PHONE>.")
    ip: bool = Field(True, description="Redact IPv4 and IPv6 addresses as <IP_ADDRESS>.")
    card: bool = Field(True, description="Redact Luhn-valid 13-19 digit card numbers as <CARD_NUMBER>.")


class NearDedupConfig(StrictModel):
    """MinHash LSH near-duplicate removal; one document per cluster (the earliest in the corpus) is kept.

    The default, word 3-grams with 20 bands x 5 rows (a pair with Jaccard 0.6 is a candidate with
    probability 0.8, at 0.7 with 0.98) confirmed at a 0.3 signature agreement, removed every copy with
    1-5 % of words edited and 86 % at 10 % in the planted-copy bench. FineWeb's word 5-grams with 14 x 8
    and no confirmation (``ngram: 5, bands: 14, rows: 8, min_similarity: 0``) needs Jaccard ~0.7 and
    removed about half of the copies at 5 % edits (docs/benchmarks.md has both curves, and datatrove's).
    """

    enabled: bool = Field(True, description="Remove near duplicates.")
    ngram: int = Field(
        3, gt=0, description="Shingle size in words; shorter shingles keep Jaccard high under word edits."
    )
    bands: int = Field(20, gt=0, description="LSH bands; documents sharing any band bucket are candidates.")
    rows: int = Field(5, gt=0, description="MinHash rows per band (bands x rows permutations in all).")
    min_similarity: float = Field(
        0.3,
        ge=0.0,
        le=1.0,
        description="Confirm a candidate pair only when its signature agreement (Jaccard estimate) reaches "
        "this, which drops chance band collisions; 0 accepts every LSH candidate as FineWeb does.",
    )
    seed: int = Field(1, ge=0, description="Seed of the MinHash permutations.")


class CleanConfig(StrictModel):
    """Rules of the ``clean`` stage."""

    profile: Literal["web", "docs", "code", "chat"] = Field(
        "web",
        description="Rule thresholds for the kind of text: web (crawled pages; the published Gopher/C4/FineWeb "
        "settings), docs (manuals, documentation, markdown, man pages), code (source files), chat (conversations, "
        "support tickets). A profile changes only the thresholds that misfire on its kind of text "
        "(docs/your-data.md lists each with its reason); a clean.* value set explicitly still wins.",
    )
    text_field: str = Field("text", min_length=1, description="JSON field that holds a document's text.")
    unicode_form: Literal["NFC", "NFKC"] = Field("NFC", description="Unicode normalization form.")
    min_chars: int = Field(20, ge=0, description="Drop documents shorter than this many characters.")
    min_words: int = Field(3, ge=0, description="Drop documents with fewer words than this.")
    exact_dedup: bool = Field(True, description="Drop exact duplicates of normalized text (keep the first).")
    language: LanguageIdConfig = Field(default_factory=LanguageIdConfig, description="Language identification.")
    gopher_repetition: GopherRepetitionConfig = Field(
        default_factory=GopherRepetitionConfig, description="Gopher repetition rules."
    )
    gopher_quality: GopherQualityConfig = Field(
        default_factory=GopherQualityConfig, description="Gopher quality rules."
    )
    c4: C4Config = Field(default_factory=C4Config, description="C4 rules.")
    fineweb: FineWebConfig = Field(default_factory=FineWebConfig, description="FineWeb line rules.")
    pii: PiiConfig = Field(default_factory=PiiConfig, description="PII redaction.")
    near_dedup: NearDedupConfig = Field(default_factory=NearDedupConfig, description="MinHash LSH dedup.")
    shard_docs: int = Field(50_000, gt=0, description="Documents per output Parquet shard.")
    workers: int = Field(
        0,
        ge=0,
        description="Processes cleaning one shard's documents in parallel; 0 = one per CPU of the pod's limit "
        "(cgroup cpu.max, else the CPU affinity). The output is the same for any number.",
    )
    quarantine_samples: int = Field(100, ge=0, description="Rejected documents kept per rule for review.")
    max_bad_records: int = Field(
        0,
        ge=0,
        description="Malformed records (bad JSON, missing text) tolerated and counted; one more fails the "
        "stage with an error naming file and line.",
    )
    max_record_bytes: int = Field(
        16 * 1024 * 1024,
        ge=1024,
        le=1024 * 1024 * 1024,
        description="Largest JSONL line or .txt document read, in bytes; a larger one is a malformed record "
        "(counted, skipped without being held in memory). Bounds the memory one record can take.",
    )

    @model_validator(mode="before")
    @classmethod
    def _apply_profile(cls, data: Any) -> Any:
        """Fill in the profile's thresholds under the values given explicitly."""
        if isinstance(data, dict) and isinstance(data.get("profile"), str):
            return deep_merge(profile_settings(data["profile"]), data)
        return data


class TokenizeConfig(StrictModel):
    """Tokenizer training and token-shard packing."""

    vocab_size: int = Field(4096, ge=260, le=1_000_000, description="Byte-level BPE vocabulary size.")
    min_frequency: int = Field(2, ge=1, description="Minimum pair frequency for a BPE merge.")
    val_fraction: float = Field(
        0.05, gt=0.0, lt=1.0, description="Fraction of documents held out for validation (by id hash)."
    )
    min_val_tokens: int = Field(
        10_000,
        ge=0,
        description="Held-out tokens the val split should hold at least: when val_fraction gives fewer, the next "
        "documents in id-hash order join it, up to max_val_fraction. Evaluation marks perplexity and bits per byte "
        "measured on fewer tokens 'low confidence', and a gate check on them n/a instead of PASS.",
    )
    min_val_documents: int = Field(
        10,
        ge=0,
        description="Held-out documents the val split should hold at least (as min_val_tokens; a few long documents "
        "are one or two texts' worth of evidence, however many tokens they hold).",
    )
    max_val_fraction: float = Field(
        0.25,
        gt=0.0,
        lt=1.0,
        description="Largest fraction of documents (by id hash) the val split may take to reach min_val_tokens and "
        "min_val_documents; training keeps the rest.",
    )
    shard_tokens: int = Field(50_000_000, gt=0, description="Maximum tokens per shard file before a new one starts.")
    eos_token: str = Field("<|endoftext|>", min_length=1, description="End-of-document token.")
    pad_token: str = Field("<|pad|>", min_length=1, description="Padding token.")
