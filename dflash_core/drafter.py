"""The DFlash drafter: a few Qwen3-style layers that denoise a whole block in one pass.

Every layer's keys/values are [projected target context ; block tokens]; queries come from
the block only, and attention inside the block is bidirectional. The target context is the
target's hidden states at `target_layer_ids`, concatenated, through `fc` and `hidden_norm`.
The block is embedded with the target's frozen embedding and read out with its frozen LM
head, so a checkpoint holds neither. Checkpoints use the published z-lab layout, so vLLM
and SGLang load ours and we load theirs.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .cache import DraftCache
from .corpus import FILE_NAME as CORPUS_FILE
from .corpus import CorpusNgrams, load_corpus
from .errors import DFlashError
from .fast_forward import Linear, PackingLinear, weight_key

WEIGHTS_NAME = "model.safetensors"
# Optional: the token ids the drafter drafts from (a JSON list). Not a weight file, so engines that
# know only the z-lab layout (vLLM, SGLang) ignore it and draft over the full vocabulary.
DRAFT_VOCAB_NAME = "draft_vocab.json"
_REQUIRED = object()
CONFIG_NAME = "config.json"


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Layers spread from shallow to deep, as in the reference (`round(1 + i*(L-4)/(n-1))`)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [round(start + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


@dataclass
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # other fields, kept for round trips

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DFlashConfig:
        d = dict(d)
        dflash = d.pop("dflash_config", None) or {}
        if not isinstance(dflash, dict):
            raise DFlashError("drafter config.json: dflash_config must be an object")

        def take(key: str, cast: type = int, default: Any = _REQUIRED, src: dict[str, Any] = d) -> Any:
            if key not in src and default is _REQUIRED:
                raise DFlashError(f"drafter config.json lacks the field {key!r}")
            value = src.pop(key, default) if src is d else src.get(key, default)
            if value is None and default is not _REQUIRED:
                return default
            try:
                return cast(value)
            except (TypeError, ValueError):
                raise DFlashError(f"drafter config.json: {key} = {value!r} is not a valid {cast.__name__}") from None

        n_layers, n_target = take("num_hidden_layers"), take("num_target_layers")
        hidden, heads = take("hidden_size"), take("num_attention_heads")
        if min(n_layers, n_target, hidden, heads) < 1:
            raise DFlashError("drafter config.json: layer counts, hidden size and heads must be positive")
        ids = dflash.get("target_layer_ids") or default_target_layer_ids(n_target, n_layers)
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise DFlashError(f"drafter config.json: target_layer_ids must be a list of integers, got {ids!r}")
        cfg = cls(
            hidden_size=hidden,
            intermediate_size=take("intermediate_size"),
            num_hidden_layers=n_layers,
            num_attention_heads=heads,
            num_key_value_heads=take("num_key_value_heads", default=heads),
            head_dim=take("head_dim", default=hidden // heads),
            vocab_size=take("vocab_size"),
            num_target_layers=n_target,
            target_layer_ids=list(ids),
            mask_token_id=take("mask_token_id", src=dflash),
            block_size=take("block_size", default=16),
            rms_norm_eps=take("rms_norm_eps", float, default=1e-6),
            rope_theta=float(_rope_theta(d)),
            max_position_embeddings=take("max_position_embeddings", default=40960),
            bos_token_id=d.pop("bos_token_id", None),
            eos_token_id=d.pop("eos_token_id", None),
        )
        d.pop("rope_theta", None)
        d.pop("rope_parameters", None)
        cfg.extra = d
        return cfg

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        extra = d.pop("extra")
        ids, mask = d.pop("target_layer_ids"), d.pop("mask_token_id")
        out: dict[str, Any] = {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "use_cache": True,
            "rope_scaling": None,
            "dtype": "bfloat16",
            "layer_types": ["full_attention"] * self.num_hidden_layers,
            "max_window_layers": self.num_hidden_layers,
            "use_sliding_window": False,
            "sliding_window": None,
        }
        out.update(extra)
        out.update(d)
        out["dflash_config"] = {"target_layer_ids": ids, "mask_token_id": mask}
        return out


def _rope_theta(d: dict[str, Any]) -> float:
    # Published z-lab configs carry a top-level rope_theta; transformers 5 writes rope_parameters.
    params = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or params
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        raise DFlashError(f"drafter uses RoPE scaling {kind!r}; only the default RoPE is supported")
    return d.get("rope_theta") or params.get("rope_theta") or 1_000_000.0


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [batch, heads, seq, head_dim]; cos/sin: [seq, head_dim] (or broadcastable)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class DraftAttention(nn.Module):
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
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.gate_proj = PackingLinear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = PackingLinear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = PackingLinear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DraftMLP(cfg)


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
        # Token ids to draft from (sorted), or None for the whole vocabulary. Drafting only among
        # the tokens the drafter was trained to predict makes the LM head, most of a CPU draft
        # step, several times cheaper; verification keeps the output exact either way.
        self.draft_vocab: torch.Tensor | None = None
        self.corpus: CorpusNgrams | None = None  # the target's frequent continuations (corpus.py), if shipped

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    def new_cache(self, max_len: int) -> DraftCache:
        p = self.fc.weight
        c = self.config
        return DraftCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, max_len, p.device, p.dtype)

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, dtype)

    # Inference state, rebuilt on demand and never saved or copied (see __getstate__).
    _joined: tuple[tuple[Any, ...], dict[str, Linear]] | None = None
    _rope_table: tuple[torch.Tensor, torch.Tensor] | None = None

    def __getstate__(self) -> dict[str, Any]:
        # Packed weights are opaque library tensors: they cannot be copied or pickled.
        state = dict(self.__dict__)
        state.pop("_joined", None)
        state.pop("_rope_table", None)
        return state

    def _fused(self) -> dict[str, Linear]:
        """For `step`: `fc`, and each layer's q/k/v and gate/up side by side as one weight (one
        GEMM where there were three and two), laid out once for the GEMM library like the
        target's (`pack_weight`). Rebuilt whenever a weight changes (training evaluates the
        live drafter between optimizer steps) or moves."""
        groups: dict[str, list[nn.Module]] = {"fc": [self.fc]}
        for i, layer in enumerate(self.layers):
            a, m = layer.self_attn, layer.mlp
            groups[f"qkv{i}"] = [a.q_proj, a.k_proj, a.v_proj]
            groups[f"gate_up{i}"] = [m.gate_proj, m.up_proj]
        key = tuple(weight_key(mod.weight) for mods in groups.values() for mod in mods)
        if self._joined is None or self._joined[0] != key:
            self._joined = (key, {name: Linear.joined(mods) for name, mods in groups.items()})
        return self._joined[1]

    def _rope_rows(self, start: int, end: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for positions [start, end), from a table kept across steps (doubling as
        contexts grow): the same values `_rope` computes, without recomputing them per block."""
        table = self._rope_table
        if table is None or table[0].shape[0] < end or table[0].dtype != like.dtype or table[0].device != like.device:
            n = max(end, 2 * (0 if table is None else table[0].shape[0]), 256)
            table = self._rope(torch.arange(n, device=like.device), like.dtype)
            self._rope_table = table
        return table[0][start:end], table[1][start:end]

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
        cfg, fused = self.config, self._fused()
        nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        # The new context's positions run straight into the block's, so both take their keys
        # and values from one GEMM per layer and land in the cache with one write: the
        # context's for good, the block's as scratch past it.
        cos, sin = self._rope_rows(ctx_start, block_start + bsz, block_embeds)
        ctx = None
        if new_context is not None and n_new:
            ctx = self.hidden_norm(fused["fc"](new_context[0].to(block_embeds.dtype)))
        h = block_embeds[0]
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            rows = x if ctx is None else torch.cat([ctx, x])
            q, k, v = fused[f"qkv{i}"](rows).split((nh * hd, nkv * hd, nkv * hd), -1)
            q = apply_rope(attn.q_norm(q[n_new:].view(bsz, nh, hd)).transpose(0, 1), cos[n_new:], sin[n_new:])
            k = apply_rope(attn.k_norm(k.view(-1, nkv, hd)).transpose(0, 1), cos, sin)
            cache.write(i, ctx_start, k[None], v.view(-1, nkv, hd).transpose(0, 1)[None])
            keys, values = cache.view(i, block_start + bsz)
            out = F.scaled_dot_product_attention(q[None], keys, values, enable_gqa=nkv != nh)[0]
            h = h + attn.o_proj(out.transpose(0, 1).reshape(bsz, nh * hd))
            gate, up = fused[f"gate_up{i}"](layer.post_attention_layernorm(h)).chunk(2, -1)
            h = h + layer.mlp.down_proj(F.silu(gate) * up)
        cache.length = block_start
        return self.norm(h)[None]

    def forward_train(
        self,
        context: torch.Tensor,
        block_embeds: torch.Tensor,
        block_positions: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """Many blocks of one or more sequences in one pass (training).

        context: [b, T, len(layer_ids)*H] target features at positions 0..T-1;
        block_embeds: [b, N, H] all blocks laid end to end; block_positions: [N] or [b, N];
        mask: bool [b or 1, 1, N, T + N], True where a block query may attend.
        """
        dtype = block_embeds.dtype
        T = context.shape[1]
        ctx = self.hidden_norm(self.fc(context.to(dtype)))
        cos_c, sin_c = self._rope(torch.arange(T, device=context.device), dtype)
        cos_b, sin_b = self._rope(block_positions.reshape(-1), dtype)
        if block_positions.dim() == 2:  # per-sequence anchors: [b, 1, N, head_dim] broadcasts over heads
            b, n = block_positions.shape
            cos_b, sin_b = cos_b.view(b, 1, n, -1), sin_b.view(b, 1, n, -1)
        h = block_embeds
        for layer in self.layers:
            attn = layer.self_attn
            k_c, v_c = attn.project_kv(ctx, cos_c, sin_c)
            x = layer.input_layernorm(h)
            k_b, v_b = attn.project_kv(x, cos_b, sin_b)
            k, v = torch.cat([k_c, k_b], dim=2), torch.cat([v_c, v_b], dim=2)
            h = h + attn.attend(attn.project_q(x, cos_b, sin_b), k, v, mask)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h)

    # ----- checkpoints (z-lab layout) -----

    def save(self, folder: str | os.PathLike[str], dtype: torch.dtype = torch.bfloat16) -> None:
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        cfg = self.config.to_dict()
        cfg["dtype"] = str(dtype).removeprefix("torch.")
        (folder / CONFIG_NAME).write_text(json.dumps(cfg, indent=2) + "\n")
        state = {k: v.detach().to(dtype).contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, str(folder / WEIGHTS_NAME), metadata={"format": "pt"})
        if self.draft_vocab is not None:
            (folder / DRAFT_VOCAB_NAME).write_text(json.dumps(self.draft_vocab.tolist()) + "\n")
        if self.corpus is not None:
            self.corpus.save(folder)


def init_weights(drafter: DFlashDrafter, std: float = 0.02, seed: int = 0) -> DFlashDrafter:
    g = torch.Generator().manual_seed(seed)
    for name, p in drafter.named_parameters():
        with torch.no_grad():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return drafter


def _resolve(spec: str) -> Path:
    """A local folder, or a hub id downloaded (config, weights and our optional extras) to the HF cache."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    if path.exists() or spec.startswith((".", "/", "~")) or spec.count("/") != 1:
        raise DFlashError(f"drafter {spec!r}: no such folder (expected a folder with {CONFIG_NAME} "
                          f"and {WEIGHTS_NAME}, or a Hugging Face id like z-lab/Qwen3-8B-DFlash-b16)")
    try:
        from huggingface_hub import snapshot_download

        wanted = [CONFIG_NAME, "*.safetensors", DRAFT_VOCAB_NAME, CORPUS_FILE]
        return Path(snapshot_download(spec, allow_patterns=wanted))
    except Exception as e:
        raise DFlashError(f"drafter {spec!r} is not a local folder and could not be fetched from the "
                          f"Hugging Face hub ({type(e).__name__}: {e})") from None


def load_drafter(spec: str | os.PathLike[str], device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32) -> DFlashDrafter:
    from safetensors.torch import load_file

    folder = _resolve(str(spec))
    cfg_file = folder / CONFIG_NAME
    if not cfg_file.is_file():
        raise DFlashError(f"drafter folder {folder} has no {CONFIG_NAME}")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise DFlashError(f"{cfg_file} is not valid JSON: {e}") from None
    if "DFlashDraftModel" not in (raw.get("architectures") or []):
        raise DFlashError(f"{cfg_file} is not a DFlash drafter (architectures = {raw.get('architectures')})")
    cfg = DFlashConfig.from_dict(raw)
    with torch.device("meta"):
        drafter = DFlashDrafter(cfg)
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise DFlashError(f"drafter folder {folder} has no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        state.update(load_file(str(shard)))
    state = {k.removeprefix("model."): v for k, v in state.items()}
    expected = set(drafter.state_dict())
    missing, unexpected = expected - set(state), set(state) - expected
    if missing:
        raise DFlashError(f"drafter weights in {folder} lack {sorted(missing)[:5]} ({len(missing)} missing)")
    for k in unexpected:  # e.g. an embedding some exporters add; we use the target's own
        state.pop(k)
    wrong = [f"{k}: weights {tuple(v.shape)}, config {tuple(drafter.state_dict()[k].shape)}"
             for k, v in state.items() if tuple(v.shape) != tuple(drafter.state_dict()[k].shape)]
    if wrong:
        raise DFlashError(f"drafter weights in {folder} have the wrong shape for its config.json: "
                          + "; ".join(wrong[:3]))
    drafter.load_state_dict(state, assign=True)
    drafter.draft_vocab = load_draft_vocab(folder / DRAFT_VOCAB_NAME, cfg.vocab_size)
    drafter.corpus = load_corpus(folder, cfg.vocab_size)
    return drafter.to(device=device, dtype=dtype).eval()


def load_draft_vocab(path: Path, vocab_size: int) -> torch.Tensor | None:
    if not path.is_file():
        return None
    try:
        ids = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DFlashError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
        raise DFlashError(f"{path} must be a non-empty list of token ids")
    if len(set(ids)) != len(ids) or not all(0 <= i < vocab_size for i in ids):
        raise DFlashError(f"{path}: token ids must be distinct and inside the vocabulary of {vocab_size}")
    return torch.tensor(sorted(ids), dtype=torch.long)


def check_fit(cfg: DFlashConfig, *, hidden_size: int, vocab_size: int, num_layers: int) -> None:
    """Refuse a drafter built for another target, naming both values."""
    problems = []
    if cfg.hidden_size != hidden_size:
        problems.append(f"hidden size: drafter {cfg.hidden_size}, target {hidden_size}")
    if cfg.vocab_size != vocab_size:
        problems.append(f"vocabulary: drafter {cfg.vocab_size}, target {vocab_size}")
    if cfg.num_target_layers != num_layers:
        problems.append(f"target depth: drafter trained for {cfg.num_target_layers} layers, target has {num_layers}")
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < num_layers]
    if bad:
        problems.append(f"target_layer_ids {bad} beyond the target's {num_layers} layers")
    if not 0 <= cfg.mask_token_id < vocab_size:
        problems.append(f"mask_token_id {cfg.mask_token_id} outside the target's vocabulary of {vocab_size}")
    if problems:
        raise DFlashError("drafter does not fit this target: " + "; ".join(problems))



def config_for_target(target_config: Any, *, num_layers: int = 2, block_size: int = 16,
                      mask_token_id: int, intermediate_size: int | None = None) -> DFlashConfig:
    """A drafter shaped like the target's own layers (the usual choice), from its HF config."""
    heads = int(target_config.num_attention_heads)
    hidden = int(target_config.hidden_size)
    n_target = int(target_config.num_hidden_layers)
    rope = getattr(target_config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta") or getattr(target_config, "rope_theta", None) or 10_000.0
    return DFlashConfig(
        hidden_size=hidden,
        intermediate_size=intermediate_size or int(target_config.intermediate_size),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=int(getattr(target_config, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(target_config, "head_dim", None) or hidden // heads),
        vocab_size=int(target_config.vocab_size),
        num_target_layers=n_target,
        target_layer_ids=default_target_layer_ids(n_target, num_layers),
        mask_token_id=mask_token_id,
        block_size=block_size,
        rms_norm_eps=float(getattr(target_config, "rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        max_position_embeddings=int(getattr(target_config, "max_position_embeddings", 8192)),
        bos_token_id=getattr(target_config, "bos_token_id", None),
        eos_token_id=getattr(target_config, "eos_token_id", None),
    )
