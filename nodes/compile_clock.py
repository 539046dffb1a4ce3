"""How long a first run waited for ``torch.compile`` (engine: plain torch, no ComfyUI).

Why: the first run of a compiled shape waits for dynamo and inductor, which took minutes on the GPU machines with an
empty inductor cache (``bench/RESULTS.md``, session 33: the FP8 DiT's first sampling 112 s, the PE's first prompt
231 s), and nothing in the log said where the time went. The DiT's blocks and the PE's decode step time the stretch
that may compile and say how long it took when dynamo made new graphs in it; a run that compiles nothing says nothing.
"""

from __future__ import annotations

import time


def _graphs() -> int:
    from torch._dynamo.utils import counters  # here: dynamo's import is not paid at ComfyUI's start

    return counters["stats"]["unique_graphs"]  # dynamo counts each graph it compiles, in this process


class CompileClock:
    """``with CompileClock() as clock: ...``; then ``clock.new_graphs`` (the graphs dynamo compiled inside) and
    ``clock.seconds`` (the wall time inside, the compiled work's own included)."""

    new_graphs: int = 0
    seconds: float = 0.0

    def __enter__(self) -> CompileClock:
        self._graphs_before, self._started = _graphs(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self._started
        self.new_graphs = max(0, _graphs() - self._graphs_before)  # a test may clear the counters meanwhile
