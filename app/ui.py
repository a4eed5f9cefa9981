"""The Gradio app: layout and event wiring. Rendering lives in render.py, charts.py and tree_view.py.

One generation runs at a time (every engine-using event shares the "generate" concurrency
group); Stop has its own group, so it is served while a generation holds the engine.
Step mode's logic lives in step.py, the "How it works" text in teach.py.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gradio as gr

from dflash_core.config import MAX_BLOCK_SIZE, MIN_BLOCK_SIZE, VERIFY_MODES, GenerationConfig
from dflash_core.engine import Engine
from dflash_core.errors import DFlashError
from dflash_core.events import Finished

from . import charts, race, step, teach, tree_view
from .history import begin_reply
from .hosting import Decorator
from .inputs import generation_config
from .render import render_view
from .session import RunStats, Session

ASSETS = Path(__file__).resolve().parent.parent / "assets"
CSS_PATH = ASSETS / "style.css"
EXAMPLES_PATH = ASSETS / "examples.json"
GENERATE = "generate"  # the concurrency group of every event that runs the engine
# On a fast GPU blocks take milliseconds; re-sending the HTML and three figures for each one
# would flood the browser. Updates are therefore spaced at least this far apart (the last
# state is always sent). On CPU every block takes longer than this, so each one shows.
MIN_UPDATE_S = 0.1
# gr.Plot has no click event, so a click on a bar of "Acceptance per block" is caught in the browser
# (plotly_click on the chart's plot div, which gradio keeps across updates) and typed into the tree's
# block slider; its change event then draws that block's tree.
PICK_BLOCK_JS = """() => {
    const bind = () => {
        const plot = document.querySelector('#acceptance .js-plotly-plot');
        if (!plot || !plot.on || plot.dataset.pickBlock) return;
        plot.dataset.pickBlock = '1';
        plot.on('plotly_click', (ev) => {
            const box = document.querySelector('#tree-block input[type=number]');
            const x = ev && ev.points && ev.points.length ? ev.points[0].x : null;
            if (!box || box.disabled || x === null) return;
            box.value = String(x);
            box.dispatchEvent(new Event('input', {bubbles: true}));
            document.getElementById('tree-view')?.scrollIntoView({behavior: 'smooth', block: 'nearest'});
        });
    };
    new MutationObserver(bind).observe(document.body, {childList: true, subtree: true});
    bind();
}"""

Update = tuple[Any, ...]


def load_examples(path: Path = EXAMPLES_PATH) -> list[dict[str, str]]:
    return json.loads(path.read_text())


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def stats_line(session: Session, status: str = "") -> str:
    """The one-line summary under the chat: tau, speed, speed-up, draft/verify time share."""
    d, p = session.dflash, session.plain
    if not d.blocks:  # prefill: a note (e.g. turns left out of a long chat) shows already
        return (status or "Ask something to see DFlash at work.") + _notes(session)
    parts = [f"**τ {d.tau:.2f}**", f"**{d.tokens_per_s:.1f} tok/s**"]
    if p is not None and p.blocks:
        parts.append(f"plain {p.tokens_per_s:.1f} tok/s")
        if p.finished is not None and p.tokens_per_s > 0:
            parts.append(f"**speed-up {d.tokens_per_s / p.tokens_per_s:.2f}×**")
    if d.draft_blocks:
        parts.append(f"draft {_pct(d.draft_share)} / verify {_pct(1 - d.draft_share)}")
    parts.append(f"{d.tokens} tokens in {len(d.draft_blocks) or len(d.blocks)} blocks")
    if d.finished is not None:
        parts.append(f"finished: {d.finished.reason}")
    # Exactness is a token-for-token claim only for greedy decoding; with sampling the two
    # runs draw from the same distribution but not the same sample.
    compared = p is not None and p.finished is not None and p.finished.reason != "cancelled"
    if compared and d.finished is not None and session.greedy:
        same = p.finished.token_ids == d.finished.token_ids
        parts.append("plain output identical ✓" if same else "plain output DIFFERS ✗")
    line = " · ".join(parts) + _notes(session)
    return f"{status}  \n{line}" if status else line


def _notes(session: Session) -> str:
    return "  \n⚠️ " + "; ".join(session.notes) if session.notes else ""


def waiting_in_queue(demo: gr.Blocks, request: gr.Request | None) -> bool:
    """Whether this visitor has an event still waiting in Gradio's queue (not yet started). Gradio
    keeps no public record of it; where its internals differ, a Stop reaches running replies only."""
    try:
        queues = demo._queue.event_queue_per_concurrency_id.values()
        return request is not None and any(e.session_hash == request.session_hash for q in queues for e in q.queue)
    except AttributeError:
        return False


def build_app(engine: Engine, gpu: Decorator | None = None) -> gr.Blocks:
    """The whole app around one loaded engine. Call `.launch(**launch_kwargs())` to serve it.

    `gpu`: a decorator for the handlers that run the engine (`spaces.GPU` on ZeroGPU), else None.
    """
    drafter = engine.drafter
    default_block = drafter.block_size if drafter is not None else MIN_BLOCK_SIZE
    examples = load_examples()

    def step_texts(session: Session) -> list[list[str]] | None:
        ev = session.current_block
        if ev is None:
            return None
        return [engine.target.token_strings(st.tokens) for st in ev.steps]

    def tree_of(session: Session, index: int | None = None) -> Any:
        """The tree picture of block `index` of the latest reply (None: its latest draft block)."""
        ev = session.current_block if index is None else session.event(index)
        return tree_view.tree_figure(ev, "" if ev is None else tree_view.anchor_text(session.events, ev))

    def view(session: Session, status: str = "") -> Update:
        """chatbot, speculation view, heatmap, acceptance, by position, speed, tree, race, stats."""
        fin = session.dflash.finished
        keep = len(fin.token_ids) if fin is not None else None
        return (
            session.chat_messages(),
            render_view(session.events, keep, decode=engine.target.decode),
            charts.heatmap_figure(session.current_block, step_texts(session)),
            charts.acceptance_figure(session.dflash),
            charts.position_figure(session.dflash.draft_blocks, session.all_draft_blocks),
            charts.speed_figure(session.dflash, session.plain),
            tree_of(session),
            race.race_html(session.dflash, session.plain, session.dflash_text, session.plain_text, session.greedy),
            stats_line(session, status),
        )

    def make_config(block_size: float, steps: float, temperature: float, top_p: float, max_new: float,
                    seed: float, verify: str = "auto") -> GenerationConfig:
        try:
            return generation_config(block_size, steps, temperature, top_p, max_new, seed, verify,
                                     drafted=drafter is not None)
        except DFlashError as e:
            raise gr.Error(str(e)) from None

    def run_reply(session: Session, text: str, cfg: GenerationConfig, racing: bool) -> Iterator[Update]:
        """Stream one reply block by block; `racing`: with plain decoding streamed beside it (race.py)."""
        plain_only = drafter is None  # `--draft none`: the app still chats, without speculation
        try:
            # Only the turns that fit the context window go to the model (history.py).
            messages, events = begin_reply(session, engine, text, cfg, plain=plain_only)
        except DFlashError as e:
            raise gr.Error(str(e)) from None
        if racing and not plain_only:
            # Both runs share the Stop flag, so one press stops both within a block.
            session.plain = RunStats()
            stream = race.race(events, engine.generate(messages, cfg, plain=True, cancel=session.cancel))
        else:
            stream = (("dflash", ev) for ev in events)
        try:
            yield view(session, "prefill…")
            last = time.monotonic()
            for side, ev in stream:
                if side == "plain":
                    session.on_plain(ev)
                elif isinstance(ev, Finished):
                    session.finish(ev)
                else:
                    session.on_event(ev)
                if isinstance(ev, Finished) or time.monotonic() - last < MIN_UPDATE_S:
                    continue
                if session.plain is None:
                    status = f"generating… block {ev.index}"
                else:
                    status = f"racing… DFlash {session.dflash.tokens} tokens · plain {session.plain.tokens} tokens"
                yield view(session, status)
                last = time.monotonic()
            yield view(session)
        finally:
            # A failure or a closed connection mid-reply: keep what streamed as the answer,
            # so history stays a clean user/assistant alternation; a race's plain run is closed too.
            close = getattr(stream, "close", None)
            if close is not None:
                close()
            session.abort()

    def chat(text: str, session: Session, block_size: float, steps: float, temperature: float, top_p: float,
             max_new: float, seed: float, compare: bool, verify: str = "auto") -> Iterator[Update]:
        if not (text or "").strip():
            yield (gr.skip(), *view(session))
            return
        cfg = make_config(block_size, steps, temperature, top_p, max_new, seed, verify)
        first = True
        for update in run_reply(session, text, cfg, compare):
            # Empty the textbox once; later updates must not wipe what the visitor types next.
            yield ("" if first else gr.skip(), *update)
            first = False

    def regenerate(session: Session, block_size: float, steps: float, temperature: float, top_p: float,
                   max_new: float, seed: float, compare: bool, verify: str = "auto") -> Iterator[Update]:
        text = session.pop_last_turn()
        if text is None:
            yield view(session)
            return
        cfg = make_config(block_size, steps, temperature, top_p, max_new, seed, verify)
        yield from run_reply(session, text, cfg, compare)

    def stop(session: Session, request: gr.Request) -> None:
        # The engine checks this flag before each block, so it halts within one block.
        session.request_stop(queued=waiting_in_queue(demo, request))

    def halt(session: Session) -> None:
        # Regenerate and Clear: stop a running reply (not the one they are about to start).
        session.cancel.set()

    def clear(session: Session) -> Update:
        session.reset()
        return view(session)

    def next_block(text: str, session: Session, block_size: float, steps: float, temperature: float,
                   top_p: float, max_new: float, seed: float, compare: bool, verify: str = "auto") -> Update:
        """Step mode: a prompt in the textbox starts a stepped reply; each click runs one more block."""
        if (text or "").strip():
            cfg = make_config(block_size, steps, temperature, top_p, max_new, seed, verify)
            try:
                step.start(session, engine, text, cfg, plain=drafter is None)
            except DFlashError as e:
                raise gr.Error(str(e)) from None
        elif session.stepper is None:
            return (gr.skip(), *view(session, "Type a prompt, then press **Next block** to step through its reply."),
                    step.step_html(None, session), teach.reply_page(session))
        result = step.advance(session)
        status = "step mode: finished" if result.finished else f"step mode: block {len(session.events) - 1} done"
        return ("", *view(session, status), step.step_html(result, session), teach.reply_page(session))

    def side_panels(session: Session) -> tuple[str, str]:
        """The Step panel and the "How it works" text, refreshed after a streamed reply or Clear."""
        return step.step_html(None, session), teach.reply_page(session)

    def pictures(session: Session) -> tuple[Any, Any]:
        """After each reply or step: the tree's block slider over the reply's blocks (on the block
        the tree shows), and the "How it works" tab's tree picture."""
        shown = session.current_block
        last = session.events[-1].index if session.events else 0
        slider = (gr.Slider(minimum=0, maximum=last, value=shown.index, interactive=True) if shown is not None
                  else gr.Slider(minimum=0, maximum=1, value=0, interactive=False))
        example = teach.tree_example(session.events)
        anchor = "" if example is None else tree_view.anchor_text(session.events, example)
        return slider, tree_view.tree_figure(example, anchor, title="Your block as a tree")

    def pick_block(session: Session, index: float | None) -> Any:
        return tree_of(session, None if index is None else int(index))

    if gpu is not None:
        # Only the handlers that run the engine hold a GPU (ZeroGPU attaches one per call).
        chat, regenerate, next_block = gpu(chat), gpu(regenerate), gpu(next_block)

    with gr.Blocks(title="DFlash Studio", fill_width=True) as demo:
        state = gr.State(Session())
        gr.Markdown(header_markdown(engine), elem_id="dflash-header")
        for note in engine.warnings:
            gr.Markdown(f"⚠️ {note}", elem_classes=["dflash-warning"])
        with gr.Tabs():
            with gr.Tab("Studio", id="studio"), gr.Row():
                with gr.Column(scale=1, min_width=240):
                    gr.Markdown("### Decoding")
                    block_size = gr.Slider(MIN_BLOCK_SIZE, MAX_BLOCK_SIZE, value=default_block, step=1,
                                           label="block size", interactive=drafter is not None,
                                           info="tokens per block: the anchor + B−1 drafted")
                    steps = gr.Slider(1, 4, value=1, step=1, label="denoising steps", interactive=drafter is not None,
                                      info="1 = one parallel pass (DFlash as published)")
                    verify = gr.Radio(list(VERIFY_MODES), value="auto", label="verify length",
                                      interactive=drafter is not None,
                                      info="full: the target checks every draft; adaptive: only the prefix worth a "
                                           "pass on this machine; tree / tree-full: the drafter's likeliest "
                                           "alternatives and lookup guesses too (1 denoising step); auto: "
                                           "on CPU tree when greedy, adaptive when sampling; full on GPU")
                    temperature = gr.Slider(0.0, 1.5, value=0.0, step=0.05, label="temperature", info="0 = greedy")
                    top_p = gr.Slider(0.05, 1.0, value=1.0, step=0.05, label="top-p")
                    max_new = gr.Slider(1, 1024, value=128, step=1, label="max new tokens")
                    seed = gr.Number(0, precision=0, label="seed")
                    compare = gr.Checkbox(False, label="race plain decoding", elem_id="race-switch",
                                          interactive=drafter is not None,
                                          info="stream plain decoding beside DFlash, live, and compare speed and text")
                with gr.Column(scale=4):
                    with gr.Row(equal_height=True):
                        chatbot = gr.Chatbot(label="Chat", height=460, scale=1, buttons=["copy"],
                                             feedback_options=None, elem_id="chatbot")
                        with gr.Column(scale=1):
                            # The component is the scroll box (not the streamed HTML inside it), so
                            # gradio's autoscroll can keep the newest block in view.
                            spec = gr.HTML(render_view([]), label="Speculation view", elem_id="spec-view",
                                           js_on_load=None, min_height=440, max_height=440, autoscroll=True)
                            show_rejected = gr.Checkbox(True, label="show rejected draft tokens",
                                                        elem_id="show-rejected")
                    race_pane = gr.HTML(race.race_html(RunStats(), None, "", "", True), elem_id="race-view",
                                        css_template=race.CSS, js_on_load=None, autoscroll=False)
                    with gr.Row():
                        msg = gr.Textbox(placeholder="Ask something…", show_label=False, scale=6, lines=1,
                                         max_lines=8, elem_id="prompt")
                        send = gr.Button("Send", variant="primary", scale=1, min_width=80)
                        stop_btn = gr.Button("Stop", variant="stop", scale=1, min_width=80)
                        step_btn = gr.Button("Next block", scale=1, min_width=120, elem_id="next-block")
                        regen_btn = gr.Button("Regenerate", scale=1, min_width=80)
                        clear_btn = gr.Button("Clear", scale=1, min_width=80)
                    with gr.Accordion("Step mode: one draft → verify → accept cycle per click", open=True):
                        step_panel = gr.HTML(step.step_html(None, Session()), elem_id="step-panel")
                    gr.Examples([[e["prompt"]] for e in examples], inputs=[msg],
                                example_labels=[e["label"] for e in examples], label="Examples")
                    stats = gr.Markdown(stats_line(Session()), elem_id="stats-line")
                    with gr.Row():
                        heat = gr.Plot(charts.heatmap_figure(None), label="Denoising heatmap", elem_id="heatmap",
                                       scale=2)
                        speed = gr.Plot(charts.speed_figure(RunStats()), label="Speed", elem_id="speed", scale=1)
                    with gr.Row():
                        acc = gr.Plot(charts.acceptance_figure(RunStats()), label="Acceptance", elem_id="acceptance")
                        position = gr.Plot(charts.position_figure([], []), label="Acceptance by position",
                                           elem_id="position-chart")
                    tree_block = gr.Slider(0, 1, value=0, step=1, label="block shown in the tree", interactive=False,
                                           elem_id="tree-block",
                                           info="the latest block; drag, or click a bar of Acceptance per block")
                    tree = gr.Plot(tree_view.tree_figure(None), label="The block's candidates", elem_id="tree-view")
            with gr.Tab("How it works", id="how"), gr.Column(elem_id="teach"):
                teach_md = gr.Markdown(teach.reply_page(None), elem_id="teach-reply")
                teach_tree = gr.Plot(tree_view.tree_figure(None, title="Your block as a tree"), show_label=False,
                                     elem_id="teach-tree")
                gr.Markdown("---\n\n" + teach.GENERIC, elem_id="teach-generic")

        controls = [block_size, steps, temperature, top_p, max_new, seed, compare, verify]
        outs = [chatbot, spec, heat, acc, position, speed, tree, race_pane, stats]
        gen_kwargs: dict[str, Any] = {"concurrency_id": GENERATE, "concurrency_limit": 1,
                                      "show_progress": "minimal", "show_progress_on": [chatbot]}
        # What changes once per reply (the side panels, the tree's block slider, the tab's tree) follows
        # it in engine-free events, so the streamed updates carry only what changes with every block.
        quiet: dict[str, Any] = {"concurrency_limit": None, "show_progress": "hidden", "api_visibility": "private"}
        panels: dict[str, Any] = {"fn": side_panels, "inputs": [state], "outputs": [step_panel, teach_md], **quiet}
        after: dict[str, Any] = {"fn": pictures, "inputs": [state], "outputs": [tree_block, teach_tree], **quiet}
        send.click(chat, [msg, state, *controls], [msg, *outs], api_name="chat", **gen_kwargs).then(**panels).then(
            **after)
        msg.submit(chat, [msg, state, *controls], [msg, *outs], api_name="chat_submit",
                   api_visibility="undocumented", **gen_kwargs).then(**panels).then(**after)
        step_btn.click(next_block, [msg, state, *controls], [msg, *outs, step_panel, teach_md], api_name="next_block",
                       **gen_kwargs).then(**after)
        # A picked block only redraws its tree: no engine, so it runs beside a generation.
        tree_block.change(pick_block, [state, tree_block], [tree], trigger_mode="always_last", **quiet)
        demo.load(None, None, None, js=PICK_BLOCK_JS)
        # Stop runs outside the generate group, otherwise it would wait for the very
        # generation it is meant to stop.
        stop_btn.click(stop, [state], None, api_name="stop", concurrency_limit=None, show_progress="hidden")
        # Regenerate and Clear first stop a running reply, then wait their turn in the group.
        regen_btn.click(halt, [state], None, concurrency_limit=None, show_progress="hidden",
                        api_visibility="private").then(
            regenerate, [state, *controls], outs, api_name="regenerate", **gen_kwargs).then(**panels).then(**after)
        clear_btn.click(halt, [state], None, concurrency_limit=None, show_progress="hidden",
                        api_visibility="private").then(
            clear, [state], outs, api_name="clear", concurrency_id=GENERATE, concurrency_limit=1).then(**panels).then(
            **after)
        # A CSS class toggle in the browser: no round trip, and it survives re-renders because
        # the class sits on the component's wrapper, not on the streamed HTML.
        show_rejected.change(None, [show_rejected], None, js="""(show) => {
            document.getElementById('spec-view')?.classList.toggle('hide-rejected', !show);
        }""")
    demo.queue(default_concurrency_limit=1)
    return demo


def header_markdown(engine: Engine) -> str:
    d = engine.drafter
    if d is None:
        draft = "no drafter (plain decoding only)"
    else:
        draft = f"DFlash drafter, {d.config.num_hidden_layers} layers, block size {d.block_size}"
    return (f"# DFlash Studio\nBlock-diffusion speculative decoding, live. Target **{engine.target.name}** · "
            f"{draft} · device `{engine.target.device}`. Output is identical to plain decoding; "
            "speed is measured on engine time.")


def launch_kwargs() -> dict[str, Any]:
    """Styling passed to `launch()`: gradio 6 takes css and theme there, not in `gr.Blocks`."""
    # show_error: a request gradio itself cannot process (a slider sent a string through the API) gets
    # gradio's message naming the component instead of a bare "the app raised an exception".
    return {"css_paths": [CSS_PATH], "theme": gr.themes.Soft(primary_hue="indigo"), "show_error": True}
