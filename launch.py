"""Start DFlash Studio: load the engine, then serve the chat app.

    python launch.py [--target ID|PATH] [--draft ID|PATH|none] [--device cpu|cuda] [--dtype auto|bf16|fp32]
                     [--host 127.0.0.1] [--port 7860] [--share]
    python launch.py --server URL [--host ...] [--port ...]   # watch a vLLM / SGLang DFlash server instead

A target or drafter that cannot be loaded ends the program with one error line and exit code 2,
before any server starts.

On a Hugging Face Space (SPACE_ID set) without the embedded GGUF package, the target defaults to
its hub original HuggingFaceTB/SmolLM2-135M-Instruct, and the generation handlers are wrapped in
`spaces.GPU` when the `spaces` package imports (ZeroGPU). See app/hosting.py.
"""

from __future__ import annotations

import argparse
import sys
import time

from app import hosting  # env checks only: no torch, no gradio


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="DFlash Studio: watch block-diffusion speculative decoding.")
    p.add_argument("--target", default=None, help="target LLM: hub id or folder (default: embedded SmolLM2-135M)")
    p.add_argument("--draft", default=None, help="DFlash drafter: hub id or folder, or 'none' for plain decoding")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 … (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="auto, bf16, fp16 or fp32 (default: bf16 on a GPU and on CPUs "
                   "with bf16 units, AMX or AVX512-BF16; fp32 on other CPUs)")
    p.add_argument("--host", default=hosting.default_host(),
                   help="address to listen on (0.0.0.0 for all interfaces; default: $GRADIO_SERVER_NAME or 127.0.0.1)")
    p.add_argument("--port", type=int, default=hosting.default_port(), help="default: $GRADIO_SERVER_PORT or 7860")
    p.add_argument("--share", action="store_true", help="also create a public gradio.live link")
    p.add_argument("--server", default=None, metavar="URL",
                   help="chat through an OpenAI-compatible DFlash server (vLLM, SGLang) and chart what it reports, "
                        "instead of loading the engine here (docs/serving.md)")
    return p.parse_args(argv)


def watch_server(args: argparse.Namespace) -> int:
    """`--server URL`: no engine here, so no torch maths; a server that does not answer yet is said
    once here and again in the app, which tries it on every Send."""
    local = [f"--{k}" for k in ("target", "draft", "device", "dtype") if getattr(args, k) is not None]
    if local:
        print(f"error: with --server the server decides the model and device: drop {', '.join(local)}",
              file=sys.stderr)
        return 2
    from app.server_mode import build_server_app
    from app.ui import launch_kwargs
    from dflash_core.errors import DFlashError
    from dflash_core.server_client import ServerClient

    try:
        client = ServerClient(args.server)
        info = client.info()
        print(f"[dflash] watching {info.model} at {client.url} "
              f"({'speculative decoding' if info.speculative else 'no speculation reported'})", flush=True)
    except DFlashError as e:
        if not args.server.strip():
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"[dflash] warning: {e}", flush=True)
    demo = build_server_app(client)
    demo.launch(server_name=args.host, server_port=args.port, share=args.share, **launch_kwargs())
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.server is not None:
        return watch_server(args)
    # Before torch: ZeroGPU's `spaces` must be imported before CUDA is touched.
    gpu = hosting.gpu_decorator()
    print("[dflash] loading the engine (torch, target, drafter) ...", flush=True)
    t0 = time.perf_counter()
    import dflash_core  # imported here so --help answers without loading torch

    target = hosting.pick_target(args.target)
    if target != args.target:
        print(f"[dflash] on a Space without the embedded GGUF: loading the target {target} from the hub", flush=True)
    try:
        engine = dflash_core.load(target=target, draft=args.draft, device=args.device, dtype=args.dtype)
    except dflash_core.DFlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (OSError, RuntimeError) as e:  # e.g. an unknown --device: still one line, not a traceback
        print(f"error: could not load the engine: {str(e).splitlines()[0] if str(e) else type(e).__name__}",
              file=sys.stderr)
        return 2
    drafter = engine.drafter
    print(f"[dflash] target {engine.target.name} on {engine.target.device} ({engine.target.dtype}, "
          f"{engine.target.forward_note}); "
          f"drafter: {'none' if drafter is None else f'block size {drafter.block_size}'} "
          f"— ready in {time.perf_counter() - t0:.1f} s", flush=True)
    for note in engine.warnings:
        print(f"[dflash] warning: {note}", flush=True)
    # Now rather than in the first reply: sized verification needs the target's pass times, for the
    # mode the app's default settings (greedy, one denoising step) resolve to.
    mode = engine.verify_mode(dflash_core.GenerationConfig())
    t1 = time.perf_counter()
    cost = None if drafter is None else engine.cost_table(mode, drafter.block_size)
    if cost is not None and mode != "adaptive":  # sampling's default: a chain sized by chain passes
        engine.cost_table("adaptive", drafter.block_size)
    if cost is not None:
        steps = ", ".join(f"{n}: {r:.2f}" for n, r in cost.relative().items())
        print(f"[dflash] {mode} pass cost in one-token passes ({steps}) measured in "
              f"{time.perf_counter() - t1:.1f} s", flush=True)

    from app.ui import build_app, launch_kwargs

    print("[dflash] building the app ...", flush=True)
    demo = build_app(engine, gpu=gpu)
    demo.launch(server_name=args.host, server_port=args.port, share=args.share, **launch_kwargs())
    return 0


if __name__ == "__main__":
    sys.exit(main())
