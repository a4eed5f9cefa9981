"""One block's candidates as a picture: every node the target checked, at its block position,
coloured by the target's verdict, with the walked path along the top row.

One picture serves every verify mode. A tree block carries its candidates (`BlockEvent.tree`);
a chain is a one-branch tree drawn from `draft`, `accepted` and `verified`. The target's own
token is drawn as the first child of the last accepted node, so the top row, read left to right,
is exactly what the block committed; rejected alternatives hang below where they branched off.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass

import plotly.graph_objects as go

from dflash_core.events import BlockEvent

from .charts import COLORS, _layout, _placeholder
from .render import visible

ACCEPTED = "accepted"  # walked: the target agreed with it
REJECTED = "rejected"  # its parent was walked, but the target chose another token there
UNREACHED = "unreached"  # below a node the target did not walk: its verdict never counted
UNVERIFIED = "unverified"  # drafted but not sent to the target (the adaptive verify length)
TARGET = "target"  # the target's own token: a correction, or a bonus after a fully walked branch
VERDICTS = {  # legend name, marker colour, in legend order
    ACCEPTED: ("accepted (the target agreed)", COLORS["accepted"]),
    TARGET: ("the target's own token", COLORS["target"]),
    REJECTED: ("rejected (the target chose another token)", COLORS["rejected"]),
    UNREACHED: ("unreached (below a rejected node)", "#adb5bd"),
    UNVERIFIED: ("not verified (adaptive verify length)", "#dee2e6"),
}
SOURCES = {  # marker symbol, legend name
    "drafter": ("circle", "drafter's top-k"),
    "lookup": ("square", "prompt lookup"),
    "ngram": ("triangle-up", "n-gram table"),
}
SELECTOR_PATH = "the selector's path (DFlash 2)"
SELECTOR_COLOR = "#7048e8"
MAX_LABEL = 8  # characters of a token shown on its node (the hover shows it whole)
ROW_PX = 46  # one row: the token above its marker, the probability below
LABEL_FONT = 11


@dataclass
class Node:
    """A node as drawn: its place, its label and the target's verdict."""

    parent: int  # index into Picture.nodes; -1: the anchor
    depth: int  # block position (the anchor is 0)
    text: str
    source: str  # "drafter", "lookup", "ngram"; "target" for the target's own token
    verdict: str
    prob: float | None = None  # the drafter's probability of the token at this position
    rank: int | None = None  # 0: the drafter's first choice there
    score: float | None = None  # the tree's estimate that the target walks through it
    row: int = 0
    selector_path: bool = False  # DFlash 2: on the path the candidate selector chose


@dataclass
class Picture:
    """A block's nodes, the target's token last, each with a row: what `tree_figure` draws."""

    index: int
    kind: str  # "tree" or "chain"
    nodes: list[Node]
    anchor_text: str
    accepted: int
    rows: int = 1

    @property
    def candidates(self) -> list[Node]:
        return [n for n in self.nodes if n.verdict != TARGET]

    def count(self, verdict: str) -> int:
        return sum(n.verdict == verdict for n in self.nodes)

    def guesses(self, source: str) -> int:
        return sum(n.source == source for n in self.nodes)


def _plain(text: str) -> str:
    """Text for plotly, which reads a few HTML tags and entities: a token "<br>" must show as itself."""
    return html.escape(visible(text), quote=False)


def label(text: str) -> str:
    """A token as a node label: whitespace made visible, cut short."""
    shown = visible(text.replace(" ", "·").replace("\n", "↵").replace("\t", "⇥")) or "∅"
    return html.escape(shown if len(shown) <= MAX_LABEL else shown[: MAX_LABEL - 1] + "…", quote=False)


def anchor_text(events: Sequence[BlockEvent], ev: BlockEvent) -> str:
    """The block's anchor: the last token the event before it committed."""
    before = next((e for e in events if e.index == ev.index - 1), None)
    return before.committed_text[-1] if before is not None and before.committed_text else ""


def _target_text(ev: BlockEvent) -> str:
    if ev.tree is not None:
        return ev.tree.target_text
    # The reply may have ended inside the block (EOS, a stop string): then the token was not committed.
    return ev.committed_text[ev.accepted] if len(ev.committed_text) > ev.accepted else f"#{ev.target_token}"


def picture(ev: BlockEvent | None, anchor: str = "") -> Picture | None:
    """The nodes of a draft block with their verdicts and rows; None for the prefill and plain steps."""
    if ev is None or not ev.is_draft_block:
        return None
    tree = ev.tree
    if tree is not None:
        walked = set(tree.walked)
        open_ = {-1, *walked}  # the nodes whose children the target's choice decided
        nodes = [Node(n.parent, n.depth, n.text, n.source,
                      ACCEPTED if i in walked else REJECTED if n.parent in open_ else UNREACHED,
                      n.prob, n.rank, n.score, selector_path=n.selector_path) for i, n in enumerate(tree.nodes)]
        last, kind = (tree.walked[-1] if tree.walked else -1), "tree"
    else:
        probs = ev.steps[-1].probs if ev.steps else []
        nodes = []
        for i in range(len(ev.draft)):
            verdict = (ACCEPTED if i < ev.accepted else UNVERIFIED if i >= ev.checked
                       else REJECTED if i == ev.accepted else UNREACHED)
            nodes.append(Node(i - 1, i + 1, ev.draft_text[i] if i < len(ev.draft_text) else "?", "drafter",
                              verdict, probs[i] if i < len(probs) else None))  # sampled: not its first choice
        last, kind = ev.accepted - 1, "chain"
    nodes.append(Node(last, ev.accepted + 1, _target_text(ev), "target", TARGET))
    pic = Picture(ev.index, kind, nodes, anchor, ev.accepted)
    pic.rows = _place(nodes)
    return pic


def _place(nodes: list[Node]) -> int:
    """Rows, depth first: a node's first child stays on its row, later children start new rows
    below everything drawn so far, so no edge crosses another. The walked child (or the target's
    token) goes first, which keeps the committed path on row 0. Returns the number of rows."""
    children: dict[int, list[int]] = {}
    for i, n in enumerate(nodes):
        children.setdefault(n.parent, []).append(i)
    rows = 1

    def visit(node: int, row: int) -> None:
        nonlocal rows
        if node >= 0:
            nodes[node].row = row
        # stable: after the walked child, the rest stay best first
        kids = sorted(children.get(node, []), key=lambda i: nodes[i].verdict not in (ACCEPTED, TARGET))
        for j, kid in enumerate(kids):
            if j == 0:
                visit(kid, row)
            else:
                rows += 1
                visit(kid, rows - 1)

    visit(-1, 0)  # a tree is at most a block deep: the recursion stays shallow
    return rows


def _ordinal(rank: int) -> str:
    n = rank + 1
    return {1: "first", 2: "2nd", 3: "3rd"}.get(n, f"{n}th")


def _origin(n: Node) -> str:
    drafter = f"the drafter's {_ordinal(n.rank)} choice here, p = {n.prob:.2f}" if n.rank is not None else ""
    if n.source == "drafter":
        if drafter:
            return drafter
        return f"the drafter's draft here, p = {n.prob:.2f}" if n.prob is not None else "the drafter's draft"
    guess = "a prompt-lookup guess (what followed these tokens earlier)" if n.source == "lookup" else \
        "a guess from the drafter's n-gram table (what the target usually writes next)"
    return f"{guess}; also {drafter}" if drafter else guess


def _hover(pic: Picture, i: int, choice: dict[int, str]) -> str:
    n = pic.nodes[i]
    lines = [f"<b>{_plain(repr(n.text))}</b> · position {n.depth}"]
    if n.verdict == TARGET:
        kind = "a correction" if any(m.verdict == REJECTED and m.parent == n.parent for m in pic.nodes) else "a bonus"
        lines.append(f"the target's own token, {kind}: committed after the accepted drafts")
    else:
        lines.append(_origin(n))
        if n.selector_path:
            lines.append("on the path the candidate selector chose (the drafter's chain)")
        if n.score is not None:
            lines.append(f"the tree's estimate that the target walks here: {n.score:.2f}")
        lines.append({
            ACCEPTED: "accepted: the target's own choice here",
            REJECTED: f"rejected: the target chose {_plain(repr(choice.get(n.parent, '?')))} here",
            UNREACHED: "unreached: a node above it was rejected, so its verdict did not count",
            UNVERIFIED: "not verified: drafted, but the adaptive verify length did not send it to the target",
        }[n.verdict])
    return "<br>".join(lines)


def _title(pic: Picture, checked: int) -> str:
    n = len(pic.candidates)
    if pic.kind == "tree":
        counts = [(pic.guesses(s), name) for s, name in (("lookup", "prompt-lookup"), ("ngram", "n-gram"))]
        guesses = [f"{k} {name}" for k, name in counts if k]
        plural = "guess" if sum(k for k, _ in counts) == 1 else "guesses"
        what = f"a tree of {n} candidates" + (f" ({', '.join(guesses)} {plural})" if guesses else "")
    else:
        what = f"a chain of {n} drafts" + (f", {checked} verified" if checked < n else "")
    return (f"Block {pic.index} · {what} · {pic.accepted} accepted + the target's own token"
            "<br><sup>the top row is what the block committed · hover a node for its probability and verdict</sup>")


def _legend(fig: go.Figure, name: str, symbol: str, color: str) -> None:
    fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=name, hoverinfo="skip",
                             marker={"symbol": symbol, "size": 11, "color": color}))


def tree_figure(ev: BlockEvent | None, anchor: str = "", title: str = "Candidates of a block") -> go.Figure:
    """The picture of one draft block (the latest one, or the one picked); a note for anything else."""
    fig = go.Figure()
    pic = picture(ev, anchor)
    if pic is None:
        what = "no draft block yet" if ev is None else f"block {ev.index} has no draft (the target's own token only)"
        return _layout(_placeholder(fig, what), title, "tree")
    assert ev is not None
    nodes = pic.nodes
    choice = {n.parent: n.text for n in nodes if n.verdict in (ACCEPTED, TARGET)}
    xy = [(0, 0), *((n.depth, n.row) for n in nodes)]  # the anchor, then the nodes

    def edges(keep: set[str], name: str, line: dict[str, object]) -> None:
        xs: list[float | None] = []
        ys: list[float | None] = []
        for n in nodes:
            if n.verdict in keep:
                px, py = xy[n.parent + 1]
                xs += [px, n.depth, None]
                ys += [py, n.row, None]
        if xs:
            fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", line=line, hoverinfo="skip", showlegend=False,
                                     name=name))

    edges({REJECTED, UNREACHED}, "branches", {"color": "#ced4da", "width": 1.5})
    edges({UNVERIFIED}, "not verified", {"color": "#dee2e6", "width": 1.5, "dash": "dot"})
    edges({ACCEPTED, TARGET}, "committed path", {"color": COLORS["accepted"], "width": 4})
    path = [i for i, n in enumerate(nodes) if n.selector_path]
    if path:  # DFlash 2: the selector's chain, over whatever the target made of it
        fig.add_trace(go.Scatter(x=[0, *(nodes[i].depth for i in path)], y=[0, *(nodes[i].row for i in path)],
                                 mode="lines", line={"color": SELECTOR_COLOR, "width": 2, "dash": "dash"},
                                 hoverinfo="skip", name=SELECTOR_PATH))
    fig.add_trace(go.Scatter(
        x=[0], y=[0], mode="markers+text", text=[label(pic.anchor_text) if pic.anchor_text else "anchor"],
        textposition="top center", textfont={"size": LABEL_FONT}, name="anchor",
        marker={"size": 14, "color": "#495057", "symbol": "circle"}, showlegend=False,
        hovertext=["the anchor: the last committed token; every candidate continues from it"], hoverinfo="text"))
    for verdict, (name, color) in VERDICTS.items():
        idx = [i for i, n in enumerate(nodes) if n.verdict == verdict]
        if not idx:
            continue
        fig.add_trace(go.Scatter(
            x=[nodes[i].depth for i in idx], y=[nodes[i].row for i in idx], mode="markers+text", name=name,
            text=[label(nodes[i].text) for i in idx], textposition="top center", textfont={"size": LABEL_FONT},
            marker={"size": 18 if verdict == TARGET else 15, "color": color, "line": {"width": 1, "color": "#fff"},
                    "symbol": ["diamond" if verdict == TARGET else SOURCES.get(nodes[i].source, ("circle",))[0]
                               for i in idx]},
            hovertext=[_hover(pic, i, choice) for i in idx], hoverinfo="text", showlegend=False))
        # The legend's own marker: a trace's legend entry shows its first node's symbol, a source's mark
        _legend(fig, name, "diamond" if verdict == TARGET else "circle", color)
    # Probabilities under the markers: the drafter's own, or "guess" for a guess it did not rank.
    under = [(n, f"{n.prob:.0%}" if n.prob is not None else "guess") for n in nodes if n.verdict != TARGET]
    fig.add_trace(go.Scatter(
        x=[n.depth for n, _ in under], y=[n.row for n, _ in under], mode="markers+text", text=[t for _, t in under],
        marker={"size": 15, "opacity": 0},  # invisible: it sets the text below the node's marker, not on it
        textposition="bottom center", textfont={"size": 9, "color": "#868e96"}, hoverinfo="skip",
        showlegend=False, name="drafter probability"))
    for source, (symbol, name) in SOURCES.items():
        if source == "drafter" or pic.guesses(source):
            _legend(fig, name, symbol, "#868e96")
    depth = max(n.depth for n in nodes)
    plot_px = ROW_PX * (pic.rows + 0.4)  # the y range below spans rows + 0.4 rows
    # gradio raises a labelled plot's top margin to 100 px; asking for it keeps the rows' spacing.
    margin = {"l": 20, "r": 20, "t": 100, "b": 100}
    height = round(plot_px) + margin["t"] + margin["b"]
    _layout(fig, _title(pic, ev.checked), "tree")
    fig.update_layout(height=height, margin=margin, hovermode="closest",
                      legend={"orientation": "h", "x": 0, "y": -60 / plot_px, "yanchor": "top"})
    fig.update_xaxes(tickvals=list(range(depth + 1)), ticktext=["anchor", *map(str, range(1, depth + 1))],
                     range=[-0.6, depth + 0.6], showgrid=False, zeroline=False, title_text="position in block")
    fig.update_yaxes(visible=False, range=[pic.rows - 0.4, -0.8], showgrid=False, zeroline=False)
    return fig
