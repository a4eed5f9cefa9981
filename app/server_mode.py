"""The Studio watching a DFlash server (`launch.py --server URL`): chat through an OpenAI-compatible
server (vLLM, SGLang) and chart what it reports per reply.

The server decodes; this app only streams its replies and reads its speculation counters before and
after each one (dflash_core.server_client). So it shows per reply what a server can tell: tokens/s
measured here (HTTP included), mean acceptance length τ and acceptance by draft position. What needs
the drafts themselves (per-token colours, the candidate tree, step mode, the race) needs the local
engine, which the header says in one line. Every server failure is one line in the status, never a
traceback.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import gradio as gr
import plotly.graph_objects as go

from dflash_core.errors import DFlashError
from dflash_core.server_client import ServerClient, ServerInfo, ServerReply, SpecCounters

from .charts import COLORS, _layout, _placeholder

LOCAL_ONLY = ("Per-token colours, the candidate tree, step mode and the race with plain decoding need the "
              "drafts themselves: run `python launch.py` without `--server` for them.")
SERVER = "server"  # the concurrency group of every event that talks to the server


@dataclass
class ServerSession:
    """One visitor's conversation with the server and the figures of each reply."""

    messages: list[dict[str, str]] = field(default_factory=list)
    replies: list[ServerReply] = field(default_factory=list)


def pooled(replies: Sequence[ServerReply]) -> SpecCounters | None:
    """All replies' counters added up: their τ weighs each reply by its drafts."""
    parts = [r.spec for r in replies if r.spec is not None]
    if not parts:
        return None
    return sum(parts, SpecCounters())


def stats_line(replies: Sequence[ServerReply], status: str = "") -> str:
    if status:
        return status
    if not replies:
        return "Ask something: the server answers, and its speculation figures appear below."
    r = replies[-1]
    parts = [f"**{r.tokens_per_s:.1f} tok/s**", f"{r.completion_tokens} tokens", f"finish: {r.finish_reason}"]
    if r.tau is not None:
        parts.insert(0, f"**τ {r.tau:.2f}**")
    if r.first_token_s is not None:
        parts.append(f"first token {r.first_token_s:.2f} s")
    total = pooled(replies)
    if total is not None and len(replies) > 1 and total.mean_acceptance_length is not None:
        parts.append(f"τ over {len(replies)} replies {total.mean_acceptance_length:.2f}")
    line = " · ".join(parts)
    return line + "".join(f"\n\n⚠️ {n}" for n in r.notes)


def speed_figure(replies: Sequence[ServerReply]) -> go.Figure:
    fig = _layout(go.Figure(), "Tokens/s per reply (timed here, HTTP included)", "server-speed")
    if not replies:
        return _placeholder(fig, "no reply yet")
    x = list(range(1, len(replies) + 1))
    fig.add_bar(x=x, y=[r.tokens_per_s for r in replies], name="tok/s", marker_color=COLORS["target"],
                hovertemplate="reply %{x}: %{y:.1f} tok/s<extra></extra>")
    fig.update_xaxes(dtick=1)  # no axis title: the legend sits below the plot (charts._layout)
    fig.update_yaxes(title="tokens/s", rangemode="tozero")
    return fig


def acceptance_figure(replies: Sequence[ServerReply], info: ServerInfo | None) -> go.Figure:
    fig = _layout(go.Figure(), "Mean acceptance length τ per reply", "server-tau")
    if info is not None and not info.speculative:
        return _placeholder(fig, "the server reports no speculation")
    spec = [(i, r.tau) for i, r in enumerate(replies, 1) if r.tau is not None]
    if not spec:
        return _placeholder(fig, "no reply yet")
    fig.add_bar(x=[i for i, _ in spec], y=[t for _, t in spec], name="τ (accepted + 1 per draft)",
                marker_color=COLORS["accepted"], hovertemplate="reply %{x}: τ %{y:.2f}<extra></extra>")
    fig.add_scatter(x=[i for i, _ in spec], y=[_running_tau(replies[:i]) for i, _ in spec], mode="lines+markers",
                    name="running τ", line={"color": COLORS["tau"]})
    fig.update_xaxes(dtick=1)
    fig.update_yaxes(title="tokens per target forward", rangemode="tozero")
    return fig


def _running_tau(replies: Sequence[ServerReply]) -> float | None:
    total = pooled(replies)
    return None if total is None else total.mean_acceptance_length


def position_figure(replies: Sequence[ServerReply], info: ServerInfo | None) -> go.Figure:
    """Per draft position, the share of drafts accepted that far: the last reply and all of them."""
    fig = _layout(go.Figure(), "Acceptance by draft position", "server-position")
    if info is not None and not info.speculative:
        return _placeholder(fig, "the server reports no speculation")
    last = next((r.spec for r in reversed(replies) if r.spec is not None and r.spec.per_position), None)
    total = pooled(replies)
    if last is None or total is None:
        return _placeholder(fig, "no reply yet")
    for name, counters, color in (("last reply", last, COLORS["accepted"]), ("all replies", total, COLORS["plain"])):
        rates = counters.position_rates
        fig.add_scatter(x=list(range(1, len(rates) + 1)), y=rates, mode="lines+markers", name=name,
                        line={"color": color}, hovertemplate="position %{x}: %{y:.0%}<extra></extra>")
    fig.update_xaxes(dtick=1, range=[0.5, len(last.per_position) + 0.5])
    fig.update_yaxes(title="drafts accepted this far", tickformat=".0%", range=[0, 1.02])
    return fig


def header_markdown(client: ServerClient, info: ServerInfo | None, error: str | None) -> str:
    if info is None:
        where = f"the server at `{client.url}`"
        note = f"⚠️ {error}" if error else ""
    else:
        where = f"**{info.model}** at `{client.url}`"
        note = ("" if info.speculative else
                "⚠️ This server reports no speculative decoding (no `vllm:spec_decode_*` counters on its "
                "/metrics): replies and tokens/s only. Start it with a drafter (docs/serving.md).")
    return "\n\n".join(p for p in (f"# DFlash Studio — watching a server\nReplies come from {where}; "
                                   "τ and acceptance by position are the server's own counters, read before "
                                   f"and after each reply. {LOCAL_ONLY}", note) if p)


def build_server_app(client: ServerClient) -> gr.Blocks:
    info: ServerInfo | None = None
    error: str | None = None
    try:
        info = client.info()
    except DFlashError as e:
        error = str(e)  # shown in the header; each Send tries the server again

    def current_info() -> ServerInfo:
        nonlocal info
        info = info or client.info()
        return info

    def view(session: ServerSession, status: str = "") -> tuple[Any, ...]:
        return (session.messages, stats_line(session.replies, status), speed_figure(session.replies),
                acceptance_figure(session.replies, info), position_figure(session.replies, info))

    def chat(text: str, session: ServerSession, max_new: float, temperature: float) -> Iterator[tuple[Any, ...]]:
        text = (text or "").strip()
        if not text:
            yield ("", session, *view(session, "Type a message first."))
            return
        asked = [*session.messages, {"role": "user", "content": text}]
        shown = ServerSession(asked, session.replies)
        yield ("", session, *view(shown, "waiting for the server …"))
        reply = None
        try:
            current_info()
            for part in client.stream_chat(asked, max_tokens=int(max_new), temperature=float(temperature)):
                if isinstance(part, ServerReply):
                    reply = part
                else:
                    shown.messages = [*asked, {"role": "assistant", "content": part}]
                    yield ("", session, *view(shown, "streaming …"))
        except DFlashError as e:
            # The question stays out of the conversation: sending it again is the natural retry.
            yield (text, session, *view(session, f"⚠️ {e}"))
            return
        assert reply is not None
        session.messages = [*asked, {"role": "assistant", "content": reply.text}]
        session.replies = [*session.replies, reply]
        yield ("", session, *view(session))

    def clear(session: ServerSession) -> tuple[Any, ...]:
        fresh = ServerSession()
        return (fresh, *view(fresh))

    with gr.Blocks(title="DFlash Studio — server") as demo:
        state = gr.State(ServerSession())
        gr.Markdown(header_markdown(client, info, error), elem_id="dflash-header")
        with gr.Row():
            with gr.Column(scale=1, min_width=240):
                temperature = gr.Slider(0.0, 1.5, value=0.0, step=0.05, label="temperature", info="0 = greedy")
                max_new = gr.Slider(1, 1024, value=128, step=1, label="max new tokens")
            with gr.Column(scale=4):
                chatbot = gr.Chatbot(label="Chat", height=420, buttons=["copy"], elem_id="chatbot")
                with gr.Row():
                    msg = gr.Textbox(placeholder="Ask something…", show_label=False, scale=6, lines=1, max_lines=8,
                                     elem_id="prompt")
                    send = gr.Button("Send", variant="primary", scale=1, min_width=80)
                    clear_btn = gr.Button("Clear", scale=1, min_width=80)
                stats = gr.Markdown(stats_line([]), elem_id="stats-line")
                with gr.Row():
                    speed = gr.Plot(speed_figure([]), label="Speed", elem_id="speed")
                    acc = gr.Plot(acceptance_figure([], info), label="Acceptance", elem_id="acceptance")
                    position = gr.Plot(position_figure([], info), label="Acceptance by position",
                                       elem_id="position-chart")
        outs = [chatbot, stats, speed, acc, position]
        kwargs: dict[str, Any] = {"concurrency_id": SERVER, "show_progress": "minimal"}
        send.click(chat, [msg, state, max_new, temperature], [msg, state, *outs], api_name="chat", **kwargs)
        msg.submit(chat, [msg, state, max_new, temperature], [msg, state, *outs], api_name="chat_submit",
                   api_visibility="undocumented", **kwargs)
        clear_btn.click(clear, [state], [state, *outs], api_name="clear", **kwargs)
    # One reply at a time: the server's counters are shared, so two replies at once would mix
    # their figures (a server shared with others still can: the reply's note says so).
    demo.queue(default_concurrency_limit=1)
    return demo
