"""`python -m dflash_core` / `dflash`: generate text, benchmark DFlash against plain decoding, train a drafter,
export one to another layout.

Each subcommand is an `add_<name>(subparsers)` function that registers its parser and sets
`func`; adding one (e.g. `train`) is one such function plus a line in `COMMANDS`.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TextIO

import torch

from .config import VERIFY_MODES, GenerationConfig
from .drafter import check_draft_window
from .engine import Engine
from .errors import DFlashError
from .events import BlockEvent, Finished
from .loading import default_drafter_for, load

EXIT_USER_ERROR = 2
EXIT_MISMATCH = 1
EXIT_INTERRUPTED = 130


# ----- shared options -----

class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default, unless the help already says it; a flag's is "off"."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "(default" in text or action.default is argparse.SUPPRESS or action.required:
            return text
        shown = "off" if action.nargs == 0 and not isinstance(action, argparse.BooleanOptionalAction) else "%(default)s"
        return f"{text} (default: {shown})"


def model_options() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("model")
    g.add_argument("--target", default=None, metavar="ID|PATH",
                   help="target LLM: 'embedded' (SmolLM2-135M-Instruct), a folder or a hub id (default: embedded)")
    g.add_argument("--draft", default=None, metavar="ID|PATH|none",
                   help="DFlash drafter folder or hub id; 'none' for plain decoding only (default: the shipped "
                        "drafter for the embedded target; other targets need one)")
    g.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    g.add_argument("--dtype", default=None, help="float32, bfloat16, float16 or auto (default: auto)")
    g.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="replay the target's short passes (verify blocks, plain steps) as CUDA graphs "
                        "(default: off; not yet measured on a GPU). On a CPU: the same static passes run "
                        "eagerly, slower, for checking them")
    return p


def decoding_options(max_new_tokens: int) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("decoding")
    g.add_argument("--block-size", type=int, default=None, metavar="N",
                   help="DFlash block size B (default: the drafter's)")
    g.add_argument("--steps", type=int, default=1, metavar="N",
                   help="denoising steps per block (1: DFlash as published)")
    g.add_argument("--verify", choices=VERIFY_MODES, default="auto",
                   help="how many draft tokens the target checks: full (the whole block), adaptive (the prefix "
                        "worth a pass on this machine), tree-full (a tree of B-1 candidates: the drafter's "
                        "likeliest alternatives too), tree (as many candidates as pay on this machine), auto "
                        "(default: on CPU tree when greedy, adaptive when sampling; full on GPU); trees need "
                        "--steps 1 and the fast forward")
    g.add_argument("--no-lookup", dest="lookup", action="store_false",
                   help="trees: leave out lookup candidates (prompt lookup and the drafter's n-gram table), "
                        "drafter only")
    g.add_argument("--draft-window", type=int, default=None, metavar="N",
                   help="the drafter reads only the last N positions of the conversation (plus the block), "
                        "which bounds its cost in long chats; the output is unchanged (default: all of them)")
    g.add_argument("--temperature", type=float, default=0.0, metavar="T", help="sampling temperature (0: greedy)")
    g.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="nucleus sampling: draw from the likeliest tokens whose probabilities add up to P (1: off)")
    g.add_argument("--top-k", type=int, default=0, metavar="K", help="draw from the K likeliest tokens only (0: off)")
    g.add_argument("--seed", type=int, default=0, metavar="S",
                   help="random seed for sampling: the same seed gives the same reply")
    g.add_argument("--max-new-tokens", type=int, default=max_new_tokens, metavar="N",
                   help="most tokens to generate per reply")
    return p


def generation_config(args: argparse.Namespace, **extra: object) -> GenerationConfig:
    """Built before any model loads, so a bad flag fails in milliseconds."""
    return GenerationConfig(max_new_tokens=args.max_new_tokens, block_size=args.block_size, steps=args.steps,
                            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            verify=args.verify, lookup=args.lookup,
                            **extra)


def check_device(device: str | None) -> None:
    # torch's own errors here are multi-line tracebacks about how it was compiled.
    if device is None:
        return
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise DFlashError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DFlashError(f"device {device!r} asked for, but this torch build sees no CUDA GPU")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise DFlashError(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s) present")


def load_engine(args: argparse.Namespace, draft: str | None = None) -> Engine:
    check_device(args.device)
    window = getattr(args, "draft_window", None)
    check_draft_window(window)
    engine = load(args.target, draft if draft is not None else args.draft, args.device, args.dtype,
                  graphs=args.cuda_graphs)
    if engine.drafter is not None:
        engine.drafter.draft_window = window
    for w in engine.warnings:
        print(f"warning: {w}", file=sys.stderr)
    return engine


# ----- generate -----

class TextStream:
    """Prints a reply as it grows, never printing what the final reply will not contain.

    Each event's text is already cut where plain decoding stops (EOS, max_new_tokens, the token
    that completes a stop string); the final reply also drops the stop string itself. So the
    stream only cuts at a stop string and holds back what could be the start of one, or half a
    multi-byte character.
    """

    def __init__(self, config: GenerationConfig, out: TextIO) -> None:
        self.stop, self.out = config.stop, out
        self.printed = ""
        self.holdback = max((len(s) for s in config.stop), default=1) - 1

    def _visible(self, text: str) -> str:
        cut = min((text.index(s) for s in self.stop if s in text), default=None)
        if cut is not None:
            return text[:cut]
        text = text[: len(text) - self.holdback] if self.holdback else text
        return text.rstrip("\ufffd")  # an incomplete UTF-8 sequence decodes to U+FFFD for now

    def _emit(self, text: str) -> None:
        if text.startswith(self.printed) and len(text) > len(self.printed):
            self.out.write(text[len(self.printed):])
            self.out.flush()
            self.printed = text

    def block(self, event: BlockEvent) -> None:
        self._emit(self._visible(event.text))

    def finish(self, fin: Finished) -> None:
        self._emit(fin.text)
        self.out.write("\n")
        self.out.flush()


def summary_line(fin: Finished, plain: bool) -> str:
    mode = "plain" if plain else "dflash"
    return (f"[{mode}] {len(fin.token_ids)} tokens · tau {fin.tau:.2f} · {fin.tokens_per_s:.2f} tok/s · "
            f"{fin.blocks} blocks · finish: {fin.reason} · {fin.elapsed_s:.2f} s "
            f"(prefill {fin.prefill_s:.2f}, draft {fin.draft_s:.2f}, verify {fin.verify_s:.2f})")


def cmd_generate(args: argparse.Namespace) -> int:
    if not args.prompt.strip():
        raise DFlashError("the prompt is empty")
    config = generation_config(args, stop=tuple(args.stop))
    # Plain decoding never touches a drafter, so don't load (or warn about) one unless asked to.
    engine = load_engine(args, draft="none" if args.plain and args.draft is None else None)
    if not args.plain and engine.drafter is not None:
        # Before the reply, as launch.py does: sizing blocks needs the target's pass times, and the
        # reply's tokens/s should not include measuring them.
        t0 = time.perf_counter()
        if engine.cost_table(engine.verify_mode(config), config.block_size or engine.drafter.block_size):
            print(f"[dflash] pass costs measured in {time.perf_counter() - t0:.1f} s (before the reply)",
                  file=sys.stderr)
    stream = TextStream(config, sys.stdout)
    fin = None
    for ev in engine.generate(args.prompt, config, plain=args.plain):
        if isinstance(ev, BlockEvent):
            stream.block(ev)
        else:
            fin = ev
    assert fin is not None
    stream.finish(fin)
    for w in fin.warnings:
        print(f"warning: {w}", file=sys.stderr)
    print(summary_line(fin, args.plain), file=sys.stderr)
    return 0


def add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", parents=[model_options(), decoding_options(256)], formatter_class=HelpFormatter,
                       help="generate a reply, streamed to stdout; stats go to stderr",
                       description="Generate one reply with DFlash (or --plain) decoding.")
    p.add_argument("--prompt", required=True, help="the user message")
    p.add_argument("--stop", nargs="+", action="extend", default=[], metavar="STR",
                   help="stop when the reply contains any of these strings (default: none)")
    p.add_argument("--plain", action="store_true", help="plain autoregressive decoding (the baseline)")
    p.set_defaults(func=cmd_generate)


# ----- bench -----

def bench_command(args: argparse.Namespace) -> str:
    """The command as typed, for the README table's "regenerate with" line."""
    argv = getattr(args, "argv", None) or sys.argv[1:]
    return "python -m dflash_core " + shlex.join(argv)


def default_report_path(prompt_set: str) -> Path:
    """`bench-<set>-<local time>.json` in the current folder (a JSONL set is named by its file's
    stem): the time keeps a run from overwriting an earlier one's report."""
    return Path(f"bench-{Path(prompt_set).stem}-{time.strftime('%Y%m%d-%H%M%S')}.json")


def _shown_path(spec: str) -> str:
    """A drafter folder inside the working directory as a relative path: reports name no home folder."""
    try:
        return str(Path(spec).resolve().relative_to(Path.cwd().resolve()))
    except (ValueError, OSError):
        return spec


def cmd_bench(args: argparse.Namespace) -> int:
    from . import bench, bench_stats
    from .prompt_sets import load_prompt_set

    if args.draft == "none":
        raise DFlashError("bench compares plain and DFlash decoding, so it needs a drafter; drop --draft none")
    if args.warmup < 0:
        raise DFlashError(f"warmup must be >= 0, got {args.warmup}")
    config = generation_config(args)
    specs = bench_stats.parse_methods(args.methods)
    dflash = [s.name for s in specs if s.kind == "dflash"]
    if not dflash:
        raise DFlashError("--methods must include dflash or dflash-bN[-sK] (the method this report is about)")
    prompts = load_prompt_set(args.prompts, args.limit, args.skip)
    out = args.out or default_report_path(args.prompts)
    # Every output is checked before the run, so an hour of benchmarking never ends in a write error.
    for path in (out, args.html, args.readme):
        if path:
            bench.check_writable(path)
    if args.readme:
        bench_stats.check_readme(args.readme, bench_stats.region_name(args.prompts, args.temperature))
    html = bench.html_renderer() if args.html else None
    server = None
    if args.server:  # before the engine loads: a dead URL costs seconds, not a model load
        from .server_bench import open_server, server_method

        server = open_server(args.server)
    if args.pinned_costs:
        from .engine import Engine
        from .verify_length import REFERENCE_CPU_COSTS

        Engine.pinned_costs, Engine.fit_threads = REFERENCE_CPU_COSTS, False
    engine = load_engine(args)
    assert engine.drafter is not None
    methods = bench.make_methods(engine, [s.name for s in specs], config)
    if server is not None:
        methods.append(server_method(server, engine))
    results = bench.run_methods(prompts, methods, config, warmup=args.warmup, progress=not args.no_progress)
    summary, per_prompt = bench.summarize(prompts, results, methods, primary=dflash[0])
    primary = next(m for m in methods if m.name == dflash[0])
    summary.update({
        "prompt_set": args.prompts,
        "skip": args.skip,
        "target": engine.target.name,
        "draft": _shown_path(args.draft or default_drafter_for(args.target) or "untrained (random init)"),
        "block_size": primary.block_size,
        "steps": primary.steps,
        "temperature": config.temperature,
        "top_p": config.top_p,
        "top_k": config.top_k,
        "seed": config.seed,
        "max_new_tokens": config.max_new_tokens,
        "device": str(engine.target.device),
        "dtype": str(engine.target.dtype).removeprefix("torch."),
        "command": bench_command(args),
        "pass_costs": "pinned (REFERENCE_CPU_COSTS)" if args.pinned_costs else "measured",
        **({"server": server.url, "server_model": server.info().model} if server is not None else {}),
        **bench.environment(engine),
    })
    written = [bench.write_report(out, summary, per_prompt)]
    if html is not None:
        written.append(html.render(out, args.html))
    if args.readme:
        written.append(bench_stats.write_readme(args.readme, summary))
    print(bench.format_table(summary))
    for path in written:
        print(f"wrote {path}", file=sys.stderr)
    if config.greedy and summary["mismatches"]:
        # Greedy DFlash must reproduce plain decoding token for token; anything else is a bug.
        print(f"error: on {summary['mismatches']} prompt(s) a method's tokens differ from {summary['baseline']}'s "
              "at T=0 (see the exact column)", file=sys.stderr)
        return EXIT_MISMATCH
    return 0


def add_bench(sub: argparse._SubParsersAction) -> None:
    from .bench_stats import METHOD_HELP
    from .prompt_sets import BUILTIN

    p = sub.add_parser("bench", parents=[model_options(), decoding_options(256)], formatter_class=HelpFormatter,
                       help="time plain vs DFlash decoding (and transformers' peers) on a prompt set",
                       description="Benchmark decoding methods on the same prompts, target and run; writes a "
                                   "JSON report, optionally a self-contained HTML report and the README table.")
    p.add_argument("--prompts", "--set", dest="prompts", required=True, metavar="FILE.jsonl|SET",
                   help='JSONL of {"prompt": str} or {"turns": [str, ...]}, or a built-in set: '
                        f"{', '.join(BUILTIN)} (mtbench: two turns per prompt, both timed; mtbench-1: "
                        "first turns only)")
    p.add_argument("--limit", type=int, default=None, metavar="K", help="use the first K prompts (default: all)")
    p.add_argument("--skip", type=int, default=0, metavar="N",
                   help="leave out the first N prompts (before --limit), e.g. to measure a drafter on "
                        "prompts the README tables do not use")
    p.add_argument("--out", "--json", dest="out", default=None, metavar="R.json",
                   help="where to write the JSON report (default: bench-SET-YYYYmmdd-HHMMSS.json in the current "
                        "folder, SET the prompt set's name; never overwrites an earlier run's)")
    p.add_argument("--html", default=None, metavar="R.html",
                   help="also write a self-contained HTML report with charts (opens offline; rendered from the "
                        "JSON report by `python -m app.bench_report`, so it needs plotly and the app/ folder) "
                        "(default: none)")
    p.add_argument("--readme", default=None, metavar="README.md",
                   help="rewrite the results table between <!-- bench:start --> and <!-- bench:end --> there "
                        "(default: none)")
    p.add_argument("--warmup", type=int, default=1, metavar="N", help="untimed warm-up rounds per method")
    p.add_argument("--methods", default="plain,dflash", metavar="A,B,...",
                   help=f"comma list from {METHOD_HELP}; the first is the baseline for speed-ups and exact "
                        "matches (all = plain, hf-generate, prompt-lookup, hf-dflash, dflash-b4/b8/b16 with 1 "
                        "and 2 steps)")
    p.add_argument("--server", default=None, metavar="URL",
                   help="also run the prompts through an OpenAI-compatible DFlash server (vLLM, SGLang) as the "
                        "method 'server': its tok/s timed here, its tau from its own counters (docs/serving.md) "
                        "(default: none)")
    p.add_argument("--pinned-costs", action="store_true",
                   help="size blocks and trees from a fixed table of pass costs (verify_length.REFERENCE_CPU_COSTS) "
                        "instead of this machine's, on a fixed thread count: tau and the blocks then do not "
                        "depend on the machine's load, to compare drafters; speed-ups are no longer this "
                        "machine's best")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_bench)


# ----- train -----

def cmd_train(args: argparse.Namespace) -> int:
    from .train.run import run_train

    check_device(args.device)
    return run_train(args)


def add_train(sub: argparse._SubParsersAction) -> None:
    from .train.args import add_train_arguments

    p = sub.add_parser("train", formatter_class=HelpFormatter,
                       help="top up data, train a drafter, measure its tau with real speculative decoding",
                       description="Train a DFlash drafter for a target in one command (resumable); writes a "
                                   "z-lab checkpoint and train_report.json into --out.")
    add_train_arguments(p)
    p.set_defaults(func=cmd_train)


# ----- export -----

def cmd_export(args: argparse.Namespace) -> int:
    from .drafter import load_drafter
    from .export import check_out, export_drafter
    from .targets import load_target

    check_out(args.out)  # before anything loads
    # Only a transformers assistant needs its target (it names neither vocabulary nor depth).
    target = load_target(args.target, device="cpu") if args.target else None
    drafter = load_drafter(args.draft, target=target)
    dtype = args.dtype or str(drafter.config.extra.get("dtype") or "bfloat16")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise DFlashError(f"--dtype must be float32, bfloat16 or float16, got {dtype!r}")
    for note in export_drafter(drafter, args.out, args.to, getattr(torch, dtype)):
        print(f"note: {note}", file=sys.stderr)
    print(f"wrote {args.out} ({args.to} layout, {dtype})", file=sys.stderr)
    return 0


def add_export(sub: argparse._SubParsersAction) -> None:
    from .export import FORMATS

    p = sub.add_parser("export", formatter_class=HelpFormatter,
                       help="write a drafter in another checkpoint layout",
                       description="Write a drafter folder in transformers' DFlash assistant layout (AutoModel "
                                   "loads it; generate(assistant_model=..., speculation_type='dflash') runs it) "
                                   "or in the z-lab layout (DFlash 1 or 2, as the drafter is).")
    p.add_argument("--draft", required=True, metavar="ID|PATH", help="the drafter: a folder or a hub id")
    p.add_argument("--to", required=True, choices=FORMATS, help="the layout to write")
    p.add_argument("--out", required=True, metavar="DIR", help="a new (or empty) folder to write")
    p.add_argument("--target", default=None, metavar="ID|PATH",
                   help="the drafter's target, needed only to read a transformers assistant (default: none)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: the drafter's own)")
    p.set_defaults(func=cmd_export)


# ----- entry point -----

COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [add_generate, add_bench, add_train, add_export]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash", description="DFlash block-diffusion speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS:
        add(sub)
    return parser


def _one_line(message: str) -> str:
    # Messages can carry newlines from library errors; the contract is one line on stderr.
    return " ".join(message.split())


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse has already printed usage + the error (or --help)
        return e.code if isinstance(e.code, int) else EXIT_USER_ERROR
    args.argv = list(sys.argv[1:] if argv is None else argv)  # bench's report names the exact command
    try:
        return args.func(args)
    except DFlashError as e:
        print(f"error: {_one_line(str(e))}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
