"""The benchmark's HTML report: one self-contained file (plotly.js inlined) that opens offline.

Built from the same summary the JSON report holds, so a report can be rendered later, on
another machine, from a JSON that came back from a GPU run:

    python -m app.bench_report bench/results.json --html bench/report.html [--readme README.md]

`bench --html` runs this module in a process of its own (`dflash_core.bench.html_renderer`) on the JSON it
has just written: the engine imports neither the app nor plotly.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from html import escape
from pathlib import Path
from typing import Any

import plotly.graph_objects as go
from plotly.offline import get_plotlyjs

from dflash_core.bench_stats import (
    TABLE_HEAD,
    hardware,
    legend,
    prompt_count,
    row_cells,
    write_readme,
    write_text_atomic,
)
from dflash_core.errors import DFlashError

from .charts import COLORS, HEIGHT

PER_PROMPT_PREVIEW = 90
CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #212529; }
table { border-collapse: collapse; margin: 1em 0; font-size: 0.9em; }
th, td { border-bottom: 1px solid #dee2e6; padding: 4px 10px; text-align: right; }
th:first-child, td:first-child { text-align: left; }
code { background: #f1f3f5; padding: 1px 4px; border-radius: 3px; }
.grid { display: grid; grid-template-columns: 1fr 1fr; gap: 1em; }
.meta { color: #495057; }
"""


def _style(fig: go.Figure, title: str) -> go.Figure:
    # The app's chart look (app/charts.py), minus uirevision: nothing here updates live.
    fig.update_layout(title={"text": title, "font": {"size": 13}}, height=HEIGHT + 60,
                      margin={"l": 50, "r": 20, "t": 40, "b": 40}, legend={"orientation": "h", "y": -0.3, "x": 0},
                      template="plotly_white")
    return fig


def _empty(title: str, why: str) -> go.Figure:
    fig = go.Figure()
    fig.add_annotation(text=why, showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5,
                       font={"color": COLORS["plain"]})
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return _style(fig, title)


def _color(stats: dict[str, Any]) -> str:
    return {"plain": COLORS["plain"], "dflash": COLORS["target"]}.get(stats["kind"], COLORS["tau"])


def _drafting(summary: dict[str, Any]) -> list[str]:
    return [n for n in summary["methods"] if summary["per_method"][n]["tau"] is not None]


def speed_figure(summary: dict[str, Any]) -> go.Figure:
    names, pm = summary["methods"], summary["per_method"]
    fig = go.Figure()
    fig.add_trace(go.Bar(x=names, y=[pm[n]["tokens_per_s_median"] for n in names], name="median over prompts",
                         marker_color=[_color(pm[n]) for n in names],
                         hovertemplate="%{x}: median %{y:.1f} tok/s<extra></extra>"))
    fig.add_trace(go.Scatter(x=names, y=[pm[n]["tokens_per_s_mean"] for n in names], mode="markers",
                             name="mean over prompts", marker={"symbol": "diamond", "size": 10, "color": "#212529"},
                             hovertemplate="%{x}: mean %{y:.1f} tok/s<extra></extra>"))
    fig.update_yaxes(title_text="tokens / s", rangemode="tozero")
    return _style(fig, "Tokens per second")


def tau_figure(summary: dict[str, Any]) -> go.Figure:
    pm = summary["per_method"]
    names = [n for n in _drafting(summary) if pm[n]["tau_hist"]]
    if not names:
        return _empty("τ histogram", "no DFlash method with per-block counts")
    fig = go.Figure()
    for n in names:
        hist = pm[n]["tau_hist"]
        total = sum(hist) or 1
        fig.add_trace(go.Bar(x=list(range(1, len(hist) + 1)), y=[100 * c / total for c in hist],
                             name=f"{n} (τ {pm[n]['tau']:.2f})", customdata=hist,
                             hovertemplate=f"{n}: %{{customdata}} blocks committed %{{x}} tokens"
                                           "<extra>%{y:.1f}%</extra>"))
    fig.update_layout(barmode="group")
    fig.update_xaxes(title_text="tokens committed per draft block (accepted + 1)", dtick=1)
    fig.update_yaxes(title_text="% of blocks", rangemode="tozero")
    return _style(fig, "τ histogram per DFlash method")


def time_figure(summary: dict[str, Any]) -> go.Figure:
    pm = summary["per_method"]
    names = [n for n in _drafting(summary) if pm[n]["verify_ms_per_block"] is not None]
    if not names:
        return _empty("Draft / verify time", "no engine-timed DFlash method")
    fig = go.Figure()
    fig.add_trace(go.Bar(x=names, y=[pm[n]["draft_ms_per_block"] or 0.0 for n in names], name="draft",
                         marker_color=COLORS["accepted"], hovertemplate="%{x}: draft %{y:.2f} ms<extra></extra>"))
    fig.add_trace(go.Bar(x=names, y=[pm[n]["verify_ms_per_block"] for n in names], name="verify (target)",
                         marker_color=COLORS["target"], hovertemplate="%{x}: verify %{y:.2f} ms<extra></extra>"))
    if summary.get("plain_step_ms"):
        fig.add_hline(y=summary["plain_step_ms"], line={"dash": "dash", "color": COLORS["plain"]},
                      annotation_text=f"plain: {summary['plain_step_ms']:.2f} ms/token (t1)",
                      annotation_position="top left")
    fig.update_layout(barmode="stack")
    fig.update_yaxes(title_text="ms per draft block", rangemode="tozero")
    return _style(fig, "Draft / verify time per block")


def bound_figure(summary: dict[str, Any]) -> go.Figure:
    pm = summary["per_method"]
    names = [n for n in _drafting(summary) if pm[n]["bound"] is not None and pm[n]["achieved"] is not None]
    if not names:
        return _empty("Achieved vs bound", "needs the plain method in the same run")
    fig = go.Figure()
    fig.add_trace(go.Bar(x=names, y=[pm[n]["bound"] for n in names], name="bound τ·t1/(tB+tdraft)",
                         marker_color=COLORS["plain"], opacity=0.5,
                         hovertemplate="%{x}: bound %{y:.2f}×<extra></extra>"))
    fig.add_trace(go.Bar(x=names, y=[pm[n]["bound"] * pm[n]["achieved"] for n in names],
                         name="measured speed-up vs plain", marker_color=COLORS["tau"],
                         customdata=[100 * pm[n]["achieved"] for n in names],
                         hovertemplate="%{x}: %{y:.2f}× (%{customdata:.0f}% of the bound)<extra></extra>"))
    fig.add_hline(y=1.0, line={"dash": "dot", "color": COLORS["rejected"]})
    fig.update_layout(barmode="group")
    fig.update_yaxes(title_text="speed-up vs plain", rangemode="tozero")
    return _style(fig, "Achieved vs bound")


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    th = "".join(f"<th>{escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"


def build_html(summary: dict[str, Any], per_prompt: Sequence[dict[str, Any]]) -> str:
    names, n_prompts = summary["methods"], summary["prompts"]
    methods_table = _table(["method", *TABLE_HEAD],
                           [[n, *row_cells(summary["per_method"][n], n_prompts)] for n in names])
    base, primary = summary["baseline"], summary["primary"]
    prompt_rows = [[r["prompt"][:PER_PROMPT_PREVIEW].replace("\n", " "), str(r["turns"]),
                    str(r.get(f"{base}_tokens", "")), "-" if r.get("tau") is None else f"{r['tau']:.2f}",
                    "yes" if r["match"] else "NO"] for r in per_prompt]
    prompts_table = _table(["prompt", "turns", f"{base} tokens", f"{primary} τ", "all match"], prompt_rows)
    figures = [speed_figure(summary), tau_figure(summary), time_figure(summary), bound_figure(summary)]
    charts = "".join(f"<div>{f.to_html(full_html=False, include_plotlyjs=False, config={'displaylogo': False})}</div>"
                     for f in figures)
    env = (f"{summary.get('date', '?')} · {hardware(summary)} · {summary.get('device', '?')} "
           f"{summary.get('dtype', '?')} · torch {summary.get('torch', '?')} · "
           f"transformers {summary.get('transformers', '?')}")
    run = (f"target {summary.get('target', '?')} · drafter {summary.get('draft', '?')} · prompt set "
           f"{summary.get('prompt_set', '?')} · {prompt_count(summary)} · ≤ {summary.get('max_new_tokens', '?')} new "
           f"tokens · T={summary.get('temperature', 0):g} · mismatches {summary['mismatches']}")
    how = "".join(f"<li>{escape(line)}</li>" for line in legend(summary))
    title = f"DFlash bench · {summary.get('target', '')} · {summary.get('date', '')}"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>
<style>{CSS}</style>
<script type="text/javascript">{get_plotlyjs()}</script>
</head><body>
<h1>DFlash bench</h1>
<p class="meta">{escape(env)}<br>{escape(run)}</p>
<p>Command: <code>{escape(summary.get("command", ""))}</code></p>
{methods_table}
<h2>How each number is computed</h2><ul>{how}</ul>
<div class="grid">{charts}</div>
<details><summary>Per prompt ({n_prompts})</summary>{prompts_table}</details>
</body></html>
"""


def write_html(path: str | Path, summary: dict[str, Any], per_prompt: Sequence[dict[str, Any]]) -> Path:
    return write_text_atomic(path, build_html(summary, per_prompt))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m app.bench_report",
                                description="Render a bench JSON report as HTML and/or the README table.")
    p.add_argument("report", help="JSON written by `python -m dflash_core bench --out`")
    p.add_argument("--html", default=None, metavar="R.html")
    p.add_argument("--readme", default=None, metavar="README.md")
    args = p.parse_args(argv)
    try:
        data = json.loads(Path(args.report).read_text(encoding="utf-8"))
        summary, per_prompt = data["summary"], data["per_prompt"]
        if "per_method" not in summary:
            raise DFlashError(f"{args.report} predates per-method statistics; rerun the bench")
        if args.html:
            print(f"wrote {write_html(args.html, summary, per_prompt)}", file=sys.stderr)
        if args.readme:
            print(f"wrote {write_readme(args.readme, summary)}", file=sys.stderr)
    except (OSError, ValueError, KeyError, DFlashError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
