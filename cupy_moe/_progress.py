"""Progress bars for long work (loading a model, the demo, `tune`): tqdm on stderr, only when stderr is a terminal,
so piped or redirected output stays clean."""
from __future__ import annotations

import sys

__all__ = ["progress_enabled", "progress_bar"]


def progress_enabled() -> bool:
    """Whether stderr is an interactive terminal."""
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def progress_bar(*, enabled: bool | None = None, **kwargs):
    """A tqdm bar on stderr; enabled None: only on a terminal (progress_enabled), True/False: forced."""
    from tqdm import tqdm
    show = progress_enabled() if enabled is None else enabled
    return tqdm(file=sys.stderr, disable=not show, dynamic_ncols=True, **kwargs)
