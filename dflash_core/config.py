"""Generation settings, validated once at the door so the loop never sees bad values."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .errors import DFlashError

MIN_BLOCK_SIZE = 2
MAX_BLOCK_SIZE = 32
VERIFY_MODES = ("auto", "adaptive", "full", "tree", "tree-full")
TREE_MODES = ("tree", "tree-full")


@dataclass(frozen=True)
class GenerationConfig:
    """How to decode one reply.

    `block_size=None` means "the drafter's own block size". `steps` is the number of
    denoising steps per block: 1 is DFlash as published (one parallel draft pass).
    `temperature=0` is greedy decoding. `verify` says how many draft tokens the target checks:
    "full" the whole block, "adaptive" only the prefix worth a pass on this machine
    (dflash_core/verify_length.py); "tree" checks several candidates per position in one pass,
    as many as pay on this machine, and "tree-full" a tree of B-1 candidates every block
    (dflash_core/draft_tree.py); "auto" is full on a GPU and, on a CPU, tree when greedy (where
    a tree pass can run) and adaptive when sampling (`verify_length.resolve_mode`). `lookup` adds
    prompt-lookup guesses (text that already occurred, lookup.py) to a tree's candidates, and the
    drafter's n-gram table's guesses where it ships one (corpus.py). The
    output is the same either way; only the speed differs.
    """

    max_new_tokens: int = 256
    block_size: int | None = None
    steps: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    verify: str = "auto"
    lookup: bool = True
    stop: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def with_(self, **changes: object) -> GenerationConfig:
        return replace(self, **changes)

    def validate(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise DFlashError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}.")
        if self.block_size is not None and (
            not isinstance(self.block_size, int)
            or not MIN_BLOCK_SIZE <= self.block_size <= MAX_BLOCK_SIZE
        ):
            raise DFlashError(
                f"block_size must be an integer from {MIN_BLOCK_SIZE} to {MAX_BLOCK_SIZE}, "
                f"got {self.block_size!r}."
            )
        if not isinstance(self.steps, int) or self.steps < 1:
            raise DFlashError(f"steps (denoising steps per block) must be an integer >= 1, got {self.steps!r}.")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise DFlashError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}.")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise DFlashError(f"top_p must be in (0, 1], got {self.top_p!r}.")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise DFlashError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}.")
        if self.verify not in VERIFY_MODES:
            raise DFlashError(f"verify must be one of {', '.join(VERIFY_MODES)}, got {self.verify!r}.")
        if self.verify in TREE_MODES and self.steps > 1:
            raise DFlashError(f"verify={self.verify!r} drafts in one denoising step (its candidates come from the "
                              f"drafter's parallel distributions); use steps=1, or verify 'full' or 'adaptive'.")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise DFlashError(f"stop strings must be non-empty strings, got {self.stop!r}.")
