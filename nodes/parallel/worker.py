"""A parallel worker process (ComfyUI side): the DiT on its own GPU, running its share of each of rank 0's forwards.

It builds the DiT as the loader did in ComfyUI's process (the MODEL's recipe), adds the same LoRA patches, loads it
through its own ComfyUI model management, then follows rank 0's jobs: for each forward the same wrapper function
as rank 0 around its DiT (``patching.split_call``), with the same per-run changes of the blocks installed (a
Cache-DiT run: ``host.sampling.mirror_run``). Its log lines go to the terminal ComfyUI was started from.
"""

from __future__ import annotations

import functools
import logging

import torch

from ..host.model import dit_blocks
from ..host.parallel import load_for_run, replay_patches
from ..host.sampling import DIFFUSION_MODEL, wrapped_options
from .patching import KEY, split_call
from .pool import WorkerChannel
from .split import Split


class _MirroredRuns:
    """The per-run changes of the blocks that rank 0's current run made, made here too."""

    def __init__(self, holder: torch.nn.Module, blocks_name: str):
        self.holder, self.blocks_name = holder, blocks_name
        self.run: int | None = None
        self.active: list = []

    def follow(self, run: int, runs: dict, call: tuple | None) -> None:
        if run != self.run:
            self.end()
            self.run = run
            for make, args in runs.values():
                self.active.append(make(self.holder, self.blocks_name, *args))
                self.active[-1].install()
        for change in self.active:
            change.activate(*call)  # every run that mirrors a change notes each call's (call, step)

    def end(self) -> None:
        for change in self.active:
            change.remove()
        self.active, self.run = [], None


def _build(payload_path: str):
    payload = torch.load(payload_path, weights_only=False)
    make, args = payload["recipe"]
    patcher = make(*args)
    replay_patches(patcher, payload["patches"])
    load_for_run([patcher])
    return patcher


def serve(spec: dict) -> None:
    """The worker's life: build and load the DiT, join the group, run jobs until rank 0 says stop. An error is
    left for rank 0 to show before the process exits with it."""
    logging.basicConfig(level=logging.INFO, format=f"ERNIE-Image worker {spec['rank']}: %(message)s")
    channel = WorkerChannel(spec)
    try:
        patcher = _build(spec["payload"])
        device = torch.device(patcher.load_device)
        channel.join(device)
        runs = _MirroredRuns(*dit_blocks(patcher))
        dit = patcher.model.diffusion_model
        with torch.inference_mode():
            for header, tensors in channel.jobs(device):
                if header["kind"] == "end_run":
                    runs.end()
                    continue
                runs.follow(header["run"], header["runs"], header["call"])
                wrapper = functools.partial(split_call, Split(header["mode"], channel.rank, channel.world))
                dit(*tensors, header["text_lens"], transformer_options=wrapped_options(DIFFUSION_MODEL, KEY, wrapper))
        runs.end()
        channel.leave()
    except BaseException as error:
        channel.fail(error)
        raise
