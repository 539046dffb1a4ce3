"""The jobs rank 0 sends its workers, as JSON (engine: no ComfyUI). Nothing a worker receives is unpickled.

A job is one line of JSON on the worker's standard input, a pipe that only rank 0 holds:

- ``{"kind": "forward", "mode": "cfg", "tensors": [{"shape": [2, 128, 8, 8], "dtype": "float32"}, …],
  "text_lens": [7, 3], "run": 1, "runs": {name: arguments}, "call": [[0, 1], 3]}``: the inputs of a DiT forward
  (x, timestep, context: the tensors that follow through the process group), the run's mirrored per-run changes
  (``host.sampling.mirror_run``: a registered name and JSON arguments) and the ``(call, step)`` they activate;
- ``{"kind": "end_run"}``: the sampling run ended (its changes are removed);
- ``{"kind": "stop"}``: the worker leaves.

``read_job`` checks a line's structure, every key and type, before anything is allocated, and refuses anything else
in words.
"""

from __future__ import annotations

import json

import torch

from .. import bounded_json
from ..errors import ErnieImageError
from .split import MODES

FORWARD, END_RUN, STOP = "forward", "end_run", "stop"
MAX_JOB_BYTES = 1 << 20  # a forward's job is a few hundred bytes
MAX_DIMS = 8
MAX_SIZE = 1 << 40  # per dimension: a bound on what a shape may say, not on what memory holds
# The dtypes of a forward's inputs (the latent, the timesteps, the text embeddings), by name.
DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in (torch.float32, torch.float16, torch.bfloat16,
                                                                   torch.float64)}
FORWARD_KEYS = {"kind", "mode", "tensors", "text_lens", "run", "runs", "call"}
TENSORS = 3  # x, timestep, context


def encode(job: dict) -> bytes:
    """One line of JSON for ``job``."""
    return json.dumps(job, allow_nan=False, separators=(",", ":")).encode() + b"\n"


def forward_job(mode: str, tensors: list[torch.Tensor], text_lens: list[int], run: int, runs: dict,
                call: tuple[tuple[int, ...], int] | None) -> bytes:
    """The job of one DiT forward (see the module's docstring)."""
    return encode({"kind": FORWARD, "mode": mode, "tensors": [tensor_spec(t) for t in tensors],
                   "text_lens": [int(n) for n in text_lens], "run": run, "runs": runs,
                   "call": None if call is None else [list(call[0]), call[1]]})


def tensor_spec(tensor: torch.Tensor) -> dict:
    """A tensor's shape and dtype by name, for the receiving ranks to allocate it."""
    return {"shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch.")}


def read_job(line: bytes) -> dict:
    """The job in ``line`` (a line of ``encode``), checked: its ``tensors`` as ``(shape, dtype)`` and its ``call``
    as a tuple; an ErnieImageError in words for anything else."""
    if len(line) > MAX_JOB_BYTES or not line.endswith(b"\n"):
        raise _refused(line, f"it is not one line of at most {MAX_JOB_BYTES} bytes")
    try:
        job = bounded_json.loads(line.decode())
    except ValueError as error:  # not UTF-8 (UnicodeDecodeError), not JSON, nested too deeply
        raise _refused(line, f"it is not JSON ({type(error).__name__})") from None
    if not isinstance(job, dict) or job.get("kind") not in (FORWARD, END_RUN, STOP):
        raise _refused(line, f'"kind" is not one of "{FORWARD}", "{END_RUN}", "{STOP}"')
    if job["kind"] != FORWARD:
        if set(job) != {"kind"}:
            raise _refused(line, f"a {job['kind']} job has only a kind")
        return job
    if set(job) != FORWARD_KEYS:
        raise _refused(line, f"a forward job has the keys {sorted(FORWARD_KEYS)}")
    if job["mode"] not in MODES:
        raise _refused(line, f'"mode" is not one of {list(MODES)}')
    if not (isinstance(job["tensors"], list) and len(job["tensors"]) == TENSORS):
        raise _refused(line, f'"tensors" is not a list of {TENSORS}')
    job["tensors"] = [_tensor(line, spec) for spec in job["tensors"]]
    if not _ints(job["text_lens"], 0) or not _int(job["run"], 1):
        raise _refused(line, '"text_lens" is not a list of counts, or "run" not a run number')
    if not (isinstance(job["runs"], dict) and all(isinstance(v, dict) for v in job["runs"].values())):
        raise _refused(line, '"runs" is not an object of named arguments')
    call = job["call"]
    if call is not None and not (isinstance(call, list) and len(call) == 2 and _ints(call[0], 0)
                                 and _int(call[1], 0)):
        raise _refused(line, '"call" is not null or [the call\'s conds, the step]')
    job["call"] = None if call is None else (tuple(call[0]), call[1])
    return job


def _tensor(line: bytes, spec) -> tuple[list[int], torch.dtype]:
    if not (isinstance(spec, dict) and set(spec) == {"shape", "dtype"} and spec["dtype"] in DTYPES
            and _ints(spec["shape"], 0, MAX_SIZE) and len(spec["shape"]) <= MAX_DIMS):
        raise _refused(line, f'a tensor is not {{"shape": [at most {MAX_DIMS} sizes], "dtype": one of '
                             f"{list(DTYPES)}}}")
    return spec["shape"], DTYPES[spec["dtype"]]


def _int(value, least: int, most: int = 1 << 62) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and least <= value <= most


def _ints(values, least: int, most: int = 1 << 62) -> bool:
    return isinstance(values, list) and all(_int(v, least, most) for v in values)


def _refused(line: bytes, why: str) -> ErnieImageError:
    shown = line[:200]
    return ErnieImageError(f"ERNIE-Image Parallel: a job from rank 0 is not the expected JSON message: {why}. It "
                           f"starts {shown!r}{' (cut)' if len(line) > len(shown) else ''}. This worker stops; the "
                           "next run starts the workers again.")
