"""Self-contained HTML pieces (inline CSS, plots as embedded PNG): no external scripts or fonts."""

from __future__ import annotations

import base64
import html
import io
import re
from collections.abc import Mapping, Sequence
from typing import Any

# Fits any window width: the page never scrolls sideways. A wide table scrolls inside its own box (.scroll),
# plots scale down, charts fall to one column when two do not fit, and paths wrap at their separators (<wbr>)
# or, lacking any, anywhere.
_CSS = """
*,*::before,*::after{box-sizing:border-box}
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2rem auto;
max-width:1100px;color:#1d2330;line-height:1.45;padding:0 1rem;overflow-wrap:break-word}
h1{font-size:1.6rem;border-bottom:2px solid #3b5bdb;padding-bottom:.3rem}h2{font-size:1.25rem;margin-top:2rem}
.scroll{max-width:100%;overflow-x:auto;margin:.6rem 0}
table{border-collapse:collapse;font-size:.92rem}th,td{border:1px solid #ccd;
padding:.3rem .6rem;text-align:right;vertical-align:top}th{background:#eef1fb}
td:first-child,th:first-child{text-align:left}td.text{text-align:left}td.pre{white-space:pre-wrap}
.pass{color:#0b7a2a;font-weight:600}.fail{color:#b3261e;font-weight:600}.skip{color:#8a6d00;font-weight:600}
img{max-width:100%;height:auto}.note{color:#556;font-size:.9rem}
code,pre{overflow-wrap:anywhere}pre{white-space:pre-wrap;background:#f6f7fb;padding:.6rem;font-size:.85rem}
.charts{display:grid;grid-template-columns:repeat(auto-fit,minmax(min(100%,28rem),1fr));gap:1rem}
.charts>div{min-width:0}dl.meta{display:grid;grid-template-columns:max-content minmax(0,1fr);gap:.2rem 1rem}
dl.meta dt{font-weight:600}dl.meta dd{margin:0}details>summary{cursor:pointer}
"""
_SEPARATORS = re.compile(r"([/\\_.\-|=&?,:])")


def breakable(text: str) -> str:
    """``text`` HTML-escaped, with a line-break opportunity (``<wbr>``) after each path or URI separator."""
    return "".join(html.escape(part) + ("<wbr>" if i % 2 else "") for i, part in enumerate(_SEPARATORS.split(text)))


def scroll_box(content: str) -> str:
    """``content`` (a table) in a box that scrolls sideways on its own when it is wider than the page."""
    return f'<div class="scroll">{content}</div>'


def details(summary: str, content: str) -> str:
    """A collapsed ``<details>`` block: ``summary`` (text) shown, ``content`` (HTML) on click."""
    return f"<details><summary>{html.escape(summary)}</summary>{content}</details>"


def charts(images: Sequence[str]) -> str:
    """Plots side by side, two per row where they fit, one per row otherwise."""
    return '<div class="charts">' + "".join(f"<div>{image}</div>" for image in images) + "</div>"


def figure_png(fig: Any) -> str:
    """An ``<img>`` tag holding a matplotlib figure as an embedded PNG; closes the figure."""
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    data = base64.b64encode(buffer.getvalue()).decode()
    return f'<img alt="plot" src="data:image/png;base64,{data}">'


def line_plot(
    series: Mapping[str, tuple[Sequence[float], Sequence[float]]], *, title: str, xlabel: str, ylabel: str
) -> str:
    """One line per named ``(x, y)`` series, as an embedded PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    for name, (xs, ys) in series.items():
        ax.plot(list(xs), list(ys), label=name, marker="." if len(xs) < 30 else None)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.3)
    if series:
        ax.legend()
    return figure_png(fig)


def bar_plot(values: Mapping[str, float], *, title: str, ylabel: str) -> str:
    """A bar per named value, as an embedded PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 3.4))
    ax.bar(list(values), list(values.values()), color="#3b5bdb")
    ax.set(title=title, ylabel=ylabel)
    ax.tick_params(axis="x", rotation=20)
    ax.grid(axis="y", alpha=0.3)
    return figure_png(fig)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, preformatted: bool = False) -> str:
    """An HTML table in its own scroll box: floats with 4 significant digits, ``None`` as an em dash, text left;
    with ``preformatted``, text cells keep their line breaks (prompts)."""
    text_class = "text pre" if preformatted else "text"

    def cell(value: Any) -> str:
        if value is None:
            return "<td>—</td>"
        if isinstance(value, float):
            return f"<td>{value:.4g}</td>"
        if isinstance(value, int):
            return f"<td>{value}</td>"
        return f'<td class="{text_class}">{breakable(str(value))}</td>'

    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(cell(v) for v in row) + "</tr>" for row in rows)
    return scroll_box(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")


def page(title: str, sections: Sequence[tuple[str, str]], *, subtitle: str = "") -> str:
    """A complete HTML document: a title, an optional subtitle and ``(heading, html)`` sections."""
    parts = [f"<h2>{html.escape(h)}</h2>\n{body}" for h, body in sections]
    sub = f'<p class="note">{breakable(subtitle)}</p>' if subtitle else ""
    head = (
        '<meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{html.escape(title)}</title><style>{_CSS}</style>"
    )
    body = f"<h1>{html.escape(title)}</h1>{sub}\n" + "\n".join(parts)
    return f'<!DOCTYPE html><html lang="en"><head>{head}</head><body>{body}</body></html>'
