"""The memory planner on the CPU: ERNIE-Image's models at their true sizes (records from their tensors' shapes, no
file), every usable size from 4 to 48 GiB in 0.25 GiB steps, with and without a LoRA and the PE."""

from __future__ import annotations

import dataclasses

import pytest

from comfyui_ernie_image.nodes.plan.describe import GRAPHED_PE, Tensor, language_model_record
from comfyui_ernie_image.nodes.plan.planner import (
    BESIDE_MODELS,
    SWAP_BYTES_PER_S,
    UNBOUNDED,
    BelowFloor,
    Card,
    plan,
)
from comfyui_ernie_image.nodes.plan.records import (
    CPU,
    DIT,
    PARTIAL,
    PER_PROMPT,
    PROMPT_ENHANCER,
    RESIDENT,
    STREAMED,
    TEXT_ENCODER,
    VAE,
    Form,
)
from helpers.plan_records import FLOOR, GIB, costs, graph, lm_tensors

SIZES = [4 + 0.25 * i for i in range(int((48 - 4) / 0.25) + 1)]
GRAPHS = [dict(gguf=gguf, lora=lora, pe=pe) for gguf in (True, False) for lora in (False, True) for pe in (False, True)]
PINNABLE = 16 * GIB


def _sweep(host: int = UNBOUNDED, **kinds):
    records, lora = graph(**kinds)
    plans = []
    for size in SIZES:
        try:
            plans.append((size, plan(records, Card(int(size * GIB), PINNABLE, host), costs(), lora)))
        except BelowFloor:
            plans.append((size, None))
    return records, lora, plans


@pytest.mark.parametrize("host", [UNBOUNDED, 8 * GIB], ids=["ample-host-ram", "8-gib-host-ram"])
@pytest.mark.parametrize("kinds", GRAPHS, ids=lambda k: "-".join(n for n, on in k.items() if on) or "turbo")
def test_more_memory_never_predicts_a_slower_prompt_and_no_plan_exceeds_the_card(kinds, host):
    records, lora, plans = _sweep(host, **kinds)
    made = [(size, p) for size, p in plans if p is not None]
    assert made and made[-1][0] == 48  # every graph has a plan on the larger cards
    assert [p is None for _, p in plans] == sorted((p is None for _, p in plans), reverse=True)  # the floor, then plans
    for (_, smaller), (size, larger) in zip(made, made[1:], strict=False):
        assert larger.warm <= smaller.warm + 1e-9, (size, smaller.line(), larger.line())
    for size, p in made:
        assert p.peak <= size * GIB, (size, p.line())


@pytest.mark.parametrize("kinds", GRAPHS, ids=lambda k: "-".join(n for n, on in k.items() if on) or "turbo")
def test_where_every_model_fits_at_once_every_model_stays_resident(kinds):
    records, lora, plans = _sweep(**kinds)
    smallest = sum(min(f.weight_bytes for f in r.forms) for r in records) + (lora.patch_bytes if lora else 0)
    room = smallest + max(r.working_bytes for r in records) + BESIDE_MODELS  # with what the process holds beside
    fitting = [(size, p) for size, p in plans if size * GIB >= room]
    assert fitting, "the sweep reaches sizes where everything fits"
    for size, p in fitting:
        assert {pl.place for pl in p.placements} == {RESIDENT}, (size, p.line())
        assert p.copied == 0


def _recipe(records, lora, size, forms: dict, places: dict):
    """The plan with each model's form and place as a measured recipe set them."""
    fixed = []
    for record in records:
        form = forms.get(record.role)
        fixed.append(dataclasses.replace(record, fixed_form=form if form else record.fixed_form,
                                         places=places.get(record.role, record.places)))
    return plan(fixed, Card(int(size * GIB), PINNABLE), costs(), lora)


# The recipes measured on the H200 (the README's card table until 2026-12-06; bench/RESULTS.md): usable memory of an
# 8/12/16/24 GB card (less a CUDA context and core's reserve) and what each held.
RECIPES = [
    (7.1, dict(gguf=True), {TEXT_ENCODER: "default"}, {DIT: (RESIDENT,), TEXT_ENCODER: (CPU,)}),
    (11.1, dict(gguf=True), {TEXT_ENCODER: "fp8_e4m3fn"}, {DIT: (RESIDENT,), TEXT_ENCODER: (RESIDENT,)}),
    (15.1, dict(gguf=False), {DIT: "fp8_per_row/default", TEXT_ENCODER: "fp8_e4m3fn"},
     {DIT: (RESIDENT,), TEXT_ENCODER: (RESIDENT,)}),
    (23.1, dict(gguf=False), {DIT: "fp8_per_row/default", TEXT_ENCODER: "fp8_e4m3fn"},
     {DIT: (RESIDENT,), TEXT_ENCODER: (RESIDENT,)}),
]


@pytest.mark.parametrize(("usable", "kinds", "forms", "places"), RECIPES, ids=["8GB", "12GB", "16GB", "24GB"])
def test_at_the_recipes_sizes_the_plan_is_the_recipe_or_predicted_faster(usable, kinds, forms, places):
    records, lora = graph(**kinds)
    recipe = _recipe(records, lora, usable, forms, places)
    chosen = plan(records, Card(int(usable * GIB), PINNABLE), costs(), lora)
    assert chosen.warm <= recipe.warm
    same = all((chosen.of(r).form.setting, chosen.of(r).place) == (recipe.of(r).form.setting, recipe.of(r).place)
               for r in (DIT, TEXT_ENCODER))
    assert same or chosen.warm < recipe.warm, (chosen.line(), recipe.line())


def test_the_8gb_recipe_is_beaten_by_streaming_the_text_encoder():
    """On 8 GB the recipe ran the text encoder on the CPU (0.3-5 s an encode); streamed through the GPU it costs
    its bytes at the pinned bandwidth instead, and the DiT stays resident."""
    records, lora = graph(gguf=True)
    chosen = plan(records, Card(int(7.1 * GIB), PINNABLE), costs(), lora)
    assert chosen.of(TEXT_ENCODER).place == STREAMED and chosen.of(TEXT_ENCODER).form.setting == "fp8_e4m3fn"
    assert chosen.of(DIT).place == RESIDENT
    assert "text encoder fp8 streamed" in chosen.line() and "predicted warm" in chosen.line()


def test_explicit_values_are_kept_and_planned_around():
    """A saved workflow's explicit text encoder settings (fp8, ComfyUI's device: loaded whole or on the CPU) are
    kept; the plan places the rest around them."""
    records, lora = graph(gguf=True, te_fixed=("fp8_e4m3fn", (RESIDENT, PER_PROMPT, CPU)))
    for usable in (7.1, 9.1, 11.1):
        chosen = plan(records, Card(int(usable * GIB), PINNABLE), costs(), lora)
        te = chosen.of(TEXT_ENCODER)
        assert te.form.setting == "fp8_e4m3fn" and te.place in (RESIDENT, PER_PROMPT, CPU)


def test_a_form_added_later_needs_no_change_to_the_planner():
    """A synthetic 2.2 GB text encoder form (a GGUF file, from the issue on GGUF files) is one more ``Form``: at 10
    GiB the plan keeps it resident beside the DiT, where fp8 (3.7 GB) had to stream."""
    records, lora = graph(gguf=True)
    te = next(r for r in records if r.role == TEXT_ENCODER)
    small = Form("GGUF Q4_K", "gguf", "text:gguf:Q4_K", int(2.2e9), int(2.2e9 / 26))
    with_gguf = [dataclasses.replace(r, forms=(*r.forms, small)) if r is te else r for r in records]
    costs_gguf = costs()
    costs_gguf = dataclasses.replace(costs_gguf, seconds={**costs_gguf.seconds, "text:gguf:Q4_K": 0.06})
    before = plan(records, Card(int(8.6 * GIB), PINNABLE), costs_gguf, lora)
    after = plan(with_gguf, Card(int(8.6 * GIB), PINNABLE), costs_gguf, lora)
    assert before.of(TEXT_ENCODER).place != RESIDENT
    assert after.of(TEXT_ENCODER).form is small and after.of(TEXT_ENCODER).place == RESIDENT
    assert after.warm < before.warm


def test_below_the_floor_the_least_memory_that_serves_these_files_is_named():
    records, lora = graph(gguf=True)
    with pytest.raises(BelowFloor) as below:
        plan(records, Card(int(1.0 * GIB), PINNABLE), costs(), lora)
    needed = below.value.needed
    assert 1.0 * GIB < needed < 4 * GIB
    assert plan(records, Card(needed, PINNABLE), costs(), lora).peak <= needed
    with pytest.raises(BelowFloor):
        plan(records, Card(needed - 2**25, PINNABLE), costs(), lora)


def test_below_the_floor_the_stage_that_needs_the_most_is_named_and_lowering_it_lowers_the_floor():
    """At 1024² the VAE's decode (1.2 GiB of working memory) sets the floor, not the DiT, whose blocks pass through
    the card: a smaller image's decode lowers it. Where the decode needs little, the DiT's sampling sets it."""
    records, lora = graph(gguf=True)
    with pytest.raises(BelowFloor) as below:
        plan(records, Card(GIB, PINNABLE), costs(), lora)
    vae = next(r for r in records if r.role == VAE)
    assert below.value.stage == VAE and below.value.stage_bytes >= vae.working_bytes
    quarter = [dataclasses.replace(r, working_bytes=r.working_bytes // 4) if r.role == VAE else r for r in records]
    with pytest.raises(BelowFloor) as smaller:
        plan(quarter, Card(GIB // 4, PINNABLE), costs(), lora)  # a 512² image's decode
    assert smaller.value.needed < below.value.needed - GIB // 4 and smaller.value.stage == DIT  # the next one
    light = [dataclasses.replace(r, working_bytes=0) if r.role == VAE else r for r in records]
    with pytest.raises(BelowFloor) as sampling:
        plan(light, Card(GIB // 4, PINNABLE), costs(), lora)
    dit = next(r for r in records if r.role == DIT)
    assert sampling.value.stage == DIT and sampling.value.stage_bytes == dit.working_bytes + dit.forms[0].block_bytes


def test_a_lora_is_counted_with_a_resident_dit():
    records, lora = graph(gguf=True, lora=True)
    chosen = plan(records, Card(int(11.1 * GIB), PINNABLE), costs(), lora)
    dit = chosen.of(DIT)
    assert dit.place == RESIDENT and dit.gpu_bytes == dit.form.weight_bytes + lora.patch_bytes
    assert "1 LoRA" in chosen.line()


@pytest.mark.parametrize("gguf", [True, False], ids=["gguf", "bf16-or-fp8"])
def test_a_gguf_dit_pays_its_loras_measured_cost_at_each_step_and_a_merged_one_none(gguf):
    """A GGUF DiT's layers add the LoRA's outputs at each call (``host/gguf_layers``): each of its runs costs the
    probe's rate per GB of the LoRA's factors more. A bf16 or FP8 DiT has the LoRA merged into its weights at load."""
    records, lora = graph(gguf=gguf, lora=True)
    card = Card(int(40 * GIB), PINNABLE)
    with_lora, without = plan(records, card, costs(), lora).of(DIT), plan(records, card, costs(), None).of(DIT)
    assert (with_lora.form, with_lora.place) == (without.form, without.place)
    added = with_lora.record.runs * costs().seconds["lora:dit_per_gb"] * lora.patch_bytes / 1e9 if gguf else 0.0
    assert with_lora.seconds - without.seconds == pytest.approx(added, abs=1e-12)
    assert not gguf or added > 0.01


def test_without_pinnable_memory_streaming_is_priced_at_the_pageable_bandwidth():
    records, lora = graph(gguf=True)
    pinned = plan(records, Card(int(7.1 * GIB), PINNABLE), costs(), lora)
    pageable = plan(records, Card(int(7.1 * GIB), 0), costs(), lora)
    assert pageable.warm > pinned.warm


def test_what_a_partial_dit_with_a_lora_gives_up_is_priced_at_the_rate_measured_with_a_lora(monkeypatch):
    """With a LoRA, what the DiT gives up to the decode and loads again cost about 1 GB/s on the 8 GB cards (the
    H200 and H100 runs, bench/RESULTS.md sessions 29 and 31), not the 2.2 GB/s measured without one."""
    from comfyui_ernie_image.nodes.plan import planner

    records, lora = graph(gguf=True, lora=True)
    card = Card(int(5.8 * GIB), PINNABLE)  # the whole DiT while it samples, part of it given to the decode
    chosen = plan(records, card, costs(), lora).of(DIT)
    assert chosen.place == PARTIAL
    streamed = chosen.form.weight_bytes + lora.patch_bytes - chosen.gpu_bytes
    given_up = chosen.copied - chosen.record.runs * streamed
    assert given_up > 0
    with_lora, without = planner.CORE_RELOAD_LORA, planner.CORE_RELOAD
    monkeypatch.setattr(planner, "CORE_RELOAD_LORA", without)
    as_without = plan(records, card, costs(), lora).of(DIT)
    assert (as_without.place, as_without.copied) == (PARTIAL, chosen.copied)
    pinned = costs().pinned
    assert chosen.seconds - as_without.seconds == pytest.approx(
        given_up / (pinned * with_lora) - given_up / (pinned * without))


def test_a_partial_dit_keeps_what_fits_and_streams_the_rest_each_step():
    """At sampling core loads what fits of the DiT beside its working memory and a block passing through; the decode
    then takes its room from the DiT, which loads it again at the next sampling: that comes on top of the layers
    streamed at every step."""
    records, lora = graph(gguf=False, pe=False)
    usable = int(6.1 * GIB)
    chosen = plan(records, Card(usable, PINNABLE), costs(), lora)
    dit, vae = chosen.of(DIT), chosen.of(VAE)
    assert dit.place == PARTIAL and 0 < dit.gpu_bytes < dit.form.weight_bytes
    assert dit.gpu_bytes == usable - BESIDE_MODELS - dit.record.working_bytes - dit.form.block_bytes
    decode = int(vae.form.weight_bytes * 1.1) + vae.record.working_bytes
    given_up = decode - (usable - BESIDE_MODELS - dit.gpu_bytes)
    assert given_up > 0
    assert dit.copied == 8 * (dit.form.weight_bytes - dit.gpu_bytes) + given_up
    assert vae.place == PER_PROMPT  # the sampler's load evicts it


@pytest.mark.parametrize("kinds", GRAPHS, ids=lambda k: "-".join(n for n, on in k.items() if on) or "turbo")
def test_no_model_core_loads_is_planned_resident_beside_a_partial_dit(kinds):
    """Core's sampler frees the partial DiT's offloaded bytes by unloading every other model it holds, then loads
    the DiT whole where it can (model_management.load_models_gpu, 0.3.75 and upstream @02b2b388). On the H200
    (2026-12-05, the PE workflow on 12 and 16 GB) the plan kept the PE "resident" beside a partial DiT: core loaded
    the PE again every prompt (7.3 GB), the DiT then whole, and the prompt took 4-5 x the prediction."""
    _, _, plans = _sweep(**kinds)
    for size, p in plans:
        if p is not None and p.of(DIT).place == PARTIAL:
            others = [pl for pl in p.placements if pl.role != DIT]
            assert all(pl.place != RESIDENT for pl in others), (size, p.line())


def test_the_pe_workflow_on_16gb_keeps_the_pe_and_the_dit_where_core_keeps_them():
    """The PE workflow on a 16 GB card (15.1 GiB usable): the PE in fp8 beside an FP8 DiT, both resident, the text
    encoder streamed: nothing core must evict per prompt (before: the bf16 PE "resident" beside a partial DiT)."""
    records, lora = graph(gguf=False, pe=True)
    chosen = plan(records, Card(int(15.1 * GIB), PINNABLE), costs(), lora)
    assert chosen.of(DIT).place == RESIDENT and chosen.of(PROMPT_ENHANCER).place == RESIDENT, chosen.line()
    assert chosen.of(TEXT_ENCODER).place in (STREAMED, RESIDENT), chosen.line()
    assert chosen.peak <= chosen.card.usable


def test_records_count_the_language_models_bytes_from_their_shapes():
    te = language_model_record(TEXT_ENCODER, "te", lm_tensors(), runs=1, working=FLOOR)
    bf16, fp8 = te.forms
    assert 6.4e9 < bf16.weight_bytes < 7.0e9  # the text encoder's language model: 3.4 B values in bf16
    assert 3.6e9 < fp8.weight_bytes < 4.2e9  # its decoder linears in one byte, the 0.8 GB embedding as stored
    assert fp8.block_bytes * 26 < fp8.weight_bytes and fp8.block_bytes > 0
    assert Tensor("layers.0.x.weight", (4, 4)).fp8 == 16 + 4 * 4


def test_a_gguf_text_encoder_is_one_form_of_its_file():
    """A llama.cpp GGUF of the text encoder: its blocks as stored, counted per ``blk.N.`` layer; fp8 asked of it is
    left to its loader, which refuses it."""
    from comfyui_ernie_image.nodes.plan.describe import gguf_tensor

    tensors = [gguf_tensor("token_embd.weight", (131072, 3072), "Q6_K", 131072 * 3072 // 256 * 210)]
    for i in range(26):
        for name, shape in (("attn_q", (4096, 3072)), ("ffn_up", (9216, 3072))):
            tensors.append(gguf_tensor(f"blk.{i}.{name}.weight", shape, "Q4_K", shape[0] * shape[1] // 256 * 144))
    record = language_model_record(TEXT_ENCODER, "te.gguf", tensors, runs=1, working=FLOOR,
                                   fixed_form="fp8_e4m3fn")
    (form,) = record.forms
    assert (form.name, form.setting, form.compute) == ("GGUF Q4_K", "default", "text:gguf:Q4_K")
    assert form.weight_bytes == sum(t.stored for t in tensors) and form.block_bytes * 26 < form.weight_bytes
    assert record.fixed_form is None


def test_compiled_forms_are_priced_at_what_compiling_measured_so_a_larger_card_never_picks_a_slower_dit():
    """The H200 run of 2026-12-05 (bench/RESULTS.md): the probe's eager forwards, dit:bf16 0.143 s and FP8 matmul
    0.156 s, against the compiled warm sampler, bf16 1.0 s and FP8 0.7 s for 8 steps. With one compile factor for
    every form (GGUF's, 1.2 / 2.2) the plan predicted bf16 faster and chose it on a 24 GB card, measured 1.32 s against
    the FP8 DiT's 0.97 s on 16 GB; priced per form, FP8 is chosen wherever it fits, and bf16's predicted time is
    within 10 % of the measured one."""
    from comfyui_ernie_image.nodes.plan.costs import Costs
    from comfyui_ernie_image.nodes.plan.describe import dit_record, vae_record
    from helpers.plan_records import dit_tensors

    h200 = Costs("H200", 25e9, 8e9, {"dit:bf16": 0.143, "dit:fp8_cast": 0.189, "dit:fp8_matmul": 0.156,
                                     "dit:gguf:Q4_K": 0.301, "text:bf16": 0.011, "text:fp8": 0.0272}, {})

    def turbo(fp8_matmul: bool):
        return [dit_record("dit", dit_tensors(), gguf_type=None, fp8_matmul=fp8_matmul, runs=8, working=FLOOR,
                           compiles=True),
                language_model_record(TEXT_ENCODER, "te", lm_tensors(), runs=1, working=FLOOR),
                vae_record("vae", [Tensor("decoder.w", (84_000_000,))], working=int(1.2 * GIB))]

    for usable in (15.1, 23.1, 40):
        chosen = plan(turbo(True), Card(int(usable * GIB), PINNABLE), h200).of(DIT)
        assert (chosen.form.name, chosen.place) == ("FP8 (torchao)", RESIDENT), usable
    bf16 = plan(turbo(False), Card(40 * GIB, PINNABLE), h200).of(DIT)
    assert bf16.form.name == "bf16" and abs(bf16.seconds - 1.0) <= 0.1  # measured: 1.0 s for the 8 steps


def test_a_per_prompt_text_encoder_pe_or_vae_is_copied_in_once_from_its_pinned_host_copy():
    """The text encoder, the PE and the VAE keep their host copy once core has unloaded them
    (``host/host_copy.py``): a per-prompt load is one copy in at the pinned rate, nothing comes back; where neither
    core's bound on pinned memory nor the host RAM has room for it, it keeps none and moves both ways at the pageable
    rate."""
    records, lora = graph(gguf=False, pe=True)
    rates = costs()
    for pinnable, moves in ((PINNABLE, lambda b: b / rates.pinned), (0, lambda b: 2 * b / rates.pageable)):
        chosen = plan(records, Card(int(11.1 * GIB), pinnable), rates, lora)
        pe = chosen.of(PROMPT_ENHANCER)
        assert pe.place == PER_PROMPT, chosen.line()
        run = rates.seconds[pe.form.compute]
        assert pe.seconds == pytest.approx(64 * run + moves(pe.form.weight_bytes)), chosen.line()
    records, lora = graph(gguf=True)
    vae_only = [dataclasses.replace(r, places=(PER_PROMPT,)) if r.role == VAE else r for r in records]
    for pinnable, moves in ((PINNABLE, lambda b: b / rates.pinned), (0, lambda b: 2 * b / rates.pageable)):
        vae = plan(vae_only, Card(int(11.1 * GIB), pinnable), rates, lora).of(VAE)
        png = rates.cpu_seconds["image:png"]  # its image saved after the decode, wherever the VAE runs
        assert vae.seconds == pytest.approx(rates.seconds["vae"] + png + moves(vae.form.weight_bytes))


def test_a_per_prompt_fp8_dit_keeps_its_host_copy_but_not_with_a_lora():
    """The torchao DiT loaded whole per prompt keeps its host copy like the language models; with a LoRA its layers
    are merged and quantized again at each load, so it is copied in and back out at the pageable rate."""
    rates = costs()
    for with_lora, expected in ((False, lambda b: b / rates.pinned), (True, lambda b: 2 * b / rates.pageable)):
        records, lora = graph(gguf=False, lora=with_lora)
        forced = [dataclasses.replace(r, places=(PER_PROMPT,), fixed_form="fp8_per_row/default")
                  if r.role == DIT else r for r in records]
        dit = plan(forced, Card(int(24 * GIB), PINNABLE), rates, lora).of(DIT)
        assert dit.form.name == "FP8 (torchao)" and dit.place == PER_PROMPT
        run = rates.seconds[dit.form.compute] * dit.form.compiled
        assert dit.seconds == pytest.approx(8 * run + expected(dit.form.weight_bytes)), with_lora


def test_the_plan_keeps_the_models_within_the_host_ram_the_machine_leaves_them():
    """The PE workflow on a 12 GB card (11.1 GiB usable): with RAM to spare the plan holds the PE, the text encoder
    and the DiT in host RAM between their stages, more than a 32 GB machine with a browser open leaves (14 GiB
    here); there it picks the fastest plan within that, and the line says what it holds."""
    records, lora = graph(gguf=False, pe=True)
    usable = int(11.1 * GIB)
    spacious = plan(records, Card(usable, PINNABLE), costs(), lora)
    room = 14 * GIB
    assert spacious.host > room, spacious.line()
    tight = plan(records, Card(usable, PINNABLE, room), costs(), lora)
    assert tight.host <= room and not tight.over_host, tight.line()
    assert tight.warm >= spacious.warm
    assert f"; {tight.host / GIB:.1f} GiB held in host RAM" in tight.line()
    for placement in tight.placements:  # what is not on the GPU between stages is on the host
        whole = placement.form.weight_bytes + (lora.patch_bytes if lora and placement.role == DIT else 0)
        assert placement.host_bytes >= whole - placement.gpu_bytes, tight.line()


def test_where_no_plan_fits_the_host_ram_the_plan_prices_the_swapping_and_says_so():
    """The PE workflow on a 12 GB card of a machine that leaves its models 8 GiB: every plan holds more, so each is
    priced with the bytes over written out and read back each prompt; the chosen one says so and beats the one
    that swaps less (the PE in fp8 on the CPU, 64 tokens at the CPU's pace)."""
    records, lora = graph(gguf=False, pe=True)
    usable, room = int(11.1 * GIB), 8 * GIB
    chosen = plan(records, Card(usable, PINNABLE, room), costs(), lora)
    assert chosen.over_host and "more than the 8.0 GiB it has free: the system swaps" in chosen.line()
    unpriced = sum(p.seconds for p in chosen.placements)
    assert chosen.warm == pytest.approx(unpriced + 2 * (chosen.host - room) / SWAP_BYTES_PER_S)
    on_cpu = [dataclasses.replace(r, places=(CPU,), fixed_form="fp8_e4m3fn") if r.role == PROMPT_ENHANCER else r
              for r in records]
    least = plan(on_cpu, Card(usable, PINNABLE, room), costs(), lora)
    assert least.host < chosen.host and least.warm > chosen.warm, (least.line(), chosen.line())


@pytest.mark.parametrize("gguf", [True, False], ids=["gguf", "turbo"])
def test_a_dit_with_a_lora_holds_its_weights_and_the_lora_in_host_ram_wherever_it_runs(gguf):
    """Core keeps the original of each weight a LoRA patches on the offload device while the patched one is loaded
    (``ModelPatcher.patch_weight_to_device``'s backup), and the LoRA's tensors stay there: resident, partial or loaded
    per prompt, a DiT with a LoRA holds its weights and the LoRA in host RAM; without one, a resident DiT holds
    none."""
    records, lora = graph(gguf=gguf, lora=True)
    places = set()
    for size in (6, 7, 8, 12, 16, 24, 48):
        chosen = plan(records, Card(int(size * GIB), PINNABLE), costs(), lora)
        dit = chosen.of(DIT)
        places.add(dit.place)
        assert dit.host_bytes == dit.form.weight_bytes + lora.patch_bytes, chosen.line()
    assert RESIDENT in places and places - {RESIDENT}, places
    plain = plan(graph(gguf=gguf)[0], Card(48 * GIB, PINNABLE), costs())
    assert plain.of(DIT).place == RESIDENT and plain.of(DIT).host_bytes == 0


def test_every_plan_counts_the_vaes_decode_scaled_by_the_images_pixels():
    """The probe times one 1024² decode (``vae``): a plan's warm prompt counts it once, scaled by the images' pixels
    as the DiT's steps are (a 2048² image: four times), and it changes no choice; costs without it count none (the
    decode then took 0.1-0.15 s of every measured prompt that no prediction had, bench/RESULTS.md session 30)."""
    rates, card = costs(), Card(int(11.1 * GIB), PINNABLE)
    records, lora = graph()
    png = rates.cpu_seconds["image:png"]  # the decoded image saved, counted with the decode (below)
    chosen = plan(records, card, rates, lora)
    assert chosen.of(VAE).seconds == pytest.approx(rates.seconds["vae"] + png), chosen.line()
    larger = [dataclasses.replace(r, compute_scale=4.0) if r.role == VAE else r for r in records]
    assert plan(larger, card, rates, lora).of(VAE).seconds == pytest.approx(4 * (rates.seconds["vae"] + png))
    unmeasured = plan(records, card, dataclasses.replace(
        rates, seconds={k: v for k, v in rates.seconds.items() if k != "vae"}), lora)
    assert unmeasured.of(VAE).seconds == pytest.approx(png)
    assert unmeasured.line().split(";")[0] == chosen.line().split(";")[0]
    assert chosen.warm == pytest.approx(unmeasured.warm + rates.seconds["vae"])


def test_a_pe_whose_decode_runs_in_cuda_graphs_is_priced_at_that_rate_and_any_other_at_the_probes_eager_one():
    """The PE decodes in CUDA graphs on CUDA (``pe/local``'s ``auto``): its token costs the probe's eager token times
    ``GRAPHED_PE`` (measured against it on the GPU), and the text encoder, a GGUF PE and a PE off CUDA cost the eager
    token (every PE token priced eager put 64 tokens of fp8 at 4.5 times their measured time)."""
    def pe(graphed: frozenset[str]):
        return language_model_record(PROMPT_ENHANCER, "pe", lm_tensors(lm_head=True), runs=64, working=FLOOR,
                                     streams=False, graphed=graphed)

    for graphed in (frozenset(), frozenset({"bf16"}), frozenset({"bf16", "fp8"})):
        factors = {form.name: form.compiled for form in pe(graphed).forms}
        assert factors == {name: GRAPHED_PE[name] if name in graphed else 1.0 for name in ("bf16", "fp8")}
    text = language_model_record(TEXT_ENCODER, "te", lm_tensors(), runs=1, working=FLOOR,
                                 graphed=frozenset({"bf16", "fp8"}))
    assert {form.compiled for form in text.forms} == {1.0}
    rates = costs()
    records, lora = graph(gguf=False, pe=True)
    compiled = [pe(frozenset({"bf16", "fp8"})) if r.role == PROMPT_ENHANCER else r for r in records]
    chosen = plan(compiled, Card(int(40 * GIB), PINNABLE), rates, lora).of(PROMPT_ENHANCER)
    assert chosen.place == RESIDENT
    assert chosen.seconds == pytest.approx(64 * rates.seconds[chosen.form.compute] * GRAPHED_PE[chosen.form.name])


def test_the_decoded_image_saved_as_a_png_is_in_the_predicted_prompt_and_changes_no_choice():
    """Every measured prompt saves its image as a PNG on the CPU after the decode (SaveImage: 0.21-0.37 s of
    1.64-1.95 s in the H100's card sweep of session 31, bench/RESULTS.md, where every prediction was 0.3-0.45 s
    short): the plan counts the probe's ``image:png`` once per 1024² of pixels, and chooses as it would without it."""
    records, lora = graph(gguf=True, lora=True)
    measured = costs()
    unmeasured = dataclasses.replace(measured, cpu_seconds={k: v for k, v in measured.cpu_seconds.items()
                                                            if k != "image:png"})
    for size in (6, 8, 12, 24):
        card = Card(int(size * GIB), PINNABLE)
        counted, uncounted = plan(records, card, measured, lora), plan(records, card, unmeasured, lora)
        assert [(p.form, p.place) for p in counted.placements] == [(p.form, p.place) for p in uncounted.placements]
        assert counted.warm == pytest.approx(uncounted.warm + 0.2), size
    four = [dataclasses.replace(r, compute_scale=4.0) if r.role == VAE else r for r in records]  # 2048², or 4 images
    card = Card(24 * GIB, PINNABLE)
    assert plan(four, card, measured, lora).warm == pytest.approx(plan(four, card, unmeasured, lora).warm + 0.8)
