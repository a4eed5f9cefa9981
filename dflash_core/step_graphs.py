"""The target's short passes (verify blocks, plain decoding steps) replayed as CUDA graphs.

At batch size 1 a GPU spends a small target's forward launching kernels, not computing: SmolLM2
is ~15 kernels per layer × 30 layers for a few microseconds of arithmetic each. A CUDA graph
replays a captured pass with one launch. What makes a pass replayable is that every tensor it
touches keeps its address and shape: `FastForward.static_forward` takes its positions as a device
tensor, writes keys/values at them and attends over the cache's whole buffer under a mask, so one
graph per pass length serves every block of a reply. The host still keeps the cache lengths
(rollback is still moving a length), and prefill (long, once per reply) stays an ordinary pass.

A graph is bound to the buffers of the cache it was captured on. Each reply has its own cache
(a suspended reply, e.g. the app's step mode, must keep its own), so a new reply captures again
on first use of each pass length: two warm-up passes and the capture, a few passes' worth of time.
The graphs of a cache go when the cache does. All graphs share one memory pool: they never run
concurrently and none reads another's outputs (each result is copied out at once), which is the
sharing PyTorch documents as safe.

On a CPU nothing is captured: `StepGraphs(capture=False)` stands in for a graph with a pass bound
the same way (it replays on the cache it was set up on, into fixed output buffers), which is how
the tests check everything here except the capture itself.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .cache import TargetCache
from .fast_forward import FastForward

MAX_TOKENS = 32  # passes longer than this (prefill) run as ordinary passes
WARMUP_PASSES = 2  # before capture, on a side stream (cuBLAS picks and allocates its workspaces)


@dataclass
class _Pass:
    """One bound pass: its fixed input buffers, its outputs, and how to replay it."""

    ids: torch.Tensor  # [1, n]
    positions: torch.Tensor  # [n]
    offsets: torch.Tensor  # arange(n): positions = offsets + the cache length
    rope: tuple[torch.Tensor, torch.Tensor]  # held here so the graph's tables stay alive
    logits: torch.Tensor | None = None
    feats: torch.Tensor | None = None
    replay: Callable[[], None] = field(default=lambda: None)
    graph: torch.cuda.CUDAGraph | None = None


class StepGraphs:
    """`forward(ids, cache, layer_ids)` through a replayed static pass, or None when this pass
    is not one to replay (too long, no room in the cache, the cache has no buffers yet, or
    capturing failed once: `disabled` says why, and every pass is an ordinary one from then)."""

    def __init__(self, fast: FastForward, capture: bool) -> None:
        self.fast = fast
        self.capture = capture
        self.disabled: str | None = None
        self._cache: weakref.ref[TargetCache] | None = None  # the cache the passes are bound to
        self._passes: dict[tuple[int, tuple[int, ...] | None], _Pass] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self.captures = 0  # passes captured (or, on a CPU, bound) so far

    @torch.inference_mode()
    def forward(
        self, ids: torch.Tensor, cache: TargetCache, layer_ids: list[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        n = ids.shape[1]
        first = cache.layers[0]
        if (self.disabled or n > MAX_TOKENS or not first.is_initialized
                or cache.length + n > cache.max_cache_len):
            return None
        # The cache object itself, not its id or address: a new reply's cache may reuse both.
        if self._cache is None or self._cache() is not cache:
            self._bind(cache)
        key = (n, None if layer_ids is None else tuple(layer_ids))
        step = self._passes.get(key)
        fresh = step is None
        if step is None:
            step = self._passes[key] = self._setup(ids, cache, layer_ids)
        step.ids.copy_(ids)
        torch.add(step.offsets, cache.length, out=step.positions)
        if fresh:
            try:
                self._record(step, cache, layer_ids)
            except RuntimeError as e:  # an op that cannot be captured: ordinary passes from now on
                # The warm-up passes wrote the keys/values the ordinary pass will write again,
                # and the cache length has not moved.
                self.disabled = f"capturing a {n}-token pass failed: {str(e).splitlines()[0]}"
                self._passes.clear()
                return None
        step.replay()
        for layer in cache.layers:
            layer.length += n
        assert step.logits is not None
        # Copies: the next replay overwrites the outputs, and callers keep features (the
        # drafter's pending context) across the next pass.
        return step.logits.clone(), None if step.feats is None else step.feats.clone()

    def _bind(self, cache: TargetCache) -> None:
        self._passes.clear()  # the old graphs (their cache is gone or no longer used)
        self._cache = weakref.ref(cache)
        passes = self._passes

        def drop() -> None:  # a finished reply's graphs go with its cache
            if self._cache is not None and self._cache() is None:
                passes.clear()

        weakref.finalize(cache, drop)

    def _setup(self, ids: torch.Tensor, cache: TargetCache, layer_ids: list[int] | None) -> _Pass:
        self.captures += 1
        n, dev = ids.shape[1], ids.device
        rope = self.fast._rope(cache.max_cache_len)  # the whole buffer, so no pass ever regrows it
        return _Pass(ids=torch.zeros((1, n), dtype=ids.dtype, device=dev),
                     positions=torch.zeros(n, dtype=torch.long, device=dev),
                     offsets=torch.arange(n, device=dev), rope=rope)

    def _run(self, step: _Pass, cache: TargetCache, layer_ids: list[int] | None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.fast.static_forward(step.ids, step.positions, cache, step.rope, layer_ids)

    def _record(self, step: _Pass, cache: TargetCache, layer_ids: list[int] | None) -> None:
        """Bind the pass to `cache`. On CUDA: warm up on a side stream, then capture; the
        warm-up passes write the same keys/values at the same positions as the replay that
        follows. On a CPU: the stand-in replays on `cache` (held weakly, as a graph holds
        addresses) into output buffers fixed here."""
        if not self.capture:
            step.logits, step.feats = self._run(step, cache, layer_ids)
            bound = weakref.ref(cache)

            def replay() -> None:
                target = bound()
                assert target is not None, "a pass replayed after its cache was freed"
                logits, feats = self._run(step, target, layer_ids)
                assert step.logits is not None
                step.logits.copy_(logits)
                if feats is not None and step.feats is not None:
                    step.feats.copy_(feats)

            step.replay = replay
            return
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_PASSES):
                self._run(step, cache, layer_ids)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            step.logits, step.feats = self._run(step, cache, layer_ids)
        step.graph = graph
        step.replay = graph.replay
