"""A lean forward pass for Llama-family targets (Llama, Qwen2, Qwen3).

The same maths as transformers' modules, written as plain torch calls over the same weights,
writing into the same preallocated KV buffers (`cache.TargetCache`), so the engine, rollback and
the transformers path stay interchangeable (`Target(fast=False)` or `DFLASH_FAST_TARGET=0`).

Why it exists, measured on SmolLM2-135M with 2 CPU threads:
- A one-token step reads every weight once and is bound by memory bandwidth (~52 ms for
  540 MB); transformers' module tree adds ~6 ms of host work on top of that.
- A verify pass of m tokens should cost little more than one token, but MKL packs each weight
  matrix again inside every small-M GEMM: 4 tokens cost 1.6x a one-token pass, 16 tokens 2.3x.
  Packing the weights once at load (MKL's packed GEMM, which torch.compile's CPU freezing also
  uses) brings that to ~1.2x and ~1.7x. That is what makes verifying a drafted block cheap.
- On an AVX2-only CPU (an AMD EPYC) MKL's packed GEMM stayed expensive (16 tokens 3.1x one
  token) while oneDNN's, over a weight reordered once, cost 1.9x; so fp32 weights take oneDNN's
  layout wherever it checks out (`onednn_fp32_works`), MKL's packing otherwise.
Packing keeps a second copy of the linear weights, so it is skipped when memory is short; it is
also checked against `F.linear` (once per process, and on the model's own shapes), since MKL
documents the packed format for the batch size it was packed for and we use it for every one.

The lean path reads the weights as they were when it was built (packed copies are copies): a
caller that changes the model's weights or dtype afterwards must build a new `Target`.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from . import batch_invariant
from .batch_invariant import AttentionPlan, InvariantLinear
from .cache import TargetCache
from .draft_tree import DraftTree, visibility

SUPPORTED_TYPES = ("llama", "qwen2", "qwen3")
# Rope variants whose cos/sin depend on the sequence seen so far, not just the position.
POSITION_DEPENDENT_ROPE = ("dynamic", "longrope")
PACK_BATCH_HINT = 16  # the largest verify pass; MKL's packed layout is chosen for it
# Below this many rows MKL's own small-M kernels are as fast or faster (measured: 1-3 rows equal
# or ~2 ms per pass better unpacked; 4 rows 58 ms packed against 76 ms unpacked).
PACKED_MIN_ROWS = 4


def unsupported_reason(model: Any) -> str | None:
    """Why `model` cannot take the lean path (None when it can)."""
    reason = config_unsupported_reason(model.config)
    if reason is not None:
        return reason
    devices = set((getattr(model, "hf_device_map", None) or {}).values())
    if len(devices) > 1:
        return "the model is spread over several devices"
    inner = getattr(model, "model", None)
    for layer in getattr(inner, "layers", [None]):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        names = [(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        names += [(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")]
        # Only plain float Linear layers: quantized, LoRA-wrapped or otherwise patched projections
        # compute something the lean path would not.
        if not all(_plain_linear(getattr(owner, n, None)) for owner, n in names):
            return "projections that are not plain float nn.Linear layers (quantized or wrapped?)"
    if not _plain_linear(getattr(model, "lm_head", None)):
        return "an LM head that is not a plain float nn.Linear"
    return None


def config_unsupported_reason(cfg: Any) -> str | None:
    """What in a model's config alone rules the lean path out (None: nothing), known before
    the weights are loaded."""
    kind = getattr(cfg, "model_type", None)
    if kind not in SUPPORTED_TYPES:
        return f"model type {kind!r} (the lean path covers {', '.join(SUPPORTED_TYPES)})"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act!r}"
    if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp > 1"
    if getattr(cfg, "use_sliding_window", False) or any(
        t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])
    ):
        return "sliding-window attention layers"
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type in POSITION_DEPENDENT_ROPE:
        return f"rope type {rope_type!r}"
    if getattr(cfg, "quantization_config", None) is not None:
        return "a quantized model"
    return None


def _plain_linear(module: Any) -> bool:
    return type(module) is torch.nn.Linear and module.weight.is_floating_point()


def _probe_weights(out: int, inp: int) -> tuple[torch.Generator, torch.Tensor, torch.Tensor]:
    """A seeded random weight and bias for the GEMM libraries' load-time probes."""
    gen = torch.Generator().manual_seed(0)
    return gen, torch.randn(out, inp, generator=gen), torch.randn(out, generator=gen)


@functools.cache
def mkl_packing_works() -> bool:
    """MKL's packed GEMM, packed once for PACK_BATCH_HINT rows, agrees with F.linear for any
    number of rows on this machine (checked once per process on a small random matrix)."""
    if not torch.backends.mkl.is_available() or os.environ.get("DFLASH_PACK_WEIGHTS", "1") == "0":
        return False
    try:
        gen, w, b = _probe_weights(96, 64)
        packed = torch.ops.mkl._mkl_reorder_linear_weight(w, PACK_BATCH_HINT)
        return _packed_agrees(w, b, packed, (1, 2, 3, 4, 7, 16, 40), gen)
    except (RuntimeError, AttributeError):
        return False


@functools.cache
def onednn_fp32_works() -> bool:
    """oneDNN's fp32 GEMM through a weight reordered once gives every row the same bits for
    1..32 rows and agrees with F.linear (probed once per process on random matrices of a
    transformer MLP's two shapes). Where it does, fp32 weights are laid out for oneDNN rather than
    packed for MKL: measured on an AVX2 AMD EPYC (2 threads), a 16-row LM-head GEMM took 15 ms
    through oneDNN against 40 ms MKL-packed, and the layers' GEMMs 20-40 % less.
    `DFLASH_ONEDNN_FP32=0` keeps MKL's packing."""
    if not torch.backends.mkldnn.is_available() or os.environ.get("DFLASH_ONEDNN_FP32", "1") == "0":
        return False
    try:
        # Both directions of an MLP: whether rows keep their bits depends on the inner size (on
        # an AMX Xeon, 576 inputs did and 1536 did not).
        for out, inp in ((1536, 576), (576, 1536)):
            gen, w, b = _probe_weights(out, inp)
            packed = batch_invariant.onednn_weight(w)
            if not _packed_agrees(w, b, packed, (1, 2, 3, 4, 7, 16, 17, 32), gen):
                return False
            x = torch.randn(32, inp, generator=gen)
            alone = torch.cat([batch_invariant.onednn_linear(x[i : i + 1], packed, b) for i in range(32)])
            rows = (2, 3, 4, 7, 16, 17, 32)
            if not all(torch.equal(batch_invariant.onednn_linear(x[:m], packed, b), alone[:m]) for m in rows):
                return False
        return True
    except (AttributeError, RuntimeError):
        return False


def _packed_agrees(weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor,
                   rows: tuple[int, ...], gen: torch.Generator) -> bool:
    """The packed GEMM gives F.linear's result (to fp32 rounding) for random inputs of these
    row counts."""
    for m in rows:
        x = torch.randn(m, weight.shape[1], generator=gen)
        got = _matmul(x, weight, bias, packed)
        if not torch.allclose(got, F.linear(x, weight, bias), rtol=1e-4, atol=1e-4):
            return False
    return True


def _available_memory() -> int:
    """Bytes this process can still take: the kernel's MemAvailable (free + reclaimable cache),
    capped by a cgroup v2 memory limit when there is one (containers, Spaces); 0 if unknown."""
    avail = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return 0
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            avail = min(avail, int(limit) - used)
    except (OSError, ValueError):
        pass
    return max(avail, 0)


@dataclass
class Linear:
    weight: torch.Tensor
    bias: torch.Tensor | None
    packed: torch.Tensor | None = None  # `weight` laid out once for its GEMM library (`pack_weight`)

    @classmethod
    def joined(cls, modules: list[torch.nn.Module]) -> Linear:
        """Linear layers that read the same input as one GEMM (`batch_invariant.joined_weight`),
        laid out once (`pack_weight`)."""
        weight, bias = batch_invariant.joined_weight(modules)
        return cls(weight, bias, pack_weight(weight))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _matmul(x, self.weight, self.bias, self.packed)

    whole = __call__  # the same GEMM for any number of rows (see InvariantLinear.whole)


def _onednn_layout(packed: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `packed` is oneDNN's layout of `weight` (it keeps the weight's shape; MKL's packed
    buffer is a flat [bytes, 1] tensor)."""
    return packed.shape == weight.shape


def _matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            packed: torch.Tensor | None) -> torch.Tensor:
    """x [rows, in] times the weight, through the packed copy when there is one (MKL's: with
    enough rows)."""
    if packed is not None and _onednn_layout(packed, weight):
        return batch_invariant.onednn_linear(x, packed, bias)
    if packed is not None and x.shape[0] >= PACKED_MIN_ROWS:
        # The last argument tells MKL that `packed` is laid out for this many rows.
        return torch.ops.mkl._mkl_linear(x, packed, weight, bias, x.shape[0])
    return F.linear(x, weight, bias)


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """A [out, in] weight laid out once for its GEMM library: oneDNN's reordered copy for bf16 on
    CPUs with AMX and for fp32 where oneDNN's fp32 GEMM passes its check (`onednn_fp32_works`),
    else MKL's packed copy for fp32; None where none applies (not CPU, `DFLASH_PACK_WEIGHTS=0`,
    or the self-checks failed)."""
    if weight.device.type != "cpu" or os.environ.get("DFLASH_PACK_WEIGHTS", "1") == "0":
        return None
    if weight.dtype == torch.bfloat16:
        return batch_invariant.onednn_weight(weight) if batch_invariant.amx_bf16_available() else None
    if weight.dtype == torch.float32 and onednn_fp32_works():
        return batch_invariant.onednn_weight(weight)
    if weight.dtype != torch.float32 or not mkl_packing_works():
        return None
    return torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)


def weight_key(w: torch.Tensor) -> tuple[Any, ...]:
    """What changes when a weight does: a new tensor (also after a move or a cast), or an
    in-place update (inference tensors keep no version counter). Copies laid out from it are
    rebuilt when it changes."""
    return w.data_ptr(), w.dtype, w.device, -1 if w.is_inference() else w._version


class PackingLinear(torch.nn.Linear):
    """An nn.Linear (same parameters, same checkpoints) that, at CPU inference with 4 or more
    rows, multiplies through weights laid out once (`pack_weight`: MKL-packed fp32, ~25 % cheaper
    for the drafter's 16-row blocks; oneDNN-reordered bf16 on AMX CPUs). The packed copy is made
    on first use and again whenever the weight changes (training evaluates the live drafter
    between optimizer steps); with gradients on it is a plain nn.Linear."""

    _packed: tuple[tuple[Any, ...], torch.Tensor | None] | None = None

    def __getstate__(self) -> dict[str, Any]:
        # The packed copy is an opaque MKL tensor: it cannot be copied or pickled, and is
        # rebuilt on first use anyway (deepcopy, torch.save of the module).
        state = dict(self.__dict__)
        state.pop("_packed", None)
        return state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // max(1, x.shape[-1])
        if torch.is_grad_enabled() or rows < PACKED_MIN_ROWS or torch.is_autocast_enabled(x.device.type):
            return super().forward(x)
        key = weight_key(self.weight)
        if self._packed is None or self._packed[0] != key:
            self._packed = (key, pack_weight(self.weight))
        out = _matmul(x.reshape(rows, x.shape[-1]), self.weight, self.bias, self._packed[1])
        return out.view(*x.shape[:-1], out.shape[-1])


def _plain(module: Any, pack: bool) -> Linear:
    w = module.weight.detach()
    b = None if getattr(module, "bias", None) is None else module.bias.detach()
    return Linear(w, b, pack_weight(w) if pack else None)


@dataclass
class Norm:
    weight: torch.Tensor
    eps: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # transformers' RMSNorm, operation for operation (fp32 statistics, weight in model dtype).
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _norm(module: Any, default_eps: float) -> Norm:
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", default_eps))
    return Norm(module.weight.detach(), float(eps))


@dataclass
class Layer:
    attn_norm: Norm
    q: Linear | None
    k: Linear | None
    v: Linear | None
    o: Linear | InvariantLinear
    q_norm: Norm | None  # Qwen3 normalises each head's queries and keys before RoPE
    k_norm: Norm | None
    mlp_norm: Norm
    gate: Linear | None
    up: Linear | None
    down: Linear | InvariantLinear
    # The batch-invariant path multiplies q/k/v and gate/up as one GEMM each (fewer, wider
    # calls; as row-invariant as the separate ones), in place of the five above.
    qkv: InvariantLinear | None = None
    gate_up: InvariantLinear | None = None


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class FastForward:
    """`forward(ids, cache, layer_ids, last_only)` for a supported model; see `Target.forward`."""

    def __init__(self, model: Any, pack: bool | None = None, invariant: bool | None = None) -> None:
        """`invariant`: bf16 maths whose rows never depend on the pass (batch_invariant.py);
        None = wherever the model is bf16 on a CPU with AMX."""
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"no lean forward for this model: {reason}")
        cfg, inner = model.config, model.model
        self.num_heads = int(cfg.num_attention_heads)
        self.num_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads)
        self.scale = self.head_dim**-0.5
        eps = float(getattr(cfg, "rms_norm_eps", 1e-6))
        weight = inner.embed_tokens.weight
        if invariant is None:
            invariant = (weight.device.type == "cpu" and weight.dtype == torch.bfloat16
                         and batch_invariant.amx_bf16_available())
        self.invariant = invariant
        if invariant:
            pack = False  # oneDNN reorders the bf16 weights instead
        elif pack is None:  # where packing applies at all (CPU fp32, MKL) `pack_weight` decides
            linear_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                               if n.endswith("proj.weight"))
            linear_bytes += model.lm_head.weight.numel() * model.lm_head.weight.element_size()
            pack = weight.dtype == torch.float32 and linear_bytes < _available_memory() // 2
        self.embed = weight.detach()
        self.layers = []

        def make_linear(module: Any, pack: bool) -> Linear | InvariantLinear:
            if invariant:
                return InvariantLinear.of(module.weight, getattr(module, "bias", None))
            return _plain(module, pack)

        for block in inner.layers:
            a, m = block.self_attn, block.mlp
            fused = invariant  # q/k/v and gate/up as one GEMM each (InvariantLinear.joined)
            self.layers.append(Layer(
                attn_norm=_norm(block.input_layernorm, eps),
                q=None if fused else _plain(a.q_proj, pack), k=None if fused else _plain(a.k_proj, pack),
                v=None if fused else _plain(a.v_proj, pack),
                o=make_linear(a.o_proj, pack),
                q_norm=_norm(a.q_norm, eps) if hasattr(a, "q_norm") else None,
                k_norm=_norm(a.k_norm, eps) if hasattr(a, "k_norm") else None,
                mlp_norm=_norm(block.post_attention_layernorm, eps),
                gate=None if fused else _plain(m.gate_proj, pack), up=None if fused else _plain(m.up_proj, pack),
                down=make_linear(m.down_proj, pack),
                qkv=InvariantLinear.joined([a.q_proj, a.k_proj, a.v_proj]) if fused else None,
                gate_up=InvariantLinear.joined([m.gate_proj, m.up_proj]) if fused else None,
            ))
        self.final_norm = _norm(inner.norm, eps)
        self.head = make_linear(model.lm_head, pack)
        if self.packed and not self._packed_shapes_agree():
            for lin in self._linears():
                lin.packed = None
        self.rotary = inner.rotary_emb
        self.cos = self.sin = weight.new_zeros((0, self.head_dim))
        # transformers reports the last layer's output after the final norm unless a config
        # says otherwise (a few vision models do).
        self.norm_last_hidden = getattr(cfg, "tie_last_hidden_states", None) is not False

    @property
    def packed(self) -> bool:
        """fp32 weights laid out once (`pack_weight`; the invariant bf16 path reorders its own)."""
        return not self.invariant and self.head.packed is not None

    @property
    def packed_by(self) -> str | None:
        """Which library the fp32 weights are laid out for: "oneDNN", "MKL" or None."""
        if not self.packed:
            return None
        assert isinstance(self.head, Linear) and self.head.packed is not None
        return "oneDNN" if _onednn_layout(self.head.packed, self.head.weight) else "MKL"

    def _linears(self) -> list[Linear | InvariantLinear]:
        layers = (lin for la in self.layers for lin in (la.q, la.k, la.v, la.o, la.gate, la.up, la.down, la.qkv,
                                                        la.gate_up))
        return [*(lin for lin in layers if lin is not None), self.head]

    @torch.inference_mode()
    def _packed_shapes_agree(self) -> bool:
        """The packed weights of this model's own shapes (one of each) agree with F.linear at the
        row counts the engine uses: MKL's blocking depends on the shape, so a small probe matrix
        (`mkl_packing_works`) does not prove it for these."""
        gen = torch.Generator().manual_seed(0)
        rows = (PACKED_MIN_ROWS, PACK_BATCH_HINT, PACK_BATCH_HINT + 1, 64)
        seen: set[tuple[int, ...]] = set()
        for lin in self._linears():
            if not isinstance(lin, Linear) or lin.packed is None or tuple(lin.weight.shape) in seen:
                continue
            seen.add(tuple(lin.weight.shape))
            if not _packed_agrees(lin.weight, lin.bias, lin.packed, rows, gen):
                return False
        return True

    @torch.inference_mode()
    def rows_agree(self) -> bool:
        """A verify pass and a tree pass give plain decoding's logits bit for bit, here, on this
        model: the batch-invariant path's promise, checked once when a target is loaded (~0.5 s
        for SmolLM2 on 2 cores). The passes cross an attention chunk boundary, and the tree puts
        a second branch's rows between the first branch's, so ancestors are gathered."""
        vocab = self.embed.shape[0]
        ids = (torch.arange(72, device=self.embed.device) * 7919 + 11) % vocab
        start, steps = batch_invariant.CHUNK - 3, 8

        def primed() -> TargetCache:
            cache = TargetCache(len(self.layers), start + 2 * steps, value_ones=True)
            self.forward(ids[None, :start], cache)
            return cache

        cache = primed()
        plain = torch.cat([self.forward(ids[None, i : i + 1], cache)[0] for i in range(start, start + steps)])
        chain = self.forward(ids[None, start : start + steps], primed())[0]
        # Rows: anchor, then nodes a1, b1, a2, b2, a3; the a-branch follows the plain tokens.
        a, other = ids[start : start + 4].tolist(), ((ids[start + 1 : start + 3] + 1) % vocab).tolist()
        tree = DraftTree([a[1], other[0], a[2], other[1], a[3]], [-1, -1, 0, 1, 2], [1, 1, 2, 2, 3],
                         [1.0] * 5, [False] * 5)
        tree_ids = torch.tensor([[a[0], *tree.tokens]], device=ids.device)
        depths = torch.tensor([0, *tree.depths], device=ids.device)
        tree = self.tree_forward(tree_ids, depths, visibility(tree, ids.device), primed())[0]
        return torch.equal(plain, chain) and torch.equal(tree[[0, 1, 3, 5]], plain[:4])

    def _rope(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows for positions [0, end), computed by the model's own rotary module (so
        every scaling variant it implements is honoured) and kept, doubling as contexts grow."""
        if end > self.cos.shape[0]:
            n = max(end, 2 * self.cos.shape[0], 256)
            pos = torch.arange(n, device=self.embed.device).unsqueeze(0)
            cos, sin = self.rotary(self.embed[:1].unsqueeze(0), pos)
            self.cos, self.sin = cos[0], sin[0]
        return self.cos, self.sin

    @torch.inference_mode()
    def forward(
        self, ids: torch.Tensor, cache: TargetCache, layer_ids: list[int] | None = None,
        last_only: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run `ids` [1, n] after what `cache` holds, appending their keys/values to it."""
        self._check(ids, layer_ids)
        n = ids.shape[1]
        start = cache.length
        end = start + n
        cos, sin = self._rope(end)
        # Queries attend to every cached key and causally among themselves; SDPA's is_causal is
        # top-left aligned, so it is only right when nothing is cached yet.
        if self.invariant and start:
            plan = AttentionPlan.chain(start, n, ids.device)
            return self._appending(ids, cos[start:end], sin[start:end], cache, plan, layer_ids, last_only)
        if self.invariant:
            # A prefill: every method computes the prompt's rows in this one pass, so their bits
            # need only be deterministic, not equal to any other pass's. Whole-pass GEMMs and
            # SDPA's causal attention make it ~2x faster than the 32-row, chunked path.
            return self._appending(ids, cos[:end], sin[:end], cache, None, layer_ids, last_only, whole=True)
        mask = torch.ones(n, end, dtype=torch.bool, device=ids.device).tril_(start) if n > 1 and start else None
        return self._appending(ids, cos[start:end], sin[start:end], cache, mask, layer_ids, last_only)

    @torch.inference_mode()
    def tree_forward(
        self, ids: torch.Tensor, depths: torch.Tensor, visible: torch.Tensor, cache: TargetCache,
        layer_ids: list[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward` over a draft tree (`draft_tree.py`): ids [1, n] = [anchor, nodes...], row i
        at position `cache.length + depths[i]` and attending to the whole cache plus the rows
        `visible[i]` [n, n] allows. Keys/values are appended in row order; the caller keeps the
        accepted rows (`TargetCache.keep_rows`)."""
        self._check(ids, layer_ids)
        n = ids.shape[1]
        start = cache.length
        positions = depths.to(ids.device) + start
        cos, sin = self._rope(int(positions.max()) + 1)
        if self.invariant:
            plan = AttentionPlan.tree(start, depths.to(ids.device), visible.to(ids.device))
            return self._appending(ids, cos[positions], sin[positions], cache, plan, layer_ids, last_only=False)
        mask = torch.cat([torch.ones(n, start, dtype=torch.bool, device=ids.device), visible.to(ids.device)], 1)
        return self._appending(ids, cos[positions], sin[positions], cache, mask, layer_ids, last_only=False)

    def _appending(
        self, ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: TargetCache,
        mask: torch.Tensor | AttentionPlan | None, layer_ids: list[int] | None, last_only: bool,
        whole: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The pass over `ids` that appends their keys/values after what `cache` holds and attends
        under `mask` (None: SDPA's own causal mask, right when nothing precedes the rows; a plan:
        the batch-invariant attention). `whole`: each linear layer in one GEMM, however many rows."""

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            layer = cache.layers[i]
            keys, values = layer.update(k.unsqueeze(0), v.unsqueeze(0))
            if isinstance(mask, AttentionPlan):
                return batch_invariant.attention(q, layer.keys[0], batch_invariant.values_with_ones(layer), mask,
                                                 self.scale)
            return self._attention(q, keys, values, mask, causal=mask is None)

        return self._layers(ids, cos, sin, attend, layer_ids, last_only, whole)

    @torch.inference_mode()
    def static_forward(
        self, ids: torch.Tensor, positions: torch.Tensor, cache: TargetCache, rope: tuple[torch.Tensor, torch.Tensor],
        layer_ids: list[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward` with nothing decided on the host: `positions` [n] is a device tensor, keys
        and values are written at those positions (`index_copy_`) and queries attend over the
        cache's whole buffer under a mask built from them, and `rope` is a (cos, sin) table
        covering the buffer. Same shapes and addresses for every call, so a CUDA graph can
        replay it (`step_graphs.py`). `cache.length` is left for the caller to advance."""
        self._check(ids, layer_ids)
        first = cache.layers[0]
        if not first.is_initialized:
            raise ValueError("the static pass needs a cache that already holds the prompt")
        # Key j is visible to the query at position p when j <= p: the cached prefix, the
        # block's earlier tokens and itself; stale keys past the end of the context are masked.
        mask = torch.arange(first.keys.shape[2], device=ids.device)[None, :] <= positions[:, None]
        cos, sin = rope[0].index_select(0, positions), rope[1].index_select(0, positions)

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            layer = cache.layers[i]
            layer.keys[0].index_copy_(1, positions, k)
            layer.values[0].index_copy_(1, positions, v)
            return self._attention(q, layer.keys, layer.values, mask)

        return self._layers(ids, cos, sin, attend, layer_ids, last_only=False)

    def _attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                   causal: bool = False) -> torch.Tensor:
        """Attention of queries q [heads, n, head_dim] over keys/values [1, kv_heads, S, head_dim]
        under `mask` [n, S] (or SDPA's own causal mask); [heads, n, head_dim]."""
        nkv, groups, hd = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim
        if q.shape[1] == 1:
            # One query: fold the query heads of each KV group into the query axis, so attention
            # runs on the KV heads as stored (no repeat).
            return F.scaled_dot_product_attention(q.reshape(nkv, groups, hd), keys[0], values[0], attn_mask=mask,
                                                  scale=self.scale)
        return F.scaled_dot_product_attention(q.unsqueeze(0), keys, values, attn_mask=mask, is_causal=causal,
                                              scale=self.scale, enable_gqa=groups > 1)[0]

    def _check(self, ids: torch.Tensor, layer_ids: list[int] | None) -> None:
        if ids.shape[0] != 1:
            raise ValueError(f"the lean forward runs batch size 1, got {ids.shape[0]} rows")
        if layer_ids is not None and not all(0 <= i < len(self.layers) for i in layer_ids):
            raise ValueError(f"layer ids {layer_ids} out of range for {len(self.layers)} layers")

    def _layers(
        self, ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        attend: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
        layer_ids: list[int] | None, last_only: bool, whole: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model's maths over `ids` [1, n] with RoPE rows `cos`/`sin` [n, head_dim];
        `attend(layer, q, k, v)` stores the new keys/values and returns the attention output
        (how is the caller's: appended at a host length, or written at device positions).
        `whole`: linear layers in one GEMM each (`Linear.whole`), not cut into row-invariant calls."""
        n = ids.shape[1]

        def linear(m: Linear | InvariantLinear, x: torch.Tensor) -> torch.Tensor:
            return m.whole(x) if whole else m(x)

        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        wanted = set(layer_ids or [])
        feats: dict[int, torch.Tensor] = {}
        x = F.embedding(ids[0], self.embed)
        for i, layer in enumerate(self.layers):
            h = layer.attn_norm(x)
            if layer.qkv is not None:
                q, k, v = linear(layer.qkv, h).split((nh * hd, nkv * hd, nkv * hd), -1)
            else:
                assert layer.q is not None and layer.k is not None and layer.v is not None
                q, k, v = linear(layer.q, h), linear(layer.k, h), linear(layer.v, h)
            q, k, v = q.view(n, nh, hd), k.view(n, nkv, hd), v.view(n, nkv, hd)
            if layer.q_norm is not None and layer.k_norm is not None:
                q, k = layer.q_norm(q), layer.k_norm(k)
            q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            out = attend(i, q, k, v)
            x = x + linear(layer.o, out.reshape(nh, n, hd).transpose(0, 1).reshape(n, nh * hd))
            h = layer.mlp_norm(x)
            if layer.gate_up is not None:
                gate, up = linear(layer.gate_up, h).chunk(2, -1)
            else:
                assert layer.gate is not None and layer.up is not None
                gate, up = linear(layer.gate, h), linear(layer.up, h)
            x = x + linear(layer.down, F.silu(gate) * up)
            if i in wanted:
                feats[i] = x
        if len(self.layers) - 1 in wanted and self.norm_last_hidden:
            feats[len(self.layers) - 1] = x = self.final_norm(x)
            x = x[-1:] if last_only else x
        else:
            x = self.final_norm(x[-1:] if last_only else x)
        logits = linear(self.head, x).float()
        feat = torch.cat([feats[i] for i in layer_ids], dim=-1) if layer_ids is not None else None
        return logits, feat
