"""A parallel worker process (ComfyUI side): the DiT on its own GPU, running its share of each of rank 0's forwards.

It builds the DiT as the loader did in ComfyUI's process (the MODEL's recipe), adds the same LoRA patches, loads it
through its own ComfyUI model management, then follows rank 0's jobs: for each forward the same wrapper function
as rank 0 around its DiT (``patching.split_call``), with the same per-run changes of the blocks installed (a
Cache-DiT run: ``host.sampling.mirror_run``, made here by the name its feature registered). Its log lines go to the
terminal ComfyUI was started from.
"""

from __future__ import annotations

import functools
import logging
import os
import sys

import torch

from ..host.model import dit_blocks
from ..host.parallel import load_for_run, replay_patches
from ..host.sampling import DIFFUSION_MODEL, make_mirrored_run, wrapped_options
from .messages import END_RUN
from .patching import KEY, split_call
from .pool import WorkerChannel
from .split import Split


class _MirroredRuns:
    """The per-run changes of the blocks that rank 0's current run made, made here too."""

    def __init__(self, holder: torch.nn.Module, blocks_name: str):
        self.holder, self.blocks_name = holder, blocks_name
        self.run: int | None = None
        self.active: list = []

    def follow(self, run: int, runs: dict[str, dict], call: tuple | None) -> None:
        if run != self.run:
            self.end()
            self.run = run
            for name, arguments in runs.items():
                self.active.append(make_mirrored_run(name, self.holder, self.blocks_name, arguments))
                self.active[-1].install()
        for change in self.active:
            change.activate(*call)  # every run that mirrors a change notes each call's (call, step)

    def end(self) -> None:
        for change in self.active:
            change.remove()
        self.active, self.run = [], None


def _build(channel: WorkerChannel):
    payload = channel.payload()
    make, args = payload["recipe"]
    patcher = make(*args)
    replay_patches(patcher, payload["patches"])
    load_for_run([patcher])
    return patcher


def serve(spec: dict) -> None:
    """The worker's life: build and load the DiT, join the group, run jobs until rank 0 says stop. An error is
    left for rank 0 to show, and the process exits with code 1 at once: an interpreter's normal teardown with the
    group still open can abort in gloo's or NCCL's threads (SIGABRT, "terminate called without an active
    exception"), which would hide the error's exit behind a signal."""
    logging.basicConfig(level=logging.INFO, format=f"ERNIE-Image worker {spec['rank']}: %(message)s")
    channel = WorkerChannel(spec)
    try:
        patcher = _build(channel)
        device = torch.device(patcher.load_device)
        channel.join(device)
        runs = _MirroredRuns(*dit_blocks(patcher))
        dit = patcher.model.diffusion_model
        with torch.inference_mode():
            for job, tensors in channel.jobs(device):
                if job["kind"] == END_RUN:
                    runs.end()
                    continue
                runs.follow(job["run"], job["runs"], job["call"])
                wrapper = functools.partial(split_call, Split(job["mode"], channel.rank, channel.world))
                dit(*tensors, job["text_lens"], transformer_options=wrapped_options(DIFFUSION_MODEL, KEY, wrapper))
        runs.end()
        channel.leave()
    except BaseException as error:
        channel.fail(error)
        logging.exception("stopped")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
