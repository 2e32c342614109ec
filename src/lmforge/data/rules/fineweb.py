"""FineWeb's line rules (Penedo et al. 2024, "The FineWeb Datasets"; datatrove's
``FineWebQualityFilter``): drop documents with too few lines ending in punctuation, too many short
lines, too many characters in duplicated lines, or too many newlines per word (lists, menus).
"""

from __future__ import annotations

from lmforge.config import FineWebConfig
from lmforge.data.rules.base import TERMINAL_PUNCTUATION, ConfiguredRule, duplicate_share
from lmforge.data.rules.text_view import TextView


class FineWebLines(ConfiguredRule[FineWebConfig]):
    """FineWeb: share of lines ending in punctuation, of short lines, of duplicated-line characters,
    and newlines per word."""

    name = "fineweb"

    def check(self, view: TextView) -> str | None:
        cfg = self.cfg
        lines = view.nonempty_lines
        if not lines:
            return "fineweb_empty"
        if cfg.line_punct_thr is not None:
            ratio = sum(line.endswith(TERMINAL_PUNCTUATION) for line in lines) / len(lines)
            if ratio < cfg.line_punct_thr and not (ratio == 0 and cfg.line_punct_exclude_zero):
                return f"line_punct_ratio {ratio:.2f} < {cfg.line_punct_thr}"
        if cfg.short_line_thr is not None:
            ratio = sum(len(line) <= cfg.short_line_length for line in lines) / len(lines)
            if ratio > cfg.short_line_thr:
                return f"short_line_ratio {ratio:.2f} > {cfg.short_line_thr}"
        if cfg.char_duplicates_ratio is not None:
            chars = duplicate_share(lines)[1] / max(len(view.text) - view.text.count("\n"), 1)
            if chars > cfg.char_duplicates_ratio:
                return f"char_dup_ratio {chars:.3f} > {cfg.char_duplicates_ratio}"
        if cfg.new_line_ratio is not None:
            ratio = view.text.count("\n") / max(len(view.words), 1)
            if ratio > cfg.new_line_ratio:
                return f"list_ratio {ratio:.2f} newlines per word > {cfg.new_line_ratio}"
        return None
