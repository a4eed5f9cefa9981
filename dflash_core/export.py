"""A drafter in transformers' own DFlash assistant layout, which `AutoModel.from_pretrained` loads and
`target.generate(assistant_model=..., speculation_type="dflash")` runs (transformers >= 5.25).

transformers ships one DFlash assistant class, `MuseGlimmerAssistantModel` (`muse_glimmer_assistant`):
a DFlash 1 drafter with the context projection under `encoder.` and every layer attending to the
whole block (no causal layers). Its generator reads `block_size`, `mask_token_id` and
`target_layer_ids` from the config, embeds the block with the target's raw embedding (no embedding
norm, as this engine does) and reads the drafts out with the target's LM head, over the whole
vocabulary. `drafter_io.read_config` loads the same layout back.

What the layout cannot express is refused in one line (DFlash 2's convolutions and selector, causal
layers, the v1 scaling fields) or, where only draft quality and speed change, named in a note (a
draft vocabulary, the n-gram table): the target verifies every draft, so the output stays exact.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from .corpus import FILE_NAME as CORPUS_FILE
from .drafter import DFlashDrafter
from .drafter_config import ASSISTANT_TYPES, V1_FIELDS, DFlashConfig
from .drafter_io import ASSISTANT_RENAMES, DRAFT_VOCAB_NAME
from .errors import DFlashError

ASSISTANT_TYPE = ASSISTANT_TYPES[0]
FORMATS = ("transformers-assistant", "zlab")


def assistant_refusal(cfg: DFlashConfig) -> str | None:
    """Why transformers' assistant layout cannot hold this drafter unchanged (None: it can)."""
    if cfg.version != 1:
        return (f"a DFlash {cfg.version} drafter has no transformers assistant layout (transformers' DFlash "
                "generator runs DFlash 1 drafters only)")
    causal = [i for i in range(cfg.num_hidden_layers) if cfg.layer_causal(i)]
    if causal:
        return (f"drafter layer(s) {causal} attend causally inside the block; transformers' assistant attends "
                "to the whole block in every layer")
    # transformers' window is inclusive (|q - k| <= W), this engine's and z-lab's exclusive (< W).
    if any(cfg.layer_window(i) == 1 for i in range(cfg.num_hidden_layers)):
        return "a sliding window of 1 position (the token itself) has no transformers equivalent"
    changed = [k for k, default in V1_FIELDS.items() if getattr(cfg, k) != default]
    if changed:
        return (f"the drafter sets {', '.join(changed)}, which transformers' assistant layout has no field for "
                "(its generator would draft with different logits)")
    return None


def assistant_config(cfg: DFlashConfig, dtype: torch.dtype = torch.float32) -> Any:
    """transformers' `MuseGlimmerAssistantConfig` for a DFlash 1 drafter (refused where it cannot be one)."""
    why = assistant_refusal(cfg)
    if why is not None:
        raise DFlashError(f"cannot export to transformers' assistant layout: {why}")
    from transformers import AutoConfig

    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling:
        rope = {**cfg.rope_scaling, "rope_theta": cfg.rope_theta}
    window = next((w for w in map(cfg.layer_window, range(cfg.num_hidden_layers)) if w is not None), None)
    eos = cfg.eos_token_id[0] if isinstance(cfg.eos_token_id, list) else cfg.eos_token_id
    return AutoConfig.for_model(
        ASSISTANT_TYPE, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters=rope, max_position_embeddings=cfg.max_position_embeddings, layer_types=list(cfg.layer_types),
        # Its forward builds the sliding mask even when no layer slides, so the field needs a number
        # then; one as long as the positions go changes nothing.
        sliding_window=cfg.max_position_embeddings if window is None else window - 1,
        bos_token_id=cfg.bos_token_id, eos_token_id=eos, pad_token_id=None, block_size=cfg.block_size,
        mask_token_id=cfg.mask_token_id, target_layer_ids=list(cfg.target_layer_ids),
        dtype=str(dtype).removeprefix("torch."))


def assistant_state(drafter: DFlashDrafter) -> dict[str, torch.Tensor]:
    """The drafter's weights under the assistant's names (drafter_io.ASSISTANT_RENAMES reversed)."""
    renames = {ours: theirs for theirs, ours in ASSISTANT_RENAMES.items()}
    out = {}
    for k, v in drafter.state_dict().items():
        old = next((o for o in renames if k.startswith(o)), None)
        out[k if old is None else renames[old] + k.removeprefix(old)] = v
    return out


def to_transformers_assistant(drafter: DFlashDrafter, dtype: torch.dtype | None = None,
                              device: torch.device | str | None = None) -> Any:
    """The drafter as a `MuseGlimmerAssistantModel` in eval mode (its weights copied), for
    `generate(assistant_model=..., speculation_type="dflash")`; the drafter's dtype and device by default."""
    from transformers import AutoModel

    p = drafter.fc.weight
    dtype, device = dtype or p.dtype, device or p.device
    model = AutoModel.from_config(assistant_config(drafter.config, dtype), dtype=torch.float32)
    missing, unexpected = model.load_state_dict(assistant_state(drafter), strict=False)
    if missing or unexpected:  # a transformers release that renamed its modules: say so, never half-load
        raise DFlashError(f"transformers' {ASSISTANT_TYPE} model does not match the drafter's weights "
                          f"(missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})")
    return model.to(device=device, dtype=dtype).eval()


def lost_in_assistant(drafter: DFlashDrafter) -> list[str]:
    """What the assistant layout drops that changes drafts (not the output): one note each."""
    notes = []
    if drafter.draft_vocab is not None:
        notes.append(f"{DRAFT_VOCAB_NAME} is not part of transformers' assistant layout: its generator drafts over "
                     f"the whole vocabulary ({drafter.config.vocab_size} tokens, not {len(drafter.draft_vocab)}); "
                     "the output stays exact, the drafts may differ")
    if drafter.corpus is not None:
        notes.append(f"the n-gram table ({CORPUS_FILE}) is left out: transformers verifies chains of drafter tokens")
    ignored = drafter.config.ignored_fields()
    if ignored:
        notes.append(f"config fields this engine does not model are left out: {', '.join(ignored)}")
    return notes


def check_out(out: str | os.PathLike[str]) -> Path:
    """The export's folder: new or empty, so that no file of an earlier checkpoint stays beside it."""
    folder = Path(out).expanduser()
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise DFlashError(f"{folder} exists and is not an empty folder; export writes a new one")
    return folder


def export_drafter(drafter: DFlashDrafter, out: str | os.PathLike[str], to: str = "transformers-assistant",
                   dtype: torch.dtype = torch.bfloat16) -> list[str]:
    """Write `drafter` to the folder `out` in the layout `to` (FORMATS), weights in `dtype`; returns
    notes on what the layout leaves out. `zlab`: the z-lab layout (DFlash 1 or 2, as the drafter is)."""
    if to not in FORMATS:
        raise DFlashError(f"unknown export format {to!r}; choose from {', '.join(FORMATS)}")
    folder = check_out(out)
    if to == "zlab":
        drafter.save(folder, dtype=dtype)
        return []
    model = to_transformers_assistant(drafter, dtype=dtype, device="cpu")
    model.save_pretrained(folder)
    return lost_in_assistant(drafter)
