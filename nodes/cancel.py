"""Cancel for the engine's loops over files, tensors and blocks.

Engine code imports no ComfyUI, so it cannot ask ComfyUI whether the user pressed Cancel. The host layer installs
that question here once, when it is first imported (``host/__init__.py``: core's
``throw_exception_if_processing_interrupted`` where a core runs, which ComfyUI reports as an interrupted prompt);
every loop over files, tensors or blocks calls ``check_cancel()`` before each item, so at most the item in hand is
finished after Cancel. Outside ComfyUI (the engine's own tests, the tools in ``scripts/``) the check returns.
"""

from __future__ import annotations

from collections.abc import Callable


def _never() -> None:
    return None


_check: Callable[[], None] = _never


def install(check: Callable[[], None]) -> None:
    """Make ``check_cancel`` call ``check``, which raises when the user asked to stop."""
    global _check
    _check = check


def check_cancel() -> None:
    """Raise the host's interrupt when the user asked to stop; return otherwise."""
    _check()
