"""The DFlash drafter: a few Qwen3-style layers that denoise a whole block in one pass.

Every layer's keys/values are [projected target context ; block tokens]; queries come from
the block only, and attention inside the block is bidirectional (in a full-attention layer;
sliding-window layers see a window of positions and, by default, the block causally: see
DFlashConfig.layer_types). The target context is the
target's hidden states at `target_layer_ids`, concatenated, through `fc` and `hidden_norm`.
The block is embedded with the target's frozen embedding and read out with its frozen LM
head, so a checkpoint holds neither (drafter_io.py reads and writes checkpoints).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import cpu_kernels
from .cache import DraftCache
from .config import MAX_BLOCK_SIZE
from .corpus import CorpusNgrams, load_corpus
from .dflash2 import CandidateSelector, DynamicConv
from .drafter_config import DFlashConfig
from .drafter_io import DRAFT_VOCAB_NAME, load_draft_vocab, read_config, read_weights, resolve, write_checkpoint
from .errors import DFlashError
from .layers import RMSNorm, apply_rope, full_attention, rope_cos_sin, swiglu
from .packing import Linear, PackingLinear, weight_key


class DraftAttention(nn.Module):
    """Grouped-query attention with per-head q/k norms (Qwen3's), split into the steps
    `forward_train` and `DFlashDrafter.step` combine differently."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = PackingLinear(h, self.n_heads * hd, bias=False)
        self.k_proj = PackingLinear(h, self.n_kv * hd, bias=False)
        self.v_proj = PackingLinear(h, self.n_kv * hd, bias=False)
        self.o_proj = PackingLinear(self.n_heads * hd, h, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def project_kv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        b, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, n, self.n_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.n_kv, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def project_q(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, n, self.n_heads, self.head_dim)).transpose(1, 2)
        return apply_rope(q, cos, sin)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        # Grouped heads in the kernel: no repeated copies of k and v (a CPU training step ~6 % cheaper).
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.n_kv != self.n_heads)
        b, _, n, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


class DraftMLP(nn.Module):
    """SwiGLU feed-forward."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.gate_proj = PackingLinear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = PackingLinear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = PackingLinear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    """One pre-norm transformer layer's modules (the drafter's passes run them)."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DraftMLP(cfg)
        self.attention_conv = self.mlp_conv = None
        if cfg.version == 2:
            self.attention_conv = DynamicConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
            self.mlp_conv = DynamicConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)


def conv_in(conv: DynamicConv | None, x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """DFlash 2's convolution of a sublayer's input x [..., N, H], N a run of blocks of `block`
    positions each convolved on its own, and the kernel for its output (DFlash 1: x, None)."""
    if conv is None:
        return x, None
    out, kernel = conv.prepare(x.reshape(-1, block, x.shape[-1]))
    return out.reshape(x.shape), kernel


def conv_out(conv: DynamicConv | None, y: torch.Tensor, kernel: torch.Tensor | None, block: int) -> torch.Tensor:
    if conv is None or kernel is None:
        return y
    return conv.finish(y.reshape(-1, block, y.shape[-1]), kernel).reshape(y.shape)


class DFlashDrafter(nn.Module):
    """Block denoiser conditioned on target features. No embedding, no LM head of its own."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.config = cfg
        n_ctx = len(cfg.target_layer_ids)
        self.fc = nn.Linear(n_ctx * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.candidate_selector = None
        if cfg.version == 2:
            self.candidate_selector = CandidateSelector(cfg.vocab_size, cfg.hidden_size, cfg.selector_top_k,
                                                        cfg.selector_rank)
        # Token ids to draft from (sorted), or None for the whole vocabulary. Drafting only among
        # the tokens the drafter was trained to predict makes the LM head, most of a CPU draft
        # step, several times cheaper; verification keeps the output exact either way.
        self.draft_vocab: torch.Tensor | None = None
        self.corpus: CorpusNgrams | None = None  # the target's frequent continuations (corpus.py), if shipped
        self.draft_window = None

    @property
    def draft_window(self) -> int | None:
        """At inference, the drafter reads only the last N committed positions (and the block),
        which bounds a draft pass's attention cost in long chats (SGLang's
        --speculative-dflash-draft-window-size). A setting of this engine, not of the checkpoint:
        drafts get worse, the output stays exact (the target verifies every token). None: all."""
        return self._draft_window

    @draft_window.setter
    def draft_window(self, n: int | None) -> None:
        check_draft_window(n)
        self._draft_window = n

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    def shape_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The checkpoint's own scaling and soft cap of its LM-head logits (z-lab's order)."""
        c = self.config
        if c.output_multiplier != 1.0:
            logits = logits * c.output_multiplier
        if c.final_logit_softcapping is not None:
            logits = torch.tanh(logits / c.final_logit_softcapping) * c.final_logit_softcapping
        return logits

    def new_cache(self, max_len: int) -> DraftCache:
        p = self.fc.weight
        c = self.config
        # With a draft window, the buffer holds the window and room for a few blocks' writes.
        return DraftCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, max_len, p.device, p.dtype,
                          window=self.draft_window, slack=4 * MAX_BLOCK_SIZE)

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        return rope_cos_sin(positions, c.head_dim, c.rope_theta, dtype, c.rope_scaling, c.max_position_embeddings)

    def _visible(self, layer: int, block_start: int, bsz: int, device: torch.device) -> tuple[int, torch.Tensor | None]:
        """For a block at `block_start` in `step`: the first key position any of its queries sees in
        this layer, and which keys from there each query sees (bool [bsz, keys]; None: all)."""
        window, causal = self.config.layer_window(layer), self.config.layer_causal(layer)
        lo = 0 if self.draft_window is None else max(0, block_start - self.draft_window)
        if window is not None:
            lo = max(lo, block_start - window + 1)  # the block's first query sees no further back
        if window is None and not causal:
            return lo, None
        q = torch.arange(block_start, block_start + bsz, device=device)[:, None]
        k = torch.arange(lo, block_start + bsz, device=device)[None, :]
        return lo, attention_mask(q, k, window, causal)

    # Inference state, rebuilt on demand and never saved or copied (see __getstate__).
    _joined: tuple[tuple[nn.Module, ...], tuple[Any, ...], dict[str, Linear]] | None = None
    _rope_table: tuple[torch.Tensor, torch.Tensor] | None = None

    def __getstate__(self) -> dict[str, Any]:
        # Packed weights are opaque library tensors: they cannot be copied or pickled.
        state = dict(self.__dict__)
        state.pop("_joined", None)
        state.pop("_rope_table", None)
        return state

    def _fused(self) -> dict[str, Linear]:
        """For `step`: `fc`, each layer's q/k/v and gate/up side by side as one weight (one GEMM
        where there were three and two), and its o and down, laid out once for the GEMM library like the
        target's (`pack_weight`). Rebuilt whenever a weight changes (training evaluates the
        live drafter between optimizer steps) or moves."""
        # The walk through the modules (nn.Module attribute lookups) cost ~0.1 ms a block in
        # decoding, so it is done once and only the weights are checked after that.
        if self._joined is not None:
            modules, key, fused = self._joined
            if key == tuple(weight_key(m._parameters["weight"]) for m in modules):
                return fused
        groups: dict[str, list[nn.Module]] = {"fc": [self.fc]}
        for i, layer in enumerate(self.layers):
            a, m = layer.self_attn, layer.mlp
            groups[f"qkv{i}"] = [a.q_proj, a.k_proj, a.v_proj]
            groups[f"gate_up{i}"] = [m.gate_proj, m.up_proj]
            groups[f"o{i}"], groups[f"down{i}"] = [a.o_proj], [m.down_proj]
        modules = tuple(mod for mods in groups.values() for mod in mods)
        key = tuple(weight_key(m._parameters["weight"]) for m in modules)
        self._joined = (modules, key, {name: Linear.joined(mods) for name, mods in groups.items()})
        return self._joined[2]

    def _rope_rows(self, start: int, end: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for positions [start, end), from a table kept across steps (doubling as
        contexts grow): the same values `_rope` computes, without recomputing them per block."""
        table = self._rope_table
        if table is None or table[0].shape[0] < end or table[0].dtype != like.dtype or table[0].device != like.device:
            n = max(end, 2 * (0 if table is None else table[0].shape[0]), 256)
            table = self._rope(torch.arange(n, device=like.device), like.dtype)
            self._rope_table = table
        return table[0][start:end], table[1][start:end]

    def _layer_kernel(self, h: torch.Tensor, fused: dict[str, Linear],
                      visible: dict[tuple[int | None, bool], tuple[int, torch.Tensor | None]]) -> Any:
        """The compiled module whose `draft_layer` runs `step`'s layers, where it applies: bf16 on
        a CPU with the compiled linear layers, full bidirectional layers (no masks), DFlash 1
        (no convolutions) and sizes its kernels take; else None."""
        cfg = self.config
        if h.dtype != torch.bfloat16 or h.device.type != "cpu" or torch.is_grad_enabled():
            return None
        if cfg.version != 1 or any(mask is not None for _, mask in visible.values()):
            return None
        if cfg.head_dim not in cpu_kernels.HEAD_DIMS or cfg.head_dim % 32 or cfg.hidden_size % 16:
            return None
        if any(lin.packed is None or lin.packed.dim() != 4 for name, lin in fused.items() if name != "fc"):
            return None
        if self.norm.weight.dtype != torch.bfloat16:  # a loaded drafter's weights share one dtype
            return None
        return cpu_kernels.kernel()

    @torch.no_grad()
    def step(
        self,
        block_embeds: torch.Tensor,
        block_start: int,
        cache: DraftCache,
        new_context: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One denoising pass over a block, at inference (no gradients: training runs
        `forward_train`, the same maths over many blocks).

        block_embeds: [1, B, H] target embeddings of [anchor, mask/known tokens...];
        new_context: [1, n, len(layer_ids)*H] target features for the n committed positions
        `cache.length .. cache.length+n-1` the drafter has not seen yet; they are added to
        the cache for good. Returns the final hidden states [1, B, H].
        """
        bsz = block_embeds.shape[1]
        ctx_start = cache.length
        n_new = 0 if new_context is None else new_context.shape[1]
        if ctx_start + n_new != block_start:
            raise RuntimeError(f"draft context ends at {ctx_start + n_new}, block starts at {block_start}")
        if cache.window is not None:
            # Context older than the window is never read: its rows are neither projected nor kept.
            drop = min(n_new, max(0, block_start - cache.window - ctx_start))
            if drop:
                new_context, ctx_start, n_new = new_context[:, drop:], ctx_start + drop, n_new - drop
            cache.make_room(block_start - cache.window, block_start + bsz)
        cfg, fused = self.config, self._fused()
        nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        # The new context's positions run straight into the block's, so both take their keys
        # and values from one GEMM per layer and land in the cache with one write: the
        # context's for good, the block's as scratch past it.
        cos, sin = self._rope_rows(ctx_start, block_start + bsz, block_embeds)
        # Layers of one kind see the same keys; sliding layers and a draft window see fewer.
        kinds = [(cfg.layer_window(i), cfg.layer_causal(i)) for i in range(cfg.num_hidden_layers)]
        visible = {kind: self._visible(kinds.index(kind), block_start, bsz, block_embeds.device)
                   for kind in dict.fromkeys(kinds)}
        ctx = None
        if new_context is not None and n_new:
            ctx = self.hidden_norm(fused["fc"](new_context[0].to(block_embeds.dtype)))
        h = block_embeds[0] * cfg.input_embedding_scale if cfg.input_embedding_scale != 1.0 else block_embeds[0]
        compiled = self._layer_kernel(h, fused, visible)
        for i, layer in enumerate(self.layers):
            if compiled is not None:  # the same maths as below, one compiled call (cpu_layer.cpp)
                keys, values, at, lo = cache.slots(i, ctx_start, visible[kinds[i]][0], block_start + bsz)
                attn = layer.self_attn
                h = compiled.draft_layer(h, ctx, layer.input_layernorm.weight, fused[f"qkv{i}"].packed,
                                       attn.q_norm.weight, attn.k_norm.weight, fused[f"o{i}"].packed,
                                       layer.post_attention_layernorm.weight, fused[f"gate_up{i}"].packed,
                                       fused[f"down{i}"].packed, cos, sin, keys, values, at, lo, nh,
                                       cfg.rms_norm_eps, hd**-0.5)
                continue
            attn = layer.self_attn
            x, kernel = conv_in(layer.attention_conv, layer.input_layernorm(h), bsz)
            rows = x if ctx is None else torch.cat([ctx, x])
            q, k, v = fused[f"qkv{i}"](rows).split((nh * hd, nkv * hd, nkv * hd), -1)
            q = apply_rope(attn.q_norm(q[n_new:].view(bsz, nh, hd)).transpose(0, 1), cos[n_new:], sin[n_new:])
            k = apply_rope(attn.k_norm(k.view(-1, nkv, hd)).transpose(0, 1), cos, sin)
            cache.write(i, ctx_start, k[None], v.view(-1, nkv, hd).transpose(0, 1)[None])
            lo, mask = visible[kinds[i]]
            keys, values = cache.view(i, lo, block_start + bsz)
            if mask is None:
                out = full_attention(q, keys[0], values[0])
            else:
                out = F.scaled_dot_product_attention(q[None], keys, values, attn_mask=mask, enable_gqa=nkv != nh)[0]
            attended = fused[f"o{i}"](out.transpose(0, 1).reshape(bsz, nh * hd))
            h = h + conv_out(layer.attention_conv, attended, kernel, bsz)
            x, kernel = conv_in(layer.mlp_conv, layer.post_attention_layernorm(h), bsz)
            h = h + conv_out(layer.mlp_conv, fused[f"down{i}"](swiglu(fused[f"gate_up{i}"](x))), kernel, bsz)
        cache.length = block_start
        return self.norm(h)[None]

    def forward_train(
        self,
        context: torch.Tensor,
        block_embeds: torch.Tensor,
        block_positions: torch.Tensor,
        mask: torch.Tensor,
        block_size: int | None = None,
    ) -> torch.Tensor:
        """Many blocks of one or more sequences in one pass (training).

        context: [b, T, len(layer_ids)*H] target features at positions 0..T-1;
        block_embeds: [b, N, H] all blocks laid end to end; block_positions: [N] or [b, N];
        mask: bool [b or 1, 1, N, T + N], True where a block query may attend; sliding layers
        (config.layer_types) narrow it further by position, as `step` does; `block_size`: the
        blocks' length (the config's by default), which DFlash 2's convolutions stay within.
        """
        dtype, block = block_embeds.dtype, block_size or self.config.block_size
        if self.config.input_embedding_scale != 1.0:
            block_embeds = block_embeds * self.config.input_embedding_scale
        T = context.shape[1]
        ctx = self.hidden_norm(self.fc(context.to(dtype)))
        cos_c, sin_c = self._rope(torch.arange(T, device=context.device), dtype)
        cos_b, sin_b = self._rope(block_positions.reshape(-1), dtype)
        if block_positions.dim() == 2:  # per-sequence anchors: [b, 1, N, head_dim] broadcasts over heads
            b, n = block_positions.shape
            cos_b, sin_b = cos_b.view(b, 1, n, -1), sin_b.view(b, 1, n, -1)
        h = block_embeds
        q_pos = block_positions if block_positions.dim() == 2 else block_positions[None]
        k_pos = torch.cat([torch.arange(T, device=q_pos.device).expand(q_pos.shape[0], T), q_pos], 1)
        layer_masks: dict[tuple[int | None, bool], torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            kind = (self.config.layer_window(i), self.config.layer_causal(i))
            if kind not in layer_masks:
                narrowed = attention_mask(q_pos[:, :, None], k_pos[:, None, :], *kind)
                layer_masks[kind] = mask if narrowed is None else mask & narrowed[:, None]
            attn = layer.self_attn
            k_c, v_c = attn.project_kv(ctx, cos_c, sin_c)
            x, kernel = conv_in(layer.attention_conv, layer.input_layernorm(h), block)
            k_b, v_b = attn.project_kv(x, cos_b, sin_b)
            k, v = torch.cat([k_c, k_b], dim=2), torch.cat([v_c, v_b], dim=2)
            out = attn.attend(attn.project_q(x, cos_b, sin_b), k, v, layer_masks[kind])
            h = h + conv_out(layer.attention_conv, out, kernel, block)
            x, kernel = conv_in(layer.mlp_conv, layer.post_attention_layernorm(h), block)
            h = h + conv_out(layer.mlp_conv, layer.mlp(x), kernel, block)
        return self.norm(h)

    def save(self, folder: str | os.PathLike[str], dtype: torch.dtype = torch.bfloat16) -> None:
        """Write the checkpoint folder in the z-lab layout (weights in `dtype`, bf16 as published)."""
        write_checkpoint(folder, self.config, self.state_dict(), dtype, self.draft_vocab, self.corpus)


def attention_mask(q: torch.Tensor, k: torch.Tensor, window: int | None, causal: bool) -> torch.Tensor | None:
    """Which keys at positions `k` queries at positions `q` see (broadcast), z-lab's rule for a
    layer: causal ones only up to their own position; within a window only keys less than
    `window` positions away (on either side when not causal). None: all of them."""
    if window is None and not causal:
        return None
    seen = k <= q if causal else torch.ones_like(q - k, dtype=torch.bool)
    if window is not None:
        seen = seen & (q - k < window)
        if not causal:
            seen = seen & (k - q < window)
    return seen


def check_draft_window(n: object) -> None:
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise DFlashError(f"draft window must be a positive number of positions (or none), got {n!r}")


def init_weights(drafter: DFlashDrafter, std: float = 0.02, seed: int = 0) -> DFlashDrafter:
    """Seeded normal weights (norm scales 1): a drafter to train from, or to test with."""
    g = torch.Generator().manual_seed(seed)
    for name, p in drafter.named_parameters():
        with torch.no_grad():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return drafter


def load_drafter(spec: str | os.PathLike[str], device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, target: Any = None) -> DFlashDrafter:
    """A drafter from a checkpoint folder or a Hugging Face id (drafter_io.resolve), in eval mode;
    `target` (a `Target`): the one it drafts for, which a transformers-native assistant needs."""
    folder = resolve(str(spec))
    cfg = read_config(folder, target)
    with torch.device("meta"):
        drafter = DFlashDrafter(cfg)
    drafter.load_state_dict(read_weights(folder, drafter.state_dict()), assign=True)
    drafter.draft_vocab = load_draft_vocab(folder / DRAFT_VOCAB_NAME, cfg.vocab_size)
    drafter.corpus = load_corpus(folder, cfg.vocab_size)
    return drafter.to(device=device, dtype=dtype).eval()
