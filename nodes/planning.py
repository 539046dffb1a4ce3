"""The memory plan of the graph being run: its models read off the prompt, their records off the files' headers, the
card off the core, the costs off the probe, then ``plan.planner``; registered in ``plan.session`` for every loader.

The prompt is ComfyUI's API-format graph, which each loader gets as a hidden input: the plan counts every model the
graph will use (a PE the graph runs later, a LoRA further down), not only those loaded so far. Only literal widget
values are read; a linked value counts as the loader's default (``auto``). A model whose name does not resolve is
left out: its loader says what is wrong when it runs.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from .accel.compile import compiles_by_default
from .choices import DIT_MODELS, FROM_SNAPSHOT, SNAPSHOT_MODELS, SNAPSHOTS
from .dit.model import ErnieImageConfig
from .dit.vae import decode_memory
from .errors import ErnieImageError
from .gguf.dequant import BLOCKS, bytes_per_value
from .gguf.reader import read_gguf
from .host.memory import torch_device
from .host.plan import (
    host_room,
    pinnable,
    placement_fixed,
    step_estimate,
    total_memory,
    usable_for_models,
    working_floor,
)
from .host.probe import costs_here
from .host.sampling import Interrupted
from .ministral_file import IGNORED, LM_HEADS
from .ministral_gguf import held_bytes
from .model_files import is_gguf, read_folder_headers, read_header
from .paths import model_file_path
from .pe.locate import PE_FILE_MODELS, pe_path
from .plan import session
from .plan.describe import (
    Tensor,
    dit_record,
    dominant_gguf_type,
    gguf_tensor,
    language_model_record,
    lora_set,
    safetensors_tensor,
    vae_record,
)
from .plan.planner import GIB, BelowFloor, Card, Plan, plan
from .plan.records import (
    CPU,
    DIT,
    LOADED,
    PER_PROMPT,
    PROMPT_ENHANCER,
    RESIDENT,
    SET,
    TEXT_ENCODER,
    VAE,
    LoadRecord,
    LoraSet,
)
from .plan.session import AUTO
from .quant.capability import FP8_MIN_ARCH, probe
from .quant.saved import weight_files
from .text.nodes import TEXT_ENCODER_FILE_MODELS, TEXT_ENCODER_MODELS

LATENT_1024 = (1, 128, 64, 64)
# The plan may stream the text encoder through the GPU layer by layer (first run on the H200 on 2026-12-05: emulated
# 6-11 GB cards, 2.9 GB copied per prompt, the encode 0.1-0.5 s, no error; bench/RESULTS.md). Set to "off", the
# variable leaves the text encoder to core's places (resident, per prompt, CPU).
STREAM_TEXT_ENCODER_ENV = "ERNIE_IMAGE_STREAM_TEXT_ENCODER"
DEFAULT_PE_TOKENS = 512


@dataclass(frozen=True)
class Wanted:
    """The graph's models as its loaders name them, and the prompt's size: what a plan is made of."""

    dit: tuple[Path, str, str] | None = None  # path, quantization, weight_dtype
    text: tuple[Path, bool, str, str] | None = None  # path, a snapshot, device, weight_dtype
    pe: tuple[Path, str, str] | None = None  # path, device, weight_dtype
    vae: Path | None = None
    loras: tuple[Path, ...] = ()
    latent: tuple[int, ...] = LATENT_1024
    steps: int = 8
    forwards: int = 1  # per step: 2 where CFG runs cond and uncond
    pe_tokens: int = DEFAULT_PE_TOKENS


def _value(inputs: Mapping, name: str, default):
    """A literal widget value of the prompt; the loader's default for a link or anything but a plain scalar (a shared
    workflow's values are checked only when their node runs: here they are only read)."""
    value = inputs.get(name, default)
    return value if isinstance(value, str | int | float | bool) else default


def _resolved(model_list, name) -> tuple[str, Path] | None:
    if not isinstance(name, str):
        return None
    try:
        model = model_list.resolve(name)
    except (ErnieImageError, OSError, ValueError):
        return None
    return model.folder, model.path


def _linked(prompt: Mapping, node: str, slot: int) -> bool:
    return any(value == [node, slot] for other in prompt.values() if isinstance(other, Mapping)
               for value in (other.get("inputs") or {}).values())


def wanted(prompt: Mapping) -> Wanted:
    """The models and sizes the API-format ``prompt`` asks for."""
    found: dict = {"loras": []}
    for node, entry in prompt.items():
        if not isinstance(entry, Mapping):
            continue
        kind, inputs = entry.get("class_type"), entry.get("inputs") or {}
        if not isinstance(inputs, Mapping):
            continue
        name = _value(inputs, "model_name", None)
        if kind == "ErnieImageLoader" and (model := _resolved(SNAPSHOT_MODELS, name)):
            snapshot = model[1]
            found["dit"] = (snapshot, _value(inputs, "quantization", AUTO), _value(inputs, "weight_dtype", "default"))
            text = (snapshot, True)
            chosen = _value(inputs, "text_encoder", FROM_SNAPSHOT)
            if chosen != FROM_SNAPSHOT and (file := _resolved(TEXT_ENCODER_FILE_MODELS, chosen)):
                text = (file[1], False)  # a file of models/text_encoders instead of the snapshot's
            found["text"] = (*text, _value(inputs, "text_encoder_device", AUTO),
                             _value(inputs, "text_encoder_weight_dtype", AUTO))
            found.setdefault("vae", snapshot / "vae" / "diffusion_pytorch_model.safetensors")
            pe = snapshot / "pe"
            chosen = _value(inputs, "prompt_enhancer", FROM_SNAPSHOT)
            if chosen != FROM_SNAPSHOT:  # a PE of models/text_encoders instead of the snapshot's
                file = _resolved(PE_FILE_MODELS, chosen)
                pe = file[1] if file else None
            if _linked(prompt, node, 3) and pe is not None and pe.exists():
                found["pe"] = (pe, "default", _value(inputs, "pe_weight_dtype", AUTO))
        elif kind == "ErnieImageDiTLoader" and (model := _resolved(DIT_MODELS, name)):
            found["dit"] = (model[1], _value(inputs, "quantization", AUTO), _value(inputs, "weight_dtype", "default"))
        elif kind == "ErnieImageTextEncoderLoader" and (model := _resolved(TEXT_ENCODER_MODELS, name)):
            found["text"] = (model[1], model[0] == SNAPSHOTS.folder, _value(inputs, "device", AUTO),
                             _value(inputs, "weight_dtype", AUTO))
        elif kind == "ErnieImagePELoader" and isinstance(name, str):
            try:
                found["pe"] = (pe_path(name), _value(inputs, "device", AUTO), _value(inputs, "weight_dtype", AUTO))
            except (ErnieImageError, OSError, ValueError):
                pass
        elif kind in ("ErnieImageVAELoader", "VAELoader") and isinstance(inputs.get("vae_name"), str):
            found["vae"] = _file("vae", inputs["vae_name"].removeprefix("vae/"))
        elif kind in ("ErnieImageLoraLoader", "LoraLoaderModelOnly", "LoraLoader"):
            strength = _value(inputs, "strength_model", 1.0)
            if isinstance(inputs.get("lora_name"), str) and strength != 0:
                found["loras"].append(_file("loras", inputs["lora_name"]))
        elif kind in ("EmptyFlux2LatentImage", "EmptySD3LatentImage", "EmptyLatentImage"):
            width, height = _value(inputs, "width", 1024), _value(inputs, "height", 1024)
            batch = _value(inputs, "batch_size", 1)
            if all(isinstance(v, int) and v > 0 for v in (width, height, batch)):
                found["latent"] = (batch, 128, max(height // 16, 1), max(width // 16, 1))
        elif kind in ("ErnieImageScheduler", "BasicScheduler", "KSampler", "KSamplerAdvanced"):
            steps = _value(inputs, "steps", 8)
            if isinstance(steps, int) and steps > 0:
                found["steps"] = steps
        if kind in ("KSampler", "KSamplerAdvanced", "CFGGuider", "SamplerCustom"):
            cfg = _value(inputs, "cfg", 1.0)
            found["forwards"] = 2 if isinstance(cfg, int | float) and cfg != 1.0 else 1
        if kind == "ErnieImagePromptEnhance":
            tokens = _value(inputs, "max_new_tokens", DEFAULT_PE_TOKENS)
            found["pe_tokens"] = tokens if isinstance(tokens, int) and tokens > 0 else DEFAULT_PE_TOKENS
    found["loras"] = tuple(p for p in found["loras"] if p is not None)
    return Wanted(**found)


def _file(folder: str, name: str) -> Path | None:
    try:
        path = model_file_path(folder, name)
    except (ErnieImageError, OSError, ValueError):
        return None
    return path if path.is_file() else None


def _stamp(path: Path) -> tuple:
    try:
        stat = path.stat()
    except OSError:
        return (str(path),)
    return (str(path), stat.st_size, stat.st_mtime_ns)


_READ: dict[tuple, object] = {}


def _cached(path: Path, read):
    """``read(path)``, kept while the file is unchanged: a header is read once, however many plans ask."""
    key = (_stamp(path), read)
    if key not in _READ:
        if len(_READ) > 64:
            _READ.clear()
        _READ[key] = read(path)
    return _READ[key]


def _gguf_tensors(path: Path) -> dict:
    return read_gguf(path).tensors


def _described(path: Path) -> list[Tensor]:
    if is_gguf(path):
        return [gguf_tensor(n, t.shape, t.kind, t.nbytes) for n, t in _cached(path, _gguf_tensors).items()]
    if path.is_dir():
        return [safetensors_tensor(n, i.shape, i.dtype) for n, i in read_folder_headers(path)[0].items()]
    return [safetensors_tensor(n, i.shape, i.dtype) for n, i in read_header(path).items()]


def _tensors(path: Path, keep=lambda name: True) -> list[Tensor]:
    """The tensors of a safetensors file, a folder of shards or a GGUF file, from their headers (kept per file)."""
    return [t for t in _cached(path, _described) if keep(t.name)]


def _language_model(name: str, lm_head: bool) -> bool:
    """A tensor of the language model (not a vision tower's); the output head only for the PE."""
    return not name.startswith(IGNORED) and (lm_head or name not in LM_HEADS)


def _places(device_choice: str, device: torch.device) -> tuple[str, ...] | None:
    """The places an explicit device leaves (None: ``auto``, every place; ``()``: another GPU, not planned here)."""
    if device_choice == AUTO:
        return None
    if device_choice == "cpu":
        return (CPU,)
    if device_choice == "default" or torch.device(device_choice) == device:
        return (RESIDENT, PER_PROMPT, CPU)  # core loads it whole, or runs it on the CPU where it cannot
    return ()


def _pixels(want: Wanted) -> float:
    """The prompt's images' pixels against one 1024² image's: what the DiT's steps and the decode scale with."""
    return want.latent[0] * want.latent[-2] * want.latent[-1] / (LATENT_1024[-2] * LATENT_1024[-1])


def _dit(want: Wanted, device: torch.device, floor: int) -> LoadRecord:
    path, quantization, weight_dtype = want.dit
    gguf = is_gguf(path)
    tensors = _tensors(path) if gguf else [t for f in weight_files(path) if f.suffix == ".safetensors"
                                           for t in _tensors(f)]
    facts = probe(device)
    compiles = compiles_by_default(device)
    # An explicit setting, or under auto the form its loader made already (ComfyUI reuses its output).
    explicit = _dit_setting(quantization, weight_dtype, gguf)
    fixed = explicit or session.held_form(DIT, str(path))
    return dit_record(str(path), tensors, gguf_type=dominant_gguf_type(tensors) if gguf else None,
                      fp8_matmul=facts.torchao and facts.arch is not None and facts.arch >= FP8_MIN_ARCH,
                      runs=want.steps * want.forwards,
                      working=max(floor, step_estimate(ErnieImageConfig, want.latent, torch.bfloat16)),
                      fixed=fixed, fixed_by=SET if explicit else LOADED, compute_scale=_pixels(want),
                      compiles=compiles)


def _dit_setting(quantization: str, weight_dtype: str, gguf: bool) -> str | None:
    """The DiT's explicit setting the plan keeps: ``quantization/weight_dtype`` where ``quantization`` is set; under
    ``auto`` a ``weight_dtype`` other than ``default`` (fp8 storage asked for) with no load-time method; None: the
    plan picks (a GGUF file has its one form)."""
    if gguf:
        return None
    if quantization != AUTO:
        return f"{quantization}/{weight_dtype}"
    return None if weight_dtype == "default" else f"none/{weight_dtype}"


def _language_model_record(role: str, want: Wanted, device: torch.device, floor: int) -> LoadRecord | None:
    if role == TEXT_ENCODER:
        path, snapshot, device_choice, weight_dtype = want.text
        where, lm_head = (path / "text_encoder" if snapshot else path), False
    else:
        path, device_choice, weight_dtype = want.pe
        where, lm_head = path, True
    places = _places(device_choice, device)
    if places == ():
        return None  # on another GPU: not this card's
    streams = role == TEXT_ENCODER and os.environ.get(STREAM_TEXT_ENCODER_ENV, "on").strip().lower() != "off"
    if is_gguf(where):  # what each tensor takes once loaded: blocks as stored, a table the PE reads whole decoded
        file = _cached(where, _gguf_tensors)
        held = ((name, t, held_bytes(name, t, torch.bfloat16, lm_head)) for name, t in file.items())
        tensors = [Tensor(name, t.shape, size, t.kind) for name, t, size in held if size]
    else:
        tensors = _tensors(where, lambda n: _language_model(n, lm_head))
    return language_model_record(
        role, str(path), tensors,
        runs=1 if role == TEXT_ENCODER else want.pe_tokens, working=floor,
        fixed_form=None if weight_dtype == AUTO else weight_dtype, places=places, streams=streams,
        graphed=_pe_graphed(device) if role == PROMPT_ENHANCER else frozenset())


def _pe_graphed(device: torch.device) -> frozenset[str]:
    """The PE forms whose decode runs in CUDA graphs on ``device`` (``pe/local``'s ``auto``): every form on CUDA."""
    return frozenset({"bf16", "fp8"}) if device.type == "cuda" else frozenset()


def records(want: Wanted, device: torch.device) -> tuple[list[LoadRecord], LoraSet | None]:
    """The load records of the graph's models (headers only) and its LoRA set. A model whose files cannot be read
    is left out: its loader says what is wrong when it runs."""
    floor = working_floor()
    makers = []
    if want.dit is not None:
        makers.append(lambda: _dit(want, device, floor))
    if want.text is not None:
        makers.append(lambda: _language_model_record(TEXT_ENCODER, want, device, floor))
    if want.pe is not None:
        makers.append(lambda: _language_model_record(PROMPT_ENHANCER, want, device, floor))
    if want.vae is not None and want.vae.is_file():
        working = max(floor, decode_memory(want.latent, torch.bfloat16) * want.latent[0])
        makers.append(lambda: vae_record(str(want.vae), _tensors(want.vae), working, _pixels(want)))
    found = []
    for make in makers:
        try:
            record = make()
        except (ErnieImageError, OSError):
            continue
        if record is not None:
            found.append(record)
    loras = [p for p in want.loras if p.is_file()]
    try:
        lora = lora_set([p.name for p in loras], [t for p in loras for t in _tensors(p)]) if loras else None
    except (ErnieImageError, OSError):
        lora = None
    return found, lora


_made: dict[tuple, Plan] = {}
_unmeasured: set[str] = set()  # the devices whose probe failed in this process
# The usable memory drifts by what torch caches between stages: a plan is kept until it differs by more than this.
DRIFT = 2**29


def make_plan(prompt: Mapping) -> Plan | None:
    """The plan of ``prompt``'s graph on this card (kept while its models, the costs and, within ``DRIFT``, the
    usable memory stay the same); None where core's placement applies (its words are logged once)."""
    device = torch_device()
    fixed = placement_fixed(device)
    if fixed is not None:
        _say_once(f"ERNIE-Image: {fixed}: models are placed as ComfyUI places them (no memory plan)")
        return None
    if str(device) in _unmeasured:
        return None
    try:
        costs = costs_here(device)
    except Interrupted:
        raise
    except Exception as error:  # a probe that cannot measure here leaves placement to core, and says why once
        # Not measured again at the next node or prompt: each try would take up to the probe's 15 s again.
        _unmeasured.add(str(device))
        _say_once(f"ERNIE-Image: the costs of this GPU could not be measured ({type(error).__name__}: "
                  f"{str(error)[:200]}): models are placed as ComfyUI places them (no memory plan; measured again "
                  "when ComfyUI restarts)", logging.WARNING)
        return None
    if costs is None:
        return None
    want = wanted(prompt)
    usable = usable_for_models(device) - session.short()
    key = (want, costs.key, session.short(), session.held_forms())  # a correction or a DiT loaded plans anew
    kept = _made.get(key)
    if kept is not None and abs(kept.card.usable - usable) <= DRIFT:
        return kept
    try:
        found, lora = records(want, device)
        made = plan(found, Card(usable, pinnable(), host_room()), costs, lora) if found else None
    except BelowFloor as below:
        raise ErnieImageError(below_floor_words(below, usable, total_memory(device) - usable, found)) from below
    except Interrupted:
        raise
    except Exception:  # a fault of the plan itself must not stop the prompt: core places the models, as before
        logging.warning("ERNIE-Image: the memory plan failed; models are placed as ComfyUI places them",
                        exc_info=True)
        return None
    if made is None:
        return None
    if all(kept.line() != made.line() for kept in _made.values()):  # the same plan again (a DiT loaded) is not news
        logging.info("ERNIE-Image: %s", made.line())
        if made.over_host:
            logging.warning("ERNIE-Image: these models need more host RAM than this machine has free, so the system "
                            "may swap and prompts slow down many times over: close programs, or use smaller files "
                            "(a GGUF DiT, the text encoder in fp8 or as a GGUF)")
    _made.clear()
    _made[key] = made
    return made


_said: set[str] = set()


def _say_once(words: str, level: int = logging.INFO) -> None:
    if words not in _said:
        _said.add(words)
        logging.log(level, words)


def below_floor_words(below: BelowFloor, usable: int, overhead: int, found: list[LoadRecord]) -> str:
    """Below the floor: the smallest card these files can serve (what they need, with ``overhead``: what this card
    keeps from models now, its CUDA context, core's reserve and other programs), what sets that floor, and what
    lowers it. The stage that needs the most sets it: the VAE's decode (its working memory grows with the image's
    pixels; no smaller file lowers it), or the DiT's sampling (its working memory, and the one block that passes
    through the card: a smaller GGUF has smaller blocks)."""
    card = (below.needed + overhead) / GIB
    words = (f"These models need at least {below.needed / GIB:.1f} GiB of GPU memory for ComfyUI's models (with every "
             f"part that can stream streamed); this GPU has {usable / GIB:.1f} GiB usable now, so the smallest card "
             f"they can serve is about {card:.1f} GiB with what this one keeps from models now (other programs, the "
             "CUDA context, ComfyUI's reserve). Close programs that use the GPU")
    stage = f"{below.stage_bytes / GIB:.1f} GiB"
    if below.stage == VAE:
        return (f"{words}, or make a smaller image: the VAE's decode of this image size needs {stage} by itself, "
                "and no smaller file lowers that.")
    dit = next((r for r in found if r.role == DIT), None)
    if below.stage != DIT or dit is None:
        return f"{words}."
    words += f", or make a smaller image (the DiT's sampling of this image size needs {stage})"
    gguf = next((f.gguf_type for f in dit.forms if f.gguf_type), None)
    if gguf is None:
        return (f"{words}, or download a GGUF of the DiT (the community's Q4_K_M, 5.2 GB) into "
                "models/diffusion_models, with the ernie_image_turbo_gguf workflow: its blocks pass through the card "
                "one at a time.")
    # The two smallest types the pack reads below the file's (``BLOCKS`` goes from the most bits to the fewest).
    smaller = [t for t in BLOCKS if bytes_per_value(t) < bytes_per_value(gguf)][-2:]
    if not smaller:
        return f"{words}."
    files = " or ".join({"Q3_K": "Q3_K_M"}.get(t, t) for t in smaller)  # as the community's files are named
    return (f"{words}, or download a smaller GGUF of the DiT ({files}) into models/diffusion_models: its blocks pass "
            "through the card one at a time.")


session.register(make_plan)
