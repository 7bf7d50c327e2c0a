"""Progress bars for long work (loading a model, the demo, `tune`): tqdm on stderr, only when stderr is a terminal,
so piped or redirected output stays clean."""
from __future__ import annotations

import sys
import threading
from contextlib import contextmanager

__all__ = ["progress_enabled", "progress_bar", "Steps", "steps"]


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


class Steps:
    """A bar over `total` named steps whose clock keeps moving during a long step (redrawn every second).

    `next(description)` starts the next step (the previous one counts as done); `say(description)` reports within
    a step."""

    def __init__(self, total: int):
        self.total = total
        self.bar = progress_bar(total=total, bar_format="{desc} [{elapsed}]", leave=False)
        self.started = 0
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._redraw, daemon=True)
        if not self.bar.disable:
            self._ticker.start()

    def _redraw(self):
        while not self._stop.wait(1.0):
            self.bar.refresh()

    def next(self, description: str):
        if self.started:
            self.bar.update(1)
        self.started += 1
        self.say(description)

    def say(self, description: str):
        self.bar.set_description_str(f"step {self.started}/{self.total}: {description}")

    def close(self):
        self._stop.set()
        if self._ticker.is_alive():
            self._ticker.join()
        self.bar.close()


@contextmanager
def steps(total: int):
    """`Steps(total)`, closed on the way out."""
    bar = Steps(total)
    try:
        yield bar
    finally:
        bar.close()
