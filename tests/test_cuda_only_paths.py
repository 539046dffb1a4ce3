"""Code that runs only where ComfyUI samples on a CUDA GPU (the memory plan's queries of core, the probe's machine
key), reached here on the CPU device with real core objects: core's own ``LoadedModel`` on the CPU, the driver's
version file. A CPU machine never takes these paths in a real run, so each test says what it stands in for."""

from __future__ import annotations

import gc
import sys

import torch

from comfyui_ernie_image.nodes.host import plan, probe
from helpers.loaded import CPU, hold


def test_a_model_another_node_leaked_is_left_out_of_the_memory_models_hold_on_the_device(loaded_models):
    """Core keeps a model whose patcher is gone but whose module another node still holds (its "memory leak"
    warning): ``LoadedModel.model`` is then None, and core's ``free_memory`` skips it. The plan's count of what
    loaded models hold (on a GPU at every plan; here on the CPU device) read it and failed with AttributeError,
    outside the plan's own error handling: the loader node failed."""
    live = hold(torch.nn.Linear(64, 64), loaded_models)
    leaked_patcher = hold(torch.nn.Linear(32, 32), loaded_models)
    leaked_module = leaked_patcher.model  # another node keeps the module
    del leaked_patcher
    gc.collect()
    assert loaded_models[0].model is None and loaded_models[0].is_dead()  # core's own view of it
    assert plan._loaded_on(CPU) == live.loaded_size() == 64 * 64 * 4 + 64 * 4
    del leaked_module


def test_the_driver_version_is_read_once_per_process(tmp_path, monkeypatch):
    """The machine key is made at every plan request (each loader and encode node of every prompt); on a GPU its
    driver version came from NVML (``nvmlInit`` and ``nvmlShutdown`` each time) or the kernel module's file. A driver
    cannot change under a process that holds a CUDA context: it is read once. (No NVML here: the file's answer.)"""
    monkeypatch.setitem(sys.modules, "pynvml", None)  # NVML absent: the file is read
    probe.driver_version.cache_clear()  # this process's first reading
    version = tmp_path / "version"
    version.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.95.05  Tue Sep 23 09:27:38 UTC 2025\n")
    assert probe.driver_version(version) == "580.95.05"
    version.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  999.1  Tue Sep 23 09:27:38 UTC 2025\n")
    assert probe.driver_version(version) == "580.95.05"
