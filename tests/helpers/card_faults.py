"""The faults the planner's tests give a CPU that a GPU would answer: core's memory queries answering for a CUDA card,
and costs as a probe would have measured them (H200-like; fp8 saves the PE memory, not time, as measured there;
bandwidths of a PCIe 4.0 x16 card). No import of the pack or of ComfyUI: the fake card (``helpers/fake_card``) runs
this inside a ComfyUI server, where the pack has another module name, and the tests' ``card`` fixture in their own
process."""

from collections.abc import Callable
from types import ModuleType

GIB = 2**30
CONTEXT = GIB // 2  # what a CUDA context takes of a real card, outside torch's allocator
SECONDS = {"dit:bf16": 0.16, "dit:fp8_cast": 0.20, "dit:fp8_matmul": 0.11, "dit:gguf:Q4_K": 0.15, "text:bf16": 0.04,
           "text:fp8": 0.05, "pe:bf16": 0.02, "pe:fp8": 0.02, "vae": 0.09,
           # A GGUF DiT's LoRA per forward and GB of factors: as the form that merged it into each decoded weight took
           # on the H100 (0.21 s over 8 forwards of the check's 0.38 GB LoRA, bench/RESULTS.md session 31).
           "lora:dit_per_gb": 0.07}
CPU_SECONDS = {"text:bf16": 2.0, "text:fp8": 2.5, "pe:bf16": 0.5, "pe:fp8": 0.6, "image:png": 0.2}
PINNED, PAGEABLE = 25e9, 8e9


def answer_as_card(set_attribute: Callable, mm: ModuleType, args: object, gib: float) -> None:
    """Core's memory queries (``comfy.model_management`` as ``mm``, its parsed ``args``) answer for a CUDA card of
    ``gib`` GiB with nothing loaded, through ``set_attribute`` (``setattr``, or a test's ``monkeypatch.setattr``)."""
    total = int(gib * GIB)
    set_attribute(args, "cpu", False)  # the tests' core runs with --cpu: its device stays the CPU
    set_attribute(mm, "is_device_cuda", lambda device: True)
    set_attribute(mm, "get_total_memory", lambda dev=None, torch_total_too=False:
                  (total, total) if torch_total_too else total)
    set_attribute(mm, "get_free_memory", lambda dev=None, torch_free_too=False:
                  (total - CONTEXT, 0) if torch_free_too else total - CONTEXT)
    set_attribute(mm, "MAX_PINNED_MEMORY", 16 * GIB)  # core's bound on an NVIDIA machine of 17 GiB
