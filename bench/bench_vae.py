"""GPU memory and time of the VAE decode at 1024x1024, whole and tiled, vs ComfyUI's own estimate (issue: memory).

The loader's VAE (``nodes/dit/vae.make_vae``: core's Flux.2 VAE, random weights, real architecture), loaded by
ComfyUI first. For each decode: the peak of allocated GPU memory above the loaded weights, and the time (median
of 3 after a warm-up). Tiled is what core's ``VAEDecodeTiled`` node runs at its defaults (512 px tiles, 64 px
overlap); its difference from the whole decode is ``||tiled - whole|| / ||whole||``.

``--history``: what was allocated at the measured whole decode's peak, by the line that allocated it (torch's memory
history, as the end-to-end check's ``--allocations``). ``--channels-last``: the decoder's weights in that layout.

``--stages`` adds where the whole decode's peak is: for each stage of the decoder (input conv, the mid block's
resnets and attention, each up block's resnets, attentions and upsampler, the output norm and conv), the peak it
allocates above what was allocated when it started and above the decode's start, and the largest three (a stage
whose peak is far above its output's size holds scratch: a kernel's workspace or an attention matrix).

    cd bench && python3 bench_vae.py [--stages] [--history] [--channels-last] [--slab-mib 0,32,128]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from functools import partial

import torch
from common import REPO, TRUE_DIT, cuda_time, machine, use_comfyui

sys.path.insert(0, str(REPO))
from checks.gpu.e2e_worker import allocations_at_peak  # noqa: E402

GIB = 2**30


def measure(decode, history: dict | None = None) -> tuple[torch.Tensor, float, float, float]:
    """Output, peak GiB above what was allocated before, peak GiB of torch's reserved memory above its start (from an
    emptied cache), seconds; with ``history``, what was allocated at the peak goes into it."""
    out = decode()  # warm-up (and ComfyUI loads the VAE)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    if history is not None:
        out, at_peak = allocations_at_peak(decode)
        history.update(at_peak)
    else:
        out = decode()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - before) / GIB
    reserved_peak = (torch.cuda.max_memory_reserved() - reserved) / GIB
    return out, peak, reserved_peak, cuda_time(decode, repeats=3)


# The decoder's parts in the order its forward calls them, none inside another: between them runs only the final
# nonlinearity, so their windows cover the decode (the attention and upsampling calls too, which leaf layers miss).
STAGES = re.compile(r"(conv_in|norm_out|conv_out|mid\.\w+|up\.\d+\.(block\.\d+|attn\.\d+|upsample))")


def stage_peaks(decoder: torch.nn.Module, decode) -> list[tuple[str, float, float, float]]:
    """(stage, peak GiB above its start, peak GiB above the decode's start, output GiB) for one whole decode."""
    torch.cuda.synchronize()
    decode_start = torch.cuda.memory_allocated()
    starts: dict[str, int] = {}
    peaks: list[tuple[str, float, float, float]] = []

    def before(name):
        def hook(module, inputs):
            torch.cuda.synchronize()
            starts[name] = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        return hook

    def after(name):
        def hook(module, inputs, output):
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
            size = output.numel() * output.element_size() if isinstance(output, torch.Tensor) else 0
            peaks.append((name, (peak - starts[name]) / GIB, (peak - decode_start) / GIB, size / GIB))
        return hook

    stages = [(name, module) for name, module in decoder.named_modules() if STAGES.fullmatch(name)]
    handles = [h for name, module in stages for h in (module.register_forward_pre_hook(before(name)),
                                                     module.register_forward_hook(after(name)))]
    try:
        decode()
    finally:
        for handle in handles:
            handle.remove()
    return peaks


def slab_sizes(vae, latent: torch.Tensor, whole: torch.Tensor, sizes: list[int]) -> list[dict]:
    """The whole decode with each slab size: peaks (allocated, reserved from an emptied cache), time, and the
    largest difference from the first decode's image."""
    from comfyui_ernie_image.nodes.host import vae as host_vae

    default, found = host_vae.SLAB_BYTES, []
    try:
        for mib in sizes:
            host_vae.SLAB_BYTES = mib * 2**20 if mib else 2**62
            out, peak, reserved, seconds = measure(partial(vae.decode, latent))
            found.append(dict(slab_mib=mib, peak_gib=round(peak, 3), reserved_gib=round(reserved, 3),
                              s=round(seconds, 4), max_abs_diff=float((out.float() - whole.float()).abs().max())))
            print(found[-1], flush=True)
    finally:
        host_vae.SLAB_BYTES = default
    return found


@torch.inference_mode()  # as ComfyUI's executor runs every node: no autograd graph keeps activations
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", action="store_true", help="the whole decode's peak per decoder stage")
    parser.add_argument("--history", action="store_true", help="what was allocated at the whole decode's peak")
    parser.add_argument("--channels-last", action="store_true", help="the decoder's weights in channels-last")
    parser.add_argument("--slab-mib", help="comma-separated: the whole decode again with the decoder "
                        "in slabs of at most this many MiB (nodes/host/vae.SLAB_BYTES; 0: no slabs)")
    options = parser.parse_args()
    use_comfyui()
    import comfy.model_management
    from diffusers import AutoencoderKLFlux2

    from comfyui_ernie_image.nodes.dit.vae import make_vae

    torch.manual_seed(0)
    vae = make_vae(AutoencoderKLFlux2().state_dict(), "random weights")
    latent = torch.randn(1, TRUE_DIT["in_channels"], 64, 64)
    compression = vae.spacial_compression_decode()
    if options.channels_last:
        vae.first_stage_model.to(memory_format=torch.channels_last)
    history = {} if options.history else None
    whole, whole_peak, whole_reserved, whole_s = measure(partial(vae.decode, latent), history)
    tiled, tiled_peak, _, tiled_s = measure(partial(vae.decode_tiled, latent, tile_x=512 // compression,
                                                 tile_y=512 // compression, overlap=64 // compression))
    estimate = vae.memory_used_decode(latent.shape, vae.vae_dtype) / GIB
    rows = dict(machine=machine(), channels_last=options.channels_last, vae_dtype=str(vae.vae_dtype),
                comfy_estimate_gib=estimate,
                whole=dict(peak_gib=whole_peak, reserved_gib=whole_reserved, s=whole_s, allocations_at_peak=history),
                tiled=dict(peak_gib=tiled_peak, s=tiled_s,
                           rel_diff=float((tiled.float() - whole.float()).norm() / whole.float().norm())))
    if options.stages:
        peaks = stage_peaks(vae.first_stage_model.decoder, partial(vae.decode, latent))
        rows["stages"] = [dict(stage=n, peak_gib=round(p, 3), above_decode_start_gib=round(d, 3),
                               output_gib=round(o, 3)) for n, p, d, o in peaks]
        print("largest stage peaks (GiB above the stage's start / above the decode's start; its output's size):")
        for name, peak, above_start, out in sorted(peaks, key=lambda row: -row[1])[:3]:
            print(f"  {name}: {peak:.2f} / {above_start:.2f} (output {out:.2f})")
    if options.slab_mib:
        rows["slabs"] = slab_sizes(vae, latent, whole, [int(n) for n in options.slab_mib.split(",")])
    comfy.model_management.unload_all_models()
    print(json.dumps(rows, indent=1))
    print(f"\n{machine()}, VAE in {vae.vae_dtype}; ComfyUI's estimate for the decode: {estimate:.2f} GiB\n")
    print("| decode 1024² | peak GiB above the weights | time s | rel. diff vs whole |\n|---|---|---|---|")
    print(f"| whole | {whole_peak:.2f} | {whole_s:.3f} | |")
    print(f"| tiled (512 px, overlap 64) | {tiled_peak:.2f} | {tiled_s:.3f} | {rows['tiled']['rel_diff']:.4f} |")
    if os.environ.get("OUT"):
        name = os.environ.get("BENCH_VAE_NAME", "bench_vae") + ".json"
        with open(os.path.join(os.environ["OUT"], name), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
