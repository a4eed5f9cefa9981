"""Benchmark decoding methods on a prompt set: speed, acceptance length τ, and exactness.

A `Method` is a name plus `run(turns, config) -> RunResult`. The runner rotates the order of the
methods per prompt, so slow drift in the machine (thermal throttling, a neighbour's job) lands
on every method alike. The first method is the baseline that speed-ups and exactness are
measured against; adding a method means writing one more `Method` and putting it in the list.
Method names, statistics and tables live in `bench_stats` (pure, no model); this module runs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm
from transformers.generation.streamers import BaseStreamer

from .bench_stats import (  # noqa: F401  (re-exported: the runner's callers read them from here)
    ALL_METHODS,
    PROMPT_PREVIEW_CHARS,
    MethodSpec,
    RunResult,
    format_table,
    parse_methods,
    summarize,
    write_text_atomic,
)
from .config import GenerationConfig
from .engine import Engine
from .errors import DFlashError
from .events import Finished, tau
from .prompt_sets import Turns
from .verify_length import resolve_mode

WARMUP_TOKENS = 8
PROMPT_LOOKUP_TOKENS = 10  # transformers' documented default for prompt_lookup_num_tokens


@dataclass
class Method:
    name: str
    run: Callable[[Turns, GenerationConfig], RunResult]
    kind: str = "custom"  # plain, dflash, hf-generate, prompt-lookup, hf-dflash: what the statistics may assume
    block_size: int | None = None  # DFlash: the block size it runs with (sizes the τ histogram)
    steps: int | None = None
    verify: str | None = None  # DFlash: full or adaptive (the verify length it runs with on this device)


def engine_method(engine: Engine, name: str, *, plain: bool, block_size: int | None = None,
                  steps: int | None = None, **overrides: Any) -> Method:
    """Plain or DFlash decoding with `engine`; `block_size`, `steps` and `overrides` pin settings."""
    pinned = {**overrides, **({"block_size": block_size} if block_size else {}), **({"steps": steps} if steps else {})}

    def run(turns: Turns, config: GenerationConfig) -> RunResult:
        cfg = config.with_(**pinned) if pinned else config
        messages: list[dict[str, str]] = []
        result = RunResult(ids=[], seconds=0.0)
        for turn in turns:
            messages.append({"role": "user", "content": turn})
            fin = None
            for ev in engine.generate(messages, cfg, plain=plain):
                if isinstance(ev, Finished):
                    fin = ev
                elif ev.index > 0:  # event 0 is the prefill: in `seconds`, not in the per-block means
                    result.blocks += 1
                    result.draft_s += ev.draft_ms / 1e3
                    result.verify_s += ev.verify_ms / 1e3
                    if ev.is_draft_block:
                        result.accepted.append(ev.accepted)
            if fin is None:
                raise RuntimeError("generate() ended without a Finished event")
            # Each method continues from its OWN replies, as a real chat would.
            messages.append({"role": "assistant", "content": fin.text})
            result.ids.extend(fin.token_ids)
            result.replies.append(fin.text)
            result.seconds += fin.elapsed_s  # the engine's clock: prefill included, our bookkeeping not
        if not plain:
            result.tau = tau(result.accepted)
        return result

    return Method(name=name, run=run, kind="plain" if plain else "dflash",
                  block_size=None if plain else pinned.get("block_size"),
                  steps=None if plain else pinned.get("steps"))


class _Commits(BaseStreamer):
    """What transformers' `generate` commits per target forward: it hands its streamer the prompt,
    then each forward's new tokens (the prefill's one, then each block's accepted drafts + 1)."""

    def __init__(self) -> None:
        self.counts: list[int] = []

    def put(self, value: torch.Tensor) -> None:
        self.counts.append(value.numel())

    def end(self) -> None:
        pass

    def accepted(self, new_tokens: int) -> list[int]:
        """Accepted drafts per block after the prefill, checked against the reply's length."""
        if len(self.counts) < 2 or sum(self.counts[1:]) != new_tokens:
            raise RuntimeError(f"transformers' generate streamed {self.counts[1:]} tokens for a reply of {new_tokens}")
        return [n - 1 for n in self.counts[2:]]


def hf_generate_method(engine: Engine, name: str, *, prompt_lookup: int = 0, block_size: int | None = None,
                       dflash: bool = False) -> Method:
    """transformers' own `generate` on the same target: plain, prompt-lookup decoding
    (`prompt_lookup_num_tokens`), or its native DFlash with the same drafter (`dflash`: the drafter as
    its assistant, `speculation_type="dflash"`, blocks of `block_size`), the peers DFlash has to beat.
    Stop strings are not applied."""
    target = engine.target
    assistant = None
    if dflash:
        from .export import to_transformers_assistant

        assert engine.drafter is not None
        try:
            assistant = to_transformers_assistant(engine.drafter, dtype=target.dtype, device=target.device)
        except DFlashError as e:
            raise DFlashError(f"bench method {name!r}: {e}") from None
        # transformers' generator takes its block size from the assistant's config: the run's, as ours do.
        assistant.config.block_size = block_size or engine.drafter.block_size

    def run(turns: Turns, config: GenerationConfig) -> RunResult:
        messages: list[dict[str, str]] = []
        result = RunResult(ids=[], seconds=0.0)
        eos = sorted(target.eos_ids)
        sampling = {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        if not config.greedy:
            sampling = {"do_sample": True, "temperature": config.temperature, "top_p": config.top_p,
                        "top_k": config.top_k or None}
            torch.manual_seed(config.seed)
        for turn in turns:
            messages.append({"role": "user", "content": turn})
            prompt = torch.tensor([engine.prompt_ids(messages)], device=target.device)
            extra: dict[str, Any] = {"prompt_lookup_num_tokens": prompt_lookup} if prompt_lookup else {}
            commits = _Commits()
            if assistant is not None:  # its generator wants the positions passed (a Llama target's too)
                extra = {"assistant_model": assistant, "speculation_type": "dflash", "streamer": commits,
                         "position_ids": torch.arange(prompt.shape[1], device=target.device)[None]}
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = target.model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                            max_new_tokens=config.max_new_tokens, eos_token_id=eos,
                                            pad_token_id=eos[0] if eos else None, **sampling, **extra)
            result.seconds += time.perf_counter() - t0
            new = out[0, prompt.shape[1]:].tolist()
            if assistant is not None:
                result.accepted.extend(commits.accepted(len(new)))
            result.ids.extend(new)
            reply = target.decode(new)
            result.replies.append(reply)
            messages.append({"role": "assistant", "content": reply})
        if assistant is not None:
            result.blocks, result.tau = len(result.accepted), tau(result.accepted)
        return result

    kind = "hf-dflash" if dflash else "prompt-lookup" if prompt_lookup else "hf-generate"
    return Method(name=name, run=run, kind=kind, block_size=assistant.config.block_size if assistant else None,
                  steps=1 if assistant else None, verify="full" if assistant else None)


def make_methods(engine: Engine, names: str | Sequence[str] = ("plain", "dflash"),
                 config: GenerationConfig | None = None) -> list[Method]:
    """Methods by name (see `bench_stats.parse_methods`); the first is the baseline. `config`
    resolves what the plain `dflash` method runs with, for the report."""
    specs = parse_methods(names)
    if engine.drafter is None and any(s.kind in ("dflash", "hf-dflash") for s in specs):
        raise DFlashError("DFlash bench methods need a drafter; drop --draft none")
    methods = []
    for s in specs:
        if s.kind == "plain":
            methods.append(engine_method(engine, s.name, plain=True))
        elif s.kind == "dflash":
            pin: dict[str, Any] = {"verify": s.verify} if s.verify else {}
            if s.lookup is not None:
                pin["lookup"] = s.lookup
            m = engine_method(engine, s.name, plain=False, block_size=s.block_size, steps=s.steps, **pin)
            assert engine.drafter is not None
            cfg = config or GenerationConfig()
            m.block_size = s.block_size or cfg.block_size or engine.drafter.block_size
            m.steps = s.steps or cfg.steps
            m.verify = resolve_mode(s.verify or cfg.verify, engine.target.device, greedy=cfg.greedy,
                                    tree_ok=engine.target.supports_tree and m.steps == 1)
            methods.append(m)
        else:
            lookup = PROMPT_LOOKUP_TOKENS if s.kind == "prompt-lookup" else 0
            block = (config or GenerationConfig()).block_size
            methods.append(hf_generate_method(engine, s.name, prompt_lookup=lookup, block_size=block,
                                              dflash=s.kind == "hf-dflash"))
    return methods


def run_methods(prompts: Sequence[Turns], methods: Sequence[Method], config: GenerationConfig, *,
                warmup: int = 1, progress: bool = True) -> list[dict[str, RunResult]]:
    """Every method on every prompt, the order rotated per prompt."""
    if not prompts:
        raise DFlashError("the prompt set is empty")
    # Untimed warm-up: first calls pay one-off costs (allocator growth, CUDA kernels and handles)
    # that would otherwise be charged to whichever method ran first.
    warm_cfg = config.with_(max_new_tokens=min(WARMUP_TOKENS, config.max_new_tokens))
    for _ in range(warmup):
        for m in methods:
            m.run(prompts[0][:1], warm_cfg)
    results = []
    for i, turns in enumerate(tqdm(prompts, desc="bench", unit="prompt", disable=not progress)):
        k = i % len(methods)
        results.append({m.name: m.run(turns, config) for m in [*methods[k:], *methods[:k]]})
    return results


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(engine: Engine) -> dict[str, Any]:
    """What the numbers depend on, minus anything that identifies the machine (no hostname)."""
    import transformers

    env: dict[str, Any] = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "target_forward": engine.target.forward_note,
        "cuda_device": None,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    if torch.cuda.is_available():
        dev = engine.target.device
        env["cuda_device"] = torch.cuda.get_device_name(dev if dev.type == "cuda" else 0)
    return env


def _report_json(summary: dict[str, Any], per_prompt: list[dict[str, Any]]) -> str:
    # One line per prompt: an indented token-id list would put every id on its own line.
    rows = ",\n  ".join(json.dumps(r, ensure_ascii=False) for r in per_prompt)
    head = json.dumps({k: v for k, v in summary.items() if k != "per_method"}, indent=2, ensure_ascii=False)
    if "per_method" in summary:  # likewise one line per method, histogram included
        lines = ",\n    ".join(f"{json.dumps(n)}: {json.dumps(s, ensure_ascii=False)}"
                                for n, s in summary["per_method"].items())
        head = head.removesuffix("\n}") + f',\n  "per_method": {{\n    {lines}\n  }}\n}}'
    head = head.replace("\n", "\n ")
    return f'{{\n "summary": {head},\n "per_prompt": [\n  {rows}\n ]\n}}\n'


def write_report(path: str | Path, summary: dict[str, Any], per_prompt: list[dict[str, Any]]) -> Path:
    return write_text_atomic(path, _report_json(summary, per_prompt))


# The app renders the HTML report (plotly, the app's chart look) in a process of its own: the engine
# names the module but imports neither it nor plotly, so it stays usable without either.
HTML_RENDERER = "app.bench_report"


@dataclass(frozen=True)
class HtmlRenderer:
    """`python -m app.bench_report` with a Python path that finds the app, as found before a run."""

    command: tuple[str, ...]
    env: dict[str, str]

    def render(self, report: str | Path, html: str | Path) -> Path:
        """The HTML report of a JSON report `bench` wrote."""
        done = subprocess.run([*self.command, str(report), "--html", str(html)], env=self.env,
                              capture_output=True, text=True)
        if done.returncode:
            why = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
            raise DFlashError(f"--html: rendering {report} failed ({why}); the JSON report is complete")
        return Path(html)


def html_renderer() -> HtmlRenderer:
    """The HTML report's renderer, checked before an hour of benchmarking: found without importing it."""
    app = importlib.util.find_spec(HTML_RENDERER.split(".")[0])
    homes = [Path(p) for p in (app.submodule_search_locations or [])] if app else []
    home = next((h for h in homes if (h / "bench_report.py").is_file()), None)
    if home is None:
        raise DFlashError("--html needs DFlash Studio's app/ package on the Python path (run from the repository "
                          "root)")
    if importlib.util.find_spec("plotly") is None:
        raise DFlashError("--html needs plotly (pip install plotly)")
    path = [str(home.parent), *filter(None, [os.environ.get("PYTHONPATH")])]
    return HtmlRenderer((sys.executable, "-m", HTML_RENDERER), {**os.environ, "PYTHONPATH": os.pathsep.join(path)})


def check_writable(path: str | Path) -> None:
    """Fail before an hour of benchmarking, not after it."""
    parent = Path(path).expanduser().resolve().parent
    if not parent.is_dir():
        raise DFlashError(f"cannot write {path}: folder {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise DFlashError(f"cannot write {path}: folder {parent} is not writable")
