"""The quantization capability rules for every GPU, kernel and torchao situation that matters, as pure functions of
the facts (no GPU here), and the facts this CPU machine really has."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from comfyui_ernie_image.nodes.errors import ErnieImageError
from comfyui_ernie_image.nodes.quant.capability import METHODS, Facts, fallback, probe, problem, require

BF16 = torch.bfloat16
QUANTIZED = [m for m in METHODS if m != "none"]
GPUS = {  # name, compute capability
    "T4": ("Tesla T4", (7, 5)),
    "A100": ("NVIDIA A100-SXM4-80GB", (8, 0)),
    "RTX 3090": ("NVIDIA GeForce RTX 3090", (8, 6)),
    "RTX 4090": ("NVIDIA GeForce RTX 4090", (8, 9)),
    "H200": ("NVIDIA H200", (9, 0)),
    "B200": ("NVIDIA B200", (10, 0)),
    "RTX 5090": ("NVIDIA GeForce RTX 5090", (12, 0)),
    "DGX Spark": ("NVIDIA GB10", (12, 1)),
}
NO_KERNELS = "No module named 'cache_dit._C_svdquant'"


def gpu(name: str, *, kernels: bool = True, torchao: bool = True) -> Facts:
    full_name, arch = GPUS[name]
    return Facts(device="cuda:0", gpu=full_name, arch=arch, torchao=torchao, svdq_kernels=kernels,
                 svdq_error="" if kernels else NO_KERNELS, cache_dit="1.5.3")


def test_none_always_runs():
    for facts in [Facts(device="cpu"), gpu("T4", kernels=False, torchao=False), gpu("H200")]:
        assert problem("none", facts, torch.float32) is None


@pytest.mark.parametrize("method", QUANTIZED)
def test_every_method_needs_a_cuda_gpu(method):
    message = problem(method, Facts(device="cpu", torchao=True, svdq_kernels=True), BF16)
    assert message == (f"Quantization '{method}' needs an NVIDIA GPU (CUDA), but ComfyUI runs this model on cpu. "
                       "Set quantization to 'none'.")


@pytest.mark.parametrize("name", ["H200", "B200"])
@pytest.mark.parametrize("method", ["svdq_int4_r32_dq", "svdq_int4_r128_dq", "svdq_nvfp4_r32_dq"])
def test_svdquant_on_hopper_and_datacenter_blackwell_points_to_fp8(method, name):
    facts = gpu(name)
    message = problem(method, facts, BF16)
    sm = "sm{}{}".format(*facts.arch)
    assert message.startswith(f"Quantization '{method}' cannot run on {facts.gpu} ({sm}): it needs ")
    assert message.endswith("Use 'fp8_per_row' instead.")
    if "int4" in method:
        assert "not Hopper (sm90) nor B200-class Blackwell (sm100)" in message
    else:
        assert "NVFP4 tensor cores" in message and "sm120/121" in message


def test_hopper_runs_fp8_and_int8():
    for method in ["fp8_per_row", "fp8_weight_only", "int8_weight_only"]:
        assert problem(method, gpu("H200", kernels=False), BF16) is None


def test_svdquant_fallback_says_torchao_is_needed_when_missing():
    message = problem("svdq_int4_r32_dq", gpu("H200", torchao=False), BF16)
    assert message.endswith("Use 'fp8_per_row' instead (after `pip install torchao`).")


@pytest.mark.parametrize("method", ["fp8_per_row", "fp8_weight_only", "int8_weight_only"])
def test_torchao_methods_say_how_to_install_torchao(method):
    message = problem(method, gpu("RTX 4090", torchao=False), BF16)
    assert message == (f"Quantization '{method}' uses torchao, which is not installed. Install it into ComfyUI's "
                       "Python: `pip install torchao`, then restart ComfyUI.")


@pytest.mark.parametrize("name", ["A100", "RTX 3090", "RTX 4090", "RTX 5090", "DGX Spark"])
def test_svdquant_int4_runs_where_the_kernels_are_built_for(name):
    for method in ["svdq_int4_r32_dq", "svdq_int4_r128_dq"]:
        assert problem(method, gpu(name), BF16) is None


@pytest.mark.parametrize("method", ["svdq_int4_r32_dq", "svdq_int4_r128_dq", "svdq_nvfp4_r32_dq"])
def test_missing_svdquant_kernels_say_how_to_install_cache_dit_cu13(method):
    message = problem(method, gpu("RTX 5090", kernels=False), BF16)
    assert f"Quantization '{method}' needs cache-dit's SVDQuant kernels (cache_dit._C_svdquant)" in message
    assert f"the installed cache-dit 1.5.3 does not have ({NO_KERNELS})" in message
    assert "`pip uninstall -y cache-dit && pip install cache-dit-cu13`" in message
    assert message.endswith("Or use 'fp8_per_row' instead.")


def test_nvfp4_needs_rtx50_and_offers_int4_on_ada():
    message = problem("svdq_nvfp4_r32_dq", gpu("RTX 4090"), BF16)
    assert message.startswith("Quantization 'svdq_nvfp4_r32_dq' cannot run on NVIDIA GeForce RTX 4090 (sm89)")
    assert message.endswith("Use 'svdq_int4_r32_dq' instead.")
    for name in ["RTX 5090", "DGX Spark"]:
        assert problem("svdq_nvfp4_r32_dq", gpu(name), BF16) is None


@pytest.mark.parametrize("method", ["fp8_per_row", "fp8_weight_only"])
def test_fp8_before_ada_offers_svdquant_or_int8(method):
    message = problem(method, gpu("RTX 3090"), BF16)
    assert message.startswith(f"Quantization '{method}' cannot run on NVIDIA GeForce RTX 3090 (sm86): it needs FP8 "
                              "tensor cores: sm89 or newer")
    assert message.endswith("Use 'svdq_int4_r32_dq' instead.")
    assert problem(method, gpu("RTX 3090", kernels=False), BF16).endswith("Use 'int8_weight_only' instead.")


def test_turing_runs_int8_only():
    facts = gpu("T4")
    assert problem("int8_weight_only", facts, torch.float32) is None
    for method in ["fp8_per_row", "svdq_int4_r32_dq", "svdq_nvfp4_r32_dq"]:
        assert problem(method, facts, BF16).endswith("Use 'int8_weight_only' instead.")


@pytest.mark.parametrize("method", ["fp8_per_row", "svdq_int4_r32_dq", "svdq_nvfp4_r32_dq"])
def test_bf16_methods_refuse_fp32_weights(method):
    message = problem(method, gpu("RTX 5090"), torch.float32)
    assert message == (f"Quantization '{method}' works on bf16 weights, but weight_dtype is fp32. "
                       "Set weight_dtype to 'bf16' (or 'default').")
    for other in ["fp8_weight_only", "int8_weight_only"]:
        assert problem(other, gpu("RTX 5090"), torch.float32) is None


def test_the_method_offered_instead_can_run():
    """Across every situation, a method named as the alternative runs there (once torchao is installed)."""
    for name, kernels, torchao, method in itertools.product(GPUS, [False, True], [False, True], QUANTIZED):
        facts = gpu(name, kernels=kernels, torchao=torchao)
        message = problem(method, facts, BF16)
        alternative = fallback(method, facts)
        if message is None or "instead" not in message:
            continue
        assert f"se '{alternative}' instead" in message  # "Use ..." or "Or use ..."
        assert problem(alternative, gpu(name, kernels=kernels, torchao=True), BF16) is None, (name, method)


def test_require_raises_the_problem_as_a_user_error():
    with pytest.raises(ErnieImageError, match=r"^Quantization 'svdq_int4_r32_dq' cannot run on NVIDIA H200 \(sm90\)"):
        require("svdq_int4_r32_dq", gpu("H200"), BF16)
    require("fp8_per_row", gpu("H200"), BF16)


def test_probe_reads_this_cpu_machine():
    import cache_dit

    facts = probe(torch.device("cpu"))
    assert facts.device == "cpu" and facts.arch is None and facts.gpu == ""
    assert facts.cache_dit == cache_dit.__version__
    assert not facts.svdq_kernels and "_C_svdquant" in facts.svdq_error  # the plain cache-dit wheel
    assert facts.torchao  # an optional extra for users, in the test environment for test_lora_quantized.py


def test_kernels_that_cannot_be_checked_say_why_injected_fault(monkeypatch):
    """cache-dit's check itself failing (a broken install: a fault a working one cannot give) leaves the SVDQuant
    methods unavailable, with the cause in the words an SVDQuant refusal quotes beside what to install."""
    import cache_dit.quantization

    from comfyui_ernie_image.nodes.quant.capability import svdq_kernels

    def broken() -> bool:
        raise OSError("libcudart.so.13: cannot open shared object file")

    monkeypatch.setattr(cache_dit.quantization, "svdq_is_available", broken)
    svdq_kernels.cache_clear()
    try:
        facts = probe(torch.device("cpu"))
    finally:
        svdq_kernels.cache_clear()
    assert not facts.svdq_kernels
    assert facts.svdq_error == "its check failed: OSError: libcudart.so.13: cannot open shared object file"
    refusal = problem("svdq_int4_r32_dq", dataclasses.replace(facts, arch=(8, 9), gpu="NVIDIA GeForce RTX 4090"), BF16)
    assert ("does not have (its check failed: OSError: libcudart.so.13: cannot open shared object file). Install the "
            "build that carries them") in refusal
