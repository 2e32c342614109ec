"""Cleaning rules, one per module, each a small unit with named thresholds (from :mod:`lmforge.config`)
and counters.

Every rule reads a :class:`TextView`, which splits a document into lines, paragraphs and words once
and caches the results; the rules and MinHash share those splits instead of re-tokenizing the same
text in every filter (the bulk of the time in rule-per-class pipelines). A rule's :meth:`Rule.check`
returns ``None`` to keep a document or a short reason string; :meth:`Rule.__call__` counts rejections
in ``removed`` and per reason in ``reasons`` (:mod:`.base`).

Thresholds and their defaults are the published ones: Gopher quality and repetition (Rae et al. 2021),
C4 (Raffel et al. 2020) and FineWeb's line rules (Penedo et al. 2024), as configured in datatrove's
FineWeb pipeline. :func:`lmforge.data.cleaning.build_rules` puts them in the order they run.
"""

from lmforge.data.rules.base import Rule
from lmforge.data.rules.c4 import C4Lines
from lmforge.data.rules.fineweb import FineWebLines
from lmforge.data.rules.gopher_quality import GopherQuality
from lmforge.data.rules.gopher_repetition import GopherRepetition
from lmforge.data.rules.language import LanguageFilter
from lmforge.data.rules.min_chars import MinChars
from lmforge.data.rules.min_words import MinWords
from lmforge.data.rules.non_empty import NonEmpty
from lmforge.data.rules.text_view import UNDETERMINED_LANG, TextView

__all__ = [
    "UNDETERMINED_LANG",
    "C4Lines",
    "FineWebLines",
    "GopherQuality",
    "GopherRepetition",
    "LanguageFilter",
    "MinChars",
    "MinWords",
    "NonEmpty",
    "Rule",
    "TextView",
]
