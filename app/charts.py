"""Run statistics → plotly figures, rebuilt once per UI update.

Every figure keeps a constant `uirevision`, so plotly keeps the visitor's zoom and legend
choices and does not flash while the figure is replaced block after block.
"""

from __future__ import annotations

from collections.abc import Sequence

import plotly.graph_objects as go

from dflash_core.events import BlockEvent

from .session import BlockStat, RunStats, survival

HEIGHT = 300
COLORS = {"accepted": "#2e9d5b", "target": "#4c6ef5", "rejected": "#e03131", "plain": "#868e96", "tau": "#f08c00"}
MAX_CELL_CHARS = 6  # longer tokens are cut in heatmap cells (the hover shows them whole)


def _layout(fig: go.Figure, title: str, revision: str) -> go.Figure:
    fig.update_layout(
        title={"text": title, "font": {"size": 13}}, height=HEIGHT, uirevision=revision,
        margin={"l": 50, "r": 20, "t": 40, "b": 40},
        legend={"orientation": "h", "y": -0.25, "x": 0},
        template="plotly_white",
    )
    return fig


def _placeholder(fig: go.Figure, text: str) -> go.Figure:
    fig.add_annotation(text=text, showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5,
                       font={"color": "#868e96"})
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return fig


def _cell(text: str) -> str:
    """A token as a heatmap cell label: visible whitespace, cut short."""
    shown = text.replace("\n", "↵").replace(" ", "·") or "∅"
    return shown if len(shown) <= MAX_CELL_CHARS else shown[: MAX_CELL_CHARS - 1] + "…"


def heatmap_figure(ev: BlockEvent | None, step_texts: Sequence[Sequence[str]] | None = None) -> go.Figure:
    """Denoising of one block: position × step, colour = drafter confidence, text = token.

    `step_texts[s][i]`: token string at position i after step s (the caller decodes ids, so
    this module never needs a tokenizer). A bottom "target" row shows the verdict.
    """
    fig = go.Figure()
    if ev is None or not ev.steps:
        return _layout(_placeholder(fig, "no draft block yet"), "Denoising (current block)", "heatmap")
    n = len(ev.draft)
    xs = [str(i) for i in range(1, n + 1)]
    ys = [f"step {s + 1}" for s in range(len(ev.steps))]
    texts = [list(t) for t in step_texts] if step_texts else [[str(t) for t in st.tokens] for st in ev.steps]
    fixed_now = [
        ["fixed now" if st.fixed[i] and not (s and ev.steps[s - 1].fixed[i]) else
         ("fixed" if st.fixed[i] else "still masked") for i in range(n)]
        for s, st in enumerate(ev.steps)
    ]
    fig.add_trace(go.Heatmap(
        x=xs, y=ys, z=[st.probs for st in ev.steps], zmin=0.0, zmax=1.0, colorscale="Viridis",
        colorbar={"title": {"text": "p"}, "thickness": 10},
        text=[[_cell(t) for t in row] for row in texts], texttemplate="%{text}", textfont={"size": 10},
        customdata=[[[t, f] for t, f in zip(row, frow, strict=False)]
                    for row, frow in zip(texts, fixed_now, strict=False)],
        hovertemplate="pos %{x} · %{y}<br>token %{customdata[0]}<br>p=%{z:.3f} · %{customdata[1]}<extra></extra>",
        name="draft",
    ))
    # The verdict row: which positions the target kept, and where its own token went.
    acc = ev.accepted
    kept = [str(i + 1) for i in range(acc)]
    lost = [str(i + 1) for i in range(acc + 1, ev.checked)]  # position acc+1 holds the target's token instead
    unchecked = [str(i + 1) for i in range(max(ev.checked, acc + 1), n)]
    fig.add_trace(go.Scatter(x=kept, y=["target"] * len(kept), mode="markers", name="accepted",
                             marker={"symbol": "circle", "size": 12, "color": COLORS["accepted"]},
                             hovertemplate="pos %{x}: accepted<extra></extra>"))
    fig.add_trace(go.Scatter(x=lost, y=["target"] * len(lost), mode="markers", name="rejected",
                             marker={"symbol": "x", "size": 10, "color": COLORS["rejected"]},
                             hovertemplate="pos %{x}: rejected<extra></extra>"))
    if unchecked:
        fig.add_trace(go.Scatter(x=unchecked, y=["target"] * len(unchecked), mode="markers", name="not verified",
                                 marker={"symbol": "circle-open", "size": 9, "color": COLORS["plain"]},
                                 hovertemplate="pos %{x}: not verified (adaptive verify length)<extra></extra>"))
    target_text = ev.committed_text[-1] if ev.committed_text else str(ev.target_token)
    kind = "bonus" if acc == ev.checked else "correction"
    fig.add_trace(go.Scatter(x=[str(acc + 1)], y=["target"], mode="markers+text", name=f"target {kind}",
                             text=[_cell(target_text)], textposition="top center",
                             marker={"symbol": "diamond", "size": 13, "color": COLORS["target"]},
                             hovertemplate=f"pos %{{x}}: target {kind}<extra></extra>"))
    fig.update_yaxes(autorange="reversed", type="category", categoryorder="array", categoryarray=[*ys, "target"])
    fig.update_xaxes(title_text="position in block", type="category")
    title = f"Denoising · block {ev.index} · {acc}/{ev.checked} drafts accepted"
    if ev.checked < n:
        title += f" ({n} drafted)"
    return _layout(fig, title, "heatmap")


def acceptance_figure(stats: RunStats) -> go.Figure:
    """Per draft block: accepted drafts + the target's token (stacked), block size, running tau."""
    fig = go.Figure()
    blocks = stats.draft_blocks
    if not blocks:
        return _layout(_placeholder(fig, "no draft block yet"), "Acceptance per block", "acceptance")
    xs = [b.index for b in blocks]
    running, total = [], 0
    for k, b in enumerate(blocks, 1):
        total += b.accepted + 1
        running.append(total / k)
    fig.add_trace(go.Bar(x=xs, y=[b.accepted for b in blocks], name="accepted drafts",
                         marker_color=COLORS["accepted"]))
    fig.add_trace(go.Bar(x=xs, y=[1] * len(blocks), name="target token", marker_color=COLORS["target"]))
    fig.add_trace(go.Scatter(x=xs, y=[b.block_size for b in blocks], mode="lines", name="block size",
                             line={"dash": "dash", "color": COLORS["plain"]}))
    fig.add_trace(go.Scatter(x=xs, y=running, mode="lines+markers", name="running τ",
                             line={"color": COLORS["tau"]}, marker={"size": 4}))
    if any(b.verified != b.block_size for b in blocks):  # the adaptive verify length was at work
        fig.add_trace(go.Scatter(x=xs, y=[b.verified for b in blocks], mode="lines", name="verified",
                                 line={"dash": "dot", "color": COLORS["target"]}, line_shape="hv"))
    fig.update_layout(barmode="stack")
    fig.update_xaxes(title_text="block")
    fig.update_yaxes(title_text="tokens", rangemode="tozero")
    return _layout(fig, f"Acceptance per block · τ = {stats.tau:.2f}", "acceptance")


def position_figure(reply: Sequence[BlockStat], everything: Sequence[BlockStat]) -> go.Figure:
    """Acceptance by draft position, the diagnostic serving engines log: the share of draft blocks
    whose draft survived to position k, for this reply (bars) and every reply since Clear (line)."""
    fig = go.Figure()
    title = "Acceptance by position"
    if not everything:
        return _layout(_placeholder(fig, "no draft block yet"), title, "position")
    positions = max(b.block_size for b in everything) - 1
    xs = list(range(1, positions + 1))
    for name, blocks, bar in (("this reply", reply, True), ("all replies", everything, False)):
        if not blocks or (not bar and len(everything) == len(reply)):
            continue  # one reply so far: the line would only repeat the bars
        kept = survival(blocks, positions)
        rates = [k / len(blocks) for k in kept]
        hover = [f"{name}: {k} of {len(blocks)} blocks kept ≥ {x} drafts" for x, k in zip(xs, kept, strict=True)]
        if bar:
            fig.add_trace(go.Bar(x=xs, y=rates, name=f"{name} ({len(blocks)} blocks)", hovertext=hover,
                                 hoverinfo="text+y", marker_color=COLORS["accepted"]))
        else:
            fig.add_trace(go.Scatter(x=xs, y=rates, mode="lines+markers", name=f"{name} ({len(blocks)} blocks)",
                                     hovertext=hover, hoverinfo="text+y", line={"color": COLORS["tau"]}))
    fig.update_xaxes(title_text="draft position k", dtick=1)
    fig.update_yaxes(title_text="blocks that kept ≥ k drafts", tickformat=".0%", range=[0, 1.05])
    if reply:
        # The mean of "accepted ≥ k" summed over k is the mean accepted: τ − 1.
        title += f" · 1 + sum of the bars = τ = {1 + sum(survival(reply, positions)) / len(reply):.2f}"
    return _layout(fig, title, "position")


def speed_title(dflash: RunStats, plain: RunStats | None) -> str:
    title = f"DFlash {dflash.tokens_per_s:.1f} tok/s"
    if plain is not None and plain.blocks:
        title += f" · plain {plain.tokens_per_s:.1f} tok/s"
        if plain.finished is not None and plain.tokens_per_s > 0:
            title += f" · speed-up {dflash.tokens_per_s / plain.tokens_per_s:.2f}×"
    return title


def speed_figure(dflash: RunStats, plain: RunStats | None = None) -> go.Figure:
    """Tokens against engine time, for DFlash and (when compared) plain decoding."""
    fig = go.Figure()
    if not dflash.blocks:
        return _layout(_placeholder(fig, "no tokens yet"), "Speed", "speed")
    runs = [("DFlash", dflash, COLORS["target"])]
    if plain is not None and plain.blocks:
        runs.append(("plain", plain, COLORS["plain"]))
    for name, run, color in runs:
        fig.add_trace(go.Scatter(
            x=[0.0, *(b.engine_s for b in run.blocks)], y=[0, *(b.tokens for b in run.blocks)],
            mode="lines", name=name, line={"color": color, "shape": "hv"},
            hovertemplate=f"{name}: %{{y}} tokens at %{{x:.2f}} s<extra></extra>",
        ))
    fig.update_xaxes(title_text="engine time (s)", rangemode="tozero")
    fig.update_yaxes(title_text="tokens", rangemode="tozero")
    return _layout(fig, speed_title(dflash, plain), "speed")
