"""A rank-64 LoRA on the true-size DiT: load time, extra GPU memory, warm Turbo time with and without it (#13).

True-size ERNIE-Image DiT with random weights as the pack's MODEL (``make_model_patcher``), its blocks' weights in
bf16 and in fp8_e4m3fn storage (weight_dtype fp8_e4m3fn: the quantized form that takes LoRAs). The LoRA: rank 64 on
every block linear layer, PEFT layout (``common.write_lora``), read from disk. Per weights, in one process:
- load s: ComfyUI loading the MODEL onto the GPU (``load_models_gpu``, from the CPU where the loader leaves it);
  with the LoRA: the file read + ``apply_lora`` (the LoRA loader's) + that load, where core merges the patches;
- resident / peak GiB: GPU memory allocated after the load, and its peak during it, over what was there before;
  extra GiB: the LoRA's load less the same MODEL's load without it; max weight Δ: one patched weight's change
  at the load (> 0: core merged the patches); the file is read just after being written (the OS's cache);
- Turbo s: 1024x1024 (a 128x64x64 latent), 8 steps, CFG 1, 256 text tokens, ComfyUI's sampler
  (``bench_dit_sampling.comfy_sampling``), eager unless --compile (the loaders' default); warm-up, median of 3.
A DiT quantized by the loader (torchao fp8_per_row) takes LoRAs by re-quantizing the patched layers from its file,
which needs the file: the GPU check's ``ernie_image_low_vram_lora`` twin measures it (``checks/gpu/gpu_e2e.py``).
``--weights gguf``: the same weights as a Q4_K_M-like GGUF (``scripts/gguf_writer.py``, random valid blocks), whose
LoRA is held as its factors on the GPU; a second LoRA row at strength 0.5 shows whether a new strength recompiled
(``graphs``: dynamo's unique graphs so far; ``model_size``: what core plans the load with).

    python bench/bench_lora.py [--compile] [--weights bf16,fp8_e4m3fn,gguf] [--out $OUT/lora.json]
    python bench/bench_lora.py --tiny --device cpu    # smoke run: tiny shapes, times and memory are nan
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_dit_sampling import comfy_sampling
from bench_native_dit import TINY
from common import REPO, TRUE_DIT, machine, random_true_size_dit, use_comfyui, write_lora

GIB, NAN = 2**30, float("nan")
CUDA = False  # set by main: on the CPU (a smoke run) times and memory are nan


def clock() -> float:
    return (torch.cuda.synchronize(), time.perf_counter())[1] if CUDA else NAN


def allocated(peak: bool = False) -> float:
    if not CUDA:
        return NAN
    return (torch.cuda.max_memory_allocated() if peak else torch.cuda.memory_allocated()) / GIB


def unload() -> None:
    import comfy.model_management

    comfy.model_management.unload_all_models()
    comfy.model_management.soft_empty_cache()
    if CUDA:
        torch.cuda.reset_peak_memory_stats()


def turbo(patcher, inputs: tuple) -> dict:
    """Warm Turbo sampling: one warm-up (which also compiles under --compile), then the median of 3 runs."""
    comfy_sampling(patcher, *inputs)
    if CUDA:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(3):
        start = clock()
        comfy_sampling(patcher, *inputs)
        times.append(clock() - start)
    return dict(turbo_s=statistics.median(times), turbo_peak_gib=allocated(peak=True))


@torch.inference_mode()  # as ComfyUI's executor runs every node (merging into fp8 weights needs it: no autograd)
def measure(patcher, lora_path: Path | None, inputs: tuple, strength: float = 1.0) -> dict:
    """Load ``patcher`` (with the LoRA at ``lora_path`` applied first, when given) and sample Turbo with it."""
    import comfy.model_management
    from safetensors.torch import load_file
    from torch._dynamo.utils import counters

    from comfyui_ernie_image.nodes.lora.patching import apply_lora

    unload()
    base, row, key = allocated(), dict(lora=lora_path is not None, read_s=0.0, apply_s=0.0, strength=strength), None
    if lora_path is not None:
        start = clock()
        lora = load_file(lora_path)
        read = clock()
        patcher, report = apply_lora(patcher, lora, strength, lora_path.name)
        row.update(read_s=read - start, apply_s=clock() - read, applied=report.text())
        key = next(iter(patcher.patches))  # one patched weight, to see the patches merged at the load
        weight = patcher.get_model_object(key).float().clone()
    start = clock()
    comfy.model_management.load_models_gpu([patcher])
    row["gpu_load_s"] = clock() - start
    row.update(load_s=row["read_s"] + row["apply_s"] + row["gpu_load_s"], resident_gib=allocated() - base,
               load_peak_gib=allocated(peak=True) - base)
    if key is not None:
        row["weight_change"] = (patcher.get_model_object(key).float().cpu() - weight).abs().max().item()
    row["model_size"] = patcher.model_size()
    return row | turbo(patcher, inputs) | dict(graphs=counters["stats"]["unique_graphs"])


def main() -> None:
    global CUDA
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (a smoke run of the script)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--compile", action="store_true", help="the loaders' default compile of the blocks")
    parser.add_argument("--weights", default="bf16,fp8_e4m3fn", help="which of bf16, fp8_e4m3fn, gguf (comma list)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")) / "lora.json")
    args = parser.parse_args()
    CUDA = args.device != "cpu"
    use_comfyui(cpu=not CUDA)
    from comfyui_ernie_image.nodes.accel.patching import compile_by_default
    from comfyui_ernie_image.nodes.dit.build import build_diffusion_model
    from comfyui_ernie_image.nodes.dit.model import make_model_patcher
    from comfyui_ernie_image.nodes.dit.schedule import reference_sigmas

    shape = TINY if args.tiny else TRUE_DIT
    rank, side, tokens = (4, 8, 5) if args.tiny else (64, 64, 256)
    torch.manual_seed(0)
    transformer = random_true_size_dit(device=args.device, **shape)
    config = {k: v for k, v in transformer.config.items() if not k.startswith("_")}
    lora_dir = tempfile.TemporaryDirectory()
    lora_path = write_lora(transformer, Path(lora_dir.name) / f"ernie-image-lora-r{rank}.safetensors", rank)
    state = transformer.state_dict()
    names, storage, patchers = args.weights.split(","), {"bf16": (), "fp8_e4m3fn": (torch.float8_e4m3fn,)}, {}
    for name in names:  # on the CPU, as the loader leaves it
        dit = (gguf_dit(state, Path(lora_dir.name) / "ernie-image-Q4_K_M.gguf") if name == "gguf"
               else build_diffusion_model(state, config, torch.bfloat16, *storage[name]))
        patchers[name] = make_model_patcher(dit)
    del transformer, state
    text = torch.randn(tokens, shape["text_in_dim"], dtype=torch.bfloat16)
    inputs = (torch.randn(1, shape["in_channels"], side, side), text, text[:40], reference_sigmas(8), 1.0)
    rows = []
    for name in names:
        patcher = compile_by_default(patchers[name]) if args.compile else patchers[name]
        measured = [measure(patcher, None, inputs), measure(patcher, lora_path, inputs)]
        if name == "gguf":
            measured.append(measure(patcher, lora_path, inputs, strength=0.5))
        for with_lora in measured[1:]:
            with_lora.update(extra_resident_gib=with_lora["resident_gib"] - measured[0]["resident_gib"],
                             extra_peak_gib=with_lora["load_peak_gib"] - measured[0]["load_peak_gib"])
        rows += [dict(weights=name, **row) for row in measured]
        print(*rows[-len(measured):], sep="\n", flush=True)
    unload()

    lora_mib = lora_path.stat().st_size / 2**20
    print(f"\n{machine()}; LoRA rank {rank} ({lora_mib:.0f} MiB), {'compiled' if args.compile else 'eager'}\n")
    print("| weights | LoRA | load s (read + apply + GPU load) | resident GiB | load peak GiB | extra GiB resident / "
          "peak | warm Turbo s (peak GiB) | model_size GiB | graphs |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        split = f" ({r['read_s']:.2f} + {r['apply_s']:.2f} + {r['gpu_load_s']:.2f})" if r["lora"] else ""
        extra = f"{r['extra_resident_gib']:+.2f} / {r['extra_peak_gib']:+.2f}" if r["lora"] else "—"
        lora = f"rank {rank} at {r['strength']:g} (max weight Δ {r['weight_change']:.1e})" if r["lora"] else "none"
        print(f"| {r['weights']} | {lora} | {r['load_s']:.2f}{split} | "
              f"{r['resident_gib']:.2f} | {r['load_peak_gib']:.2f} | {extra} | {r['turbo_s']:.3f} "
              f"({r['turbo_peak_gib']:.1f}) | {r['model_size'] / GIB:.2f} | {r['graphs']} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(machine=machine(), rank=rank, lora_mib=lora_mib, compile=args.compile,
                                        rows=rows), indent=1))
    lora_dir.cleanup()


def gguf_dit(state: dict[str, torch.Tensor], path: Path):
    """The DiT of ``state`` as a Q4_K_M-like GGUF file at ``path``, loaded as the pack's GGUF loader loads it."""
    from comfyui_ernie_image.nodes.dit.gguf import load_gguf_dit

    sys.path.insert(0, str(REPO))  # the repository's scripts/
    from scripts.gguf_writer import mixed_kind, write_gguf

    return load_gguf_dit(write_gguf(path, state, mixed_kind, arch="wan"), torch.bfloat16)


if __name__ == "__main__":
    main()
