"""One frozen load record per model the graph uses, made from file headers (never weights).

A record says what the model can be here: its ``forms`` (as stored; fp8; a GGUF type; quantized on load), each with
the bytes its weights take on the GPU and the largest unit that can stream through it (a block, a decoder layer), the
``places`` it can run in, and the working memory one prompt of the requested size needs while it runs. Loaders and
every later stage read these records as plain attributes. Forms are data: a form added later (a GGUF text encoder)
is one more ``Form`` in a record, and the planner needs no change.
"""

from __future__ import annotations

from dataclasses import dataclass

DIT, TEXT_ENCODER, PROMPT_ENHANCER, VAE = "DiT", "text encoder", "Prompt Enhancer", "VAE"
ROLES = (PROMPT_ENHANCER, TEXT_ENCODER, DIT, VAE)  # in the order a prompt runs them (the LoRA rides on the DiT)

# Where a model runs. RESIDENT: on the GPU across prompts. STREAMED: its weights stay in (pinned) host RAM and pass
# through the GPU a block at a time, every run. PARTIAL: ComfyUI keeps what fits on the GPU and streams the rest at
# every run (core's partial loading). PER_PROMPT: loaded whole on the GPU for its stage, then moved out for the next
# model. CPU: computed on the CPU.
RESIDENT, STREAMED, PARTIAL, PER_PROMPT, CPU = "resident", "streamed", "partial", "per prompt", "CPU"
# Why a record's form is fixed, as the plan's line says it.
SET, LOADED = "as set", "as loaded"


@dataclass(frozen=True)
class Form:
    """One way of holding a model's weights. ``name``: as the log says it (``GGUF Q4_K``, ``fp8``, ``bf16``);
    ``setting``: the loader value that gives it (``none``, ``fp8_e4m3fn``, ``fp8_per_row``, ``default``);
    ``compute``: the key of the measured cost of one run in this form (``costs.Costs.seconds``); ``weight_bytes``:
    its weights on the GPU; ``block_bytes``: the largest unit that streams (0: it cannot stream); ``compiled``: a
    run's time with its blocks compiled on the GPU against the eager run the probe measures (1: not compiled, or not
    measured); blocks that stream run eager."""

    name: str
    setting: str
    compute: str
    weight_bytes: int
    block_bytes: int = 0
    compiled: float = 1.0
    # Loaded whole per prompt, it keeps its host copy, pinned (the text encoder, the PE, the VAE, the torchao DiT
    # without a LoRA: ``host/host_copy.py``): each load copies at the pinned rate and nothing is copied back.
    keeps_host_copy: bool = False
    gguf_type: str | None = None  # a GGUF file as it is: its dominant block type (``gguf.dequant.BLOCKS``)


@dataclass(frozen=True)
class LoadRecord:
    """One model of the graph. ``runs``: how often it runs per prompt (the DiT: its forward passes; the PE: its new
    tokens; 1 for the text encoder and the VAE); ``working_bytes``: the GPU memory one run of a prompt of the
    requested size takes beside the weights (activations, the decode's peak); ``fixed_form``: the form's setting the
    plan must keep (None: ``auto``), ``fixed_by`` why (``SET``: the loader's explicit value; ``LOADED``: ComfyUI
    reuses what the loader made under an earlier plan); ``places_set``: the loader's explicit device left ``places``
    (the plan's line says both)."""

    role: str
    source: str
    forms: tuple[Form, ...]
    places: tuple[str, ...]
    working_bytes: int = 0
    runs: int = 1
    fixed_form: str | None = None
    fixed_by: str = ""
    places_set: bool = False
    first_read_bytes: int = 0  # what the first prompt reads from disk
    compute_scale: float = 1.0  # a run's compute against the measured one (the DiT: the image's pixels / 1024²)
    # The measured CPU work (``costs.Costs.cpu_seconds``) that follows each run wherever the model runs, scaled as
    # its compute: the VAE's image saved as a PNG (``image:png``). The same in every plan, it changes no choice;
    # it is part of the warm prompt the plan predicts and the log sets beside the measured one.
    host_work: str = ""


@dataclass(frozen=True)
class LoraSet:
    """The LoRAs applied to the DiT: ``patch_bytes`` of patches (held on the GPU with the DiT when it is resident,
    and counted in its size), ``layers`` patched; ``sources`` the files."""

    sources: tuple[str, ...]
    patch_bytes: int
    layers: int
