"""The DiT fast path on Hopper (issue: fast path): attention kernels, one forward, and Turbo end to end.

True-size ERNIE-Image DiT (8B), random bf16 weights, 1024x1024 (64x64 latent), 256 prompt tokens, 40 negative
tokens (batched CFG pads the negative: the mask case). In one process:

1. attention alone at the DiT's shape (32 heads of 128, 4352 tokens) on each SDPA kernel, with and without a mask;
2. one DiT forward, batch 1 (Turbo) and batch 2 (Base CFG, masked): diffusers' forward eager and compiled, the pack's
   DiT (``nodes/dit/dit.py``) eager per attention kernel and compiled (the loader's default), the compiled
   blocks replayed from a CUDA graph, and FP8 (torchao per-row, the loader's ``fp8_per_row``) eager and compiled;
   relative error of each against the same weights in fp32 (diffusers' forward, fp32 activations);
3. a profile of the compiled bf16 and FP8 forwards (top kernels by GPU time);
4. Turbo end to end (text encoding + 8 steps + VAE decode): the diffusers pipeline, eager, vs the pack's ComfyUI
   path (the loader's MODEL, ``comfy.sample.sample_custom``, core VAE decode), bf16 and FP8.

    cd bench && python3 bench_fast_path.py        # writes $OUT/bench_fast_path.json when OUT is set
"""

from __future__ import annotations

import contextlib
import copy
import gc
import json
import os
import time
import traceback
from functools import partial

import torch
import torch.nn.functional as F
from bench_dit_sampling import comfy_sampling
from common import TRUE_DIT, cuda_time, machine, pack_dit, pack_forward, random_true_size_dit, use_comfyui

LATENT, TOKENS, NEGATIVE = 64, 256, 40
TEXT_DIM, HEADS, HEAD_DIM = TRUE_DIT["text_in_dim"], TRUE_DIT["num_attention_heads"], 128
SEQUENCE = LATENT * LATENT + TOKENS
DEADLINE_S = float(os.environ.get("BENCH_BUDGET_S", 540))  # no section starts after this
START = time.perf_counter()
RESULTS: dict = {"machine": None, "attention": [], "forward": [], "profile": {}, "e2e": [], "errors": []}


def elapsed() -> float:
    return time.perf_counter() - START


def save() -> None:
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_fast_path.json"), "w") as f:
            json.dump(RESULTS, f, indent=1)


def section(name: str):
    """Run a section unless the deadline passed; an error is recorded and the next section runs."""
    def wrap(fn):
        def run(*args, **kwargs):
            if elapsed() > DEADLINE_S:
                RESULTS["errors"].append(f"{name}: skipped (time budget)")
                return None
            print(f"--- {name} ({elapsed():.0f} s)", flush=True)
            try:
                return fn(*args, **kwargs)
            except Exception as e:
                traceback.print_exc()
                RESULTS["errors"].append(f"{name}: {type(e).__name__}: {e}"[:500])
            finally:
                save()
        return run
    return wrap


def free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


@contextlib.contextmanager
def attention_env(choice: str | None):
    """``ERNIE_IMAGE_ATTENTION`` set to ``choice`` (None: unset) for the block."""
    from comfyui_ernie_image.nodes.dit.attention import ATTENTION_ENV

    before = os.environ.pop(ATTENTION_ENV, None)
    if choice is not None:
        os.environ[ATTENTION_ENV] = choice
    try:
        yield
    finally:
        os.environ.pop(ATTENTION_ENV, None)
        if before is not None:
            os.environ[ATTENTION_ENV] = before


@contextlib.contextmanager
def diffusers_forward(transformer):
    """diffusers' own forward for the block (the pack's MODEL puts its forward on the instance)."""
    ours = vars(transformer).pop("forward", None)
    try:
        yield
    finally:
        if ours is not None:
            transformer.forward = ours


@section("attention kernels")
def attention_kernels() -> None:
    from torch.nn.attention import sdpa_kernel

    from comfyui_ernie_image.nodes.dit.attention import BACKENDS

    try:
        from torch.nn.attention import list_flash_attention_impls

        RESULTS["flash_impls"] = list(list_flash_attention_impls())
    except ImportError:
        pass
    for batch, masked in ((1, False), (2, False), (2, True)):
        q, k, v = (torch.randn(batch, HEADS, SEQUENCE, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
                   for _ in range(3))
        mask = None
        if masked:  # row 0 is the negative prompt: its text padding is masked out as keys
            mask = torch.ones(batch, 1, 1, SEQUENCE, dtype=torch.bool, device="cuda")
            mask[0, ..., LATENT * LATENT + NEGATIVE:] = False
        flop = 4 * batch * HEADS * SEQUENCE * SEQUENCE * HEAD_DIM
        for name in ("cudnn", "flash", "efficient"):
            row = dict(batch=batch, masked=masked, kernel=name)
            try:
                with sdpa_kernel([BACKENDS[name]]):
                    call = partial(F.scaled_dot_product_attention, q, k, v, attn_mask=mask)
                    call()
                    seconds = cuda_time(call, repeats=20)
                row.update(ms=1000 * seconds, tflops=flop / seconds / 1e12)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"[:200]
            RESULTS["attention"].append(row)
            print(row, flush=True)


def dit_inputs() -> dict[int, tuple]:
    """Inputs per batch: latents, timestep (sigma 0.5), padded text, true lengths (batch 2: negative, prompt)."""
    torch.manual_seed(1)
    latents = torch.randn(2, TRUE_DIT["in_channels"], LATENT, LATENT, device="cuda", dtype=torch.bfloat16)
    timestep = torch.full((2,), 500.0, device="cuda", dtype=torch.bfloat16)
    text = torch.zeros(2, TOKENS, TEXT_DIM, device="cuda", dtype=torch.bfloat16)
    text[0, :NEGATIVE] = torch.randn(NEGATIVE, TEXT_DIM, device="cuda")
    text[1] = torch.randn(TOKENS, TEXT_DIM, device="cuda")
    return {1: (latents[1:], timestep[1:], text[1:], [TOKENS]),
            2: (latents, timestep, text, [NEGATIVE, TOKENS])}


def diffusers_call(model, latents, timestep, text, lens):
    from diffusers import ErnieImageTransformer2DModel

    return ErnieImageTransformer2DModel.forward(
        model, hidden_states=latents, timestep=timestep, text_bth=text,
        text_lens=torch.tensor(lens, device=latents.device), return_dict=False)[0]


@torch.inference_mode()
def fp32_references(transformer, inputs) -> dict[int, torch.Tensor]:
    """diffusers' forward on an fp32 copy of the weights with fp32 activations: the yardstick for every error."""
    reference = copy.deepcopy(transformer).float()
    out = {}
    for batch, (latents, timestep, text, lens) in inputs.items():
        out[batch] = diffusers_call(reference, latents.float(), timestep.float(), text.float(), lens).float()
    del reference
    free()
    return out


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm())


@torch.inference_mode()
def time_forward(name: str, call, model, inputs, refs, batches=(1, 2), **extra) -> None:
    for batch in batches:
        args = inputs[batch]
        row = dict(variant=name, batch=batch, **extra)
        try:
            start = time.perf_counter()
            out = call(model, *args)
            torch.cuda.synchronize()
            row["first_call_s"] = time.perf_counter() - start  # includes compilation for compiled variants
            row["ms"] = 1000 * cuda_time(lambda a=args: call(model, *a), repeats=10)
            row["rel_error_vs_fp32"] = rel_error(out, refs[batch])
        except Exception as e:
            traceback.print_exc()
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"[:300]
        RESULTS["forward"].append(row)
        print(row, flush=True)


@contextlib.contextmanager
def compiled_blocks(model):
    from comfyui_ernie_image.nodes.accel.compile import RegionalCompile

    regional = RegionalCompile(model.layers)
    regional.install()
    try:
        yield
    finally:
        regional.remove()


@torch.inference_mode()
def graph_replay_ms(model, inputs) -> float:
    """The compiled blocks of a batch-1 forward of the pack's DiT ``model`` captured in one CUDA graph and replayed:
    launch gaps removed."""
    latents, timestep, text, lens = inputs[1]
    x = torch.randn(1, SEQUENCE, TRUE_DIT["hidden_size"], device="cuda", dtype=torch.bfloat16)
    angles = torch.randn(1, SEQUENCE, 1, HEAD_DIM, device="cuda")
    rotary = (torch.cos(angles).bfloat16(), torch.sin(angles).bfloat16())
    temb = [torch.randn(1, 1, TRUE_DIT["hidden_size"], device="cuda", dtype=torch.bfloat16) * 0.1 for _ in range(6)]

    def blocks():
        h = x
        for layer in model.layers:
            h = layer(h, rotary, temb, None)
        return h

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            blocks()
    torch.cuda.current_stream().wait_stream(stream)
    eager_blocks_ms = 1000 * cuda_time(blocks, repeats=10)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        blocks()
    replay_ms = 1000 * cuda_time(graph.replay, repeats=10)
    return eager_blocks_ms, replay_ms


@section("one forward, bf16")
def forward_bf16(transformer, inputs, refs) -> None:
    from comfyui_ernie_image.nodes.dit.attention import backend_order

    RESULTS["auto_order"] = backend_order(torch.device("cuda"), "auto")
    time_forward("diffusers, eager", diffusers_call, transformer, inputs, refs)
    pack = pack_dit(transformer)
    for choice in (None, "flash", "cudnn", "efficient"):
        with attention_env(choice):
            time_forward(f"pack, eager, attention {choice or 'auto'}", pack_forward, pack, inputs, refs)
    with compiled_blocks(pack):
        time_forward("pack, compiled (default)", pack_forward, pack, inputs, refs)
        eager_blocks, replay = graph_replay_ms(pack, inputs)
        RESULTS["forward"].append(dict(variant="pack, compiled blocks only: launched / CUDA-graph replay", batch=1,
                                       ms=replay, launched_ms=eager_blocks))
        print(RESULTS["forward"][-1], flush=True)


@section("one forward, other compiled variants")
def forward_bf16_extras(transformer, inputs, refs) -> None:
    """diffusers' forward compiled (its mask kept), and the pack's with Flash attention (each compiles anew)."""
    torch._dynamo.reset()
    with compiled_blocks(transformer):
        time_forward("diffusers, compiled (mask kept)", diffusers_call, transformer, inputs, refs, batches=(1,))
    torch._dynamo.reset()
    pack = pack_dit(transformer)
    with attention_env("flash"), compiled_blocks(pack):
        time_forward("pack, compiled, attention flash", pack_forward, pack, inputs, refs, batches=(1,))


def top_kernels(call, rows: int = 15) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if getattr(e, "self_device_time_total", 0) > 0]
    total = sum(e.self_device_time_total for e in events)
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    return [dict(kernel=e.key[:110], calls=e.count, ms=e.self_device_time_total / 1000,
                 share=e.self_device_time_total / total) for e in events[:rows]] + [dict(total_ms=total / 1000)]


@section("profile, compiled bf16")
def profile_bf16(transformer, inputs) -> None:
    pack = pack_dit(transformer)
    with torch.inference_mode(), compiled_blocks(pack):
        call = partial(pack_forward, pack, *inputs[1])
        call(), call()
        RESULTS["profile"]["bf16 compiled, batch 1"] = top_kernels(call)


def fp8_pack(transformer) -> torch.nn.Module:
    """The pack's DiT with a copy of ``transformer``'s weights, quantized as the loader's ``fp8_per_row`` does."""
    from comfyui_ernie_image.nodes.quant.quantize import quantize_torchao

    return quantize_torchao(pack_dit(copy.deepcopy(transformer)), "float8_per_row", torch.device("cuda"))


@section("one forward and profile, fp8")
def forward_fp8(transformer, inputs, refs) -> torch.nn.Module:
    start = time.perf_counter()
    fp8 = fp8_pack(transformer)
    RESULTS["fp8_quantize_s"] = time.perf_counter() - start
    time_forward("pack fp8_per_row, eager", pack_forward, fp8, inputs, refs)
    with compiled_blocks(fp8):
        time_forward("pack fp8_per_row, compiled", pack_forward, fp8, inputs, refs)
        with torch.inference_mode():
            call = partial(pack_forward, fp8, *inputs[1])
            RESULTS["profile"]["fp8 compiled, batch 1"] = top_kernels(call)
    return fp8


def random_text_encoder():
    """ERNIE-Image's text encoder at true size (Ministral 3B language model), random weights."""
    from bench_pe import PE_3B
    from transformers import Ministral3Config, Ministral3Model

    config = Ministral3Config(**{k: v for k, v in PE_3B.items() if k != "tie_word_embeddings"})
    with torch.device("meta"):
        model = Ministral3Model(config)
    model = model.to_empty(device="cuda").to(torch.bfloat16)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.fill_(1.0) if "norm" in name else param.normal_(0.0, 0.02)
        with torch.device("cuda"):
            model.rotary_emb = type(model.rotary_emb)(config)
    return model.eval()


def diffusers_turbo_s(transformer, encode) -> tuple[float, float]:
    """Seconds of the diffusers pipeline's Turbo run (text encoding included) and of its VAE decode alone."""
    from diffusers import AutoencoderKLFlux2, ErnieImagePipeline, FlowMatchEulerDiscreteScheduler

    vae = AutoencoderKLFlux2().to("cuda", torch.bfloat16).eval()
    pipe = ErnieImagePipeline(transformer=transformer, vae=vae, text_encoder=None, tokenizer=None,
                              scheduler=FlowMatchEulerDiscreteScheduler(shift=4.0))
    pipe.set_progress_bar_config(disable=True)
    generator = torch.Generator("cuda")

    def turbo():
        return pipe(prompt_embeds=[encode()], height=1024, width=1024, num_inference_steps=8, guidance_scale=1.0,
                    generator=generator.manual_seed(0), output_type="pt", use_pe=False).images

    latents = torch.randn(1, 32, 128, 128, device="cuda", dtype=torch.bfloat16)
    with diffusers_forward(transformer), torch.inference_mode():
        turbo(), vae.decode(latents)
        return cuda_time(turbo, repeats=3), cuda_time(lambda: vae.decode(latents), repeats=5)


def pack_turbo(patcher, vae, encode, noise, negative, sigmas) -> dict:
    """The pack's Turbo run through ComfyUI's sampler and core VAE: first run, then each part and the whole."""
    sample = partial(comfy_sampling, patcher, noise, encode(), negative, sigmas, 1.0)
    start = time.perf_counter()
    latent = sample()
    torch.cuda.synchronize()
    row = dict(first_run_s=time.perf_counter() - start)
    vae.decode(latent)
    row["sampling_s"] = cuda_time(sample, repeats=3)
    row["vae_decode_s"] = cuda_time(lambda: vae.decode(latent), repeats=5)
    row["total_s"] = cuda_time(lambda: vae.decode(comfy_sampling(patcher, noise, encode(), negative, sigmas, 1.0)),
                               repeats=3)
    return row


def vae_errors():
    """The loader's VAE (random Flux.2 VAE weights) with its decoder compiled, against an fp32 decode and a plain
    bf16 one. The loader leaves the decoder eager (nodes/dit/vae.py says why); the decode here is compiled."""
    import comfy.sd
    from diffusers import AutoencoderKLFlux2

    from comfyui_ernie_image.nodes.dit.vae import TRAINED_BN_EPS, make_vae

    torch.manual_seed(3)
    weights = AutoencoderKLFlux2().state_dict()
    latent = torch.randn(1, TRUE_DIT["in_channels"], LATENT, LATENT)
    plain = make_vae(weights, "random weights")
    fp32 = comfy.sd.VAE(sd=weights, dtype=torch.float32)
    fp32.first_stage_model.bn_eps = TRAINED_BN_EPS
    reference = fp32.decode(latent).float()
    compiled = make_vae(weights, "random weights")
    compiled.first_stage_model.decoder.compile()
    start = time.perf_counter()
    out = compiled.decode(latent)
    row = dict(compiled_first_decode_s=time.perf_counter() - start,
               rel_error_compiled=rel_error(out, reference),
               rel_error_plain_bf16=rel_error(plain.decode(latent), reference),
               compiled_ms=1000 * cuda_time(lambda: compiled.decode(latent), repeats=5),
               plain_ms=1000 * cuda_time(lambda: plain.decode(latent), repeats=5))
    RESULTS["vae"] = row
    print(row, flush=True)
    return plain


@section("Turbo end to end")
def end_to_end(transformer, fp8) -> None:
    import comfy.model_management

    from comfyui_ernie_image.nodes.accel.patching import COMPILE_KEY, SAMPLER_SAMPLE, compile_by_default
    from comfyui_ernie_image.nodes.dit.model import make_model_patcher
    from comfyui_ernie_image.nodes.dit.schedule import reference_sigmas

    encoder = random_text_encoder()
    ids = torch.randint(1000, 100000, (1, 300), device="cuda")

    @torch.inference_mode()
    def encode():
        return encoder(input_ids=ids, output_hidden_states=True).hidden_states[-2][0]

    encode()
    encode_s = cuda_time(encode, repeats=10)
    diffusers_s, diffusers_vae_s = diffusers_turbo_s(transformer, encode)
    RESULTS["e2e"].append(dict(variant="diffusers pipeline, eager", total_s=diffusers_s, text_encode_s=encode_s,
                               vae_decode_s=diffusers_vae_s))
    free()
    vae = vae_errors()  # the loader's VAE; its decode compiled, checked against fp32
    noise = torch.randn(1, TRUE_DIT["in_channels"], LATENT, LATENT)
    negative = torch.zeros(NEGATIVE, TEXT_DIM, device="cuda", dtype=torch.bfloat16)  # unused at CFG 1
    for name, dit in (("bf16", pack_dit(transformer)), ("fp8_per_row", fp8)):
        if dit is None:
            continue
        patcher = compile_by_default(make_model_patcher(dit, whole=dit is fp8))  # quantized: whole, as the loader
        row = dict(variant=f"pack {name}, default path", text_encode_s=encode_s,
                   compiled=bool(patcher.get_wrappers(SAMPLER_SAMPLE, COMPILE_KEY)))
        row.update(pack_turbo(patcher, vae, encode, noise, negative, reference_sigmas(8)))
        RESULTS["e2e"].append(row)
        print(row, flush=True)
        comfy.model_management.unload_all_models()
        free()


@torch.inference_mode()
def plain_loop(pack, noise, text, sigmas: list[float]) -> torch.Tensor:
    """The Euler loop alone (no ComfyUI), on the pack's forward: what sampling costs without a host framework."""
    x = noise
    for sigma, next_sigma in zip(sigmas[:-1], sigmas[1:], strict=True):
        t = torch.full((1,), 1000 * sigma, device="cuda", dtype=torch.bfloat16)
        x = x + (next_sigma - sigma) * pack_forward(pack, x, t, text[None], [text.shape[0]])
    return x


def gpu_busy_summary(call) -> dict:
    """One run under the profiler: GPU kernel time vs wall time, host waits, and the host's costliest ops."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    events = prof.key_averages()
    kernels = sum(e.self_device_time_total for e in events) / 1e6
    waits = {e.key: dict(calls=e.count, ms=e.self_cpu_time_total / 1000) for e in events
             if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync", "cudaMemGetInfo",
                          "aten::item", "aten::_local_scalar_dense", "aten::to", "aten::copy_")}
    host = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    return dict(wall_s=wall, gpu_kernel_s=kernels, waits=waits,
                host_top=[dict(op=e.key[:80], calls=e.count, ms=e.self_cpu_time_total / 1000) for e in host])


@section("sampling overhead (Turbo, compiled, bf16)")
def sampling_overhead(transformer) -> None:
    import comfy.model_management

    from comfyui_ernie_image.nodes.accel.patching import compile_by_default
    from comfyui_ernie_image.nodes.dit.model import make_model_patcher
    from comfyui_ernie_image.nodes.dit.schedule import reference_sigmas

    text = torch.randn(TOKENS, TEXT_DIM, device="cuda", dtype=torch.bfloat16)
    noise = torch.randn(1, TRUE_DIT["in_channels"], LATENT, LATENT)
    sigmas = reference_sigmas(8)
    rows = RESULTS.setdefault("sampling", [])
    pack = pack_dit(transformer)
    with compiled_blocks(pack):
        loop = partial(plain_loop, pack, noise.cuda().bfloat16(), text, sigmas.tolist())
        loop()
        rows.append(dict(variant="plain Euler loop, pack forward, compiled blocks", s=cuda_time(loop, repeats=3)))
        print(rows[-1], flush=True)
    patcher = compile_by_default(make_model_patcher(pack))
    for cond_device in ("cpu", "cuda"):
        run = partial(comfy_sampling, patcher, noise, text, text[:NEGATIVE], sigmas, 1.0, cond_device)
        run()
        row = dict(variant=f"ComfyUI sample_custom, conditioning on {cond_device}", s=cuda_time(run, repeats=3))
        row["profile"] = gpu_busy_summary(run)
        rows.append(row)
        print(row, flush=True)
    comfy.model_management.unload_all_models()
    free()


@section("VAE decode and text encoding")
def vae_and_text() -> None:
    import comfy.sd
    from diffusers import AutoencoderKLFlux2

    from comfyui_ernie_image.nodes.dit.vae import TRAINED_BN_EPS

    rows = RESULTS.setdefault("parts", [])
    latent = torch.randn(1, TRUE_DIT["in_channels"], LATENT, LATENT)
    vae = comfy.sd.VAE(sd=AutoencoderKLFlux2().state_dict())
    vae.first_stage_model.bn_eps = TRAINED_BN_EPS
    decode = partial(vae.decode, latent)
    reference = decode()
    rows.append(dict(part="VAE decode, core VAE, eager", ms=1000 * cuda_time(decode, repeats=5)))
    with torch.backends.cudnn.flags(enabled=True, benchmark=True):
        decode()
        rows.append(dict(part="VAE decode, cudnn.benchmark", ms=1000 * cuda_time(decode, repeats=5)))
    decoder = vae.first_stage_model.decoder
    decoder.compile()
    start = time.perf_counter()
    out = decode()
    rows.append(dict(part="VAE decode, decoder compiled", compile_s=time.perf_counter() - start,
                     ms=1000 * cuda_time(decode, repeats=5),
                     max_abs_diff=float((out.float() - reference.float()).abs().max())))
    encoder = random_text_encoder()
    ids = torch.randint(1000, 100000, (1, 300), device="cuda")
    for name, model in (("eager", encoder), ("compiled (dynamic)", torch.compile(encoder, dynamic=True))):
        def encode(model=model):
            with torch.inference_mode():
                return model(input_ids=ids, output_hidden_states=True).hidden_states[-2]
        start = time.perf_counter()
        encode()
        rows.append(dict(part=f"text encoding 300 tokens, {name}", compile_s=time.perf_counter() - start,
                         ms=1000 * cuda_time(encode, repeats=10)))
    for row in rows:
        print(row, flush=True)


def report() -> None:
    print(f"\n{RESULTS['machine']}; {elapsed():.0f} s in all; auto attention order: {RESULTS.get('auto_order')}; "
          f"flash impls: {RESULTS.get('flash_impls')}\n")
    print("| attention, batch | mask | kernel | ms | TFLOP/s |\n|---|---|---|---|---|")
    for r in RESULTS["attention"]:
        value = r.get("error") or f"{r['ms']:.2f} | {r['tflops']:.0f}"
        print(f"| {r['batch']} | {'yes' if r['masked'] else 'no'} | {r['kernel']} | {value} |")
    flop = {1: 79.5e12}
    flop[2] = 2 * flop[1]
    print("\n| DiT forward | batch | ms | TFLOP/s (79.5 per image) | first call s | rel. error vs fp32 |\n"
          "|---|---|---|---|---|---|")
    for r in RESULTS["forward"]:
        if "error" in r:
            print(f"| {r['variant']} | {r['batch']} | {r['error']} | | | |")
            continue
        extra = f" (launched {r['launched_ms']:.1f})" if "launched_ms" in r else ""
        print(f"| {r['variant']} | {r['batch']} | {r['ms']:.1f}{extra} | {flop[r['batch']] / r['ms'] / 1e9:.0f} | "
              f"{r.get('first_call_s', float('nan')):.1f} | {r.get('rel_error_vs_fp32', float('nan')):.4f} |")
    for name, rows in RESULTS["profile"].items():
        print(f"\nTop kernels, {name} (total {rows[-1]['total_ms']:.1f} ms GPU):\n| kernel | calls | ms | share |\n"
              "|---|---|---|---|")
        for r in rows[:-1]:
            print(f"| `{r['kernel']}` | {r['calls']} | {r['ms']:.2f} | {100 * r['share']:.1f} % |")
    print("\n| Turbo 1024², 8 steps | text encode ms | sampling s | VAE decode ms | total s | first run s |\n"
          "|---|---|---|---|---|---|")
    for r in RESULTS["e2e"]:
        print(f"| {r['variant']} | {1000 * r['text_encode_s']:.1f} | {r.get('sampling_s', float('nan')):.3f} | "
              f"{1000 * r['vae_decode_s']:.1f} | {r['total_s']:.3f} | {r.get('first_run_s', float('nan')):.1f} |")
    for r in RESULTS.get("sampling", []):
        prof = r.get("profile", {})
        print(f"\nsampling: {r['variant']}: {r['s']:.3f} s"
              + (f"; profiled run {prof['wall_s']:.3f} s wall, {prof['gpu_kernel_s']:.3f} s of kernels; "
                 f"waits {prof['waits']}; host top {prof['host_top'][:6]}" if prof else ""))
    if "vae" in RESULTS:
        print(f"VAE: {RESULTS['vae']}")
    for r in RESULTS.get("parts", []):
        print(f"part: {r}")
    for e in RESULTS["errors"]:
        print(f"ERROR {e}")


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--overhead-only", action="store_true",
                        help="only the compiled forward, the sampling overhead, the VAE and the text encoder")
    parser.add_argument("--e2e-only", action="store_true", help="only Turbo end to end (bf16 and fp8) and the VAE")
    args = parser.parse_args()
    use_comfyui()
    import comfy.model_management

    torch._dynamo.config.cache_size_limit = 64
    RESULTS["machine"] = machine()
    if args.e2e_only:
        transformer = random_true_size_dit()
        fp8 = None
        try:
            fp8 = fp8_pack(transformer)
        except Exception as e:
            RESULTS["errors"].append(f"fp8: {e!r}")
        end_to_end(transformer, fp8)
        report()
        return
    if args.overhead_only:
        transformer = random_true_size_dit()
        inputs = dit_inputs()
        refs = fp32_references(transformer, inputs)
        pack = pack_dit(transformer)
        with compiled_blocks(pack):
            time_forward("pack, compiled (default)", pack_forward, pack, inputs, refs, batches=(1,))
        sampling_overhead(transformer)
        del transformer
        free()
        vae_and_text()
        report()
        return
    attention_kernels()
    transformer = random_true_size_dit()
    inputs = dit_inputs()
    refs = fp32_references(transformer, inputs)
    forward_bf16(transformer, inputs, refs)
    profile_bf16(transformer, inputs)
    fp8 = forward_fp8(transformer, inputs, refs)
    end_to_end(transformer, fp8)  # the compiled graphs above serve it: its first run is warm
    comfy.model_management.unload_all_models()
    del fp8
    free()
    forward_bf16_extras(transformer.to("cuda"), inputs, refs)
    report()
    save()


if __name__ == "__main__":
    main()
