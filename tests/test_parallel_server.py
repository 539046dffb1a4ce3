"""ERNIE-Image Parallel in a real headless ComfyUI (CPU, gloo): the worker starts from the pack as ComfyUI imported it
(under the path-like module name ComfyUI gives custom nodes), the image is the one without the node, no socket of
ComfyUI's process or its worker listens beyond the loopback, and the worker stops when the next prompt no longer has
the node and on ``POST /free``."""

from __future__ import annotations

import time

import numpy as np
import psutil
import pytest

from conftest import COMFY_DIR, REPO
from helpers.parallel import beyond_loopback, listening
from helpers.reference import saved_image
from helpers.workflows import text_to_image
from scripts.comfy_headless import ComfyServer

SNAPSHOT = "ERNIE-Image-Turbo-tiny"


@pytest.fixture(scope="module")
def comfy_server(tiny_models, tmp_path_factory):
    """A headless ComfyUI of this file's own, started with the switch that lets the node run workers on the CPU."""
    server = ComfyServer(COMFY_DIR, tmp_path_factory.mktemp("comfy_base"), REPO, tiny_models["models_dir"],
                         env={"ERNIE_IMAGE_PARALLEL_CPU_WORKERS": "1"})
    server.start()
    yield server
    server.stop()


def _workers(server) -> list[psutil.Process]:
    children = psutil.Process(server.process.pid).children()
    return [p for p in children if any("nodes.parallel.worker" in part for part in p.cmdline())]


def _gone(workers: list[psutil.Process], timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in workers):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_the_node_samples_the_image_of_one_process_and_its_workers_stop_with_the_next_prompt_and_on_free(
        comfy_server):
    graph = dict(snapshot=SNAPSHOT, prompt="two gpus", negative="blur", steps=4, cfg=4.0, seed=7)
    parallel = text_to_image(**graph, prefix="parallel", model_nodes=(("ErnieImageParallel", {"mode": "cfg",
                                                                                              "gpus": 2}),))
    result = comfy_server.run(parallel)
    assert result.status == "success", result.messages
    workers = _workers(comfy_server)
    assert len(workers) == 1
    sockets = listening([comfy_server.process.pid, workers[0].pid])  # the pool idle between prompts
    assert sockets and beyond_loopback(sockets) == []

    plain = comfy_server.run(text_to_image(**graph, prefix="plain"))
    assert plain.status == "success", plain.messages
    assert _gone(workers), "the worker outlived the prompts that used it"
    (one,), (two,) = comfy_server.output_images(result), comfy_server.output_images(plain)
    assert np.abs(saved_image(one) - saved_image(two)).max() <= 1  # 8-bit levels: the latents agree to 1e-6

    assert comfy_server.run(parallel).status == "success"
    workers = _workers(comfy_server)
    assert len(workers) == 1
    comfy_server.free(unloads="ErnieImageModel")
    assert _gone(workers), "POST /free left the worker running"
