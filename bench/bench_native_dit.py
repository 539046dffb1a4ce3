"""One DiT forward at true size: the pack's DiT against diffusers' and ComfyUI's native ERNIE-Image, same weights.

The issue "The DiT as a ComfyUI-native model" asks for this comparison: eager and with the blocks compiled (the
pack's regional compile, the same for all three), bf16, 1024² (4096 image tokens) and 256 text tokens, batch 1,
each output's relative error against diffusers' forward on an fp32 copy of the weights.

ComfyUI's native model (``comfy/ldm/ernie/model.py``, ComfyUI >= 0.19) is public source that stays out of this
repository: pass a copy with ``--native PATH`` (it imports ``comfy.ldm.modules.attention``, which 0.3.75 has).

    python bench/bench_native_dit.py [--native .gpu/native_ernie.py] [--tiny --device cpu]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

import torch
from common import TRUE_DIT, cuda_time, machine, pack_dit, pack_forward, random_true_size_dit, use_comfyui

TINY = dict(hidden_size=64, num_attention_heads=4, num_layers=3, ffn_hidden_size=128, in_channels=128,
            out_channels=128, text_in_dim=32, rope_axes_dim=(4, 6, 6))


def native_dit(path: Path, reference: torch.nn.Module, config: dict) -> torch.nn.Module:
    """ComfyUI's native ERNIE-Image model from ``path``, holding ``reference``'s weights (shared)."""
    import comfy.ops

    spec = importlib.util.spec_from_file_location("native_ernie", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["native_ernie"] = module  # where torch.compile looks the module up again
    spec.loader.exec_module(module)
    with torch.device("meta"):
        model = module.ErnieImageModel(**config, dtype=reference.dtype, operations=comfy.ops.disable_weight_init)
    model.load_state_dict(reference.state_dict(), strict=True, assign=True)
    return model.eval()


def time_ms(call, device: torch.device, repeats: int = 5) -> float:
    call()  # warm-up (and compile) at the timed shapes
    if device.type != "cuda":
        return float("nan")
    return 1000 * cuda_time(call, repeats=repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--native", type=Path, help="a copy of ComfyUI's comfy/ldm/ernie/model.py")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (a smoke run of the script)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")) / "native_dit.json")
    args = parser.parse_args()
    use_comfyui(cpu=args.device == "cpu")
    from comfyui_ernie_image.nodes.accel.compile import RegionalCompile, compile_settings

    device = torch.device(args.device)
    config = {**TRUE_DIT, "patch_size": 1} if not args.tiny else {**TINY, "patch_size": 1}
    side, tokens = (8, 5) if args.tiny else (64, 256)
    torch.manual_seed(0)
    diffusers_dit = random_true_size_dit(device=args.device, **(TINY if args.tiny else {}))
    latents = torch.randn(1, config["in_channels"], side, side, device=device, dtype=torch.bfloat16)
    timestep = torch.full((1,), 500.0, device=device, dtype=torch.bfloat16)
    text = torch.randn(1, tokens, config["text_in_dim"], device=device, dtype=torch.bfloat16)
    with torch.inference_mode():
        fp32 = random_true_size_dit(dtype=torch.float32, device=args.device, **(TINY if args.tiny else {}))
        fp32.load_state_dict(diffusers_dit.state_dict())
        reference = fp32(latents.float(), timestep.float(), text.float(), torch.tensor([tokens], device=device),
                         return_dict=False)[0]
        del fp32

    calls = {
        "diffusers": (diffusers_dit, lambda: diffusers_dit(latents, timestep, text,
                                                            torch.tensor([tokens], device=device),
                                                            return_dict=False)[0]),
    }
    pack = pack_dit(diffusers_dit)
    calls["pack"] = (pack, lambda: pack_forward(pack, latents, timestep, text, [tokens]))
    if args.native:
        native = native_dit(args.native, diffusers_dit, config)
        calls["comfyui native"] = (native, lambda: native(latents, timestep, text))

    rows = []
    for name, (model, call) in calls.items():
        with torch.inference_mode():
            out = call()
            error = ((out.float() - reference).norm() / reference.norm()).item()
            eager = time_ms(call, device)
            regional = RegionalCompile(model.layers)
            regional.install()
            try:
                with compile_settings():
                    compiled = time_ms(call, device)
            finally:
                regional.remove()
        rows.append(dict(implementation=name, eager_ms=eager, compiled_ms=compiled, rel_error=error))
        print(f"{name}: eager {eager:.1f} ms, compiled blocks {compiled:.1f} ms, rel. error vs fp32 {error:.4f}",
              flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(machine=machine(), rows=rows), indent=1))


if __name__ == "__main__":
    main()
