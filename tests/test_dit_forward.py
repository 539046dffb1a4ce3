"""The pack's DiT (``dit.py``) against diffusers' own on the same weights, its keys, and the attention-kernel choice
(engine, no server)."""

from __future__ import annotations

import comfy.ops
import pytest
import torch
from diffusers import ErnieImageTransformer2DModel

from comfyui_ernie_image.nodes.dit.attention import ATTENTION_ENV, attention_choice, backend_order
from comfyui_ernie_image.nodes.dit.build import build_diffusion_model
from comfyui_ernie_image.nodes.dit.dit import ErnieImageDiT
from comfyui_ernie_image.nodes.errors import ErnieImageError
from scripts.tiny_models import TINY_DIT, randomise_zero_init


@pytest.fixture(scope="module")
def reference() -> ErnieImageTransformer2DModel:
    torch.manual_seed(0)
    model = ErnieImageTransformer2DModel(**TINY_DIT).eval()
    randomise_zero_init(model, torch.Generator().manual_seed(0))
    return model


@pytest.fixture(scope="module")
def dit(reference) -> ErnieImageDiT:
    return build_diffusion_model(reference.state_dict(), TINY_DIT, torch.float32)


def ernie_forward(dit, latents, timestep, text, lengths):
    return dit._forward(latents, timestep, text, lengths)


def _inputs(lengths: list[int], height: int = 6, width: int = 4):
    torch.manual_seed(1)
    batch, longest = len(lengths), max(lengths)
    text = torch.zeros(batch, longest, TINY_DIT["text_in_dim"])
    for row, n in enumerate(lengths):
        text[row, :n] = torch.randn(n, TINY_DIT["text_in_dim"])
    latents = torch.randn(batch, TINY_DIT["in_channels"], height, width)
    timestep = torch.tensor([700.0, 300.0, 50.0][:batch])
    return latents, timestep, text


@pytest.mark.parametrize("lengths", [[7], [5, 5], [9, 4], [3, 8, 8]], ids=str)
def test_forward_equals_diffusers(reference, dit, lengths):
    latents, timestep, text = _inputs(lengths)
    with torch.no_grad():
        expected = reference(hidden_states=latents, timestep=timestep, text_bth=text, text_lens=torch.tensor(lengths),
                             return_dict=False)[0]
        ours = ernie_forward(dit, latents, timestep, text, lengths)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)


def test_bf16_forward_is_within_diffusers_bf16_error(reference, dit):
    """The bf16 path the GPU runs (the mixed-dtype ``out=`` kernels, RoPE added in place) runs on bf16 inputs and is
    no farther from the fp32 forward than diffusers' own module in bf16 (plus a margin for rounding noise)."""
    lengths = [9, 4]
    latents, timestep, text = _inputs(lengths, height=8, width=8)
    half = build_diffusion_model(reference.state_dict(), TINY_DIT, torch.bfloat16)
    reference_half = ErnieImageTransformer2DModel(**TINY_DIT).eval()
    reference_half.load_state_dict(reference.state_dict())
    reference_half.to(torch.bfloat16)
    with torch.no_grad():
        exact = ernie_forward(dit, latents, timestep, text, lengths)
        ours = ernie_forward(half, latents.bfloat16(), timestep, text.bfloat16(), lengths).float()
        theirs = reference_half(hidden_states=latents.bfloat16(), timestep=timestep, text_bth=text.bfloat16(),
                                text_lens=torch.tensor(lengths), return_dict=False)[0].float()

    def error(x):
        return ((x - exact).norm() / exact.norm()).item()

    assert 0 < error(ours) <= 1.25 * error(theirs), (error(ours), error(theirs))


def test_the_released_keys_load_both_ways(reference, dit):
    """diffusers' state dict loads into the pack's DiT with no missing or unexpected key, and back."""
    ours = dit.state_dict()
    assert ours.keys() == reference.state_dict().keys()
    with torch.device("meta"):
        back = ErnieImageTransformer2DModel(**TINY_DIT)
    back.load_state_dict(ours, strict=True, assign=True)  # raises on a missing or unexpected key
    with torch.device("meta"):
        again = ErnieImageDiT(**TINY_DIT, operations=comfy.ops.disable_weight_init)
    again.load_state_dict(reference.state_dict(), strict=True, assign=True)


def test_mask_only_when_some_text_is_padded(dit, monkeypatch):
    masks = []
    real = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, attn_mask=None: masks.append(attn_mask) or real(*a, attn_mask=attn_mask))
    with torch.no_grad():
        for lengths in ([6, 6], [6, 2]):
            masks.clear()
            ernie_forward(dit, *_inputs(lengths), lengths)
            assert {m is None for m in masks} == {lengths == [6, 6]}


def test_padding_does_not_change_a_prompt(dit):
    """A row's prediction is the same alone or batched with a longer prompt (zero padding, masked)."""
    latents, timestep, text = _inputs([9, 4])
    with torch.no_grad():
        batched = ernie_forward(dit, latents, timestep, text, [9, 4])
        alone = ernie_forward(dit, latents[1:], timestep[1:], text[1:, :4], [4])
    torch.testing.assert_close(batched[1:], alone, rtol=1e-5, atol=1e-5)


def test_attention_choice_is_read_and_checked(monkeypatch):
    monkeypatch.delenv(ATTENTION_ENV, raising=False)
    assert attention_choice() == "auto"
    monkeypatch.setenv(ATTENTION_ENV, " Flash ")
    assert attention_choice() == "flash"
    monkeypatch.setenv(ATTENTION_ENV, "xformers")
    with pytest.raises(ErnieImageError, match=f"{ATTENTION_ENV}='xformers'.*auto, cudnn, flash"):
        attention_choice()


def test_backend_order_per_device():
    cuda = torch.device("cuda", 0)
    assert backend_order(torch.device("cpu"), "cudnn") is None
    assert backend_order(cuda, "auto", capability=(9, 0)) == ["cudnn", "flash", "efficient", "math"]
    assert backend_order(cuda, "auto", capability=(8, 9)) is None  # Ada and others: PyTorch's order
    assert backend_order(cuda, "auto", capability=(12, 0)) is None
    assert backend_order(cuda, "efficient", capability=(8, 6)) == ["efficient", "flash", "cudnn", "math"]
