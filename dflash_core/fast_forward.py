"""The fast forward: the target's forward pass for Llama-family models (Llama, Qwen2, Qwen3) in plain torch.

The same maths as transformers' modules, written as plain torch calls over the same weights,
writing into the same preallocated KV buffers (`cache.TargetCache`), so the engine, rollback and
the transformers forward stay interchangeable (`Target(fast=False)` picks transformers').

Why it exists, measured on SmolLM2-135M with 2 CPU threads: a one-token step reads every weight
once and is bound by memory bandwidth (~52 ms for 540 MB); transformers' module tree adds ~6 ms
of host work on top of that. And its linear layers multiply through weights laid out once
(packing.py), which is what makes verifying a drafted block cheap; on CPUs with bf16 units (AMX,
AVX512-BF16) it runs the batch-invariant bf16 maths (batch_invariant.py) instead.

The fast forward reads the weights as they were when it was built (packed copies are copies): a
caller that changes the model's weights or dtype afterwards must build a new `Target`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from . import batch_invariant, cpu_kernels
from .batch_invariant import AttentionPlan, InvariantLinear
from .cache import TargetCache
from .draft_tree import DraftTree, visibility
from .fast_forward_support import unsupported_reason
from .layers import apply_rope, rms_norm, swiglu
from .packing import PACK_BATCH_HINT, PACKED_MIN_ROWS, Linear, available_memory, onednn_layout, packed_agrees


@dataclass
class Norm:
    """An RMSNorm's detached weight and epsilon (`layers.rms_norm`)."""

    weight: torch.Tensor
    eps: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


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


class FastForward:
    """`forward(ids, cache, layer_ids, last_only)` for a supported model; see `Target.forward`."""

    def __init__(self, model: Any, pack: bool | None = None, invariant: bool | None = None) -> None:
        """`invariant`: bf16 maths whose rows never depend on the pass (batch_invariant.py);
        None = wherever the model is bf16 on a CPU with bf16 units (AMX, AVX512-BF16)."""
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"no fast forward for this model: {reason}")
        cfg, inner = model.config, model.model
        self.num_heads = int(cfg.num_attention_heads)
        self.num_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads)
        self.scale = self.head_dim**-0.5
        eps = float(getattr(cfg, "rms_norm_eps", 1e-6))
        weight = inner.embed_tokens.weight
        if invariant is None:
            invariant = (weight.device.type == "cpu" and weight.dtype == torch.bfloat16
                         and batch_invariant.bf16_gemm_available())
        self.invariant = invariant
        if invariant:
            pack = False  # oneDNN reorders the bf16 weights instead
        elif pack is None:  # where packing applies at all (CPU fp32, MKL) `pack_weight` decides
            linear_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                               if n.endswith("proj.weight"))
            linear_bytes += model.lm_head.weight.numel() * model.lm_head.weight.element_size()
            pack = weight.dtype == torch.float32 and linear_bytes < available_memory() // 2
        self.embed = weight.detach()
        self.layers = []

        def make_linear(module: Any, pack: bool) -> Linear | InvariantLinear:
            if invariant:
                return InvariantLinear.of(module.weight, getattr(module, "bias", None))
            return Linear.of(module, pack)

        fused = invariant  # q/k/v and gate/up as one GEMM each (InvariantLinear.joined)

        def separate(module: Any) -> Linear | None:
            return None if fused else Linear.of(module, pack)

        for block in inner.layers:
            a, m = block.self_attn, block.mlp
            self.layers.append(Layer(
                attn_norm=_norm(block.input_layernorm, eps),
                q=separate(a.q_proj), k=separate(a.k_proj), v=separate(a.v_proj),
                o=make_linear(a.o_proj, pack),
                q_norm=_norm(a.q_norm, eps) if hasattr(a, "q_norm") else None,
                k_norm=_norm(a.k_norm, eps) if hasattr(a, "k_norm") else None,
                mlp_norm=_norm(block.post_attention_layernorm, eps),
                gate=separate(m.gate_proj), up=separate(m.up_proj),
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
        self.layer_args = self._compiled_layer_args()

    def _compiled_layer_args(self) -> list[tuple[Any, ...]] | None:
        """Each layer's weights as `decoder_layer` (cpu_layer.cpp) takes them, where that whole
        compiled layer applies: the batch-invariant path with compiled linears (AVX512-BF16) and
        sizes its kernels take; else None (the layers run as torch calls)."""
        if not self.invariant or cpu_kernels.attention_kernel(self.head_dim) is None:
            return None
        if self.head_dim % 32 or self.embed.shape[1] % 16:
            return None
        args = []
        norms = [n for la in self.layers for n in (la.attn_norm, la.mlp_norm, la.q_norm, la.k_norm) if n is not None]
        if len({n.eps for n in norms}) > 1 or any(n.weight.dtype != torch.bfloat16 for n in norms):
            return None  # the kernel takes one epsilon, and bf16 norm weights
        for la in self.layers:
            linears = (la.qkv, la.o, la.gate_up, la.down)
            if any(not isinstance(lin, InvariantLinear) or lin.compiled is None for lin in linears):
                return None
            if (la.q_norm is None) != (la.k_norm is None) or la.gate_up.weight.shape[0] % 32:
                return None  # both per-head norms or neither; gate and up each a multiple of 16 wide
            q_norm = None if la.q_norm is None else la.q_norm.weight
            k_norm = None if la.k_norm is None else la.k_norm.weight
            args.append((la.attn_norm.weight, la.qkv.packed, la.qkv.bias, q_norm, k_norm, la.o.packed, la.o.bias,
                         la.mlp_norm.weight, la.gate_up.packed, la.gate_up.bias, la.down.packed, la.down.bias))
        self.layer_eps = self.layers[0].attn_norm.eps
        return args

    @property
    def packed(self) -> bool:
        """fp32 weights laid out once (`pack_weight`; the invariant bf16 path reorders its own)."""
        return not self.invariant and self.head.packed is not None

    @property
    def packed_by(self) -> str | None:
        """Which code the fp32 weights are laid out for: "compiled" (cpu_kernels.py's float32
        kernel), "oneDNN", "MKL" or None."""
        if not self.packed:
            return None
        assert isinstance(self.head, Linear) and self.head.packed is not None
        if self.head.packed.dim() == 4:
            return "compiled"
        return "oneDNN" if onednn_layout(self.head.packed, self.head.weight) else "MKL"

    @property
    def bf16_weights(self) -> bool:
        """The compiled float32 kernel multiplies by weights kept in bf16 (all of them bf16 values)."""
        return self.packed_by == "compiled" and self.head.packed.dtype == torch.bfloat16

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
            if not packed_agrees(lin.weight, lin.bias, lin.packed, rows, gen):
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
            # need only be deterministic, not equal to any other pass's. Whole-pass GEMMs make it
            # ~2x faster than the 32-row, chunked path; the compiled attention (a chain's plan)
            # runs ~3.5x faster than SDPA's causal kernel at 40-351 rows, which stays where it
            # does not build.
            compiled = ids.device.type == "cpu" and cpu_kernels.attention_kernel(self.head_dim) is not None
            plan = AttentionPlan.chain(0, n, ids.device) if compiled else None
            return self._appending(ids, cos[:end], sin[:end], cache, plan, layer_ids, last_only, whole=True)
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

        kernel = cpu_kernels.kernel() if self.layer_args is not None else None
        if (isinstance(mask, AttentionPlan) and kernel is not None and not whole
                and getattr(cache.layers[0], "values_ones", None) is not None):
            return self._compiled_layers(kernel, ids, cos, sin, cache, mask, layer_ids, last_only)

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            layer = cache.layers[i]
            keys, values = layer.update(k.unsqueeze(0), v.unsqueeze(0))
            if isinstance(mask, AttentionPlan):
                return batch_invariant.attention(q, layer.keys[0], batch_invariant.values_with_ones(layer), mask,
                                                 self.scale)
            return self._attention(q, keys, values, mask, causal=mask is None)

        return self._layers(ids, cos, sin, attend, layer_ids, last_only, whole)

    def _compiled_layers(
        self, kernel: Any, ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: TargetCache,
        plan: AttentionPlan, layer_ids: list[int] | None, last_only: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`_layers` with each layer one compiled call (`decoder_layer`): the same kernels in the
        same order, so the same bits, without ~20 Python-level calls a layer."""
        layer_args = self.layer_args
        assert layer_args is not None
        start, n = cache.length, ids.shape[1]
        end = start + n
        if end > cache.max_cache_len:
            raise RuntimeError(f"KV cache overflow: {end} > {cache.max_cache_len} positions")
        wanted = set(layer_ids or [])
        feats: dict[int, torch.Tensor] = {}
        x = F.embedding(ids[0], self.embed)
        for i, (args, layer) in enumerate(zip(layer_args, cache.layers, strict=True)):
            x = kernel.decoder_layer(x, *args, cos, sin, layer.keys[0], layer.values_ones[0], start, plan.before,
                                     plan.after, plan.after_count, self.num_heads, self.layer_eps, self.scale)
            if i in wanted:
                feats[i] = x
        for layer in cache.layers:
            layer.length = end
        return self._head(x, feats, layer_ids, last_only, self.head)

    def _head(self, x: torch.Tensor, feats: dict[int, torch.Tensor], layer_ids: list[int] | None, last_only: bool,
              head: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The final norm and LM head over the last layer's x [n, hidden], and the features of
        `layer_ids` (`feats`, the wanted layers' outputs) side by side."""
        if len(self.layers) - 1 in feats and self.norm_last_hidden:
            feats[len(self.layers) - 1] = x = self.final_norm(x)
            x = x[-1:] if last_only else x
        else:
            x = self.final_norm(x[-1:] if last_only else x)
        logits = head(x).float()
        feat = torch.cat([feats[i] for i in layer_ids], dim=-1) if layer_ids is not None else None
        return logits, feat

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
            raise ValueError(f"the fast forward runs batch size 1, got {ids.shape[0]} rows")
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
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            out = attend(i, q, k, v)
            x = x + linear(layer.o, out.reshape(nh, n, hd).transpose(0, 1).reshape(n, nh * hd))
            h = layer.mlp_norm(x)
            if layer.gate_up is not None:
                act = swiglu(linear(layer.gate_up, h))
            else:
                assert layer.gate is not None and layer.up is not None
                act = F.silu(linear(layer.gate, h)) * linear(layer.up, h)
            x = x + linear(layer.down, act)
            if i in wanted:
                feats[i] = x
        return self._head(x, feats, layer_ids, last_only, lambda h: linear(self.head, h))
