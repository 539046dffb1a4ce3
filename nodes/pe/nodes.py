"""Prompt Enhancer nodes: a local PE loader, a remote PE, and the enhance node (schemas and plumbing only).

Every handle made here runs on ComfyUI's host (``ComfyRuntime``): its model management, interrupt and progress bar.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any

import folder_paths
from comfy_api.v0_0_2 import io, ui

from ..choices import FROM_SNAPSHOT
from ..host.memory import device_options
from ..inputs import lm_weight_dtype_input, wants_fp8
from ..model_files import is_gguf
from ..plan import session
from ..plan.records import CPU, PROMPT_ENHANCER
from ..plan.session import AUTO
from ..sockets import ErniePEType
from .cache import CACHE_MODES, ResultCache, enhance_cached
from .comfy_runtime import ComfyRuntime
from .local.enhancer import DTYPES, LocalPromptEnhancer
from .locate import PE_FILE_MODELS, PE_MODELS, pe_path
from .protocol import (
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_P,
    EnhancerError,
    PromptSpec,
    SamplingParams,
)
from .remote.enhancer import RemotePromptEnhancer


def pe_weight_dtype_input(name: str) -> io.Combo.Input:
    """The local PE's weight storage (the PE loader's and the all-in-one loader's): optional, last."""
    return lm_weight_dtype_input(name, "prompt enhancer", "It saves memory, not time, and the enhanced text may "
                                 "differ a little from bf16's.")


class ErnieImagePELoader(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="ErnieImagePELoader",
            display_name="ERNIE-Image Prompt Enhancer Loader",
            category="ERNIE-Image/loaders",
            description="The local Prompt Enhancer (a 3B Ministral 3 LM). Weights load on first use and are managed "
            "like any ComfyUI model (offloaded when memory is needed, unloaded by Free memory).",
            inputs=[
                PE_MODELS.input("model_name", tooltip="diffusers/<snapshot> (its pe/ and pe_tokenizer/), or a PE "
                                "folder, ernie-image-prompt-enhancer.safetensors or a GGUF PE (llama.cpp's "
                                "converter) under models/text_encoders."),
                io.Combo.Input("device", options=[AUTO, *device_options()], default=AUTO,
                               tooltip="auto: where the memory plan puts it for this card and the whole graph (the "
                               "GPU, loaded for its stage or kept there, or the CPU; the log states the plan). "
                               "default: ComfyUI's GPU. Another GPU keeps the PE beside the DiT."),
                io.Combo.Input("dtype", options=["auto", *DTYPES], default="auto",
                               tooltip="auto: as ComfyUI's text encoders: bf16 on GPUs that compute in it (NVIDIA from "
                               "Ampere on), float32 elsewhere (the CPU, older GPUs)."),
                pe_weight_dtype_input("weight_dtype"),
            ],
            outputs=[ErniePEType.Output(display_name="PE")],
            hidden=[io.Hidden.prompt],
        )

    @classmethod
    def validate_inputs(cls, model_name: str) -> bool | str:
        return PE_MODELS.check(model_name)

    @classmethod
    def execute(cls, model_name: str, device: str = AUTO, dtype: str = "auto",
                weight_dtype: str = AUTO) -> io.NodeOutput:
        session.plan_for_node(cls)
        follows = device == AUTO and session.place(PROMPT_ENHANCER) is not None
        return io.NodeOutput(_pe_file(pe_path(model_name), weight_dtype, "weight_dtype", device=_planned_device(device),
                                      dtype=dtype, follows_plan=follows, form_follows_plan=weight_dtype == AUTO))


class ErnieImagePERemote(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="ErnieImagePERemote",
            display_name="ERNIE-Image Prompt Enhancer (remote)",
            category="ERNIE-Image/loaders",
            description="A Prompt Enhancer served by vLLM, SGLang or any OpenAI-compatible server "
            "(POST /v1/chat/completions). Nothing is contacted until a prompt is enhanced.",
            inputs=[
                io.String.Input("base_url", default="http://127.0.0.1:8000",
                                tooltip="The API root, as the OpenAI client's base_url: http(s)://host:port and an "
                                "optional path prefix (/v1, /llm/lmapi/v3); a bare host means its /v1. No query, "
                                "fragment or user:password. Redirects are not followed."),
                io.String.Input("model", default="", tooltip="Empty: the first model the server lists."),
                io.String.Input("api_key_env", default="",
                                tooltip="Empty: no key. Otherwise ERNIE_PE_API_KEY or ERNIE_PE_API_KEY_<NAME>: the "
                                "NAME of an environment variable holding the key (never the key: workflows are "
                                "saved in images and shared). The key is sent only to the server whose address is in "
                                "<that name>_URL, also set in the environment; any other name or server is refused."),
                io.Float.Input("timeout_s", default=120.0, min=1.0, max=3600.0, step=1.0,
                               tooltip="Seconds for one request as a whole: connecting and the entire answer."),
                io.Int.Input("max_retries", default=3, min=0, max=10,
                             tooltip="Retries on connection errors, timeouts, 408, 429 and 5xx (backoff, jitter)."),
            ],
            outputs=[ErniePEType.Output(display_name="PE")],
        )

    @classmethod
    def execute(cls, base_url: str, model: str = "", api_key_env: str = "", timeout_s: float = 120.0,
                max_retries: int = 3) -> io.NodeOutput:
        return io.NodeOutput(RemotePromptEnhancer(base_url, model, api_key_env, timeout_s, max_retries,
                                                  runtime=ComfyRuntime()))


def _pe_file(path: Path, weight_dtype: str, input_name: str, **options) -> LocalPromptEnhancer:
    """The PE at ``path`` (a folder, a safetensors or a GGUF file) on ComfyUI's host, lazy; fp8 asked of a GGUF file
    (its ``input_name``) is refused."""
    if is_gguf(path) and wants_fp8(weight_dtype):
        raise EnhancerError(f"{input_name} {weight_dtype} stores the prompt enhancer's layers in fp8, but {path} is a "
                            "GGUF file, quantized already (its layers stay in their GGUF types and are decoded as "
                            f"they run): set {input_name} to auto or default, or pick the safetensors file.")
    return LocalPromptEnhancer.from_path(path, runtime=ComfyRuntime(), fp8=planned_fp8(weight_dtype), **options)


def snapshot_pe(snapshot: Path, weight_dtype: str = AUTO, choice: str = FROM_SNAPSHOT) -> LocalPromptEnhancer | None:
    """The all-in-one loader's PE on ComfyUI's host, lazy: the snapshot's (None when it has no ``pe/``), or the file
    ``choice`` names (``pe_file_input``). ``weight_dtype``: a value of ``pe_weight_dtype_input``."""
    if choice != FROM_SNAPSHOT:
        return _pe_file(PE_FILE_MODELS.resolve(choice).path, weight_dtype, "pe_weight_dtype")
    return LocalPromptEnhancer.from_snapshot(snapshot, runtime=ComfyRuntime(), fp8=planned_fp8(weight_dtype))


def pe_file_input(name: str) -> io.Combo.Input:
    """The all-in-one loader's PE: the snapshot's, or a file of models/text_encoders; optional, last."""
    return io.Combo.Input(name, options=[FROM_SNAPSHOT, *PE_FILE_MODELS.options()], default=FROM_SNAPSHOT,
                          optional=True, tooltip="snapshot: the snapshot's pe/ (none where it has none). Or a PE of "
                          "models/text_encoders: ernie-image-prompt-enhancer.safetensors, a PE folder, or a GGUF of it "
                          "(llama.cpp's converter; its layers stay 4 to 8 bits and are decoded as they run: for small "
                          "cards).")


def _planned_device(device: str) -> str:
    """The PE loader's ``device`` with ``auto`` as the plan resolves it (ComfyUI's GPU, or the CPU)."""
    if device != AUTO:
        return device
    return "cpu" if session.place(PROMPT_ENHANCER) == CPU else "default"


def planned_fp8(weight_dtype: str) -> bool:
    """Whether the PE's decoder layers are fp8: ``weight_dtype`` (``pe_weight_dtype_input``), ``auto`` as the plan
    resolves it."""
    return wants_fp8(session.form_setting(PROMPT_ENHANCER, weight_dtype, "default"))


@functools.cache
def result_cache() -> ResultCache:
    """The process-wide result cache, persisted in ComfyUI's user directory: in the system user folder
    ``user/__ernie_image/`` where the core has them (ComfyUI serves no ``__`` folder over ``/userdata``; a file left
    in ``user/ernie_image/`` by an earlier version is moved there), else in ``user/ernie_image/`` as before."""
    former = Path(folder_paths.get_user_directory()) / "ernie_image" / "pe_cache.sqlite3"
    system_folder = getattr(folder_paths, "get_system_user_directory", None)  # older cores have none
    if system_folder is None:
        return ResultCache(former)
    return ResultCache(Path(system_folder("ernie_image")) / "pe_cache.sqlite3", former=former)


class ErnieImagePromptEnhance(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="ErnieImagePromptEnhance",
            display_name="ERNIE-Image Prompt Enhance",
            category="ERNIE-Image",
            description="Rewrites a short prompt into the rich description ERNIE-Image was trained on (often in "
            "Chinese). A list of prompts is enhanced in batches that fit the device (local) or concurrently "
            "(remote). Results are cached by everything that changes the text: the backend (weights, template, "
            "dtype, device, decode path; or the server's model and revision), prompt, size, sampling and seed.",
            is_input_list=True,
            inputs=[
                ErniePEType.Input("pe", optional=True, tooltip="From a PE loader, the remote PE or the ERNIE-Image "
                                  "Loader. Not needed when enabled is off."),
                io.String.Input("prompt", multiline=True, default=""),
                io.Int.Input("width", default=1024, min=16, max=8192, step=16, tooltip="The image width."),
                io.Int.Input("height", default=1024, min=16, max=8192, step=16, tooltip="The image height."),
                io.Boolean.Input("enabled", default=True,
                                 tooltip="Off: the prompt passes through untouched and nothing is loaded or called."),
                io.Float.Input("temperature", default=DEFAULT_TEMPERATURE, min=0.0, max=2.0, step=0.01,
                               tooltip="0: greedy. Baidu's recipe: 0.6."),
                io.Float.Input("top_p", default=DEFAULT_TOP_P, min=0.01, max=1.0, step=0.01,
                               tooltip="Nucleus sampling. Baidu's recipe: 0.8."),
                io.Int.Input("max_new_tokens", default=DEFAULT_MAX_NEW_TOKENS, min=1, max=8192,
                             tooltip="Longest enhanced prompt, in tokens; a warning says when a text was cut."),
                io.Int.Input("seed", default=0, min=0, max=2**31 - 1, control_after_generate=True,
                             tooltip="The same seed gives the same text."),
                # Last and optional: workflows saved before it load unchanged and mean "use".
                io.Combo.Input("cache", options=list(CACHE_MODES), default="use", optional=True,
                               tooltip="use: a stored text is reused when everything it depends on is the same; "
                               "refresh: enhance again at every run and replace the stored text; off: neither read "
                               "nor store."),
            ],
            outputs=[io.String.Output(display_name="prompt", is_output_list=True)],
            hidden=[io.Hidden.prompt],
        )

    @classmethod
    def fingerprint_inputs(cls, cache: list[str] | None = None, **inputs) -> Any:
        """refresh: a new value at every run, so that ComfyUI runs the node again instead of reusing its output."""
        return time.time_ns() if cache and cache[0] == "refresh" else ""

    @classmethod
    def execute(cls, prompt: list[str], width: list[int], height: list[int], enabled: list[bool],
                temperature: list[float], top_p: list[float], max_new_tokens: list[int], seed: list[int],
                pe: list | None = None, cache: list[str] | None = None) -> io.NodeOutput:
        count = max(len(prompt), len(width), len(height))
        specs = [PromptSpec(prompt[min(i, len(prompt) - 1)], width[min(i, len(width) - 1)],
                            height[min(i, len(height) - 1)]) for i in range(count)]
        if not enabled[0]:
            texts = [spec.prompt for spec in specs]
        else:
            odd = [f"{spec.width}×{spec.height}" for spec in specs if spec.width % 16 or spec.height % 16]
            if odd:
                raise EnhancerError(f"width and height must be multiples of 16 (got {', '.join(odd)}): ERNIE-Image "
                                    "makes images of such sizes, e.g. 1024×1024, 848×1264 or 1264×848.")
            backend = pe[0] if pe else None
            if backend is None:
                raise EnhancerError("No prompt enhancer is connected (or the snapshot has no pe/ folder): connect "
                                    "an ERNIE-Image PE loader or the remote PE, or turn 'enabled' off.")
            session.plan_for_node(cls)
            if isinstance(backend, LocalPromptEnhancer) and session.place(PROMPT_ENHANCER) is not None:
                backend.follow(_planned_device(AUTO), planned_fp8(AUTO))  # a plan made since its loader ran
            params = SamplingParams(temperature[0], top_p[0], max_new_tokens[0], seed[0])
            mode = cache[0] if cache else "use"
            texts = [c.text for c in enhance_cached(backend, specs, params, result_cache(), mode)]
        return io.NodeOutput(texts, ui=ui.PreviewText("\n\n".join(texts)))


PE_NODES = [ErnieImagePELoader, ErnieImagePERemote, ErnieImagePromptEnhance]
