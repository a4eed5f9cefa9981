"""DFlash Studio's Gradio app. UI only: no torch, no tensor maths (that is dflash_core's job)."""

from __future__ import annotations

from typing import Any

__all__ = ["build_app", "launch_kwargs"]


def __getattr__(name: str) -> Any:
    # Lazy, so `app.render` and `app.charts` can be imported (and tested) without gradio.
    if name in __all__:
        from . import ui

        return getattr(ui, name)
    raise AttributeError(name)
