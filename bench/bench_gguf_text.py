"""GGUF text encoder, PE and DiT types (issue 44) on one GPU, through the pack's own loaders, true size, random weights.

In one process, under ``--deadline-s`` (a part not started by then is listed as not run):

1. ``te``: the text encoder as llama.cpp's Q4_K_M and Q8_0 GGUF (``ManagedTextEncoder.from_gguf``) against the bf16
   and fp8 safetensors single file (``from_single_file``): file bytes, bytes held on the device once loaded (its
   tensors; on CUDA also what the allocator gained), the first encode (loading onto the device included) and the
   warm encode, the median of ``--repeats``, of the GPU check's prompt (its token count shown: alike for all);
2. ``pe``: the PE as the Q4_K_M GGUF against the fp8 and bf16 single file (``LocalPromptEnhancer.from_path``, the
   decode path ``auto`` takes on CUDA, static-graphs; ``static`` eager with ``--tiny``): the same prompt's token ids
   (Baidu's template, rendered once) and ``--pe-tokens`` new tokens each (EOS ignored), warm-up first; decode tokens
   per second from the whole run less the first token's time, as ``bench_pe.py``;
3. ``dit``: the DiT as a Q4_0 and a Q4_K GGUF (every linear layer of that type; ``load_gguf_dit``): one forward at
   1024² with 256 text tokens (a Turbo step), eager and with the pack's regional compile (``RegionalCompile``, as the
   sampler runs it), median of ``--repeats``.

The files are llama.cpp's and the community's layouts (``scripts/ministral_gguf_writer.py``, ``scripts/gguf_writer.py``)
with random valid blocks, values not read (times and bytes do not depend on them). The text encoders are the GPU
check's files under ``--models`` (its folder by default: a check run before leaves them there, else they are written
here, the same way): ``text_encoders/ministral-3-3b.safetensors`` (the bf16 language model with its tokenizer, also
read as the PE: a random PE has the text encoder's architecture, tied embeddings) and the two GGUF text encoders (the
Q4_K_M also read as the PE). The DiT files are written to ``--work`` one at a time and deleted once loaded (4.6 GB
each at true size: the GPU machine's disk holds the check's 48 GB beside them).

Prints a table per part and writes ``bench_gguf_text.json`` to ``--out`` after every measurement.

    python bench/bench_gguf_text.py --deadline-s 420            # on the GPU (docs/gpu-session.md)
    python bench/bench_gguf_text.py --tiny --device cpu --no-compile   # tiny models on the CPU (the test)
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: scripts, checks
from common import TRUE_DIT, machine, pack_forward, use_comfyui  # noqa: E402

from checks.gpu.e2e_models import GGUF_TEXT_ENCODERS, write_gguf_text_encoders  # noqa: E402
from scripts.gguf_writer import uniform_kind, write_gguf  # noqa: E402

SINGLE_FILE = "text_encoders/ministral-3-3b.safetensors"  # the check's (e2e_models.py)
GGUF_FILE = {file_type: name for name, file_type in GGUF_TEXT_ENCODERS.items()}  # Q4_K_M, Q8_0: the check's
PROMPT = "A cozy reading nook by a rainy window, warm lamp light, a cat asleep on a stack of books"  # the check's
DIT_TYPES = ("Q4_0", "Q4_K")
PARTS = ("te", "pe", "dit")


class Clock:
    """Wall seconds of calls on ``device``, synchronised on CUDA."""

    def __init__(self, device: torch.device):
        self.device = device

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def seconds(self, fn: Callable[[], object]) -> float:
        self.sync()
        start = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - start

    def median(self, fn: Callable[[], object], repeats: int) -> float:
        return statistics.median(self.seconds(fn) for _ in range(repeats))

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0


def tensor_bytes(tensors, device: torch.device) -> int:
    """Bytes of the distinct ``tensors`` on ``device``'s type (a tied weight once)."""
    seen = {t.data_ptr(): t.numel() * t.element_size() for t in tensors if t.device.type == device.type}
    return sum(seen.values())


def free_all() -> None:
    import comfy.model_management as mm

    gc.collect()
    mm.unload_all_models()
    mm.soft_empty_cache()


def write_single_file(models: Path, tiny: bool, device: torch.device) -> Path:
    """The check's bf16 single-file text encoder, written as ``e2e_models`` writes it, where no check left one."""
    from bench_pe import random_true_size_pe  # the PE's geometry is TRUE_MINISTRAL's
    from safetensors.torch import save_file

    from scripts.tiny_models import make_pipeline, make_tokenizer, save_text_encoder_single_file, tekken_entry

    path = models / SINGLE_FILE
    if path.is_file():
        return path
    if tiny:
        return save_text_encoder_single_file(make_pipeline(), path)
    model = random_true_size_pe(device=str(device)).model
    state = {f"model.{k}": v.contiguous().cpu() for k, v in model.state_dict().items()}
    state["tekken_model"] = tekken_entry(make_tokenizer())
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    save_file(state, str(partial), metadata={"format": "pt"})
    partial.replace(path)
    return path


def measured(part: str, variants: dict, measure: Callable[..., dict], deadline: float):
    """Each of ``variants`` (label: the arguments of ``measure``) measured while there is time, its models gone
    before the next; a row saying "not run" for each one after the deadline, and the error of one that failed (the
    others still run: one call on a lent machine)."""
    for label, arguments in variants.items():
        if time.time() > deadline:
            yield dict(part=part, variant=label, error="not run: deadline")
            continue
        try:
            row = measure(*arguments)
        except Exception as error:
            traceback.print_exc()
            row = dict(error=f"{type(error).__name__}: {error}"[:300])
        yield dict(part=part, variant=label, **row)
        free_all()


@torch.inference_mode()  # as ComfyUI runs its nodes: the loader and the encode node
def measure_text_encoder(path: Path, load: Callable, clock: Clock, repeats: int) -> dict:
    """A text encoder loaded by the pack, encoded once (loading onto the device) and ``repeats`` times."""
    row = dict(file=path.name, file_mb=round(path.stat().st_size / 1e6, 1))
    before = clock.allocated()
    start = time.perf_counter()
    encoder = load(path)
    row["load_s"] = round(time.perf_counter() - start, 2)
    row["first_encode_s"] = round(clock.seconds(lambda: encoder.encode(PROMPT)), 3)
    device = encoder.patcher.load_device
    row["device"] = str(device)
    row["held_mb"] = round(tensor_bytes(encoder.cache_tensors(), device) / 1e6, 1)
    if device.type == "cuda":
        row["allocated_mb"] = round((clock.allocated() - before) / 1e6, 1)
    row["tokens"] = len(encoder.encoder.token_ids(PROMPT))
    row["warm_encode_ms"] = round(clock.median(lambda: _encoded_anew(encoder), repeats) * 1e3, 2)
    return row


def _encoded_anew(encoder) -> None:
    """The prompt encoded, not taken from the encodings the encoder keeps of the texts it met."""
    encoder.encodings.clear()
    encoder.encode(PROMPT)


def bench_text_encoders(models: Path, clock: Clock, repeats: int, deadline: float):
    """Part 1: the text encoder as each file and storage."""
    from comfyui_ernie_image.nodes.text.managed import ManagedTextEncoder

    def single_file(fp8: bool) -> Callable:
        return lambda path: ManagedTextEncoder.from_single_file(path, fp8=fp8)

    gguf = ManagedTextEncoder.from_gguf
    variants = {"bf16 safetensors": (SINGLE_FILE, single_file(False)),
                "fp8 safetensors": (SINGLE_FILE, single_file(True)),
                "GGUF Q4_K_M": (GGUF_FILE["Q4_K_M"], gguf), "GGUF Q8_0": (GGUF_FILE["Q8_0"], gguf)}
    return measured("te", {label: (models / name, load, clock, repeats) for label, (name, load) in variants.items()},
                    measure_text_encoder, deadline)


def measure_prompt_enhancer(path: Path, fp8: bool, prompt: list, clock: Clock, new_tokens: int, repeats: int,
                            decode: str) -> dict:
    """A PE loaded by the pack decoding ``new_tokens`` (EOS ignored) after ``prompt``'s ids (``prompt[0]`` None: its
    own rendering of Baidu's template, kept there for the next PEs)."""
    from comfyui_ernie_image.nodes.pe.local.decode import DecodeRequest
    from comfyui_ernie_image.nodes.pe.local.enhancer import LocalPromptEnhancer
    from comfyui_ernie_image.nodes.pe.protocol import PromptSpec, SamplingParams

    dtype = "float32" if clock.device.type == "cpu" else "bfloat16"
    row = dict(file=path.name, file_mb=round(path.stat().st_size / 1e6, 1), new_tokens=new_tokens, decode=decode)
    enhancer = LocalPromptEnhancer.from_path(path, device=str(clock.device), dtype=dtype, decode=decode, fp8=fp8)
    start = time.perf_counter()
    enhancer._ensure_loaded()  # the pack's own loading: its weights, fused gate/up, its decoder
    enhancer._load(0)  # onto the device, as before a generation
    row["load_s"] = round(time.perf_counter() - start, 2)
    row["held_mb"] = round(tensor_bytes(enhancer.cache_tensors(), clock.device) / 1e6, 1)
    if prompt[0] is None:
        prompt[0] = enhancer._token_rows([PromptSpec(PROMPT)])
    ids, mask = (t.to(clock.device) for t in enhancer._left_pad(prompt[0]))
    row["prompt_tokens"] = ids.shape[1]

    def run(count: int) -> torch.Tensor:
        request = DecodeRequest(ids, mask, SamplingParams(0.6, 0.8, count, seed=0), enhancer._eos_ids(),
                                enhancer._pad_id(), lambda: False, lambda done: None)
        return enhancer._decoder.generate(request, ignore_eos=True)

    with torch.inference_mode():
        row["warmup_s"] = round(clock.seconds(lambda: run(new_tokens)), 2)  # compiles and captures
        total = clock.median(lambda: run(new_tokens), repeats)
        first = clock.median(lambda: run(1), repeats)
    enhancer._decoder.release()
    row.update(total_s=round(total, 3), ttft_ms=round(first * 1e3, 1),
               decode_tok_s=round((new_tokens - 1) / max(total - first, 1e-9), 1))
    return row


def bench_prompt_enhancers(models: Path, clock: Clock, new_tokens: int, repeats: int, tiny: bool, deadline: float):
    """Part 2: the PE as each file and storage, on the same prompt ids."""
    decode = "static" if tiny else "static-graphs"  # what "auto" takes on CUDA; eager for the CPU smoke run
    prompt = [None]
    variants = {"bf16 safetensors": (SINGLE_FILE, False), "fp8 safetensors": (SINGLE_FILE, True),
                "GGUF Q4_K_M": (GGUF_FILE["Q4_K_M"], False)}
    return measured("pe", {label: (models / name, fp8, prompt, clock, new_tokens, repeats, decode)
                           for label, (name, fp8) in variants.items()}, measure_prompt_enhancer, deadline)


def dit_state(config: dict) -> dict[str, torch.Tensor]:
    """The DiT's tensors: weights on the meta device (written as random blocks), 1-D ones with values (norms 1)."""
    from diffusers import ErnieImageTransformer2DModel

    with torch.device("meta"):
        model = ErnieImageTransformer2DModel(**config)
    state = {}
    for name, value in model.state_dict().items():
        if value.ndim == 1:
            value = torch.ones(value.shape) if "norm" in name else torch.randn(value.shape) * 0.02
        state[name] = value
    return state


def measure_dit(path: Path, kind: str, state: dict, inputs: tuple, clock: Clock, repeats: int, compiled: bool,
                deadline: float) -> dict:
    """A DiT file of ``kind`` written, loaded by the pack (then deleted), one forward timed eager and compiled."""
    from comfyui_ernie_image.nodes.accel.compile import RegionalCompile, compile_problem, compile_settings
    from comfyui_ernie_image.nodes.dit.gguf import load_gguf_dit

    start = time.perf_counter()
    try:
        write_gguf(path, state, uniform_kind(kind), arch="wan")
        row = dict(file_mb=round(path.stat().st_size / 1e6, 1), write_s=round(time.perf_counter() - start, 1))
        start = time.perf_counter()
        dit = load_gguf_dit(path, inputs[0].dtype).to(clock.device)
    finally:
        path.unlink(missing_ok=True)  # loaded (or not): the disk is the check's
    row["load_s"] = round(time.perf_counter() - start, 2)
    row["held_mb"] = round(tensor_bytes([*dit.parameters(), *dit.buffers()], clock.device) / 1e6, 1)

    def forward():
        return pack_forward(dit, *inputs)

    with torch.inference_mode():
        forward()
        row["eager_ms"] = round(clock.median(forward, repeats) * 1e3, 2)
        problem = "--no-compile" if not compiled else compile_problem(clock.device)
        problem = problem or ("deadline" if time.time() > deadline else None)
        if problem is not None:
            row["compiled_ms"] = f"not run: {problem}"
            return row
        regional = RegionalCompile(dit.layers, device=clock.device)
        regional.install()
        try:
            with compile_settings():
                row["compile_s"] = round(clock.seconds(forward), 1)
                row["compiled_ms"] = round(clock.median(forward, repeats) * 1e3, 2)
        finally:
            regional.remove()
    return row


def bench_dits(work: Path, clock: Clock, repeats: int, tiny: bool, compiled: bool, deadline: float):
    """Part 3: the DiT as each GGUF type: one forward (a Turbo step at 1024², 256 text tokens)."""
    from scripts.tiny_models import TINY_DIT

    config = TINY_DIT if tiny else TRUE_DIT
    side, tokens = (8, 5) if tiny else (64, 256)  # latents of 1024² (patch 1)
    device, dtype = clock.device, torch.float32 if clock.device.type == "cpu" else torch.bfloat16
    inputs = (torch.randn(1, config["in_channels"], side, side, device=device, dtype=dtype),
              torch.full((1,), 500.0, device=device, dtype=dtype),
              torch.randn(1, tokens, config["text_in_dim"], device=device, dtype=dtype), [tokens])
    state = dit_state(config)
    return measured("dit", {f"GGUF {kind}": (work / f"ernie-image-turbo-{kind}.gguf", kind, state, inputs, clock,
                                             repeats, compiled, deadline) for kind in DIT_TYPES}, measure_dit, deadline)


def table(rows: list[dict]) -> str:
    columns = {"files": [],
               "te": ["file_mb", "held_mb", "allocated_mb", "load_s", "first_encode_s", "tokens", "warm_encode_ms"],
               "pe": ["file_mb", "held_mb", "load_s", "prompt_tokens", "new_tokens", "warmup_s", "ttft_ms",
                      "decode_tok_s"],
               "dit": ["file_mb", "write_s", "held_mb", "load_s", "eager_ms", "compile_s", "compiled_ms"]}
    lines = []
    for part, names in columns.items():
        mine = [r for r in rows if r["part"] == part]
        if not mine:
            continue
        lines += ["", f"| {part} | " + " | ".join(names) + " | error |", "|---" * (len(names) + 2) + "|"]
        lines += [f"| {r['variant']} | " + " | ".join(str(r.get(n, "-")) for n in names) +
                  f" | {r.get('error', '')} |" for r in mine]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--models", type=Path, default=Path("/tmp/ernie-e2e/models"),
                        help="the GPU check's models folder (its text encoder files are read, or written there)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/ernie-bench-gguf"), help="the DiT files, briefly")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    parser.add_argument("--deadline-s", type=float, default=420.0, help="start nothing after this")
    parser.add_argument("--repeats", type=int, default=5, help="warm runs per measurement (the median)")
    parser.add_argument("--pe-tokens", type=int, default=64, help="new tokens per PE run")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny models (the CPU smoke run)")
    parser.add_argument("--no-compile", action="store_true", help="the DiT eager only")
    args = parser.parse_args()
    deadline = time.time() + args.deadline_s
    device = torch.device(args.device)
    use_comfyui(cpu=device.type == "cpu")
    clock = Clock(device)
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"date": datetime.date.today().isoformat(), "machine": machine(), "tiny": args.tiny, "rows": []}

    def save(row: dict) -> None:
        report["rows"].append(row)
        print(f"[{args.deadline_s - (deadline - time.time()):5.0f} s] {row}", flush=True)
        (args.out / "bench_gguf_text.json").write_text(json.dumps(report, indent=1))

    parts = args.parts.split(",")
    start = time.perf_counter()
    if {"te", "pe"} & set(parts):
        try:
            write_single_file(args.models, args.tiny, device)
            write_gguf_text_encoders(args.models, list(GGUF_TEXT_ENCODERS), true_size=not args.tiny)
        except Exception as error:  # the text encoder files: without them, only the DiT part can run
            traceback.print_exc()
            save(dict(part="files", variant="text encoder files", error=f"{type(error).__name__}: {error}"[:300]))
            parts = [part for part in parts if part == "dit"]
        report["files_s"] = round(time.perf_counter() - start, 1)
        free_all()
    measures = {"te": lambda: bench_text_encoders(args.models, clock, args.repeats, deadline),
                "pe": lambda: bench_prompt_enhancers(args.models, clock, args.pe_tokens, max(args.repeats // 2, 1),
                                                     args.tiny, deadline),
                "dit": lambda: bench_dits(args.work, clock, args.repeats, args.tiny, not args.no_compile, deadline)}
    for part in parts:
        try:
            for row in measures[part]():
                save(row)
        except Exception as error:  # one run on a lent machine: record and go on
            traceback.print_exc()
            save(dict(part=part, variant="(failed)", error=f"{type(error).__name__}: {error}"[:300]))
            free_all()
    print(f"\n{report['machine']}; files ready in {report.get('files_s', 0)} s" + table(report["rows"]))


if __name__ == "__main__":
    main()
