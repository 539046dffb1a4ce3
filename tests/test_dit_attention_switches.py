"""ComfyUI's attention switches and the DiT (``nodes/host/attention.py``, ``nodes/dit/attention.py``).

The DiT follows ``--use-split-cross-attention`` and ``--use-quad-cross-attention`` with core's own functions and
``--use-flash-attention`` with PyTorch's FlashAttention kernel, and its images stay diffusers'; it does not follow
``--use-sage-attention`` (8-bit Q and K) and says so; it says which ``transformer_options`` patches it does not apply.
"""

from __future__ import annotations

import logging

import comfy.ldm.modules.attention as core_attention
import numpy as np
import pytest
import torch
from comfy.cli_args import args
from diffusers import ErnieImageTransformer2DModel
from PIL import Image

from comfyui_ernie_image.nodes.dit import attention
from comfyui_ernie_image.nodes.dit.build import build_diffusion_model
from comfyui_ernie_image.nodes.host import attention as host_attention
from conftest import COMFY_DIR, REPO
from helpers.workflows import text_to_image
from scripts.comfy_headless import ComfyServer
from scripts.tiny_models import TINY_DIT, randomise_zero_init

SWITCHES = ("use_split_cross_attention", "use_quad_cross_attention", "use_flash_attention", "use_sage_attention")


@pytest.fixture
def started_with(monkeypatch):
    """``started_with(switch, chosen)``: ComfyUI as started with ``--<switch>``, core having chosen its function
    ``chosen`` (what core's import does from the switch, and from what is installed)."""
    def start(switch: str | None, chosen: str = "attention_pytorch") -> None:
        for name in SWITCHES:
            monkeypatch.setattr(args, name, name == switch)
        monkeypatch.setattr(core_attention, "optimized_attention", getattr(core_attention, chosen))
        host_attention._say_followed.cache_clear()
        host_attention._say_sage_not_followed.cache_clear()
    return start


def test_each_switch_gives_its_plan(started_with, caplog):
    caplog.set_level(logging.INFO)
    def plan() -> attention.AttentionPlan:
        return attention.AttentionPlan(*host_attention.core_attention_choice())

    started_with(None, "attention_sub_quad")  # core's own default on the CPU: not the user's choice
    assert plan() == attention.SDPA
    started_with("use_split_cross_attention", "attention_split")
    assert plan() == attention.AttentionPlan(function=core_attention.attention_split)
    assert "the DiT follows --use-split-cross-attention (core's attention_split)" in caplog.text
    started_with("use_quad_cross_attention", "attention_sub_quad")
    assert plan() == attention.AttentionPlan(function=core_attention.attention_sub_quad)
    started_with("use_split_cross_attention", "attention_xformers")  # xformers installed: core ignores the switch
    assert plan() == attention.SDPA
    started_with("use_flash_attention", "attention_flash")
    assert plan() == attention.AttentionPlan(kernel="flash")
    assert "the DiT follows --use-flash-attention (PyTorch's FlashAttention kernel)" in caplog.text
    started_with("use_sage_attention", "attention_sage")
    assert plan() == attention.SDPA
    assert "does not follow --use-sage-attention: SageAttention rounds Q and K to 8 bits" in caplog.text


def test_the_flash_switch_puts_flash_first_unless_the_pack_is_told_otherwise(monkeypatch):
    monkeypatch.delenv(attention.ATTENTION_ENV, raising=False)
    hopper = torch.device("cuda", 0)
    assert attention.backend_order(hopper, attention.attention_choice("flash"), capability=(9, 0))[0] == "flash"
    monkeypatch.setenv(attention.ATTENTION_ENV, "math")
    assert attention.attention_choice("flash") == "math"


@pytest.fixture(scope="module")
def reference() -> ErnieImageTransformer2DModel:
    torch.manual_seed(0)
    model = ErnieImageTransformer2DModel(**TINY_DIT).eval()
    randomise_zero_init(model, torch.Generator().manual_seed(0))
    return model


@pytest.mark.parametrize(("switch", "chosen"), [("use_split_cross_attention", "attention_split"),
                                                ("use_quad_cross_attention", "attention_sub_quad")])
@pytest.mark.parametrize("lengths", [[7], [9, 4]], ids=str)  # [9, 4]: a text mask
def test_core_attention_keeps_diffusers_results(started_with, reference, switch, chosen, lengths):
    started_with(switch, chosen)
    dit = build_diffusion_model(reference.state_dict(), TINY_DIT, torch.float32)
    assert dit.layers[0].self_attention.plan.function is getattr(core_attention, chosen)
    torch.manual_seed(1)
    text = torch.zeros(len(lengths), max(lengths), TINY_DIT["text_in_dim"])
    for row, n in enumerate(lengths):
        text[row, :n] = torch.randn(n, TINY_DIT["text_in_dim"])
    latents = torch.randn(len(lengths), TINY_DIT["in_channels"], 6, 4)
    timestep = torch.tensor([700.0, 300.0][:len(lengths)])
    with torch.no_grad():
        expected = reference(hidden_states=latents, timestep=timestep, text_bth=text, text_lens=torch.tensor(lengths),
                             return_dict=False)[0]
        ours = dit._forward(latents, timestep, text, lengths)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)


def test_patches_the_dit_does_not_apply_are_said_once_each(caplog):
    attention._say_unapplied.cache_clear()
    attention.say_unapplied_patches({"patches": {}, "patches_replace": {"dit": {}}, "sigmas": torch.ones(1)})
    assert "does not apply" not in caplog.text
    for _ in range(3):
        attention.say_unapplied_patches({"patches": {"attn1_patch": [print]},
                                         "optimized_attention_override": print})
    assert caplog.text.count("the DiT does not apply transformer_options['patches']") == 1
    assert caplog.text.count("the DiT does not apply transformer_options['optimized_attention_override']") == 1


@pytest.fixture(scope="module")
def split_server(tiny_models, tmp_path_factory):
    """A headless ComfyUI started with --use-split-cross-attention (the CPU core accepts it)."""
    server = ComfyServer(COMFY_DIR, tmp_path_factory.mktemp("split_base"), REPO, tiny_models["models_dir"],
                         extra_args=("--use-split-cross-attention",))
    server.start()
    yield server
    server.stop()


def _pixels(server: ComfyServer, graph: dict) -> np.ndarray:
    result = server.run(graph)
    assert result.status == "success", result.messages
    return np.asarray(Image.open(server.output_images(result)[0]), dtype=np.int16)


def test_the_split_switch_in_the_server_gives_the_same_image(comfy_server, split_server):
    # Two prompt lengths under CFG: one batch with a text mask, through core's split attention.
    graph = text_to_image(snapshot="diffusers/ERNIE-Image-Turbo-tiny", prompt="a red fox in the snow at dawn",
                          negative="blurry", steps=2, cfg=3.0, seed=5)
    start = len(comfy_server.log())
    default = _pixels(comfy_server, graph)
    split = _pixels(split_server, graph)
    assert "ERNIE-Image: the DiT follows --use-split-cross-attention (core's attention_split)" in split_server.log()
    assert "the DiT follows" not in comfy_server.log()[start:]
    assert "the DiT does not apply" not in comfy_server.log() + split_server.log()  # a plain run carries no patches
    assert np.abs(default - split).max() <= 1  # PNG's 8 bits: rounding may flip one level
