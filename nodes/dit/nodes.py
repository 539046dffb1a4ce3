"""Loader and scheduler nodes for the ERNIE-Image DiT (schemas and plumbing only)."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import folder_paths
import torch
from comfy_api.v0_0_2 import io

from ..accel.capability import METHODS
from ..accel.compile import compiles_by_default
from ..accel.patching import compile_by_default
from ..accel.quantize import load_quantized_dit
from ..errors import ErnieImageError
from ..host.memory import compute_dtype, core_unet_dtype, fits_whole, torch_device, usable_memory
from ..host.sizes import module_bytes
from ..paths import (
    SNAPSHOT_PREFIX,
    check_choice,
    model_file_path,
    safetensors_names,
    snapshot_names,
    snapshot_path,
)
from ..pe.nodes import ErniePEType, snapshot_pe
from ..text.managed import ManagedTextEncoder
from ..text.nodes import ErnieTextEncoderType, text_encoder_device_input
from .build import load_dit
from .model import make_model_patcher
from .schedule import DEFAULT_SHIFT, reference_sigmas, snapshot_shift
from .vae import load_snapshot_vae, load_vae

WEIGHT_DTYPES = {"default": None, "bf16": torch.bfloat16, "fp32": torch.float32,
                 "fp8_e4m3fn": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
RUNNABLE_DTYPES = [torch.bfloat16, torch.float32]  # what the pack's DiT computes in
STORAGE_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]  # what it may keep its block weights in, cast per layer
QUANTIZATION_METHODS = list(METHODS)

def _weight_dtypes(choice: str) -> tuple[torch.dtype, torch.dtype | None]:
    """The DiT's compute dtype and its block weights' dtype (None: an fp8 file's own fp8, else the compute dtype).

    ``default``: ComfyUI's pick for the device (bf16 on recent GPUs, fp32 on CPU), and a file's fp8 weights stay
    fp8. ComfyUI's global unet dtype flags (``--fp8_e4m3fn-unet``, ``--bf16-unet``, ...) make its pick a dtype
    whatever the model or file: an fp8 one becomes the storage; one the pack's DiT cannot run falls back to bf16
    (fp32 where bf16 is unsupported), said once."""
    device = torch_device()
    asked = WEIGHT_DTYPES[choice]
    if asked is None:
        asked, forced = core_unet_dtype(device, RUNNABLE_DTYPES)
        if asked not in RUNNABLE_DTYPES + STORAGE_DTYPES:
            _say_dtype_fallback(asked, compute_dtype(device))
            return compute_dtype(device), None
        if not forced:
            return asked, None
    if asked in STORAGE_DTYPES:
        return compute_dtype(device), asked
    return asked, asked


@functools.cache  # once per process and dtype pair
def _say_dtype_fallback(asked: torch.dtype, used: torch.dtype) -> None:
    logging.warning(
        "ERNIE-Image: ComfyUI's unet dtype flag asks for %s, which the ERNIE-Image DiT does not run in; loading it "
        "in %s. For FP8 weights, pick weight_dtype fp8_e4m3fn or the loader's quantization input (fp8_per_row).",
        asked, used)


def _load_model(path: Path, weight_dtype: str, quantization: str, shift: float, disable_dynamic: bool = False):
    """The DiT at ``path`` as a MODEL, quantized at load when asked (a method that cannot run here fails first).

    ``disable_dynamic``: on core's classic patcher also where the core streams models with dynamic VRAM (core's
    compile node asks so through ``cached_patcher_init`` when it demotes a model to compile it)."""
    dtype, storage = _weight_dtypes(weight_dtype)
    quantized = bool(METHODS[quantization].backend)
    if quantized and storage not in (None, dtype):
        raise ErnieImageError(f"weight_dtype {weight_dtype} and quantization {quantization} are two ways of storing "
                              "the DiT's weights: pick one (set the other to default / none).")
    device = torch_device()
    dit = load_quantized_dit(
        # A quantization method starts from the compute dtype's weights, also when the file holds fp8 ones.
        lambda: load_dit(path, dtype, dtype if quantized else storage, load_device=device),
        quantization,
        source=path,
        dtype=dtype,
        device=device,
        free_memory=usable_memory,
        cache_root=Path(folder_paths.models_dir) / "ernie_quantized",  # where SVDQuant DiTs are saved
    )
    # cache-dit's W4A4 kernels and core's mixed-precision layers under torch.compile are unverified (no GPU here
    # runs the first; the second has not run on one): those stay eager unless ErnieImageCompile asks.
    compiles = (compiles_by_default(device) and not quantization.startswith("svdq")
                and not getattr(dit, "quant_formats", None))
    # Compiled blocks need their weights on the GPU: where the whole DiT fits there, core's classic patcher keeps
    # it so (as core's compile node demotes a dynamic model); elsewhere core's own choice streams it.
    resident = disable_dynamic or (compiles and fits_whole(module_bytes(dit), device))
    patcher = make_model_patcher(dit, shift, whole=quantized, resident=resident)
    patcher.cached_patcher_init = (_load_model, (path, weight_dtype, quantization, shift))
    return compile_by_default(patcher) if compiles else patcher


def _weight_inputs() -> list:
    return [
        io.Combo.Input("weight_dtype", options=list(WEIGHT_DTYPES), default="default",
                       tooltip="default: bf16 on GPUs that run it well, fp32 on the CPU; an fp8 file stays fp8. "
                       "fp8_*: the blocks' weights stored in fp8 (half of bf16's memory), cast to bf16 as each "
                       "layer runs."),
        io.Combo.Input("quantization", options=QUANTIZATION_METHODS, default="none",
                       tooltip="Quantize the DiT's block linear layers at load time. fp8_per_row: RTX 40, H100/H200, "
                       "Blackwell (needs torchao; weights 16 → 8 GB). int8_weight_only: any NVIDIA GPU (needs "
                       "torchao). svdq_*: SVDQuant W4A4 on A100, RTX 30/40/50 with the cache-dit-cu13 build; "
                       "minutes the first time, then reloaded from models/ernie_quantized. See the README."),
    ]


class ErnieImageLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="ErnieImageLoader",
            display_name="ERNIE-Image Loader (snapshot)",
            category="ERNIE-Image/loaders",
            description="Loads a Hugging Face ERNIE-Image snapshot from models/diffusers: DiT, text encoder, VAE "
            "and, when the snapshot has one, the Prompt Enhancer. Samples like diffusers (shift 4.0, text mask).",
            inputs=[
                io.Combo.Input("model_name", options=snapshot_names(),
                               tooltip="A snapshot folder under models/diffusers (baidu/ERNIE-Image(-Turbo))."),
                *_weight_inputs(),
                text_encoder_device_input("text_encoder_device"),
            ],
            outputs=[
                io.Model.Output(),
                ErnieTextEncoderType.Output(display_name="TEXT_ENCODER"),
                io.Vae.Output(),
                ErniePEType.Output(display_name="PE"),
            ],
        )

    @classmethod
    def validate_inputs(cls, model_name: str) -> bool | str:
        return check_choice(model_name, snapshot_names(), "diffusers")

    @classmethod
    def execute(cls, model_name: str, weight_dtype: str = "default", quantization: str = "none",
                text_encoder_device: str = "default") -> io.NodeOutput:
        snapshot = snapshot_path(model_name)
        model = _load_model(snapshot, weight_dtype, quantization, snapshot_shift(snapshot))
        return io.NodeOutput(
            model,
            ManagedTextEncoder.from_snapshot(snapshot, text_encoder_device),
            load_snapshot_vae(snapshot),
            snapshot_pe(snapshot),
        )


def _dit_choices() -> list[str]:
    return safetensors_names("diffusion_models") + [SNAPSHOT_PREFIX + n for n in snapshot_names()]


class ErnieImageDiTLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        options = _dit_choices()
        return io.Schema(
            node_id="ErnieImageDiTLoader",
            display_name="ERNIE-Image DiT Loader",
            category="ERNIE-Image/loaders",
            description="Loads the ERNIE-Image diffusion transformer from models/diffusion_models (the ComfyUI "
            "repack) or from a snapshot folder's transformer/ (listed as diffusers/<name>).",
            inputs=[
                io.Combo.Input("model_name", options=options,
                               tooltip="ernie-image(-turbo).safetensors, or diffusers/<snapshot folder>."),
                *_weight_inputs(),
            ],
            outputs=[io.Model.Output()],
        )

    @classmethod
    def validate_inputs(cls, model_name: str) -> bool | str:
        return check_choice(model_name, _dit_choices(), "diffusion_models")

    @classmethod
    def execute(cls, model_name: str, weight_dtype: str = "default", quantization: str = "none") -> io.NodeOutput:
        if model_name.startswith(SNAPSHOT_PREFIX):
            snapshot = snapshot_path(model_name[len(SNAPSHOT_PREFIX):])
            return io.NodeOutput(_load_model(snapshot, weight_dtype, quantization, snapshot_shift(snapshot)))
        path = model_file_path("diffusion_models", model_name)
        return io.NodeOutput(_load_model(path, weight_dtype, quantization, DEFAULT_SHIFT))


class ErnieImageScheduler(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="ErnieImageScheduler",
            display_name="ERNIE-Image Scheduler",
            category="ERNIE-Image",
            description="The exact sigmas of diffusers' ErnieImagePipeline: shift applied to linspace(1, 0, steps+1). "
            "Turbo: 8 steps; Base: 50 steps.",
            inputs=[
                io.Model.Input("model", tooltip="The model to sample (orders this node after the loader, like "
                               "core's BasicScheduler)."),
                io.Int.Input("steps", default=8, min=1, max=1000),
                io.Float.Input("shift", default=DEFAULT_SHIFT, min=0.01, max=100.0, step=0.01,
                               tooltip="4.0 is ERNIE-Image's trained shift (ComfyUI's native ERNIE uses 3.0)."),
            ],
            outputs=[io.Sigmas.Output()],
        )

    @classmethod
    def execute(cls, model, steps: int, shift: float) -> io.NodeOutput:
        return io.NodeOutput(reference_sigmas(steps, shift))


class ErnieImageVAELoader(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="ErnieImageVAELoader",
            display_name="ERNIE-Image VAE Loader",
            category="ERNIE-Image/loaders",
            description="Loads the Flux.2 VAE file (flux2-vae.safetensors) for ERNIE-Image latents with the trained "
            "batch-norm epsilon, so it decodes exactly as diffusers does (core's VAE Loader assumes 1e-4).",
            inputs=[io.Combo.Input("vae_name", options=safetensors_names("vae"), tooltip="A file in models/vae.")],
            outputs=[io.Vae.Output()],
        )

    @classmethod
    def validate_inputs(cls, vae_name: str) -> bool | str:
        return check_choice(vae_name, safetensors_names("vae"), "vae")

    @classmethod
    def execute(cls, vae_name: str) -> io.NodeOutput:
        return io.NodeOutput(load_vae(model_file_path("vae", vae_name)))


DIT_NODES = [ErnieImageLoader, ErnieImageDiTLoader, ErnieImageScheduler, ErnieImageVAELoader]
