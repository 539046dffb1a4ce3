"""The DiT loaders, where the features meet: the DiT with its load-time quantization and its default compile, and
the all-in-one snapshot loader with the text encoder, VAE and Prompt Enhancer (schemas and plumbing only)."""

from __future__ import annotations

import logging
from pathlib import Path

import folder_paths
from comfy_api.v0_0_2 import io

from .accel.compile import compiles_by_default, fp8_cast_problem
from .accel.patching import compile_by_default
from .choices import DIT_MODELS, FROM_SNAPSHOT, SNAPSHOT_MODELS, SNAPSHOTS
from .dit.build import dit_skeleton, load_dit
from .dit.gguf import gguf_dtype, load_gguf_dit
from .dit.model import make_model_patcher
from .dit.precision import WEIGHT_DTYPES, asked_dtypes
from .dit.schedule import DEFAULT_SHIFT, snapshot_shift
from .dit.vae import load_snapshot_vae
from .dit.weights import tensor_locations
from .gguf.dequant import BLOCK_TYPE_NAMES
from .host.memory import capacity, fits_whole, torch_device, usable_memory
from .host.sizes import module_bytes
from .model_files import is_gguf
from .pe.nodes import pe_file_input, pe_weight_dtype_input, snapshot_pe
from .plan import session
from .plan.records import DIT, RESIDENT
from .quant.capability import METHODS, cuda_arch, halving_method, probe
from .quant.choice import AUTO, choose, fp8_bytes
from .quant.quantize import load_quantized_dit
from .sockets import ErniePEType, ErnieTextEncoderType
from .text.nodes import (
    TEXT_ENCODER_FILE_MODELS,
    load_text_encoder,
    text_encoder_device_input,
    text_encoder_file_input,
    text_encoder_weight_dtype_input,
)


def _planned(quantization: str, weight_dtype: str) -> tuple[str, str]:
    """``auto`` as the graph's memory plan resolves it (its DiT form's ``quantization/weight_dtype``)."""
    if quantization != AUTO or session.place(DIT) is None:
        return quantization, weight_dtype
    planned, planned_dtype = session.form_setting(DIT, AUTO, f"{AUTO}/{weight_dtype}").split("/")
    logging.info("ERNIE-Image: quantization auto follows the memory plan: %s with weight_dtype %s", planned,
                 planned_dtype)
    return planned, planned_dtype


def _load_model(path: Path, weight_dtype: str, quantization: str, shift: float, disable_dynamic: bool = False):
    """The DiT at ``path`` as a MODEL, quantized at load when asked (a method that cannot run here fails first).

    ``disable_dynamic``: on core's classic patcher also where the core streams models with dynamic VRAM (core's
    compile node asks so through ``cached_patcher_init`` when it demotes a model to compile it)."""
    device = torch_device()
    if quantization == AUTO and is_gguf(path):
        quantization = "none"  # a GGUF file is quantized already: auto keeps it as it is
    quantization, weight_dtype = _planned(quantization, weight_dtype)
    if quantization == AUTO:  # no plan here (a flag or device that fixes placement): the rule for this GPU
        choice = choose(probe(device), capacity(device), fp8_bytes(path), weight_dtype)
        logging.info("ERNIE-Image: quantization auto chose %s with weight_dtype %s: %s", choice.quantization,
                     choice.weight_dtype, choice.why)
        quantization, weight_dtype = choice.quantization, choice.weight_dtype
    method = METHODS[quantization]
    if is_gguf(path):  # quantized already: the loader's quantization methods do not apply
        dit = load_gguf_dit(path, gguf_dtype(weight_dtype, quantization))
        dit.source = str(path)  # named should its weights make a NaN image
    else:
        dtype, storage = asked_dtypes(weight_dtype, quantization, method.quantizes)
        dit = load_quantized_dit(
            lambda: load_dit(path, dtype, storage, load_device=device),
            quantization,
            source=path,
            locate=tensor_locations,
            skeleton=lambda: dit_skeleton(path, dtype),
            dtype=dtype,
            device=device,
            free_memory=usable_memory,
            cache_root=Path(folder_paths.models_dir) / "ernie_quantized",  # where quantized DiTs are saved
        )
    # Read back by the out-of-memory advice (dit/model.py ``memory_choices``), which cannot see the quant feature:
    # the method in use (auto's choice where auto was asked), and the one that would halve the DiT on this GPU.
    dit.quantization, dit.quantize_to = quantization, halving_method(cuda_arch(device))
    if dit.gguf_types:
        dit.quantization, dit.quantize_to = "GGUF", None  # quantized in its file: no loader method applies
    # Core's mixed-precision layers under torch.compile are unverified (they have not run on a GPU): a file held in
    # them stays eager unless ErnieImageCompile asks, as do the methods that say so. A GGUF DiT compiles (its decode
    # fused by inductor). Blocks stored in fp8 compile only where Triton converts fp8 (sm89+).
    compiles = (compiles_by_default(device) and method.compiles and not dit.quant_formats
                and fp8_cast_problem(dit.layers, device) is None)
    # Compiled blocks need their weights on the GPU: where the whole DiT fits there, core's classic patcher keeps
    # it so (as core's compile node demotes a dynamic model); elsewhere core's own choice streams it.
    planned = session.place(DIT)
    resident = disable_dynamic or (compiles and (planned == RESIDENT if planned else fits_whole(module_bytes(dit),
                                                                                                device)))
    patcher = make_model_patcher(dit, shift, whole=method.loads_whole, resident=resident)
    patcher.cached_patcher_init = (_load_model, (path, weight_dtype, quantization, shift))
    return compile_by_default(patcher) if compiles else patcher


def _weight_inputs() -> list:
    return [
        io.Combo.Input("weight_dtype", options=list(WEIGHT_DTYPES), default="default",
                       tooltip="default: bf16 on GPUs that run it well, fp32 on the CPU; an fp8 file stays fp8. "
                       "fp8_*: the blocks' weights stored in fp8 (half of bf16's memory), cast to bf16 as each "
                       "layer runs."),
        io.Combo.Input("quantization", options=[AUTO, *METHODS], default=AUTO,
                       tooltip="Quantize the DiT's block linear layers at load time. auto: what the memory plan "
                       "picks for this card and the whole graph (the log states the plan): on RTX 40/50 fp8_per_row "
                       "where the FP8 DiT stays on the card beside the rest, else fp8 storage that ComfyUI streams; "
                       "a GGUF file stays as it is. fp8_per_row: RTX 40, H100/H200, "
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
                SNAPSHOT_MODELS.input("model_name", tooltip="A snapshot folder under models/diffusers "
                                      "(baidu/ERNIE-Image(-Turbo)), listed as diffusers/<folder>."),
                *_weight_inputs(),
                text_encoder_device_input("text_encoder_device"),
                text_encoder_weight_dtype_input("text_encoder_weight_dtype"),
                pe_weight_dtype_input("pe_weight_dtype"),
                text_encoder_file_input("text_encoder"),
                pe_file_input("prompt_enhancer"),
            ],
            outputs=[
                io.Model.Output(),
                ErnieTextEncoderType.Output(display_name="TEXT_ENCODER"),
                io.Vae.Output(),
                ErniePEType.Output(display_name="PE"),
            ],
            hidden=[io.Hidden.prompt],
        )

    @classmethod
    def validate_inputs(cls, model_name: str) -> bool | str:
        return SNAPSHOT_MODELS.check(model_name)

    @classmethod
    def execute(cls, model_name: str, weight_dtype: str = "default", quantization: str = AUTO,
                text_encoder_device: str = AUTO, text_encoder_weight_dtype: str = AUTO,
                pe_weight_dtype: str = AUTO, text_encoder: str = FROM_SNAPSHOT,
                prompt_enhancer: str = FROM_SNAPSHOT) -> io.NodeOutput:
        resolved = SNAPSHOT_MODELS.resolve(model_name)
        snapshot = resolved.path
        session.plan_for_node(cls)
        model = _load_model(snapshot, weight_dtype, quantization, snapshot_shift(snapshot))
        encoder = resolved if text_encoder == FROM_SNAPSHOT else TEXT_ENCODER_FILE_MODELS.resolve(text_encoder)
        return io.NodeOutput(
            model,
            load_text_encoder(encoder, text_encoder_device, text_encoder_weight_dtype),
            load_snapshot_vae(snapshot),
            snapshot_pe(snapshot, pe_weight_dtype, prompt_enhancer),
        )


class ErnieImageDiTLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="ErnieImageDiTLoader",
            display_name="ERNIE-Image DiT Loader",
            category="ERNIE-Image/loaders",
            description="Loads the ERNIE-Image diffusion transformer from models/diffusion_models (the ComfyUI "
            f"repack, or a GGUF file: {BLOCK_TYPE_NAMES}) or from a snapshot folder's transformer/ (listed as "
            "diffusers/<name>).",
            inputs=[
                DIT_MODELS.input("model_name", tooltip="diffusion_models/ernie-image(-turbo).safetensors, a GGUF of "
                                 "it (diffusion_models/<name>.gguf: its layers stay 4 to 8 bits and are decoded as "
                                 "they run; quantization must be none), or diffusers/<snapshot folder>."),
                *_weight_inputs(),
            ],
            outputs=[io.Model.Output()],
            hidden=[io.Hidden.prompt],
        )

    @classmethod
    def validate_inputs(cls, model_name: str) -> bool | str:
        return DIT_MODELS.check(model_name)

    @classmethod
    def execute(cls, model_name: str, weight_dtype: str = "default", quantization: str = AUTO) -> io.NodeOutput:
        model = DIT_MODELS.resolve(model_name)
        session.plan_for_node(cls)
        shift = snapshot_shift(model.path) if model.folder == SNAPSHOTS.folder else DEFAULT_SHIFT
        return io.NodeOutput(_load_model(model.path, weight_dtype, quantization, shift))


LOADER_NODES = [ErnieImageLoader, ErnieImageDiTLoader]
