"""Shared pieces of the GPU benchmarks and the GPU end-to-end check (``checks/gpu/``): a true-size random
ERNIE-Image DiT and a LoRA for it, CUDA timing, environment setup."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

# docs/ARCHITECTURE.md §2: the released 8B DiT.
TRUE_DIT = dict(
    hidden_size=4096, num_attention_heads=32, num_layers=36, ffn_hidden_size=12288, in_channels=128,
    out_channels=128, text_in_dim=3072, rope_axes_dim=(32, 48, 48),
)


def use_comfyui(comfy_dir: Path | None = None, cpu: bool = False) -> None:
    """Import ComfyUI's core (GPU mode, or ``--cpu``) and the pack as ``comfyui_ernie_image``, as the tests do.
    The core is ``.gpu/comfyui`` where ``scripts/gpu_carry.sh`` put one (the device), else the tests' own."""
    import importlib.util

    comfy_dir = comfy_dir or next(p for p in (REPO / ".gpu" / "comfyui", REPO / ".cache" / "comfyui")
                                  if (p / "main.py").is_file())
    sys.argv = sys.argv[:1]
    sys.path.insert(0, str(comfy_dir))
    if cpu:
        from comfy.cli_args import args

        args.cpu = True  # before comfy.model_management is imported, as the tests' conftest does
    spec = importlib.util.spec_from_file_location(
        "comfyui_ernie_image", REPO / "__init__.py", submodule_search_locations=[str(REPO)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["comfyui_ernie_image"] = module
    spec.loader.exec_module(module)


@torch.no_grad()
def random_true_size_dit(dtype: torch.dtype = torch.bfloat16, device: str = "cuda", **overrides):
    """The 8B DiT with normal(0, 0.02) weights (norms at 1): speed does not depend on weight values."""
    from diffusers import ErnieImageTransformer2DModel

    with torch.device("meta"):
        model = ErnieImageTransformer2DModel(**{**TRUE_DIT, **overrides})
    model = model.to_empty(device=device).to(dtype)
    for name, param in model.named_parameters():
        if "norm" in name and name.endswith("weight"):
            param.fill_(1.0)
        else:
            param.normal_(0.0, 0.02)
    return model.eval()


def write_lora(transformer: torch.nn.Module, path: Path, rank: int) -> Path:
    """A LoRA of ``rank`` on every block linear layer of ``transformer`` (PEFT keys), small random deltas."""
    from safetensors.torch import save_file

    generator, tensors = torch.Generator().manual_seed(0), {}
    for name, module in transformer.named_modules():
        if isinstance(module, torch.nn.Linear) and name.startswith("layers."):
            for key, shape in (("lora_A", (rank, module.in_features)), ("lora_B", (module.out_features, rank))):
                tensors[f"transformer.{name}.{key}.weight"] = (0.01 * torch.randn(shape, generator=generator)).to(
                    torch.bfloat16)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path)
    return path


def pack_dit(model, dtype: torch.dtype = torch.bfloat16):
    """The pack's DiT (``nodes/dit/dit.py``, what its MODEL runs) with a diffusers DiT's weights (shared)."""
    from comfyui_ernie_image.nodes.dit.build import build_diffusion_model

    config = {k: v for k, v in model.config.items() if not k.startswith("_")}
    return build_diffusion_model(model.state_dict(), config, dtype)


def pack_forward(dit, latents: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor, text_lens: list[int]):
    """One forward of the pack's DiT as its MODEL runs it, without ComfyUI's wrappers."""
    return dit._forward(latents, timestep, text, text_lens)


def cuda_time(fn, repeats: int = 1) -> float:
    """Median wall seconds of ``fn()`` over ``repeats`` runs, synchronised."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def machine() -> str:
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return f"{name}, torch {torch.__version__}, {os.cpu_count()} CPUs"


# NVML's reasons for holding the clocks below their maximum (``nvmlClocksEventReason*`` bits).
CLOCK_EVENTS = {0x1: "idle", 0x2: "application clocks", 0x4: "power cap (software)", 0x8: "hardware slowdown",
                0x10: "sync boost", 0x20: "thermal (software)", 0x40: "thermal (hardware)",
                0x80: "power brake (hardware)", 0x100: "display clocks"}


def _clock_events_reader() -> Callable[[], int] | None:
    """A function returning NVML's current clock-event bits for the current CUDA device, or None without NVML."""
    try:
        import pynvml

        handle = torch.cuda._get_pynvml_handler()  # the NVML handle of torch's current device (private API)
        read = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            pynvml.nvmlDeviceGetCurrentClocksThrottleReasons
        read(handle)
    except Exception:  # no NVML, or a driver without the query: no reasons recorded
        return None
    return lambda: read(handle)


@contextmanager
def gpu_clock(readings: dict, period_s: float = 0.01):
    """Samples the GPU's SM clock (MHz), power draw (W) and NVML's clock-event reasons while the block runs; on
    leaving, ``readings`` holds the means (``sm_mhz``, ``watts``) and every reason seen (``clock_events``), or
    nothing where NVML is missing."""
    samples: list[tuple[int, float]] = []
    events = 0
    done = threading.Event()
    read_events = _clock_events_reader()

    def poll() -> None:
        nonlocal events
        while not done.wait(period_s):
            samples.append((torch.cuda.clock_rate(), torch.cuda.power_draw() / 1000))
            if read_events is not None:
                events |= read_events()

    try:
        torch.cuda.clock_rate()
    except Exception:  # no NVML (pynvml) on this machine: no readings
        yield
        return
    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        if samples:
            readings.update(sm_mhz=round(sum(s[0] for s in samples) / len(samples)),
                            clock_events=[name for bit, name in CLOCK_EVENTS.items() if events & bit],
                            watts=round(sum(s[1] for s in samples) / len(samples)))
