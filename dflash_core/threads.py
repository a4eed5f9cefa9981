"""How many threads the target's maths gets on a CPU that other work shares.

torch starts one worker per core, and each parallel region waits for all of them: when another
process holds a core, every region waits on a worker the kernel has not scheduled, and a reply
slows several-fold (bench/HISTORY.md, "A busy neighbour"). Before each reply the engine looks at
how busy the cores were since the last reply ended, counting other processes only, and leaves
their cores to them.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

MIN_GAP_S = 0.05  # a shorter gap between replies tells too little: keep the last choice
FIRST_LOOK_S = 0.1  # before the first reply: how long to watch the cores


def _cores() -> set[int]:
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def _ticks(cores: set[int]) -> tuple[int, int] | None:
    """(busy clock ticks of `cores`, ticks this process used), or None where /proc is missing.
    Only our cores count: in a container /proc/stat may list the whole host's."""
    busy = 0
    try:
        with open("/proc/stat") as f:
            for line in f:
                name, *rest = line.split()
                if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores:
                    ticks = [int(x) for x in rest[:8]]
                    busy += sum(ticks) - ticks[3] - ticks[4]  # all but idle and iowait
        with open("/proc/self/stat") as f:
            own = f.read().rsplit(")", 1)[1].split()
        return busy, int(own[11]) + int(own[12])  # utime + stime
    except (OSError, ValueError, IndexError):
        return None


def governed() -> bool:
    """Whether the thread count is ours to fit: an explicit OMP_NUM_THREADS is the user's choice."""
    return "OMP_NUM_THREADS" not in os.environ


@dataclass
class ThreadGovernor:
    """`fit()` before a reply sets torch's thread count to the cores other processes left free
    (never below 1, never above what torch chose at start); `rested()` after it marks the
    start of the gap the next `fit` reads."""

    most: int = 0
    _mark: tuple[float, int, int] | None = None

    def __post_init__(self) -> None:
        self.most = self.most or torch.get_num_threads()
        self.core_ids = _cores()
        self.tick_s = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01

    def rested(self) -> None:
        t = _ticks(self.core_ids)
        self._mark = None if t is None else (time.monotonic(), *t)

    def busy_elsewhere(self) -> float | None:
        """Cores other processes kept busy since `rested()` (looking briefly if never called)."""
        if self._mark is None:
            self.rested()
            if self._mark is None:
                return None
            time.sleep(FIRST_LOOK_S)
        t0, busy0, own0 = self._mark
        now = _ticks(self.core_ids)
        gap = time.monotonic() - t0
        if now is None or gap < MIN_GAP_S:
            return None
        busy, own = now[0] - busy0, now[1] - own0
        return max(0.0, (busy - own) * self.tick_s / gap)

    def fit(self) -> int:
        """Set and return the thread count for the next reply."""
        others = self.busy_elsewhere()
        if others is not None:
            free = len(self.core_ids) - int(others + 0.5)
            torch.set_num_threads(max(1, min(self.most, free)))
        return torch.get_num_threads()


GOVERNOR: ThreadGovernor | None = None  # one per process: torch's thread count is process-wide


def fit_threads() -> tuple[int, int]:
    """Before a CPU reply: (threads it runs on, threads torch had at start)."""
    global GOVERNOR
    if GOVERNOR is None:
        GOVERNOR = ThreadGovernor()
    return GOVERNOR.fit(), GOVERNOR.most


def rested() -> None:
    if GOVERNOR is not None:
        GOVERNOR.rested()
