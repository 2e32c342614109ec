"""Self-contained HTML pieces (inline CSS, plots as embedded PNG): no external scripts or fonts."""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Mapping, Sequence
from typing import Any

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2rem auto;
max-width:1100px;color:#1d2330;line-height:1.45;padding:0 1rem}
h1{font-size:1.6rem;border-bottom:2px solid #3b5bdb;padding-bottom:.3rem}h2{font-size:1.25rem;margin-top:2rem}
table{border-collapse:collapse;margin:.6rem 0;font-size:.92rem}th,td{border:1px solid #ccd;
padding:.3rem .6rem;text-align:right}th{background:#eef1fb}td:first-child,th:first-child{text-align:left}
.pass{color:#0b7a2a;font-weight:600}.fail{color:#b3261e;font-weight:600}.skip{color:#8a6d00;font-weight:600}
img{max-width:100%;height:auto}.note{color:#556;font-size:.9rem}
"""


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


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """An HTML table; floats are shown with 4 significant digits, ``None`` as an em dash."""

    def cell(value: Any) -> str:
        if value is None:
            return "—"
        if isinstance(value, float):
            return f"{value:.4g}"
        return html.escape(str(value))

    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{cell(v)}</td>" for v in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def page(title: str, sections: Sequence[tuple[str, str]], *, subtitle: str = "") -> str:
    """A complete HTML document: a title, an optional subtitle and ``(heading, html)`` sections."""
    parts = [f"<h2>{html.escape(h)}</h2>\n{body}" for h, body in sections]
    sub = f'<p class="note">{html.escape(subtitle)}</p>' if subtitle else ""
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{_CSS}</style></head><body><h1>{html.escape(title)}</h1>{sub}\n" + "\n".join(parts) + "</body></html>"
    )
