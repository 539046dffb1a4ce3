"""The memory plan inside a real ComfyUI 0.3.75 core, for the models' true sizes (sparse files: true headers, no
data) on a card the CPU cannot be: core's memory queries answer for a 10 GB CUDA card, and the probe's costs are
given (no GPU to measure). Both are faults a CPU cannot produce, so the tests say so in their names."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging

import pytest
import torch
from torch.overrides import TorchFunctionMode

from conftest import REPO
from helpers.card_faults import answer_as_card
from helpers.plan_files import sparse_gguf_dit, sparse_safetensors, sparse_text_encoder, sparse_vae
from helpers.plan_records import GIB, costs

HOST_ROOM = 48 * GIB


@pytest.fixture(autouse=True)
def no_plan_after():
    """No plan outlives a test: loaders run later without a prompt would follow it."""
    from comfyui_ernie_image.nodes.plan import session

    yield
    session.forget()


@pytest.fixture
def card(monkeypatch):
    """``card(gib)``: core's memory queries answer for a CUDA card of ``gib`` GiB with nothing loaded (fault)."""
    import comfy.cli_args
    import comfy.model_management as mm

    from comfyui_ernie_image.nodes import planning

    def answer(gib: float) -> None:
        answer_as_card(monkeypatch.setattr, mm, comfy.cli_args.args, gib)
        monkeypatch.setattr(planning, "costs_here", lambda device: costs())
        monkeypatch.setattr(planning, "host_room", lambda: HOST_ROOM)  # the host RAM of a 64 GB machine, not CI's
        monkeypatch.setenv(planning.STREAM_TEXT_ENCODER_ENV, "on")
        planning._made.clear()
        planning._unmeasured.clear()

    return answer


@pytest.fixture
def true_size_files(placed, comfy_paths, tiny_models):
    comfy_paths.add_model_folder_path("vae", str(tiny_models["models_dir"] / "vae"), is_default=True)
    return {
        "dit": sparse_gguf_dit(placed("diffusion_models", "plan-10gb/ernie-image-turbo-Q4_K.gguf")),
        "text": sparse_text_encoder(placed("text_encoders", "plan-10gb/ministral-3-3b.safetensors")),
        "vae": sparse_vae(placed("vae", "plan-10gb/flux2-vae.safetensors")),
        "lora": sparse_safetensors(placed("loras", "plan-10gb/lora.safetensors"),
                                   {f"layers.{i}.mlp.up_proj.lora_{ab}.weight": shape for i in range(36)
                                    for ab, shape in (("A", (16, 4096)), ("B", (12288, 16)))}),
    }


def _gguf_graph(te_device: str = "auto", te_weight_dtype: str = "auto") -> dict:
    """The shipped GGUF workflow's API twin on the true-size files."""
    prompt = json.loads((REPO / "tests" / "workflows" / "ernie_image_turbo_gguf.json").read_text())
    for node in prompt.values():
        inputs = node["inputs"]
        if node["class_type"] == "ErnieImageDiTLoader":
            inputs.update(model_name="diffusion_models/plan-10gb/ernie-image-turbo-Q4_K.gguf", quantization="auto")
        elif node["class_type"] == "ErnieImageTextEncoderLoader":
            inputs.update(model_name="text_encoders/plan-10gb/ministral-3-3b.safetensors", device=te_device,
                          weight_dtype=te_weight_dtype)
        elif node["class_type"] == "ErnieImageVAELoader":
            inputs.update(vae_name="vae/plan-10gb/flux2-vae.safetensors")
    return prompt


def _with_lora(prompt: dict) -> dict:
    prompt = copy.deepcopy(prompt)
    dit = next(k for k, n in prompt.items() if n["class_type"] == "ErnieImageDiTLoader")
    prompt["lora"] = {"class_type": "ErnieImageLoraLoader",
                      "inputs": {"model": [dit, 0], "lora_name": "plan-10gb/lora.safetensors", "strength_model": 1.0}}
    for node in prompt.values():
        for name, value in node["inputs"].items():
            if value == [dit, 0] and node is not prompt["lora"]:
                node["inputs"][name] = ["lora", 0]
    return prompt


def test_on_a_10gb_card_faked_in_cores_memory_queries_the_plan_streams_the_text_encoder_and_keeps_the_dit(
        card, true_size_files, caplog):
    """Today the text encoder (fp8, 3.7 GB) is judged to fit alone (``fits_whole``) and is loaded whole for each
    prompt beside a DiT that, with it and the decode, does not fit: core unloads one of them at every prompt. The
    plan keeps the DiT and the VAE on the card and streams the text encoder's layers through it."""
    import torch

    from comfyui_ernie_image.nodes import planning
    from comfyui_ernie_image.nodes.host.memory import fits_whole, torch_device
    from comfyui_ernie_image.nodes.plan.records import DIT, RESIDENT, STREAMED, TEXT_ENCODER, VAE

    card(10)
    device = torch_device()
    with caplog.at_level(logging.INFO):
        plan = planning.make_plan(_gguf_graph())
    assert plan is not None
    te, dit, vae = plan.of(TEXT_ENCODER), plan.of(DIT), plan.of(VAE)
    assert fits_whole(te.form.weight_bytes, device)  # today's rule: the text encoder alone fits
    beside = dit.form.weight_bytes + vae.form.weight_bytes + te.form.weight_bytes + vae.record.working_bytes
    assert beside > plan.card.usable  # ... but not beside the DiT and the decode
    assert (te.place, te.form.setting) == (STREAMED, "fp8_e4m3fn")
    assert dit.place == RESIDENT and vae.place == RESIDENT and plan.peak <= plan.card.usable
    assert 9.0 < plan.card.usable / GIB < 9.2  # 10 GiB less a CUDA context and core's reserve
    line = next(r.getMessage() for r in caplog.records if "plan for" in r.getMessage())
    assert line.startswith("ERNIE-Image: plan for 9.1 GiB usable: text encoder fp8 streamed")
    assert "DiT GGUF Q4_K resident" in line and "predicted warm" in line
    assert device == torch.device("cpu")  # the fault: the CPU answered as a 10 GB CUDA card


def test_explicit_values_of_a_saved_workflow_are_planned_around_on_a_faked_10gb_card(card, true_size_files):
    from comfyui_ernie_image.nodes import planning
    from comfyui_ernie_image.nodes.plan.records import CPU, PER_PROMPT, RESIDENT, TEXT_ENCODER

    card(10)
    plan = planning.make_plan(_gguf_graph("default", "fp8_e4m3fn"))  # as the workflow was saved before auto
    te = plan.of(TEXT_ENCODER)
    assert te.form.setting == "fp8_e4m3fn" and te.place in (RESIDENT, PER_PROMPT, CPU)
    assert f"text encoder fp8 (as set) {te.place} (device as set)" in plan.line()  # the plan says it kept them
    assert "(as set)" not in planning.make_plan(_gguf_graph()).line()  # auto: nothing is set


def test_adding_a_lora_to_a_graph_that_has_run_makes_a_new_plan_on_a_faked_10gb_card(card, true_size_files, caplog):
    from comfyui_ernie_image.nodes import planning
    from comfyui_ernie_image.nodes.plan import session

    card(10)
    session.register(planning.make_plan)
    with caplog.at_level(logging.INFO):
        first = session.plan_for(_gguf_graph())
        again = session.plan_for(_gguf_graph())  # the same graph again: the same plan, not logged again
        with_lora = session.plan_for(_with_lora(_gguf_graph()))
    lines = [r.getMessage() for r in caplog.records if "plan for" in r.getMessage()]
    assert again is first and len(lines) == 2
    assert with_lora is not first and with_lora.lora is not None and "1 LoRA" in lines[1]


def test_below_the_floor_the_error_names_the_least_memory_and_what_lowers_it_on_a_faked_2gb_card(
        card, true_size_files):
    from comfyui_ernie_image.nodes import planning
    from comfyui_ernie_image.nodes.errors import ErnieImageError

    card(2)
    with pytest.raises(ErnieImageError, match=r"need at least \d+\.\d GiB .* smallest card they can serve is about "
                       r"\d+\.\d GiB .* make a smaller image: the VAE's decode of this image size needs 1\.\d GiB "
                       r"by itself, and no smaller file lowers that\.$"):
        planning.make_plan(_gguf_graph())  # 1024²: the decode sets the floor, not the DiT (whose blocks stream)


@pytest.mark.parametrize(("gguf_type", "advice"), [
    ("Q4_K", "or download a smaller GGUF of the DiT (Q3_K_M or Q2_K) into models/diffusion_models"),
    ("Q3_K", "or download a smaller GGUF of the DiT (Q2_K) into models/diffusion_models"),
    ("Q2_K", None),
    (None, "or download a GGUF of the DiT (the community's Q4_K_M, 5.2 GB) into models/diffusion_models"),
])
def test_below_a_floor_the_dits_sampling_sets_a_smaller_gguf_is_named_only_where_one_exists(gguf_type, advice):
    """Where the DiT's sampling sets the floor (its working memory and one block passing through), a smaller GGUF
    type than the file's lowers it; a Q2_K file has none smaller, and the words do not offer one."""
    from comfyui_ernie_image.nodes import planning
    from comfyui_ernie_image.nodes.plan.planner import BelowFloor, Card, plan
    from comfyui_ernie_image.nodes.plan.records import DIT, VAE
    from helpers.plan_records import graph

    records, _ = graph(gguf=gguf_type is not None)
    records = [dataclasses.replace(r, working_bytes=0) if r.role == VAE else
               dataclasses.replace(r, forms=tuple(dataclasses.replace(f, gguf_type=gguf_type) for f in r.forms))
               if r.role == DIT and gguf_type else r for r in records]
    with pytest.raises(BelowFloor) as below:
        plan(records, Card(GIB // 4, 16 * GIB), costs())
    words = planning.below_floor_words(below.value, GIB // 4, GIB, records)
    assert below.value.stage == DIT and "or make a smaller image (the DiT's sampling of this image size needs" in words
    if advice is None:
        assert "download" not in words and words.endswith("GiB).")
    else:
        assert advice in words


class OutOfMemoryOnce(TorchFunctionMode):
    """A GPU that fills up at the first attention of a sampling step, once (injected: the CPU cannot run out)."""

    def __init__(self):
        super().__init__()
        self.raised = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.scaled_dot_product_attention and not self.raised:
            self.raised += 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 198.00 MiB")
        return func(*args, **(kwargs or {}))


def test_an_out_of_memory_in_a_planned_step_replans_and_retries_once_injected_oom(card, true_size_files, tiny_models,
                                                                                    caplog):
    from comfyui_ernie_image.nodes import planning
    from comfyui_ernie_image.nodes.dit.build import load_dit
    from comfyui_ernie_image.nodes.dit.model import make_model_patcher
    from comfyui_ernie_image.nodes.plan import session
    from helpers.accel import sample

    card(10)
    session.register(planning.make_plan)
    first = session.plan_for(_gguf_graph())
    model = make_model_patcher(load_dit(tiny_models["snapshot"], torch.float32))
    with caplog.at_level(logging.WARNING), OutOfMemoryOnce() as fault:
        sample(model, steps=1, cfg=1.0)  # the step ran out once, and ran again
    assert fault.raised == 1
    assert any("planning again with" in r.getMessage() and "retrying once" in r.getMessage() for r in caplog.records)
    corrected = session.plan_for(_gguf_graph())  # the next prompt: a plan for less memory
    assert corrected is not first and corrected.card.usable < first.card.usable - 2**27  # less 256 MiB (tiny DiT added)
    with OutOfMemoryOnce(), OutOfMemoryOnce(), pytest.raises(torch.OutOfMemoryError, match="ERNIE-Image: "):
        sample(model, steps=1, cfg=1.0)  # twice in one step of the corrected plan: no second retry, the advice


def test_without_a_plan_an_out_of_memory_is_not_retried_injected_oom(tiny_models):
    from comfyui_ernie_image.nodes.dit.build import load_dit
    from comfyui_ernie_image.nodes.dit.model import make_model_patcher
    from helpers.accel import sample

    model = make_model_patcher(load_dit(tiny_models["snapshot"], torch.float32))
    with OutOfMemoryOnce() as fault, pytest.raises(torch.OutOfMemoryError, match="ERNIE-Image: "):
        sample(model, steps=1, cfg=1.0)
    assert fault.raised == 1


@pytest.mark.parametrize(("twin", "steps", "forwards", "pe_tokens"), [("ernie_image_pe_local", 8, 1, 2048),
                                                                       ("ernie_image_base", 50, 2, None)])
def test_the_graph_is_read_for_its_models_and_the_prompts_size(comfy_paths, tiny_models, twin, steps, forwards,
                                                               pe_tokens):
    """A shipped workflow's graph (its API twin) on the tiny snapshot: the all-in-one loader's DiT, text encoder, VAE
    and, where the graph enhances prompts, its PE; the steps, CFG's second pass, the PE's new tokens and the latent."""
    from comfyui_ernie_image.nodes import planning

    prompt = json.loads((REPO / "tests" / "workflows" / f"{twin}.json").read_text())
    snapshot = tiny_models["snapshot"]
    for node in prompt.values():
        if node["class_type"] == "ErnieImageLoader":
            node["inputs"]["model_name"] = f"diffusers/{snapshot.name}"
    want = planning.wanted(prompt)
    assert want.dit[0] == snapshot and want.text[:2] == (snapshot, True)
    assert want.vae == snapshot / "vae" / "diffusion_pytorch_model.safetensors"
    assert (want.pe is not None) == (pe_tokens is not None) and (want.pe is None or want.pe[0] == snapshot / "pe")
    assert (want.steps, want.forwards, want.latent) == (steps, forwards, (1, 128, 64, 64))
    if pe_tokens:
        assert want.pe_tokens == pe_tokens


def test_the_dits_steps_and_the_vaes_decode_are_priced_by_the_images_pixels(comfy_paths, tiny_models):
    """A 2048² image: the DiT's steps and the VAE's decode (the probe times both at 1024²) cost four times as much
    (on main the decode was priced at 1024² whatever the size)."""
    from comfyui_ernie_image.nodes import planning
    from comfyui_ernie_image.nodes.plan.records import DIT, VAE

    prompt = json.loads((REPO / "tests" / "workflows" / "ernie_image_turbo.json").read_text())
    for node in prompt.values():
        if node["class_type"] == "ErnieImageLoader":
            node["inputs"]["model_name"] = f"diffusers/{tiny_models['snapshot'].name}"
        if node["class_type"] == "EmptyFlux2LatentImage":
            node["inputs"].update(width=2048, height=2048)
    found, _ = planning.records(planning.wanted(prompt), torch.device("cpu"))
    assert {r.role: r.compute_scale for r in found if r.role in (DIT, VAE)} == {DIT: 4.0, VAE: 4.0}


@pytest.mark.parametrize("flag", ["gpu_only", "highvram", "lowvram", "novram"])
def test_under_a_placement_flag_core_places_the_models_on_a_faked_10gb_card(card, true_size_files, monkeypatch, flag,
                                                                            caplog):
    import comfy.cli_args

    from comfyui_ernie_image.nodes import planning

    card(10)
    monkeypatch.setattr(comfy.cli_args.args, flag, True)
    planning._said.clear()
    with caplog.at_level(logging.INFO):
        assert planning.make_plan(_gguf_graph()) is None
    words = f"--{flag.replace('_', '-')}: models are placed as ComfyUI places them (no memory plan)"
    assert any(words in r.getMessage() for r in caplog.records)


def test_a_fault_in_the_plan_leaves_placement_to_core_and_says_so_injected_fault(card, true_size_files, monkeypatch,
                                                                                   caplog):
    """A fault of the plan itself (injected: none is known) must not stop the prompt."""
    from comfyui_ernie_image.nodes import planning

    card(10)

    def broken(want, device):
        raise RuntimeError("injected")

    monkeypatch.setattr(planning, "records", broken)
    with caplog.at_level(logging.WARNING):
        assert planning.make_plan(_gguf_graph()) is None
    assert any("the memory plan failed" in r.getMessage() for r in caplog.records)


def test_a_gguf_text_encoder_is_planned_as_its_file_on_a_faked_10gb_card(card, true_size_files, placed):
    """A llama.cpp GGUF of the text encoder (the tiny fixture) in the graph: the plan's text encoder form is the
    file's type, counted as it is held once loaded (``ministral_gguf.held_bytes``)."""
    import shutil

    from comfyui_ernie_image.nodes import planning
    from comfyui_ernie_image.nodes.plan.records import RESIDENT, TEXT_ENCODER

    fixture = REPO / "tests" / "fixtures" / "gguf" / "ernie-image-text-encoder-tiny-Q8_0.gguf"
    shutil.copyfile(fixture, placed("text_encoders", "plan-10gb/te-Q8_0.gguf"))
    prompt = _gguf_graph()
    for node in prompt.values():
        if node["class_type"] == "ErnieImageTextEncoderLoader":
            node["inputs"]["model_name"] = "text_encoders/plan-10gb/te-Q8_0.gguf"
    card(10)
    te = planning.make_plan(prompt).of(TEXT_ENCODER)
    assert (te.form.name, te.form.setting, te.place) == ("GGUF Q8_0", "default", RESIDENT)
    assert 0 < te.form.weight_bytes < fixture.stat().st_size


def test_a_strangers_graph_with_values_of_any_json_type_is_read_without_error(comfy_paths):
    """The plan reads every node's widget values before those nodes run and check them: a shared workflow's dict,
    list, number or null where a name or a choice goes is read as the loader's default, never raised on."""
    from comfyui_ernie_image.nodes import planning

    odd = [{"a": 1}, [1], 5, None, 1e300, True]
    prompt = {str(i): {"class_type": kind, "inputs": {name: value for name in names}}
              for i, (kind, names) in enumerate([
                  ("ErnieImageLoader", ("model_name", "quantization", "text_encoder", "text_encoder_device",
                                        "prompt_enhancer")),
                  ("ErnieImageDiTLoader", ("model_name", "quantization", "weight_dtype")),
                  ("ErnieImageTextEncoderLoader", ("model_name", "device", "weight_dtype")),
                  ("ErnieImagePELoader", ("model_name", "device")), ("VAELoader", ("vae_name",)),
                  ("LoraLoaderModelOnly", ("lora_name", "strength_model")),
                  ("EmptyFlux2LatentImage", ("width", "height", "batch_size")), ("KSampler", ("steps", "cfg")),
                  ("ErnieImagePromptEnhance", ("max_new_tokens",))])
              for value in odd[:1]}
    for value in odd:
        for node in prompt.values():
            node["inputs"] = dict.fromkeys(node["inputs"], value)
        want = planning.wanted({**prompt, "x": [1, 2], "y": {"class_type": 3, "inputs": [4]}})
        assert want.dit is None and want.text is None and want.pe is None and want.loras == ()
        hash(want)  # kept as a key of the plans made


def test_an_explicit_weight_dtype_under_quantization_auto_is_kept_on_a_faked_24gb_card(card, placed, comfy_paths,
                                                                                          tiny_models):
    """``quantization`` auto with ``weight_dtype`` fp8_e4m3fn set: the plan keeps fp8 storage (it would pick
    another form on a 24 GB card), and says so."""
    from comfyui_ernie_image.nodes import planning
    from comfyui_ernie_image.nodes.plan.records import DIT
    from helpers.plan_files import sparse_safetensors
    from helpers.plan_records import dit_tensors

    sparse_safetensors(placed("diffusion_models", "plan-24gb/ernie-image-turbo.safetensors"),
                       {t.name: t.shape for t in dit_tensors()})
    prompt = _gguf_graph()
    for node in prompt.values():
        if node["class_type"] == "ErnieImageDiTLoader":
            node["inputs"].update(model_name="diffusion_models/plan-24gb/ernie-image-turbo.safetensors",
                                  quantization="auto", weight_dtype="fp8_e4m3fn")
        if node["class_type"] in ("ErnieImageTextEncoderLoader", "ErnieImageVAELoader"):
            node["class_type"] = "Unused"  # the DiT alone
    card(24)
    assert planning.make_plan(prompt).of(DIT).form.setting == "none/fp8_e4m3fn"
    for node in prompt.values():
        if node["class_type"] == "ErnieImageDiTLoader":
            node["inputs"]["weight_dtype"] = "default"
    assert planning.make_plan(prompt).of(DIT).form.setting != "none/fp8_e4m3fn"


def test_a_probe_that_cannot_measure_leaves_placement_to_core_and_says_so_injected_fault(card, true_size_files,
                                                                                          monkeypatch, caplog):
    """The probe failing on a GPU (injected: none is known) must not stop the prompt: no plan, and one warning that
    names what failed. The probe is not run again at the next plan request (each loader and encode node asks, and a
    probe takes up to 15 s)."""
    from comfyui_ernie_image.nodes import planning

    card(10)
    probes = []

    def failing(device):
        probes.append(device)
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(planning, "costs_here", failing)
    planning._said.clear()
    with caplog.at_level(logging.WARNING):
        assert planning.make_plan(_gguf_graph()) is None
        assert planning.make_plan(_gguf_graph()) is None
    said = [r.getMessage() for r in caplog.records if "could not be measured" in r.getMessage()]
    assert said == ["ERNIE-Image: the costs of this GPU could not be measured (RuntimeError: CUDA error: an illegal "
                    "memory access was encountered): models are placed as ComfyUI places them (no memory plan; "
                    "measured again when ComfyUI restarts)"]
    assert len(probes) == 1


def test_a_text_encoder_the_plan_put_on_the_cpu_comes_back_to_the_gpu_in_the_plans_new_form_on_faked_cards(
        card, true_size_files, tiny_models, monkeypatch, caplog):
    """A card with little free (5 GiB: a display and other programs hold the rest) puts the text encoder on the CPU
    as stored; when the card frees up (12 GiB) the next prompt's plan holds it on the GPU in fp8. ComfyUI does not
    run the loader again (its inputs are the same), so the encode node moves it and reads it again in the new form.
    Before, an encoder the plan had put on the CPU stayed there until the loader ran again. (Tiny weights under a
    plan made for the true-size files: the cards' sizes are faked.)"""
    from comfyui_ernie_image.nodes import planning
    from comfyui_ernie_image.nodes.plan import session
    from comfyui_ernie_image.nodes.plan.records import CPU, RESIDENT, TEXT_ENCODER
    from comfyui_ernie_image.nodes.text.encoder import ErnieTextEncoder
    from comfyui_ernie_image.nodes.text.nodes import TEXT_ENCODER_MODELS, ErnieImageTextEncode, load_text_encoder

    session.register(planning.make_plan)
    card(5)
    monkeypatch.setenv(planning.STREAM_TEXT_ENCODER_ENV, "off")  # core's places alone: resident, per prompt, CPU
    graph = _gguf_graph()
    assert (session.plan_for(graph).of(TEXT_ENCODER).place, session.place(TEXT_ENCODER)) == (CPU, CPU)
    tiny = TEXT_ENCODER_MODELS.resolve("text_encoders/" + tiny_models["text_encoder_file"].name)
    te = load_text_encoder(tiny, "auto", "auto")
    assert te.follows_plan and te.on_host and not te.fp8

    card(12)
    monkeypatch.setenv(planning.STREAM_TEXT_ENCODER_ENV, "off")
    placement = session.plan_for(graph).of(TEXT_ENCODER)
    assert (placement.place, placement.form.setting) == (RESIDENT, "fp8_e4m3fn")
    with caplog.at_level(logging.INFO), torch.inference_mode():
        encoded = ErnieImageTextEncode.execute(te, "a red cat").result[0][0][0]
    assert te.fp8 and not te.on_host and not te.streamed
    assert te.patcher.load_device == te.devices[0]  # the GPU's device (the CPU here: its size alone is faked)
    assert any("reading it again" in r.getMessage() for r in caplog.records)
    fp8 = ErnieTextEncoder.from_single_file(tiny.path, te.encoder.language_model.dtype, fp8=True)
    assert torch.equal(encoded[0], fp8.encode("a red cat", torch.device("cpu")).to(encoded.dtype))


def test_a_prompt_enhancer_the_plan_put_on_the_cpu_runs_on_the_gpu_when_the_card_frees_up_on_faked_cards(
        card, true_size_files, tiny_models, placed, tmp_path, monkeypatch, caplog):
    """As the text encoder above, the PE (device and weight_dtype ``auto``): on the CPU as stored at 5 GiB, on the GPU
    in fp8 at 12 GiB; the enhance node moves it without its loader running again. Before, it stayed on the CPU."""
    import folder_paths
    from test_pe_nodes import enhance_inputs

    from comfyui_ernie_image.nodes import planning
    from comfyui_ernie_image.nodes.pe.nodes import ErnieImagePELoader, ErnieImagePromptEnhance, result_cache
    from comfyui_ernie_image.nodes.plan import session
    from comfyui_ernie_image.nodes.plan.records import CPU, PER_PROMPT, PROMPT_ENHANCER, RESIDENT
    from helpers.plan_files import sparse_text_encoder

    monkeypatch.setattr(folder_paths, "user_directory", str(tmp_path))  # the PE's result cache
    result_cache.cache_clear()
    pe_file = "plan-10gb/ernie-image-prompt-enhancer.safetensors"
    sparse_text_encoder(placed("text_encoders", pe_file))  # a random PE is the text encoder's shape, tied
    graph = _gguf_graph()
    graph["pe"] = {"class_type": "ErnieImagePELoader", "inputs": {"model_name": f"text_encoders/{pe_file}"}}
    graph["enhance"] = {"class_type": "ErnieImagePromptEnhance", "inputs": {"pe": ["pe", 0], "max_new_tokens": 64}}
    session.register(planning.make_plan)
    card(5)
    monkeypatch.setenv(planning.STREAM_TEXT_ENCODER_ENV, "off")
    assert session.plan_for(graph).of(PROMPT_ENHANCER).place == CPU
    tiny = placed("text_encoders", "tiny/ernie-image-prompt-enhancer.safetensors")
    tiny.write_bytes(tiny_models["pe_single_file"].read_bytes())
    (pe,) = ErnieImagePELoader.execute("text_encoders/tiny/ernie-image-prompt-enhancer.safetensors").result
    assert pe.device_name == "cpu" and not pe.fp8
    with torch.inference_mode():
        ErnieImagePromptEnhance.execute(**enhance_inputs(["a cat"], pe, cache="off"))  # loaded on the CPU
    before = next(pe._model.parameters())

    card(12)
    monkeypatch.setenv(planning.STREAM_TEXT_ENCODER_ENV, "off")
    placement = session.plan_for(graph).of(PROMPT_ENHANCER)
    assert placement.place in (RESIDENT, PER_PROMPT) and placement.form.setting == "fp8_e4m3fn"  # on the GPU
    with caplog.at_level(logging.INFO), torch.inference_mode():
        (texts,) = ErnieImagePromptEnhance.execute(**enhance_inputs(["a cat"], pe, cache="off")).result
    assert pe.device_name == "default" and pe.fp8 and pe.loaded and texts[0]
    assert next(pe._model.parameters()) is not before  # read again in the plan's form
    assert any("runs the prompt enhancer on the GPU in fp8" in r.getMessage() for r in caplog.records)
    result_cache.cache_clear()


def test_a_dit_loaded_in_one_form_is_planned_in_it_until_its_loader_runs_again_on_faked_cards(
        card, true_size_files, placed, tiny_models, caplog):
    """ComfyUI reuses a loader's output while its inputs stay, so a DiT made in fp8 storage on a 12 GiB card stays so
    when the card frees up (another program closed): the plans made meanwhile keep that form and place the other
    models around it (before, they planned a bf16 DiT that was not there). When its loader runs again, the plan
    picks freely. The loader records the form it made."""
    from comfyui_ernie_image.nodes import planning
    from comfyui_ernie_image.nodes.loaders import ErnieImageDiTLoader
    from comfyui_ernie_image.nodes.plan import session
    from comfyui_ernie_image.nodes.plan.records import DIT
    from helpers.plan_files import sparse_safetensors
    from helpers.plan_records import dit_tensors

    dit = sparse_safetensors(placed("diffusion_models", "plan-turbo/ernie-image-turbo.safetensors"),
                             {t.name: t.shape for t in dit_tensors()})
    prompt = _gguf_graph()
    for node in prompt.values():
        if node["class_type"] == "ErnieImageDiTLoader":
            node["inputs"]["model_name"] = "diffusion_models/plan-turbo/ernie-image-turbo.safetensors"
    session.register(planning.make_plan)
    card(12)
    small = session.plan_for(prompt).of(DIT).form.setting
    card(32)
    free = session.plan_for(prompt).of(DIT).form.setting
    assert (small, free) == ("none/fp8_e4m3fn", "none/default")

    session.loaded(DIT, str(dit), small)  # as the loader records what it made under the 12 GiB plan
    with caplog.at_level(logging.INFO):
        kept = session.plan_for(prompt)
    assert kept.of(DIT).form.setting == small
    assert any("DiT fp8 (as loaded) resident" in r.getMessage() for r in caplog.records
               if "plan for" in r.getMessage())  # the line says why the plan kept it
    session.loading(DIT, str(dit))  # its loader runs again
    assert session.plan_for(prompt).of(DIT).form.setting == free

    tiny = tiny_models["single_file"]
    ErnieImageDiTLoader.execute(f"diffusion_models/{tiny.name}", "default", "auto")
    assert session.held_form(DIT, str(tiny)) in ("none/default", "none/fp8_e4m3fn")


def test_a_machine_short_of_host_ram_gets_a_plan_that_says_it_swaps_on_a_faked_10gb_card_and_16gb_machine(
        card, true_size_files, monkeypatch, caplog):
    """The host RAM the plan may fill is what the machine has available, less what the pack leaves to the system
    (``host/memory.spare_host_memory``: 4 GiB here), plus what the pack's models hold now. On a 16 GB machine with 6
    GiB available, the GGUF workflow's streamed text encoder (3.6 GiB on the host) does not fit in the 2 GiB left:
    the plan prices the swapping and says so, and the log warns what to do. With RAM to spare it says neither."""
    import psutil

    from comfyui_ernie_image.nodes import planning
    from comfyui_ernie_image.nodes.host import host_copy
    from comfyui_ernie_image.nodes.host import plan as host_plan

    card(10)
    monkeypatch.setattr(planning, "host_room", host_plan.host_room)  # the real one, on a faked machine
    total = 16 * GIB
    for available, swaps in ((6 * GIB, True), (40 * GIB, False)):
        machine = psutil.virtual_memory()._replace(total=total, available=available)
        monkeypatch.setattr(psutil, "virtual_memory", lambda machine=machine: machine)
        planning._made.clear()
        caplog.clear()
        with caplog.at_level(logging.INFO):
            plan = planning.make_plan(_gguf_graph())
        assert plan.card.host == available - 4 * GIB + host_copy.held_on_host()
        assert plan.over_host is swaps, plan.line()
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("more host RAM than this machine has free" in w for w in warned) is swaps
        assert ("the system swaps" in plan.line()) is swaps


@pytest.mark.parametrize("loader", ["LoraLoaderModelOnly", "ErnieImageLoraLoader"])
def test_a_lora_added_to_a_graph_that_has_run_is_planned_anew_while_comfyui_reuses_every_loader_on_a_faked_10gb_card(
        tiny_models, tmp_path, loader):
    """A real headless ComfyUI whose memory queries answer for a 10 GB CUDA card (the fault, from
    ``helpers/fake_card``, a second custom node folder): the graph runs, then the same graph with a LoRA after the
    loader. ComfyUI reuses the loader's outputs and both encodes; the log shows a second plan, with the LoRA, before
    the sampling. Core's own LoRA loader runs no node of the pack: the scheduler plans, as it runs again whenever
    its model changes."""
    from safetensors.torch import save_file

    from conftest import COMFY_DIR
    from helpers.lora import LAYERS, deltas, lora_file
    from helpers.workflows import text_to_image
    from scripts.comfy_headless import ComfyServer

    loras = tiny_models["models_dir"] / "loras"
    loras.mkdir(exist_ok=True)
    save_file(lora_file("peft", deltas(LAYERS, seed=8)), loras / "planned.safetensors")
    server = ComfyServer(COMFY_DIR, tmp_path, REPO, tiny_models["models_dir"], env={"ERNIE_TEST_FAKE_CARD_GIB": "10"})
    (tmp_path / "custom_nodes" / "ernie_test_fake_card").symlink_to(REPO / "tests" / "helpers" / "fake_card",
                                                                     target_is_directory=True)
    settings = dict(snapshot="ERNIE-Image-Turbo-tiny", prompt="a cat", steps=2, seed=3, prefix="planned")
    lora = (loader, {"lora_name": "planned.safetensors", "strength_model": 1.0})
    server.start()
    try:
        plain, before = server.run_logged(text_to_image(**settings))
        with_lora, after = server.run_logged(text_to_image(**settings, model_nodes=(lora,)))
    finally:
        server.stop()
    assert plain.status == "success" and with_lora.status == "success", (plain.messages, with_lora.messages)
    cached = next(data["nodes"] for kind, data in with_lora.messages if kind == "execution_cached")
    assert {"loader", "positive", "negative"} <= set(cached)
    first = [line for line in before.splitlines() if "ERNIE-Image: plan for" in line]
    again = [line for line in after.splitlines() if "ERNIE-Image: plan for" in line]
    assert len(first) == 1 and "LoRA" not in first[0], before[-3000:]
    assert len(again) == 1 and "1 LoRA" in again[0], after[-3000:]
    assert after.index(again[0]) < after.index("100%"), after[-3000:]  # planned before the sampling's steps
