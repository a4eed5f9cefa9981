"""Concurrent visitors, Stop / closed tabs and a soak, measured against the real app (`launch.py`).

    .venv/bin/python scripts/soak.py --visitors 8 --replies 200 --out runs/soak.json

Starts `launch.py` on a free loopback port (127.0.0.1 only) and drives it over HTTP as visitors would:

1. Visitors: N `gradio_client` visitors at once, each in its own thread with its own client and its
   own prompt, then a second turn that refers to the first. Every reply must complete and equal plain
   greedy decoding of that visitor's own conversation (computed here, in this process, with
   `dflash_core.load()` and `Engine.generate(..., plain=True)`); no streamed update may show another
   visitor's turns. Records each visitor's wait (submit to first streamed update), total time and the
   queue positions (ranks) gradio reported while it waited.
2. Stop / closed tab: a visitor starts a long reply and, once it streams, presses Stop (`/stop`),
   cancels the job (`job.cancel()`, what gradio_client does) or drops the connection (a closed tab);
   measures how soon the visitor queued behind it is served, and checks that the queued visitors'
   replies are unaffected.
3. Soak: R replies in sequence (Send, Regenerate, Send, Clear, as a visitor would; a new visitor
   every few cycles), each checked against plain greedy, sampling the server's resident memory, open
   file descriptors and threads every few replies; at the end a new visitor still gets its reply.

Writes a JSON report (--out) and a short table. Exit status 1 when any check fails.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

HOST = "127.0.0.1"  # the server never listens anywhere else
Message = dict[str, str]

TOPICS = ["the Moon", "volcanoes", "honey bees", "the river Nile", "chess", "penguins", "copper", "the violin",
          "glaciers", "owls", "the Sahara", "tea", "comets", "the piano", "coral reefs", "bamboo"]
SECOND_TURN = "Which topic did I just ask you about? Answer in a few words."
LONG_PROMPT = "Tell me a long story about a dragon who learns to bake bread."
FOLLOW_UP = "Now give the story a title."
QUEUED_PROMPTS = ["Name three colours.", "What is 5 + 7?", "Name a large city.", "Say good morning in French."]
SOAK_PROMPTS = ["Say hello.", "Name a fruit.", "What is 3 + 4?", "Name a colour.", "Give a word that rhymes with cat.",
                "What day comes after Monday?", "Name an animal that can fly.", "What is the capital of France?",
                "Count from one to five.", "Name a planet."]
FINAL_PROMPT = "Are you still there? Answer in one sentence."
CANCEL_MODES = ("stop", "cancel", "disconnect")
# The 2-core CPU's pass costs the test suite pins (tests/conftest.py): with --pinned-costs the server skips
# measuring them at start-up (over a minute on a busy machine) and sizes its trees the same on any machine.
PINNED_WRAPPER = (
    "import runpy, sys; from dflash_core.engine import Engine; "
    "from dflash_core.verify_length import PassCosts, VerifyCost; "
    "c = VerifyCost((1, 2, 4, 16), (60.0, 69.0, 90.0, 138.0)); "
    "Engine.pinned_costs = PassCosts(chain=c, tree=c, draft_ms=8.0); "
    "sys.argv = ['launch.py', *sys.argv[1:]]; runpy.run_path('launch.py', run_name='__main__')"
)


@dataclass
class Config:
    visitors: int = 8
    max_new: int = 32  # the visitors' replies
    long_max_new: int = 256  # the reply that is stopped
    queued: int = 2  # visitors queued behind the stopped one
    cancel_modes: tuple[str, ...] = CANCEL_MODES
    replies: int = 200  # soak replies
    soak_max_new: int = 24
    sample_every: int = 10  # soak replies between memory samples
    cycles_per_visitor: int = 5  # soak cycles (3 replies each) before a new visitor arrives
    block_size: int | None = None  # None: the drafter's (the app's default)
    pinned_costs: bool = False
    startup_timeout: float = 900.0
    reply_timeout: float = 1800.0
    progress: bool = True


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""
    timing: bool = False  # depends on how fast the machine is (the tests leave these out)


# ----------------------------------------------------------------------------------------- helpers


def message_text(message: dict[str, Any]) -> str:
    """Chatbot content comes back as a string or as a list of {"type": "text", "text": ...}."""
    content = message["content"]
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


def plain_chat(chat: list[dict[str, Any]]) -> list[Message]:
    return [{"role": m["role"], "content": message_text(m)} for m in chat]


def shown(text: str) -> str:
    """A message as gr.Chatbot shows it: gradio passes text through `inspect.cleandoc` (leading and trailing
    blank lines go, a reply ending in "\\n\\n" shows without them). The visitor's session keeps the text as
    generated, and that is what goes back to the model."""
    return inspect.cleandoc(text)


def shown_chat(messages: list[Message]) -> list[Message]:
    return [{"role": m["role"], "content": shown(m["content"])} for m in messages]


def summary(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"min": round(min(values), 3), "median": round(statistics.median(values), 3),
            "max": round(max(values), 3)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


class References:
    """Plain greedy replies, computed in this process with the app's own settings; cached per conversation."""

    def __init__(self, engine: Any, block_size: int) -> None:
        self.engine = engine
        self.block_size = block_size
        self.cache: dict[tuple[str, int], Any] = {}

    def finished(self, messages: list[Message], max_new: int) -> Any:
        key = (json.dumps(messages), max_new)
        if key not in self.cache:
            from app.inputs import generation_config
            from dflash_core.events import Finished

            # Exactly what the app builds from its sliders: greedy, seed 0, one denoising step.
            cfg = generation_config(self.block_size, 1, 0.0, 1.0, max_new, 0, "auto")
            *_, fin = self.engine.generate(messages, cfg, plain=True)
            assert isinstance(fin, Finished)
            self.cache[key] = fin
        return self.cache[key]

    def reply(self, messages: list[Message], max_new: int) -> str:
        return self.finished(messages, max_new).text

    def cut_replies(self, messages: list[Message], max_new: int, seen: str) -> list[str]:
        """The texts a reply cut after some token (by Stop) can have, given how the chat showed it."""
        ids = self.finished(messages, max_new).token_ids
        texts = (self.engine.target.decode(ids[:k]) for k in range(1, len(ids) + 1))
        return [t for t in texts if shown(t) == seen]

    def tokens(self, text: str) -> int:
        return len(self.engine.target.tokenizer(text)["input_ids"])


# ------------------------------------------------------------------------------------------ server


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log: Path
    startup_s: float = 0.0

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, lines: int = 20) -> str:
        with suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""


def server_env() -> dict[str, str]:
    env = dict(os.environ)
    for name in ("GRADIO_SERVER_NAME", "GRADIO_SERVER_PORT", "GRADIO_SHARE", "GRADIO_ROOT_PATH", "SPACE_ID"):
        env.pop(name, None)  # local, loopback-only, whatever the caller's environment says
    env["GRADIO_ANALYTICS_ENABLED"] = "False"
    env["PYTHONUNBUFFERED"] = "1"
    return env


@contextmanager
def serve(log: Path, pinned_costs: bool = False, timeout: float = 900.0) -> Iterator[Server]:
    """`launch.py` on a free loopback port, as a subprocess; yields once it answers, stops it afterwards."""
    import httpx

    port = free_port()
    args = ["--host", HOST, "--port", str(port)]
    cmd = [sys.executable, "-c", PINNED_WRAPPER, *args] if pinned_costs else [sys.executable, "launch.py", *args]
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=server_env(), stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
    server = Server(proc, f"http://{HOST}:{port}/", log)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"launch.py exited with {proc.returncode} before answering:\n{server.log_tail()}")
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"launch.py did not answer within {timeout:.0f} s:\n{server.log_tail()}")
            with suppress(httpx.HTTPError):
                if httpx.get(server.url + "gradio_api/info", timeout=5).status_code == 200:
                    break
            time.sleep(0.5)
        server.startup_s = time.monotonic() - t0
        yield server
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)


def new_client(url: str) -> Any:
    """A fresh client is a fresh session hash: a new visitor with their own chat."""
    from gradio_client import Client

    return Client(url, verbose=False, analytics_enabled=False, download_files=False)


def close_client(client: Any) -> None:
    with suppress(Exception):
        client.close()


def process_sample(pid: int) -> dict[str, float]:
    """Resident memory (MB), open file descriptors and threads of the server process."""
    try:
        import psutil

        p = psutil.Process(pid)
        rss, fds, threads = p.memory_info().rss, p.num_fds(), p.num_threads()
    except ImportError:
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
        fields = {line.split(":")[0]: line.split(":")[1].split() for line in status if ":" in line}
        rss = int(fields["VmRSS"][0]) * 1024
        threads = int(fields["Threads"][0])
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    return {"rss_mb": round(rss / 2**20, 1), "fds": fds, "threads": threads}


# ------------------------------------------------------------------------------------------- jobs


@dataclass
class Turn:
    """One reply as a visitor saw it."""

    visitor: int
    prompt: str
    expected: str
    reply: str | None = None
    chat: list[Message] = field(default_factory=list)
    stats: str = ""
    wait_s: float | None = None  # submit → first streamed update
    total_s: float | None = None  # submit → final result
    ranks: list[int] = field(default_factory=list)  # queue positions reported while waiting (changes only)
    queue_sizes: list[int] = field(default_factory=list)  # queue lengths reported while waiting (changes only)
    updates: int = 0
    foreign: list[str] = field(default_factory=list)  # other visitors' content seen in any update
    error: str | None = None
    started_at: float | None = None  # monotonic time of the first update

    @property
    def ok(self) -> bool:
        return self.error is None and self.reply == shown(self.expected)


def chat_args(block: int, prompt: str, max_new: int) -> tuple[Any, ...]:
    # textbox, block size, steps, temperature, top-p, max new tokens, seed, compare, verify length
    return (prompt, block, 1, 0.0, 1.0, max_new, 0, False, "auto")


def follow(job: Any, turn: Turn, t0: float, timeout: float, poll: float = 0.05) -> Any:
    """Watch a submitted job until it ends: the first update's time, the queue ranks; returns its result."""
    from gradio_client.utils import Status

    deadline = t0 + timeout
    while not job.done():
        st = job.status()
        if st.code == Status.IN_QUEUE and st.rank is not None:
            if not turn.ranks or turn.ranks[-1] != st.rank:
                turn.ranks.append(int(st.rank))
            if st.queue_size is not None and (not turn.queue_sizes or turn.queue_sizes[-1] != st.queue_size):
                turn.queue_sizes.append(int(st.queue_size))
        if turn.wait_s is None and job.outputs():
            turn.started_at = time.monotonic()
            turn.wait_s = turn.started_at - t0
        if time.monotonic() > deadline:
            raise TimeoutError(f"no result within {timeout:.0f} s")
        time.sleep(poll)
    result = job.result(timeout=60)
    turn.total_s = time.monotonic() - t0
    if turn.wait_s is None:  # finished between two polls
        turn.started_at, turn.wait_s = time.monotonic(), turn.total_s
    return result


def foreign_content(chat: list[Message], own_prompts: set[str], others: list[str]) -> list[str]:
    """Other visitors' turns in this chat: user messages that are not this visitor's, or others' text."""
    seen = [m["content"] for m in chat if m["role"] == "user" and m["content"] not in own_prompts]
    seen += [o for o in others for m in chat if o in m["content"]]
    return sorted(set(seen))


def chat_turn(client: Any, cfg: Config, block: int, turn: Turn, max_new: int, own: set[str], others: list[str]) -> None:
    """One /chat reply; fills `turn` (never raises: an error is recorded on the turn)."""
    t0 = time.monotonic()
    try:
        job = client.submit(*chat_args(block, turn.prompt, max_new), api_name="/chat")
        final = follow(job, turn, t0, cfg.reply_timeout)
        updates = [u for u in job.outputs() if isinstance(u, (list, tuple)) and len(u) > 1]
        turn.updates = len(updates)
        for update in [*updates, final]:
            turn.foreign.extend(foreign_content(plain_chat(update[1]), own, others))
        turn.foreign = sorted(set(turn.foreign))
        turn.chat = plain_chat(final[1])
        turn.stats = str(final[-1])
        turn.reply = turn.chat[-1]["content"] if turn.chat and turn.chat[-1]["role"] == "assistant" else None
    except Exception as e:
        turn.error = f"{type(e).__name__}: {e}"


# ------------------------------------------------------------------------------------ 1. visitors


def visitor_prompts(n: int) -> list[str]:
    return [f"Tell me one fact about {TOPICS[i % len(TOPICS)]}." + (f" (visitor {i})" if i >= len(TOPICS) else "")
            for i in range(n)]


def visitor_expectations(refs: References, cfg: Config) -> list[list[Message]]:
    """Each visitor's whole expected conversation (two turns), from plain greedy decoding."""
    convs = []
    for prompt in visitor_prompts(cfg.visitors):
        msgs: list[Message] = []
        for text in (prompt, SECOND_TURN):
            msgs.append({"role": "user", "content": text})
            msgs.append({"role": "assistant", "content": refs.reply(msgs, cfg.max_new)})
        convs.append(msgs)
    return convs


def run_visitors(url: str, refs: References, cfg: Config, convs: list[list[Message]]) -> tuple[dict, list[Check]]:
    n = len(convs)
    prompts = [c[0]["content"] for c in convs]
    turns: list[list[Turn]] = [[Turn(i, c[0]["content"], c[1]["content"]), Turn(i, c[2]["content"], c[3]["content"])]
                               for i, c in enumerate(convs)]
    clients: list[Any] = [None] * n
    barrier = threading.Barrier(n)
    bar = tqdm(total=2 * n, desc="visitors", unit="reply", disable=not cfg.progress, leave=False)
    lock = threading.Lock()

    def visitor(i: int) -> None:
        try:
            clients[i] = new_client(url)
        except Exception as e:
            turns[i][0].error = turns[i][1].error = f"client: {type(e).__name__}: {e}"
        with suppress(threading.BrokenBarrierError):
            barrier.wait(timeout=cfg.startup_timeout)  # everyone submits at once
        if clients[i] is None:
            return
        others = [p for j, p in enumerate(prompts) if j != i]
        others += [shown(c[1]["content"]) for j, c in enumerate(convs) if j != i and len(c[1]["content"]) >= 24
                   and c[1]["content"] not in (convs[i][1]["content"], convs[i][3]["content"])]
        own = {prompts[i], SECOND_TURN}
        for turn in turns[i]:
            chat_turn(clients[i], cfg, refs.block_size, turn, cfg.max_new, own, others)
            with lock:
                bar.update()
            if turn.error:
                break

    threads = [threading.Thread(target=visitor, args=(i,), name=f"visitor-{i}") for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bar.close()
    for c in clients:
        if c is not None:
            close_client(c)

    flat = [t for ts in turns for t in ts]
    first_turns = sorted((ts[0] for ts in turns if ts[0].started_at is not None), key=lambda t: t.started_at)
    waited = first_turns[1:]  # all but the first served waited behind at least one reply
    histories_ok = all(ts[1].chat == shown_chat(convs[i]) for i, ts in enumerate(turns))
    errors = [f"visitor {t.visitor}: {t.error}" for t in flat if t.error]
    differ = [f"visitor {t.visitor}: {t.prompt!r}" for t in flat if t.error is None and not t.ok]
    leaks = [f"visitor {t.visitor}: {t.foreign}" for t in flat if t.foreign]
    unranked = [t.visitor for t in waited if not t.ranks]
    ranks = sorted({r for t in flat for r in t.ranks})
    checks = [
        Check("visitors: every reply completes", not errors, "; ".join(errors) or f"{len(flat)} replies"),
        Check("visitors: each reply equals plain greedy of its own chat", not differ and not errors,
              "; ".join(differ) or f"{sum(t.ok for t in flat)}/{len(flat)} equal"),
        Check("visitors: no visitor sees another's turns", not leaks and histories_ok,
              "; ".join(leaks) or ("histories exact" if histories_ok else "a final history differs")),
        Check("visitors: waiting visitors are shown a queue position", bool(waited) and not unranked,
              f"ranks seen {ranks}" + (f"; no rank for visitors {unranked}" if unranked else "")),
    ]
    report = {
        "visitors": n,
        "turns": [asdict(t) | {"chat": None, "started_at": None} for t in flat],
        "wait_s": summary([t.wait_s for t in flat if t.wait_s is not None]),
        "first_turn_wait_s": summary([t.wait_s for t in first_turns]),
        "total_s": summary([t.total_s for t in flat if t.total_s is not None]),
        "ranks_seen": ranks,
        "max_queue_size": max((q for t in flat for q in t.queue_sizes), default=None),
        "replies_equal_plain": sum(t.ok for t in flat),
        "replies": len(flat),
    }
    return report, checks


# ------------------------------------------------------------------------------- 2. stop / closed tab


class RawStream:
    """A visitor talking to gradio's REST API directly, so that the connection itself can be dropped."""

    def __init__(self, url: str, data: list[Any]) -> None:
        import httpx

        self.http = httpx.Client(timeout=httpx.Timeout(30.0, read=None))
        event_id = self.http.post(f"{url}gradio_api/call/chat", json={"data": data}).json()["event_id"]
        self.stream = self.http.stream("GET", f"{url}gradio_api/call/chat/{event_id}")
        self.lines = self.stream.__enter__().iter_lines()
        self.updates = 0
        self.update_times: list[float] = []

    def wait_updates(self, n: int, timeout: float) -> bool:
        """Read until `n` streamed updates arrived; False when the reply ended first."""
        deadline = time.monotonic() + timeout
        event = ""
        while self.updates < n and time.monotonic() < deadline:
            line = next(self.lines, None)
            if line is None:
                return False
            if line.startswith("event:"):
                event = line.removeprefix("event:").strip()
                if event in ("complete", "error"):
                    return False
                if event == "generating":
                    self.updates += 1
                    self.update_times.append(time.monotonic())
        return self.updates >= n

    def close(self) -> None:
        """Drop the connection, as a closed browser tab does."""
        with suppress(Exception):
            self.stream.__exit__(None, None, None)
        self.http.close()


def run_cancel(url: str, refs: References, cfg: Config, mode: str) -> tuple[dict, list[Check]]:
    """A long reply, visitors queued behind it, then Stop / job.cancel() / a dropped connection."""
    from gradio_client.utils import Status

    block = refs.block_size
    args = list(chat_args(block, LONG_PROMPT, cfg.long_max_new))
    queued_prompts = [QUEUED_PROMPTS[k % len(QUEUED_PROMPTS)] for k in range(cfg.queued)]
    queued = [Turn(k, p, refs.reply([{"role": "user", "content": p}], cfg.max_new))
              for k, p in enumerate(queued_prompts)]
    report: dict[str, Any] = {"mode": mode}
    clients: list[Any] = []
    problems: list[str] = []
    a_client = job_a = raw = None
    try:
        t0 = time.monotonic()
        update_times: list[float]
        if mode == "disconnect":
            raw = RawStream(url, args)
            streaming = raw.wait_updates(3, cfg.reply_timeout)
            update_times = raw.update_times
        else:
            a_client = new_client(url)
            clients.append(a_client)
            job_a = a_client.submit(*args, api_name="/chat")
            update_times, seen = [], 0
            while not job_a.done() and seen < 3 and time.monotonic() - t0 < cfg.reply_timeout:
                if len(job_a.outputs()) > seen:
                    seen = len(job_a.outputs())
                    update_times.append(time.monotonic())
                time.sleep(0.02)
            streaming = seen >= 3 and not job_a.done()
        if not streaming:
            problems.append("the long reply ended before it could be stopped")
        # Visitors arrive while the long reply runs, and wait in the queue behind it.
        jobs = []
        for turn in queued:
            c = new_client(url)
            clients.append(c)
            jobs.append((c.submit(*chat_args(block, turn.prompt, cfg.max_new), api_name="/chat"),
                         time.monotonic()))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(j.status().code == Status.IN_QUEUE for j, _ in jobs):
            time.sleep(0.02)
        report["queued_before_cancel"] = all(j.status().code == Status.IN_QUEUE for j, _ in jobs)
        for (job, _), turn in zip(jobs, queued, strict=True):
            if (rank := job.status().rank) is not None:
                turn.ranks.append(int(rank))
        if not report["queued_before_cancel"]:
            problems.append("the visitors behind the long reply were not waiting in the queue when it was stopped")
        t_cancel = time.monotonic()
        if mode == "stop":
            a_client.predict(api_name="/stop")
        elif mode == "cancel":
            job_a.cancel()
        else:
            raw.close()
        # Watch the queued visitors: the first one's first update is "the engine is free again".
        results: list[Any] = [None] * len(jobs)
        outs: list[Any] = [None] * len(jobs)
        threads = []
        for k, ((job, t_sub), turn) in enumerate(zip(jobs, queued, strict=True)):
            def watch(k: int = k, job: Any = job, t_sub: float = t_sub, turn: Turn = turn) -> None:
                try:
                    results[k] = follow(job, turn, t_sub, cfg.reply_timeout)
                    outs[k] = job.outputs()
                except Exception as e:
                    turn.error = f"{type(e).__name__}: {e}"
            threads.append(threading.Thread(target=watch, name=f"queued-{k}"))
            threads[-1].start()
        for t in threads:
            t.join()
        for turn, final, updates in zip(queued, results, outs, strict=True):
            if final is None:
                continue
            turn.chat = plain_chat(final[1])
            turn.reply = turn.chat[-1]["content"]
            turn.updates = len(updates or [])
            for update in [*(updates or []), final]:
                if isinstance(update, (list, tuple)) and len(update) > 1:
                    turn.foreign.extend(foreign_content(plain_chat(update[1]), {turn.prompt}, [LONG_PROMPT]))
        served = [t.started_at for t in queued if t.started_at is not None]
        gaps = [b - a for a, b in zip([t0, *update_times], update_times, strict=False)]
        report.update({
            "cancel_to_next_served_s": round(min(served) - t_cancel, 3) if served else None,
            "long_reply_update_gap_s": round(max(gaps[1:] or gaps), 3) if gaps else None,
            "queued": [asdict(t) | {"chat": None, "started_at": None} for t in queued],
        })
        # The stopped visitor: Stop ends the reply as cancelled; the partial reply is kept, is the start of
        # the plain reply, and the visitor can go on chatting (a closed tab has nobody left to chat).
        if mode == "stop":
            final = job_a.result(timeout=cfg.reply_timeout)
            report["stopped_stats"] = str(final[-1])
            if "finished: cancelled" not in str(final[-1]):
                problems.append(f"Stop did not cancel the reply: {final[-1]!r}")
        if a_client is not None:
            after = Turn(0, FOLLOW_UP, "")
            chat_turn(a_client, cfg, block, after, cfg.max_new, {LONG_PROMPT, FOLLOW_UP}, [])
            users = [m["content"] for m in after.chat if m["role"] == "user"]
            if after.error or users != [LONG_PROMPT, FOLLOW_UP] or len(after.chat) != 4:
                problems.append(f"the stopped visitor's next reply failed: {after.error or after.chat}")
            else:
                stopped = after.chat[1]["content"]
                report["stopped_reply_tokens"] = refs.tokens(stopped)
                if report["stopped_reply_tokens"] >= cfg.long_max_new:
                    problems.append("the stopped reply ran to its full length")
                # Greedy: the stopped reply is the plain reply cut after some token (a few past the
                # stopped one's length suffice to find where).
                cuts = refs.cut_replies([{"role": "user", "content": LONG_PROMPT}],
                                        report["stopped_reply_tokens"] + 8, stopped)
                if not cuts:
                    problems.append(f"the stopped reply is not the start of the plain reply: {stopped!r}")
                # The session kept the cut reply as generated: the next reply continues from that text.
                for cut in cuts:
                    after.expected = refs.reply([{"role": "user", "content": LONG_PROMPT},
                                                 {"role": "assistant", "content": cut},
                                                 {"role": "user", "content": FOLLOW_UP}], cfg.max_new)
                    if after.ok:
                        break
                report["next_reply_equals_plain"] = after.ok
                if cuts and not after.ok:
                    problems.append("the stopped visitor's next reply differs from plain greedy")
    except Exception as e:
        problems.append(f"{type(e).__name__}: {e}")
    finally:
        if raw is not None:
            raw.close()
        for c in clients:
            close_client(c)
    errors = [f"{t.prompt!r}: {t.error}" for t in queued if t.error]
    differ = [f"{t.prompt!r} differs from plain: {t.reply!r}" for t in queued if t.error is None and not t.ok]
    leaks = [f"{t.prompt!r}: {t.foreign}" for t in queued if t.foreign]
    unranked = [f"{t.prompt!r} was shown no queue position" for t in queued if not t.ranks]
    report["ranks_seen"] = sorted({r for t in queued for r in t.ranks})
    gap = report.get("long_reply_update_gap_s")
    served_s = report.get("cancel_to_next_served_s")
    bound = None if gap is None else round(3 * gap + 1.0, 3)
    report["served_bound_s"] = bound
    checks = [
        Check(f"{mode}: the stopped visitor and the engine behave", not problems, "; ".join(problems) or "ok"),
        Check(f"{mode}: visitors queued behind are shown their place and unaffected",
              not errors and not differ and not leaks and not unranked,
              "; ".join(errors + differ + leaks + unranked)
              or f"{len(queued)} replies equal plain; ranks seen {report['ranks_seen']}"),
        Check(f"{mode}: the next visitor is served within a few blocks", served_s is not None and bound is not None
              and served_s <= bound, f"{served_s} s after the cancel (bound {bound} s: 3 × the longest gap "
              "between the long reply's updates + 1 s)", timing=True),
    ]
    return report, checks


# -------------------------------------------------------------------------------------------- 3. soak


@dataclass
class Step:
    action: str  # send, regenerate, clear
    prompt: str | None
    expected_chat: list[Message]  # the whole chat after the step
    new_visitor: bool = False


def soak_plan(refs: References, cfg: Config) -> list[Step]:
    """The soak's steps: cycles of Send A, Regenerate, Send B, Clear, a new visitor every few cycles."""
    steps: list[Step] = []
    replies, cycle = 0, 0
    while replies < cfg.replies:
        a, b = SOAK_PROMPTS[cycle % len(SOAK_PROMPTS)], SOAK_PROMPTS[(cycle + 1) % len(SOAK_PROMPTS)]
        chat: list[Message] = [{"role": "user", "content": a}]
        chat.append({"role": "assistant", "content": refs.reply(chat, cfg.soak_max_new)})
        todo = [Step("send", a, list(chat), new_visitor=cycle % cfg.cycles_per_visitor == 0),
                Step("regenerate", None, list(chat))]
        chat = [*chat, {"role": "user", "content": b}]
        chat.append({"role": "assistant", "content": refs.reply(chat, cfg.soak_max_new)})
        todo.append(Step("send", b, list(chat)))
        for step in todo:
            if replies < cfg.replies:
                steps.append(step)
                replies += 1
        steps.append(Step("clear", None, []))
        cycle += 1
    return steps


def flat_check(samples: list[dict], key: str, tolerance: float) -> tuple[bool, str]:
    """No growth after warm-up: the last third's peak is within `tolerance` of the earlier peak."""
    values = [s[key] for s in samples]
    if len(values) < 3:
        return True, f"{values} (too few samples to judge)"
    cut = max(1, 2 * len(values) // 3)
    early, late = max(values[:cut]), max(values[cut:])
    return late <= early + tolerance, f"first {values[0]}, last {values[-1]}, max {max(values)}; " \
        f"peak of the last third {late} vs earlier {early} (tolerance {tolerance:g})"


def run_soak(server: Server, refs: References, cfg: Config, steps: list[Step]) -> tuple[dict, list[Check]]:
    url, block = server.url, refs.block_size
    t0 = time.monotonic()
    samples = [{"replies": 0, "t_s": 0.0, **process_sample(server.pid)}]
    client = None
    replies, equal, wrong, errors, reply_s = 0, 0, [], [], []
    bar = tqdm(total=cfg.replies, desc="soak", unit="reply", disable=not cfg.progress, leave=False)
    try:
        for step in steps:
            if step.new_visitor or client is None:
                if client is not None:
                    close_client(client)
                client = new_client(url)
            t1 = time.monotonic()
            try:
                if step.action == "send":
                    chat = client.predict(*chat_args(block, step.prompt, cfg.soak_max_new), api_name="/chat")[1]
                elif step.action == "regenerate":
                    chat = client.predict(*chat_args(block, "", cfg.soak_max_new)[1:], api_name="/regenerate")[0]
                else:
                    chat = client.predict(api_name="/clear")[0]
            except Exception as e:
                errors.append(f"reply {replies} ({step.action}): {type(e).__name__}: {e}")
                chat = None
            right = chat is not None and plain_chat(chat) == shown_chat(step.expected_chat)
            if chat is not None and not right:
                wrong.append(f"reply {replies} ({step.action} {step.prompt!r})")
            if step.action == "clear":
                continue
            equal += right
            reply_s.append(time.monotonic() - t1)
            replies += 1
            bar.update()
            if replies % cfg.sample_every == 0 or replies == cfg.replies:
                samples.append({"replies": replies, "t_s": round(time.monotonic() - t0, 1),
                                **process_sample(server.pid)})
        # After the soak, a new visitor still gets its reply.
        close_client(client)
        client = new_client(url)
        final_turn = Turn(0, FINAL_PROMPT, refs.reply([{"role": "user", "content": FINAL_PROMPT}], cfg.max_new))
        chat_turn(client, cfg, block, final_turn, cfg.max_new, {FINAL_PROMPT}, [])
        samples.append({"replies": replies, "t_s": round(time.monotonic() - t0, 1), "after": True,
                        **process_sample(server.pid)})
    finally:
        bar.close()
        if client is not None:
            close_client(client)
    rss_ok, rss_detail = flat_check(samples, "rss_mb", max(32.0, 0.05 * samples[0]["rss_mb"]))
    fds_ok, fds_detail = flat_check(samples, "fds", 4)
    threads_ok, threads_detail = flat_check(samples, "threads", 2)
    answers = final_turn.ok and final_turn.chat[:-1] == shown_chat([{"role": "user", "content": FINAL_PROMPT}])

    def curve(key: str) -> dict[str, float]:
        values = [s[key] for s in samples]
        return {"first": values[0], "last": values[-1], "max": max(values), "min": min(values)}

    report = {
        "replies": replies,
        "visitors": sum(s.new_visitor for s in steps) + 1,
        "replies_equal_plain": equal,
        "wrong": wrong[:20],
        "errors": errors[:20],
        "reply_s": summary(reply_s),
        "elapsed_s": round(time.monotonic() - t0, 1),
        "samples": samples,
        "rss_mb": curve("rss_mb"),
        "fds": curve("fds"),
        "threads": curve("threads"),
        "answers_after": answers,
        "after_reply": final_turn.reply,
    }
    checks = [
        Check("soak: every reply completes and equals plain greedy", not errors and not wrong,
              "; ".join((errors + wrong)[:5]) or f"{replies} replies (and the Clears) as expected"),
        Check("soak: the app answers afterwards", answers, final_turn.error or repr(final_turn.reply)),
        Check("soak: memory samples recorded", len(samples) >= 3, f"{len(samples)} samples"),
        Check("soak: resident memory flat (MB)", rss_ok, rss_detail),
        Check("soak: open file descriptors flat", fds_ok, fds_detail),
        Check("soak: threads flat", threads_ok, threads_detail),
    ]
    return report, checks


# -------------------------------------------------------------------------------------------- driver


def measure(cfg: Config, engine: Any = None, log: Path | None = None) -> dict[str, Any]:
    """The whole measurement; `engine`: the reference engine (default: `dflash_core.load()`, as launch.py)."""
    import dflash_core

    t0 = time.monotonic()
    if engine is None:
        engine = dflash_core.load()
    block = cfg.block_size or (engine.drafter.block_size if engine.drafter is not None else 2)
    refs = References(engine, block)
    # Every reference before the server starts, so it does not share the cores with the server's
    # start-up measurements or with the visitors.
    bar = tqdm(desc="plain references", unit="reply", disable=not cfg.progress, leave=False)
    reply = refs.reply

    def counted(messages: list[Message], max_new: int) -> str:
        bar.update()
        return reply(messages, max_new)

    refs.reply = counted  # type: ignore[method-assign]
    convs = visitor_expectations(refs, cfg)
    steps = soak_plan(refs, cfg)
    for k in range(cfg.queued):
        refs.reply([{"role": "user", "content": QUEUED_PROMPTS[k % len(QUEUED_PROMPTS)]}], cfg.max_new)
    refs.reply([{"role": "user", "content": FINAL_PROMPT}], cfg.max_new)
    refs.reply = reply  # type: ignore[method-assign]
    bar.close()
    references_s = time.monotonic() - t0

    report: dict[str, Any] = {"config": asdict(cfg), "block_size": block, "references_s": round(references_s, 1),
                              "references": len(refs.cache), "cpus": os.cpu_count(),
                              "load_before": os.getloadavg()}
    checks: list[Check] = []
    log = log or ROOT / "runs" / "soak-server.log"
    with serve(log, cfg.pinned_costs, cfg.startup_timeout) as server:
        report["server"] = {"url": server.url, "pid": server.pid, "startup_s": round(server.startup_s, 1),
                            "log": str(log), "pinned_costs": cfg.pinned_costs,
                            "start": process_sample(server.pid)}
        phases = report["phase_s"] = {"references": round(references_s, 1), "startup": round(server.startup_s, 1)}
        if cfg.visitors:
            t1 = time.monotonic()
            report["visitors"], c = run_visitors(server.url, refs, cfg, convs)
            phases["visitors"] = round(time.monotonic() - t1, 1)
            checks += c
        report["cancel"] = []
        for mode in cfg.cancel_modes:
            t1 = time.monotonic()
            r, c = run_cancel(server.url, refs, cfg, mode)
            phases[mode] = round(time.monotonic() - t1, 1)
            report["cancel"].append(r)
            checks += c
        if cfg.replies:
            t1 = time.monotonic()
            report["soak"], c = run_soak(server, refs, cfg, steps)
            phases["soak"] = round(time.monotonic() - t1, 1)
            checks += c
        report["server"]["alive_at_end"] = server.proc.poll() is None
        checks.append(Check("server: still running at the end", server.proc.poll() is None, server.log_tail(3)))
    report["elapsed_s"] = round(time.monotonic() - t0, 1)
    report["checks"] = [asdict(c) for c in checks]
    report["ok"] = all(c.ok for c in checks)
    return report


def table(report: dict[str, Any]) -> str:
    lines = [f"server: launch.py on {report['server']['url']} (pid {report['server']['pid']}), "
             f"answering after {report['server']['startup_s']} s; block size {report['block_size']}"]
    v = report.get("visitors")
    if v:
        lines.append(f"visitors  {v['visitors']} at once × 2 turns: {v['replies_equal_plain']}/{v['replies']} "
                     f"equal plain; wait s {fmt(v['wait_s'])} (first turn {fmt(v['first_turn_wait_s'])}); "
                     f"total s {fmt(v['total_s'])}; queue ranks seen {v['ranks_seen']}")
        for i in range(v["visitors"]):
            mine = [t for t in v["turns"] if t["visitor"] == i]
            lines.append(f"  visitor {i}: " + "; ".join(
                f"turn {k + 1} wait {t['wait_s'] or 0:.2f} s, total {t['total_s'] or 0:.2f} s, ranks {t['ranks']}, "
                f"{'= plain' if t['reply'] == shown(t['expected']) else 'DIFFERS'}" for k, t in enumerate(mine)))
    for c in report.get("cancel", []):
        extra = f", stopped at {c['stopped_reply_tokens']} tokens" if "stopped_reply_tokens" in c else ""
        lines.append(f"{c['mode']:<9} next visitor served {c.get('cancel_to_next_served_s')} s after the cancel "
                     f"(long reply's update gap {c.get('long_reply_update_gap_s')} s){extra}")
    s = report.get("soak")
    if s:
        lines.append(f"soak      {s['replies']} replies ({s['visitors']} visitors) in {s['elapsed_s']} s, "
                     f"{s['replies_equal_plain']} equal plain; reply s {fmt(s['reply_s'])}")
        for key in ("rss_mb", "fds", "threads"):
            k = s[key]
            lines.append(f"          {key:<8} first {k['first']}  last {k['last']}  max {k['max']}")
        lines.append("          curve: " + "  ".join(f"{x['replies']}:{x['rss_mb']}MB/{x['fds']}fd"
                                                 for x in s["samples"]))
    lines.append("")
    for c in report["checks"]:
        lines.append(f"{'✓' if c['ok'] else '✗'} {c['name']}: {c['detail']}")
    lines.append(f"\n{'all checks hold' if report['ok'] else 'SOME CHECKS FAILED'} ({report['elapsed_s']} s)")
    return "\n".join(lines)


def fmt(s: dict[str, float] | None) -> str:
    return "-" if not s else f"{s['min']:.2f}/{s['median']:.2f}/{s['max']:.2f}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    d = Config()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--visitors", type=int, default=d.visitors, help="visitors at once (0: skip)")
    p.add_argument("--max-new", type=int, default=d.max_new, help="max new tokens of the visitors' replies")
    p.add_argument("--long-max-new", type=int, default=d.long_max_new, help="max new tokens of the stopped reply")
    p.add_argument("--queued", type=int, default=d.queued, help="visitors queued behind the stopped reply")
    p.add_argument("--cancel-modes", default=",".join(d.cancel_modes),
                   help="how the long reply ends: stop (the Stop button), cancel (job.cancel()), "
                        "disconnect (a closed tab); comma-separated, empty to skip")
    p.add_argument("--replies", type=int, default=d.replies, help="soak replies (0: skip)")
    p.add_argument("--soak-max-new", type=int, default=d.soak_max_new, help="max new tokens of the soak's replies")
    p.add_argument("--sample-every", type=int, default=d.sample_every, help="soak replies between memory samples")
    p.add_argument("--cycles-per-visitor", type=int, default=d.cycles_per_visitor,
                   help="soak cycles (Send, Regenerate, Send, Clear) before a new visitor arrives")
    p.add_argument("--block-size", type=int, default=None, help="the visitors' block size (default: the drafter's)")
    p.add_argument("--pinned-costs", action="store_true",
                   help="start the server with the test suite's fixed pass-cost table instead of measuring it")
    p.add_argument("--startup-timeout", type=float, default=d.startup_timeout, help="seconds for launch.py to answer")
    p.add_argument("--out", type=Path, default=Path("runs/soak.json"), help="JSON report")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    modes = tuple(m for m in args.cancel_modes.split(",") if m)
    if bad := [m for m in modes if m not in CANCEL_MODES]:
        p.error(f"unknown cancel mode(s) {bad}; choose from {list(CANCEL_MODES)}")
    for name in ("visitors", "replies", "queued"):
        if getattr(args, name) < 0:
            p.error(f"--{name} must be 0 or more")
    for name in ("max_new", "long_max_new", "soak_max_new", "sample_every", "cycles_per_visitor"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    args.cancel_modes = modes
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = Config(visitors=args.visitors, max_new=args.max_new, long_max_new=args.long_max_new, queued=args.queued,
                 cancel_modes=args.cancel_modes, replies=args.replies, soak_max_new=args.soak_max_new,
                 sample_every=args.sample_every, cycles_per_visitor=args.cycles_per_visitor,
                 block_size=args.block_size, pinned_costs=args.pinned_costs, startup_timeout=args.startup_timeout,
                 progress=not args.quiet)
    out = args.out if args.out.is_absolute() else Path.cwd() / args.out
    report = measure(cfg, log=out.with_suffix(".server.log"))
    report["command"] = shlex.join([".venv/bin/python", "scripts/soak.py", *(sys.argv[1:] if argv is None else argv)])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, ensure_ascii=False))
    print(table(report))
    print(f"report: {out}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
