"""DFlash Studio's engine: exact DFlash speculative decoding, with no UI imports.

Data flow: `load()` → `Engine.generate(prompt, GenerationConfig)` → `BlockEvent`s → `Finished`.
"""

from .config import GenerationConfig
from .drafter import DFlashDrafter, load_drafter
from .drafter_config import DFlashConfig
from .engine import Engine
from .errors import DFlashError
from .events import BlockEvent, DraftStep, Finished
from .loading import load
from .targets import EMBEDDED, Target, load_target

__all__ = [
    "EMBEDDED",
    "BlockEvent",
    "DFlashConfig",
    "DFlashDrafter",
    "DFlashError",
    "DraftStep",
    "Engine",
    "Finished",
    "GenerationConfig",
    "Target",
    "load",
    "load_drafter",
    "load_target",
]
