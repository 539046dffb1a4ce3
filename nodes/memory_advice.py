"""Out-of-memory advice that fits the state (engine: plain Python and torch, no ComfyUI).

A fixed tip misleads: "quantize the DiT (fp8_per_row)" told users on 8 GB cards to do what they had done. Here the
host (``host/oom.py``) describes the moment as plain data (``Shortage``): the device and what was free there, what
ran out (a model to be loaded whole, or a sampling step), and each of the pack's models ComfyUI holds with what its
loaders chose (``PackModel``; each model describes itself, ``ministral_choices`` and ``one_byte_saving`` help).
``advice`` puts that into words: what is chosen, and the first step in ``RANK`` not taken yet whose saving covers
what is missing; where no single step does, the first few that do together, or that the card is too small.

Every saving is bytes on the failing device, measured from the models' tensors (or, for a sampling step, from
ComfyUI's own estimate and the accelerators' own counts), never a size written here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .fp8_linear import DECODER_LINEAR, FP8, FUSED_LINEAR

DIT, TEXT_ENCODER, PROMPT_ENHANCER = "DiT", "text encoder", "Prompt Enhancer"
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
               torch.float8_e4m3fn: "fp8_e4m3fn", torch.float8_e5m2: "fp8_e5m2"}
ONE_BYTE = {torch.float8_e4m3fn, torch.float8_e5m2, torch.int8, torch.uint8}
ROW_SCALE = 4  # bytes: one fp32 scale per output row, as per-row fp8 (fp8_linear, torchao) keeps beside a weight


@dataclass(frozen=True)
class PackModel:
    """One of the pack's models as the advice sees it.

    ``weight_dtype``: its large weights' dtype as named in its loaders (``bf16``, ``fp8_e4m3fn``); ``device``: its
    load device; ``held``: the bytes it holds on the failing device (for the model that failed to load: all it
    needs there). ``fp8_saving``: bytes that fp8 storage of its large linears would free (0: they are one byte
    already). DiT only: ``quantization`` (the loader's input, a key of ``quant.capability.METHODS``),
    ``quantize_to`` (the method that holds its block weights in one byte on its GPU; None where none runs),
    ``quantize_saving`` (what that frees), ``loads_in_part`` (ComfyUI may load part of it and stream the rest),
    ``gguf_saving`` (what a Q4_K_M GGUF of it would free: 0 for a GGUF DiT)."""

    role: str
    size: int
    weight_dtype: str
    device: str = ""
    held: int = 0
    name: str = ""  # its class, as ComfyUI's log names it
    fp8_saving: int = 0
    quantization: str | None = None
    quantize_to: str | None = None
    quantize_saving: int = 0
    loads_in_part: bool = False
    gguf_saving: int = 0


@dataclass(frozen=True)
class Shortage:
    """What ran out on ``device``: ``need`` bytes asked for where ``free`` were free (None: unreadable).

    ``failed``: the model that could not be loaded whole (None: a sampling step ran out); ``held``: the pack's other
    models ComfyUI holds (on any device: their choices are named); ``others``: bytes other models (the VAE, other
    packs') hold on ``device``. Sampling only: ``image`` (width, height in pixels), ``multiple`` (what image sides
    must be a multiple of) and ``accelerators`` (each per-run accelerator on, with the bytes it keeps)."""

    device: str
    free: int | None
    need: int
    failed: PackModel | None = None
    held: tuple[PackModel, ...] = ()
    others: int = 0
    image: tuple[int, int] | None = None
    multiple: int = 1
    accelerators: tuple[tuple[str, int], ...] = ()

    @property
    def models(self) -> tuple[PackModel, ...]:
        return (self.failed, *self.held) if self.failed else self.held

    @property
    def missing(self) -> int | None:
        """Bytes missing on the device (None: unknown; 0 or less: ComfyUI's count said it fit, yet it ran out)."""
        return None if self.free is None else self.need - self.free

    def model(self, role: str) -> PackModel | None:
        return next((m for m in self.models if m.role == role), None)


@dataclass(frozen=True)
class Step:
    """A change the user can make, and the bytes it frees on the failing device. Steps of one ``group`` (one model,
    one accelerator) replace each other: only one of them counts in a combination."""

    group: str
    words: str
    saving: int
    up_to: bool = False  # the saving is the most it frees (ComfyUI keeps as much as fits)


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def one_byte_saving(weights: Iterable[torch.Tensor]) -> int:
    """Bytes freed by holding these 2-D weights in one byte each with a per-row scale (per-row fp8, int8, the
    text models' fp8). Quantized (wrapper) and one-byte weights free nothing: they are there already."""
    saved = 0
    for weight in weights:
        if is_traceable_wrapper_subclass(weight) or weight.dtype in ONE_BYTE or weight.ndim != 2:
            continue
        saved += max(weight.nelement() * (weight.element_size() - 1) - weight.shape[0] * ROW_SCALE, 0)
    return saved


# A Q4_K_M GGUF (the community's 4-bit file) mixes Q4_K and Q6_K blocks: the check's file of the 8B DiT holds its
# linear layers in 4,980 MiB (bench/RESULTS.md), about 5.3 bits a weight; counted here at Q5_K's 176 bytes per 256
# values (gguf's GGML_QUANT_SIZES), 5.5 bits, so that the saving is not overstated.
Q4_K_M_RATE = (256, 176)


def q4_k_m_bytes(weight: torch.Tensor) -> int | None:
    """What a 2-D weight takes in a Q4_K_M GGUF (at its average rate); None where its rows are not whole 256-value
    blocks (GGUF writers keep such a weight in 16 bits)."""
    values, size = Q4_K_M_RATE
    if weight.ndim != 2 or weight.shape[-1] % values:
        return None
    return weight.nelement() // values * size


def ministral_choices(role: str, language_model: torch.nn.Module) -> PackModel:
    """The text encoder or the PE (a Ministral 3 model) as it is held: its bytes, its decoder linears' dtype (fp8
    once ``fp8_linear`` holds them; the PE's stacked gate and up ones too) and what fp8 would free."""
    tensors = [*language_model.parameters(), *language_model.buffers()]
    linears = [t for name, t in language_model.named_parameters()
               if DECODER_LINEAR.match(name) or FUSED_LINEAR.match(name)]
    floating = [t for t in tensors if t.is_floating_point()]
    dtype = FP8 if any(t.dtype == FP8 for t in linears) else (floating[0].dtype if floating else torch.float32)
    return PackModel(role, sum(t.nelement() * t.element_size() for t in tensors), dtype_name(dtype),
                     fp8_saving=one_byte_saving(linears))


def format_bytes(n: int) -> str:
    """Bytes in the unit that shows them (tests' tiny models are KiB; the true ones GiB)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if abs(n) >= scale / 10:
            return f"{n / scale:.1f} {unit}"
    return f"{n / 2**10:.1f} KiB"


# The steps, cheapest for the user first: a cost in quality that is hard to see (fp8 text encoder and PE, fp8 or
# int8 DiT: faster on FP8 tensor cores), then another file (a 4-bit GGUF DiT: as fast on 8 and 12 GB cards as the
# FP8 one on the whole GPU, within 2x), then time only when prompts change (the text encoder on the CPU), then time at
# every prompt (the PE on the CPU), then time at every step (no Cache-DiT, a streamed DiT), and last a different
# picture (a smaller image). ``RANK`` below lists them in that order.

def _fp8_weights(role: str, words: str) -> Callable[[Shortage], Step | None]:
    def step(s: Shortage) -> Step | None:
        model = s.model(role)
        if model is None or not model.held or model.weight_dtype == "fp8_e4m3fn" or not model.fp8_saving:
            return None
        return Step(role, words, model.fp8_saving)
    return step


_text_encoder_fp8 = _fp8_weights(TEXT_ENCODER, "set the text encoder's weight_dtype to fp8_e4m3fn "
                                 "(text_encoder_weight_dtype on the ERNIE-Image Loader): its decoder layers' weights "
                                 "in fp8")
_pe_fp8 = _fp8_weights(PROMPT_ENHANCER, "set the Prompt Enhancer's weight_dtype to fp8_e4m3fn (pe_weight_dtype on the "
                       "ERNIE-Image Loader): its decoder layers' weights in fp8, the enhanced text may differ a little")


def _dit_quantize(s: Shortage) -> Step | None:
    dit = s.model(DIT)
    if dit is None or not dit.held or dit.quantization != "none" or dit.quantize_to is None:
        return None
    # Quantized, the DiT is loaded whole: what it holds then is its size less the saving, whatever part it held.
    saving = dit.held - (dit.size - dit.quantize_saving)
    if saving <= 0:
        return None
    from_plain = " with weight_dtype default" if dit.weight_dtype.startswith("fp8") else ""
    return Step(DIT, f"set the DiT loader's quantization to {dit.quantize_to}{from_plain}: its block weights in one "
                "byte each, loaded whole", saving)


def _dit_gguf(s: Shortage) -> Step | None:
    dit = s.model(DIT)
    if dit is None or not dit.held or not dit.gguf_saving or not dit.size:
        return None
    # A GGUF DiT loads in part as the bf16 one does: ComfyUI would hold the same share of it.
    return Step(DIT, "load a Q4_K_M GGUF of the DiT instead (a .gguf file in models/diffusion_models/, in the "
                "ERNIE-Image DiT Loader, quantization none; the ernie_image_turbo_gguf workflow): its block weights "
                "at 4 to 6 bits, decoded as each layer runs", dit.held * dit.gguf_saving // dit.size)


def _off_the_gpu(role: str, words: str) -> Callable[[Shortage], Step | None]:
    def step(s: Shortage) -> Step | None:
        model = s.model(role)
        if model is None or not model.held or model.device == "cpu" or s.device == "cpu":
            return None
        return Step(role, words, model.held)
    return step


_text_encoder_cpu = _off_the_gpu(TEXT_ENCODER, "set the text encoder's device to cpu (text_encoder_device on the "
                                 "ERNIE-Image Loader): prompts then encode on the CPU, more slowly")
_pe_cpu = _off_the_gpu(PROMPT_ENHANCER, "run the Prompt Enhancer on the CPU (ERNIE-Image Prompt Enhancer Loader, "
                       "device cpu) or on a server (ERNIE-Image Prompt Enhancer (remote))")


def _bypass_accelerators(s: Shortage) -> list[Step]:
    return [Step(name, f"bypass {name}: what it keeps across steps", held) for name, held in s.accelerators if held]


def _dit_in_part(s: Shortage) -> Step | None:
    dit = s.model(DIT)
    if dit is None or not dit.held:
        return None
    if not dit.loads_in_part:
        return Step(DIT, "set the DiT loader's quantization to none with weight_dtype fp8_e4m3fn: ComfyUI then keeps "
                    "what fits of the DiT on the GPU and streams the rest at each step, more slowly", dit.held,
                    up_to=True)
    if dit.weight_dtype.startswith("fp8") or not dit.fp8_saving or not dit.size:
        return None
    # ComfyUI holds the same share of a DiT whose block weights are half as large.
    return Step(DIT, "set the DiT loader's weight_dtype to fp8_e4m3fn: its block weights in fp8, cast as each "
                "layer runs", dit.held * dit.fp8_saving // dit.size)


def _smaller_image(s: Shortage) -> Step | None:
    """The largest image of the same shape whose step fits what is free: a step's memory grows with its pixels
    (ComfyUI's estimate and the accelerators' stores alike)."""
    if s.image is None or s.missing is None or s.missing <= 0 or not s.free or s.free <= 0:
        return None
    scale = math.sqrt(s.free / s.need)
    width, height = (int(side * scale) // s.multiple * s.multiple for side in s.image)
    if width < s.multiple or height < s.multiple:
        return None
    return Step("image", f"make the image at most {width}×{height} (now {s.image[0]}×{s.image[1]})", s.missing)


RANK: tuple[Callable[[Shortage], Step | list[Step] | None], ...] = (
    _text_encoder_fp8, _pe_fp8, _dit_quantize, _dit_gguf, _text_encoder_cpu, _pe_cpu, _bypass_accelerators,
    _dit_in_part, _smaller_image,
)


def steps(s: Shortage) -> list[Step]:
    """The steps not taken yet that free memory on the device, in ``RANK`` order."""
    found: list[Step] = []
    for rule in RANK:
        made = rule(s)
        found += [made] if isinstance(made, Step) else (made or [])
    return [step for step in found if step.saving > 0]


def _one_per_group(ranked: list[Step]) -> list[Step]:
    """Each group's largest step among ``ranked``, in rank order. A smaller image is left out: it is sized alone,
    for what is free with nothing else changed."""
    best: dict[str, Step] = {}
    for step in ranked:
        if step.group != "image" and (step.group not in best or step.saving > best[step.group].saving):
            best[step.group] = step
    return list(best.values())


def _combination(ranked: list[Step], missing: int) -> list[Step] | None:
    """The steps of the shortest run of ``ranked``'s first ones that covers ``missing`` together (one per group);
    None when even all of them do not."""
    for end in range(1, len(ranked) + 1):
        together = _one_per_group(ranked[:end])
        if sum(step.saving for step in together) >= missing:
            return together
    return None


def _freed(step: Step) -> str:
    return f"{step.words} (frees {'up to' if step.up_to else 'about'} {format_bytes(step.saving)})"


def _chosen(model: PackModel, s: Shortage) -> str:
    """What a model's loaders chose, and what it holds on the failing device."""
    if model.role == DIT:
        words = f"DiT quantization {model.quantization or 'none'}, weight_dtype {model.weight_dtype}"
    elif model.role in (TEXT_ENCODER, PROMPT_ENHANCER):
        words = f"{model.role} weight_dtype {model.weight_dtype}, device {model.device}"
    else:  # a model that does not describe itself: its class
        words = model.name or model.role
    if model is s.failed:
        return words  # its size is in the first line
    if model.held and model.loads_in_part and model.held < model.size:
        return f"{words} ({format_bytes(model.held)} of its {format_bytes(model.size)} loaded on {s.device})"
    return f"{words} ({format_bytes(model.held)} on {s.device})" if model.held else words


def _what_ran_out(s: Shortage) -> str:
    if s.failed is not None:
        named = f"the {s.failed.role}" + (f" ({s.failed.name})" if s.failed.name else "")
        free = ("the memory free there could not be read" if s.free is None else
                "nothing free there" if s.free <= 0 else f"{format_bytes(s.free)} free there")
        return (f"{named} needs {format_bytes(s.need)} on {s.device} as a whole (it cannot be loaded in part), "
                f"with {free}")
    picture = f"a {s.image[0]}×{s.image[1]} image" if s.image else "an image"
    kept = "".join(f", {format_bytes(held)} of it for {name}" for name, held in s.accelerators if held)
    step = f"the step needs about {format_bytes(s.need)} (ComfyUI's estimate{kept})"
    when = ("the memory free could not be read" if s.free is None else
            "nothing was free as it began" if s.free <= 0 else f"{format_bytes(s.free)} were free as it began")
    return f"sampling {picture} ran out of memory on {s.device}: {step} and {when}"


def advice(s: Shortage) -> str:
    """The words for ``s``: what ran out, what is chosen, and the next step that fits (or the few that do together,
    or that the card is too small). Never a step already taken: each rule reads the choice it would change."""
    lines = [_what_ran_out(s) + "."]
    chosen = [_chosen(m, s) for m in s.models]
    if s.others:
        chosen.append(f"other models {format_bytes(s.others)} on {s.device}")
    if chosen:
        lines.append("Chosen: " + "; ".join(chosen) + ".")
    ranked, missing = steps(s), s.missing
    if missing is None or missing <= 0:
        # Unknown, or ComfyUI's count said it fit and the load or step took more: the cheapest step that frees
        # anything.
        why = "" if missing is None else " (ComfyUI's count said it fit: it took more than counted)"
        lines.append(f"Next step{why}: {_freed(ranked[0])}." if ranked else _too_small(s, []))
        return "\n".join(lines)
    short = f"{format_bytes(missing)} missing"
    single = next((step for step in ranked if step.saving >= missing), None)
    if single is not None:
        lines.append(f"Next step that fits ({short}): {_freed(single)}.")
        return "\n".join(lines)
    together = _combination(ranked, missing)
    if together is not None:
        lines.append(f"No single step frees the {format_bytes(missing)} missing; these together do: "
                     + "; ".join(_freed(step) for step in together) + ".")
        return "\n".join(lines)
    lines.append(_too_small(s, ranked))
    return "\n".join(lines)


def _too_small(s: Shortage, ranked: list[Step]) -> str:
    """No step or combination frees enough: what would still be missing with everything taken, measured from
    these models and this step, in words that hold for any card."""
    every = _one_per_group(ranked)
    left = (s.missing or 0) - sum(step.saving for step in every)
    if not every:
        taken = "every step the pack offers is taken already"
        if s.missing is not None and s.missing > 0:
            taken += f", and {format_bytes(s.missing)} is missing on {s.device}"
    else:
        taken = "even with every step the pack offers (" + "; ".join(_freed(step) for step in every) + ")"
        taken += f", {format_bytes(left)} would still be missing on {s.device}" if s.missing is not None else ""
    return f"The card is too small for this: {taken}. Close other programs that use it, or use a GPU with more memory."
