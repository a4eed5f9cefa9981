"""A drafter checkpoint folder (z-lab layout), local or on the hub: finding it, reading and writing its files."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from .corpus import FILE_NAME as CORPUS_FILE
from .corpus import CorpusNgrams
from .drafter_config import ARCHITECTURES, ASSISTANT_TYPES, DFlashConfig, zlab_from_assistant
from .errors import DFlashError

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
ASSISTANT_RENAMES = {"encoder.fc.": "fc.", "encoder.output_norm_enc.": "hidden_norm."}
# DFlash 2 checkpoints store the selector's codebooks as bare tensors, not embedding modules.
CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")
# Optional: the token ids the drafter drafts from (a JSON list). Not a weight file, so engines that
# know only the z-lab layout (vLLM, SGLang) ignore it and draft over the full vocabulary.
DRAFT_VOCAB_NAME = "draft_vocab.json"


def resolve(spec: str) -> Path:
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


def read_config(folder: Path, target: Any = None) -> DFlashConfig:
    """The folder's config.json, refused unless it describes a DFlash drafter: the z-lab layout, or
    a transformers-native assistant (`ASSISTANT_TYPES`), which needs its `target` (a `Target`) to
    say the vocabulary and depth it was made for."""
    cfg_file = folder / CONFIG_NAME
    if not cfg_file.is_file():
        raise DFlashError(f"drafter folder {folder} has no {CONFIG_NAME}")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise DFlashError(f"{cfg_file} is not valid JSON: {e}") from None
    if raw.get("model_type") in ASSISTANT_TYPES:
        from transformers import AutoConfig

        if target is None:
            raise DFlashError(f"{cfg_file}: a transformers-native DFlash assistant ({raw['model_type']}) loads "
                              "only with its target (it names neither the vocabulary nor the target's depth)")
        full = AutoConfig.from_pretrained(folder).to_dict()
        return DFlashConfig.from_dict(zlab_from_assistant(full, target.vocab_size, target.num_layers))
    arch = set(raw.get("architectures") or []) & set(ARCHITECTURES.values())
    if not arch:
        raise DFlashError(f"{cfg_file} is not a DFlash drafter (architectures = {raw.get('architectures')}; "
                          f"known: {', '.join(ARCHITECTURES.values())})")
    cfg = DFlashConfig.from_dict(raw)
    if ARCHITECTURES[cfg.version] not in arch:
        raise DFlashError(f"{cfg_file}: architectures {sorted(arch)} but the fields describe "
                          f"{ARCHITECTURES[cfg.version]} (DFlash 2 needs conv_* and selector_* fields, DFlash 1 none)")
    return cfg


def read_weights(folder: Path, expected: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """All *.safetensors shards of the folder, checked against a model's `expected` state dict
    (names and shapes); keys the model does not have are dropped."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise DFlashError(f"drafter folder {folder} has no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        try:
            state.update(load_file(str(shard)))
        except (SafetensorError, OSError) as e:
            raise DFlashError(f"drafter weights {shard} cannot be read ({e}): the file is damaged or "
                              "incomplete; download or copy it again") from None
    state = {k.removeprefix("model."): v for k, v in state.items()}
    for old, new in ASSISTANT_RENAMES.items():  # a transformers-native assistant's names for fc, hidden_norm
        state = {new + k.removeprefix(old) if k.startswith(old) else k: v for k, v in state.items()}
    state = {f"{k}.weight" if k in CODEBOOKS else k: v for k, v in state.items()}
    missing, unexpected = set(expected) - set(state), set(state) - set(expected)
    if missing:
        raise DFlashError(f"drafter weights in {folder} lack {sorted(missing)[:5]} ({len(missing)} missing)")
    for k in unexpected:  # e.g. an embedding some exporters add; we use the target's own
        state.pop(k)
    wrong = [f"{k}: weights {tuple(v.shape)}, config {tuple(expected[k].shape)}"
             for k, v in state.items() if tuple(v.shape) != tuple(expected[k].shape)]
    if wrong:
        raise DFlashError(f"drafter weights in {folder} have the wrong shape for its config.json: "
                          + "; ".join(wrong[:3]))
    return state


def load_draft_vocab(path: Path, vocab_size: int) -> torch.Tensor | None:
    """The sorted token ids in a draft vocabulary file, or None when there is none."""
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


def write_checkpoint(folder: str | os.PathLike[str], cfg: DFlashConfig, state: dict[str, torch.Tensor],
                     dtype: torch.dtype, draft_vocab: torch.Tensor | None, corpus: CorpusNgrams | None) -> None:
    """The z-lab folder: config.json, the weights in `dtype`, and the optional extras."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    raw = cfg.to_dict()
    raw["dtype"] = str(dtype).removeprefix("torch.")
    (folder / CONFIG_NAME).write_text(json.dumps(raw, indent=2) + "\n")
    state = {k.removesuffix(".weight") if k.removesuffix(".weight") in CODEBOOKS else k:
             v.detach().to(dtype).contiguous().cpu() for k, v in state.items()}
    save_file(state, str(folder / WEIGHTS_NAME), metadata={"format": "pt"})
    if draft_vocab is not None:
        (folder / DRAFT_VOCAB_NAME).write_text(json.dumps(draft_vocab.tolist()) + "\n")
    if corpus is not None:
        corpus.save(folder)
