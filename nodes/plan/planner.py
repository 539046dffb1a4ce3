"""The memory plan: each model's form and place for a card, chosen to minimise the predicted warm prompt (a pure
function: engine code, no ComfyUI).

A prompt runs its models in stages (``records.ROLES``: the PE, the text encoder, the DiT, the VAE decode). A model
RESIDENT on the GPU holds its weights there through every stage; the others hold GPU memory only in their own stage:
PER_PROMPT its whole weights (moved in, and back out when the next model needs the room), STREAMED two of its
blocks (the one computing and the next arriving), CPU nothing. A PARTIAL DiT is core's partial loading as core runs
it (``_partial``): at sampling core evicts every other model it holds and loads what fits of the DiT; the later
stages take their room from the DiT, which loads it again at the next sampling. A stage's peak is what stays on the
GPU, what the running model holds and its working memory; a plan is possible where every stage's peak fits the
usable memory.

Time: each model's runs at the measured cost of its form (``costs``), plus the bytes it moves each prompt at the
measured bandwidth (pinned for streamed weights and for the host copy a per-prompt model keeps, the text encoder, the
PE or an FP8 DiT without LoRA, where core may pin them all; pageable for whole loads of the others, in and out; for
core's partial loading the rates it reached on the H200, ``CORE_STREAMING`` and ``CORE_RELOAD`` or, with a LoRA,
``CORE_RELOAD_LORA``), plus a GGUF DiT's LoRA added at each call (``_lora_seconds``), plus the CPU work after a run
(``LoadRecord.host_work``: the decode's image saved as a PNG, 0.2-0.3 s of every measured prompt, the same in every
plan). Every combination is tried (a handful of forms and places per model).

Host RAM: what is not on the GPU between stages is in host RAM (a model on the CPU, streamed, loaded per prompt, or
what a partial DiT does not keep or gives up); a DiT with a LoRA holds all its weights and the LoRA there wherever it
runs (core's backups of the patched weights). Where the models take more than the machine leaves them
(``Card.host``), the system swaps the bytes over out and in each prompt, priced at a disk's rate
(``SWAP_BYTES_PER_S``), and the plan's line says so.

Where every model can stay on the GPU at once, the plan keeps them there: it moves nothing per prompt, which no
measured cost beats on a card whose link other programs share. Otherwise the plan is the fastest possible one, then
the one whose first prompt is fastest, then the one that moves fewest bytes. A larger card only adds possible
combinations or makes a partial DiT keep more, so the predicted warm time never rises as memory grows, but where the
all-resident rule would pick a slower plan than a mix that moves weights: the tests check over every size from 4 to
48 GiB that it does not for ERNIE-Image's models.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace

from .costs import LORA_PER_GB, Costs
from .records import CPU, DIT, PARTIAL, PER_PROMPT, RESIDENT, ROLES, STREAMED, Form, LoadRecord, LoraSet

GIB = 2**30
LOAD_MARGIN = 1.1  # core frees 1.1x a model's size before it loads it whole (model_management.load_models_gpu)
DISK_BYTES_PER_S = 1e9  # the first prompt's read of the files (the same files in every plan: a tie-breaker only)
# Models that hold more host RAM than the machine leaves them swap: each prompt runs every model once, so the system
# writes the bytes over out and reads them back in, each way at a disk's rate (not measured: a plan within the host
# RAM never pays it, and one over it says so in its line).
SWAP_BYTES_PER_S = DISK_BYTES_PER_S
# Core's partial loading against the probe's pinned copy (52 GB/s on the H200), fitted to session 25's rows
# (bench/RESULTS.md, 2026-12-05): the offloaded layers stream one cast at a time, each waited for by its layer
# (18 GB/s: the GGUF DiT on 6 and 7 GB cards and the fp8 DiT on 8 GB then predict within 0.83-1.10 x what they
# measured); a byte the DiT gives up to another stage is copied out and pinned, then unpinned and copied back at
# the next sampling (2.2 GB/s for the pair: 0.94 GB given up cost 0.43 s on 7 GB against 8 GB).
CORE_STREAMING = 0.35
CORE_RELOAD = 0.042
# The same pair for a DiT with a LoRA: about 1 GB/s (the H200's 8 GB card, session 29: 424 MB given up to each
# decode cost +0.24 s in VAE Decode and +0.18 s at the next sampling; the H100's, session 31: +0.22 and +0.17 s).
# Why it is slower is not profiled yet (the layers' LoRA factors travel with them, from pageable memory, one guess).
# At 2.2 GB/s the plan predicted that row 1.48 x short.
CORE_RELOAD_LORA = 0.019
# What the process keeps allocated beside the models between stages (cuBLAS workspaces, latents, encodings, the
# streamed text encoder's buffers): on the H200's 8 GB card core found 0.51 GiB less free before the decode than the
# plan counted with the LoRA, and with no LoRA at most 0.43 (it unloaded nothing) (2026-12-05).
BESIDE_MODELS = int(0.4 * GIB)
UNBOUNDED = 1 << 60  # a machine whose host RAM no plan fills (the planner's tests of GPU memory alone)


@dataclass(frozen=True)
class Card:
    """``usable``: bytes the pack's models and their working memory may take on the GPU (what core would give
    models, less what other processes hold); ``pinnable``: host bytes that may be pinned (core's bound); ``host``:
    host RAM the models may hold between their stages (what the system and other programs leave)."""

    usable: int
    pinnable: int
    host: int = UNBOUNDED


@dataclass(frozen=True)
class Placement:
    record: LoadRecord
    form: Form
    place: str
    gpu_bytes: int  # held on the GPU across prompts (resident, or the part core keeps)
    copied: int  # bytes moved host → GPU each warm prompt
    seconds: float  # its share of a warm prompt
    host_bytes: int  # held in host RAM between stages: all of it but what stays on the GPU

    @property
    def role(self) -> str:
        return self.record.role


@dataclass(frozen=True)
class Plan:
    """Every model's placement, the predicted warm and first prompt (seconds) and the predicted peak on the GPU."""

    card: Card
    placements: tuple[Placement, ...]
    warm: float
    first: float
    peak: int
    lora: LoraSet | None = None

    def of(self, role: str) -> Placement | None:
        return next((p for p in self.placements if p.role == role), None)

    @property
    def copied(self) -> int:
        return sum(p.copied for p in self.placements)

    @property
    def host(self) -> int:
        """Host RAM the models hold between their stages."""
        return sum(p.host_bytes for p in self.placements)

    @property
    def over_host(self) -> bool:
        """Whether the models hold more host RAM than the machine leaves them (the predicted times count the
        swapping)."""
        return self.host > self.card.host

    def line(self) -> str:
        """The plan in one line, as the log states it."""
        parts = []
        for p in self.placements:
            fixed = f" ({p.record.fixed_by})" if p.record.fixed_by else ""
            what = f"{p.role} {p.form.name}{fixed} {p.place}" + (" (device as set)" if p.record.places_set else "")
            if p.place == RESIDENT:
                what += f" ({p.gpu_bytes / GIB:.1f} GiB)"
            elif p.place == PARTIAL:
                whole = p.form.weight_bytes + (self.lora.patch_bytes if p.role == DIT and self.lora else 0)
                what += f" ({p.gpu_bytes / GIB:.1f} of {whole / GIB:.1f} GiB on the GPU while it samples)"
            if p.copied:
                what += f" ({p.copied / 1e9:.1f} GB per prompt)"
            if p.role == DIT and self.lora is not None:
                what += f", {len(self.lora.sources)} LoRA ({self.lora.patch_bytes / 2**20:.0f} MiB with it)"
            parts.append(what)
        host = f"{self.host / GIB:.1f} GiB held in host RAM"
        if self.over_host:
            host += f", more than the {max(self.card.host, 0) / GIB:.1f} GiB it has free: the system swaps"
        return (f"plan for {self.card.usable / GIB:.1f} GiB usable: {', '.join(parts)}; "
                f"predicted warm {self.warm:.1f} s; {host}")


class BelowFloor(ValueError):
    """No plan fits: ``needed`` is the least usable memory any plan of these files needs; ``lowest`` that plan's
    placements; ``stage`` the role whose own stage needs the most there (what a smaller image, or a smaller file of
    that model, would lower), ``stage_bytes`` what it needs."""

    def __init__(self, needed: int, lowest: tuple[Placement, ...]):
        super().__init__(f"needs {needed / GIB:.1f} GiB usable")
        self.needed, self.lowest = needed, lowest
        needs = {p.role: _stage_need(p.record, p.form, p.place) for p in lowest}
        self.stage = max(needs, key=needs.get) if needs else None
        self.stage_bytes = needs.get(self.stage, 0)


def _options(record: LoadRecord) -> list[tuple[Form, str]]:
    forms = [f for f in record.forms if record.fixed_form in (None, f.setting)]
    return [(f, p) for f in forms for p in record.places if p not in (STREAMED, PARTIAL) or f.block_bytes > 0]


def _run_seconds(record: LoadRecord, form: Form, place: str, costs: Costs) -> float | None:
    """One run's compute time in ``form`` at ``place`` (None: it cannot run there, or nothing is known of it)."""
    table = costs.cpu_seconds if place == CPU else costs.seconds
    scale = record.compute_scale * (1.0 if place == CPU else form.compiled)
    if form.compute in table:
        return table[form.compute] * scale
    # A form the probe has not measured: the slowest measured form of the same model kind (never optimistic).
    kind = form.compute.split(":", 1)[0] + ":"
    known = [s for key, s in table.items() if key.startswith(kind)]
    if known:
        return max(known) * scale
    # Nothing measured of this kind (costs without the VAE's decode): the same in every plan on the GPU; never
    # planned on the CPU.
    return None if place == CPU else 0.0


def _lora_seconds(record: LoadRecord, form: Form, lora: LoraSet | None, costs: Costs) -> float:
    """What one DiT run adds for its LoRA where the LoRA is applied at each call: a GGUF DiT's layers add its
    outputs (``host/gguf_layers``), at the probe's rate per GB of factors; the other forms have it merged into
    their weights at load (core's patching, or merged and quantized again: a first-prompt cost)."""
    if record.role != DIT or lora is None or form.gguf_type is None:
        return 0.0
    return record.compute_scale * costs.seconds.get(LORA_PER_GB, 0.0) * lora.patch_bytes / 1e9


def _held(record: LoadRecord, form: Form, lora_bytes: int) -> int:
    """What a model holds on the GPU in ``form`` once loaded: the DiT with its LoRA patches."""
    return form.weight_bytes + (lora_bytes if record.role == DIT else 0)


def _stage_need(record: LoadRecord, form: Form, place: str) -> int:
    """What a model's own stage needs beside what stays on the GPU: its weights where core loads them for the stage
    (with core's margin), two streamed blocks (a partial DiT: one), and its working memory."""
    if place == CPU:
        return 0
    if place == PARTIAL:  # at least one block passes through beside the working memory (``_partial``)
        return form.block_bytes + record.working_bytes
    held = {PER_PROMPT: int(form.weight_bytes * LOAD_MARGIN), STREAMED: 2 * form.block_bytes}.get(place, 0)
    return held + record.working_bytes


@dataclass(frozen=True)
class _Partial:
    """A DiT under core's partial loading: ``kept`` on the GPU while it samples, ``lost`` of it given up to the other
    stages and loaded again at each sampling, ``peak`` the most any stage holds."""

    kept: int
    lost: int
    peak: int


def _partial(choice: Sequence[tuple[LoadRecord, Form, str]], at: int, lora_bytes: int, usable: int) -> _Partial | None:
    """How core runs a partial DiT (model_management.load_models_gpu, 0.3.75 and upstream @02b2b388): the sampler's
    load frees the DiT's offloaded bytes (x1.1) and its working memory by unloading every other model core holds
    (the sampler's DiT is a new clone, never a candidate itself), then loads as much of the DiT as is free; every
    later load (the decode, the next prompt's PE) frees its room by unloading part of the DiT first (the model with
    the most offloaded). So no other model core loads stays resident beside a partial DiT (the H200's log, PE
    workflow on 12 and 16 GB, 2026-12-05: the PE loaded again each prompt, the DiT then loaded whole), and what the
    DiT gives up between two samplings is loaded again at each."""
    record, form, _ = choice[at]
    others = [c for i, c in enumerate(choice) if i != at]
    if any(place == RESIDENT for _, _, place in others):
        return None
    need = _stage_need(record, form, PARTIAL)
    kept = min(_held(record, form, lora_bytes), usable - need)
    if kept < 0:
        return None
    # The stages after sampling, in order (the decode, then the next prompt's PE and text encoder): what core loads
    # for one stays until the sampler's load evicts it.
    after = [c for c in others if ROLES.index(c[0].role) > ROLES.index(DIT)] + \
            [c for c in others if ROLES.index(c[0].role) < ROLES.index(DIT)]
    held = lost = peak = 0
    for other, other_form, place in after:
        stage = held + _stage_need(other, other_form, place)
        if stage > usable:
            return None
        lost, peak = max(lost, stage - (usable - kept)), max(peak, stage)
        if place == PER_PROMPT:
            held += other_form.weight_bytes
    lost = max(lost, 0)
    return _Partial(kept, lost, max(kept + need, kept - lost + peak))


def _keeps_host_copy(record: LoadRecord, form: Form, lora: LoraSet | None) -> bool:
    """Whether ``form`` keeps its host copy when loaded per prompt: a DiT with a LoRA has its layers merged and
    quantized again at each load, which a kept copy cannot stand in for."""
    return form.keeps_host_copy and not (record.role == DIT and lora is not None)


def _evaluate(choice: Sequence[tuple[LoadRecord, Form, str]], lora: LoraSet | None, card: Card,
              costs: Costs) -> tuple[float, float, int, int, tuple[Placement, ...]] | None:
    lora_bytes = lora.patch_bytes if lora is not None else 0
    room = card.usable - BESIDE_MODELS
    at = next((i for i, (_, _, place) in enumerate(choice) if place == PARTIAL), None)
    if at is not None:
        partial = _partial(choice, at, lora_bytes, room)
        if partial is None:
            return None
        peak = partial.peak
    else:
        resident = sum(_held(r, f, lora_bytes) for r, f, place in choice if place == RESIDENT)
        peak = resident + max((_stage_need(r, f, place) for r, f, place in choice), default=0)
    if peak > room:
        return None
    # Streamed weights and the host copies of models loaded per prompt are pinned where core allows it and the host
    # RAM has room (``card.pinnable``); else weights stream from pageable memory, more slowly, and no copy is kept.
    pinned = sum(form.weight_bytes for record, form, place in choice
                 if place == STREAMED or place == PER_PROMPT and _keeps_host_copy(record, form, lora))
    pins_fit = pinned <= card.pinnable
    host_rate = costs.pinned if pins_fit else costs.pageable
    warm = first = 0.0
    placements = []
    for record, form, place in choice:
        run = _run_seconds(record, form, place, costs)
        if run is None:
            return None
        run += _lora_seconds(record, form, lora, costs)
        gpu = _held(record, form, lora_bytes) if place == RESIDENT else 0
        moved = 0
        if place == STREAMED:
            moved = record.runs * form.weight_bytes
            seconds = record.runs * run + moved / host_rate
        elif place == PARTIAL:
            gpu = partial.kept
            streams = _held(record, form, lora_bytes) - partial.kept
            moved = record.runs * streams + partial.lost
            # The blocks core streams run eager (compiled blocks need their weights on the GPU), at the rate core's
            # per-layer casts reach; what the other stages took is moved out and back in (core pins it).
            share = streams / form.weight_bytes
            seconds = (record.runs * run * (1 + share * (1 / form.compiled - 1))
                       + record.runs * streams / (costs.pinned * CORE_STREAMING)
                       + partial.lost / (costs.pinned * (CORE_RELOAD_LORA if lora_bytes else CORE_RELOAD)))
        elif place == PER_PROMPT:
            # Loaded whole for its stage and moved back to the host when the next model needs the room; a model that
            # keeps its host copy is only copied in.
            moved = form.weight_bytes
            kept = pins_fit and _keeps_host_copy(record, form, lora)
            seconds = record.runs * run + (moved / costs.pinned if kept else 2 * moved / costs.pageable)
        else:
            seconds = record.runs * run
        if record.host_work:
            seconds += record.runs * record.compute_scale * costs.cpu_seconds.get(record.host_work, 0.0)
        warm += seconds
        first += seconds + record.first_read_bytes / DISK_BYTES_PER_S
        # What the GPU does not hold between stages is in host RAM: for a partial DiT, also what it gives up. A DiT
        # with a LoRA holds all of it there, wherever it runs: core keeps the original of each weight a LoRA patches
        # on the offload device while the patched one is loaded (``ModelPatcher.patch_weight_to_device``, 0.3.75 and
        # upstream), and the LoRA's own tensors stay there too.
        host = _held(record, form, lora_bytes)
        if record.role != DIT or lora is None:
            host += (partial.lost if place == PARTIAL else 0) - gpu
        placements.append(Placement(record, form, place, gpu, moved, seconds, host))
    swapped = max(sum(p.host_bytes for p in placements) - card.host, 0)
    warm, first = warm + 2 * swapped / SWAP_BYTES_PER_S, first + 2 * swapped / SWAP_BYTES_PER_S
    # The peak counts what the process holds beside the models: an out-of-memory error's measured peak compares to it.
    return warm, first, sum(p.copied for p in placements), peak + BESIDE_MODELS, tuple(placements)


def _ordered(records: Sequence[LoadRecord]) -> list[LoadRecord]:
    return sorted(records, key=lambda r: ROLES.index(r.role) if r.role in ROLES else len(ROLES))


def _best(records: list[LoadRecord], card: Card, costs: Costs, lora: LoraSet | None) -> Plan | None:
    best = None
    for combination in itertools.product(*(_options(r) for r in records)):
        choice = [(r, form, place) for r, (form, place) in zip(records, combination, strict=True)]
        found = _evaluate(choice, lora, card, costs)
        if found is None:
            continue
        warm, first, copied, peak, placements = found
        everywhere = all(p.place == RESIDENT for p in placements)
        key = (not everywhere, round(warm, 3), round(first, 3), copied)
        if best is None or key < best[0]:
            best = (key, Plan(card, placements, warm, first, peak, lora))
    return None if best is None else best[1]


def plan(records: Sequence[LoadRecord], card: Card, costs: Costs, lora: LoraSet | None = None) -> Plan:
    """The fastest possible plan for ``records`` (one per model of the graph) on ``card``; ``BelowFloor`` when none
    fits."""
    ordered = _ordered(records)
    found = _best(ordered, card, costs, lora)
    if found is None:
        raise _below_floor(ordered, card, costs, lora)
    return found


def _below_floor(records: list[LoadRecord], card: Card, costs: Costs, lora: LoraSet | None) -> BelowFloor:
    """The least usable memory at which these records have a plan (found by halving between the card and 1 TiB)."""
    low, high = max(card.usable, 0), 1 << 40
    if _best(records, replace(card, usable=high), costs, lora) is None:
        return BelowFloor(high, ())
    while high - low > 2**24:
        middle = (low + high) // 2
        if _best(records, replace(card, usable=middle), costs, lora) is None:
            low = middle
        else:
            high = middle
    lowest = _best(records, replace(card, usable=high), costs, lora)
    return BelowFloor(high, lowest.placements if lowest else ())
