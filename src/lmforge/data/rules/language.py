"""Language identification with lingua (``lingua-language-detector``), loaded on first use: tag each
document with its language and drop those outside the allowed set or below a confidence. FineWeb's
pipeline (datatrove's ``LanguageFilter``) does the same with a fastText model, which needs a download.
"""

from __future__ import annotations

from typing import Any

from lmforge.config import LanguageIdConfig
from lmforge.data.rules.base import Rule
from lmforge.data.rules.text_view import UNDETERMINED_LANG, TextView
from lmforge.errors import ConfigError


class LanguageFilter(Rule):
    """Tag each document with its language; drop those not in ``allowed`` or below ``min_confidence``.

    The detector chooses among ``candidates`` (by default 28 widely written languages; low-accuracy mode:
    trigram models only, fast and small), so a French page is recognized as French rather than forced
    into the nearest allowed language.
    """

    name = "language"

    def __init__(self, cfg: LanguageIdConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.allowed = frozenset(cfg.allowed)
        self._detector: Any = None
        from lingua import IsoCode639_1

        for field, codes in (("allowed", cfg.allowed), ("candidates", cfg.candidates or [])):
            unknown = [c for c in codes if not hasattr(IsoCode639_1, c.upper())]
            if unknown:
                raise ConfigError(f"clean.language.{field}: unknown ISO 639-1 code(s) {unknown}")

    def _detect(self, text: str) -> tuple[str, float]:
        if self._detector is None:
            from lingua import IsoCode639_1, LanguageDetectorBuilder

            if self.cfg.candidates is None:
                builder = LanguageDetectorBuilder.from_all_languages()
            else:
                codes = sorted({*self.cfg.candidates, *self.cfg.allowed})
                builder = LanguageDetectorBuilder.from_iso_codes_639_1(
                    *(getattr(IsoCode639_1, c.upper()) for c in codes)
                )
            self._detector = builder.with_low_accuracy_mode().build()
        values = self._detector.compute_language_confidence_values(text[: self.cfg.sample_chars])
        if not values:
            return UNDETERMINED_LANG, 0.0
        top = values[0]
        return top.language.iso_code_639_1.name.lower(), float(top.value)

    def check(self, view: TextView) -> str | None:
        lang, confidence = self._detect(view.text)
        view.lang = lang
        if lang not in self.allowed:
            return f"language_not_allowed {lang} ({confidence:.2f})"
        if confidence < self.cfg.min_confidence:
            return f"language_low_confidence {lang} {confidence:.2f} < {self.cfg.min_confidence}"
        return None
