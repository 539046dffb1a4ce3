#!/usr/bin/env python3
"""The pack on a newer ComfyUI core: the pip-installable fork ``hiddenswitch/pip-and-uv-installable-ComfyUI`` (0.12.1).

Not part of CI. Given the fork's fetched git snapshot, it sets the fork up outside the repository (the recipe,
patches and package list in ``shared/newcore``, referenced there, never copied), then runs

1. every API twin in ``tests/workflows/`` that can run on 0.12, on the tiny models under the released names, through
   a headless ComfyUI of the fork (the pack's own ``scripts/comfy_headless.py``), as
   ``tests/test_shared_workflows.py`` runs them (128x128, 16 PE tokens, ``transformers serve`` for the remote PE);
2. the pack's parity tests (``tests/test_e2e_parity.py``: the graph equals diffusers' pipeline, VAE decode included,
   and the single-file DiT / text encoder / VAE give the snapshot's image; the VAE decode test of
   ``tests/test_inference_mode_moves.py``) with pytest in the fork's venv, twice: ``[src]`` with
   ``ERNIE_TEST_COMFYUI`` = the fork's source as it is (this cannot work: the fork's main.py ignores
   ``--base-directory`` and the fork names ``folder_paths`` only for custom nodes it loads; these rows do not decide the
   exit status), then ``[launcher]`` with the two shims written into the work folder (``LAUNCHER_MAIN``,
   ``LAUNCHER_PLUGIN`` below),

and prints a markdown table (twin/test | result | seconds | error). Every step already done is skipped (stamps under
the work folder), so a second run only refreshes the pack's copy and runs.

    python3 scripts/newcore/run_newcore.py [--work /tmp/newcore] [--shared DIR] [--git-dir DIR]
                                           [--setup-only] [--no-twins] [--no-tests] [--no-src-check]
                                           [--twins NAME ...] [--tests NODE_ID ...]

``--shared`` defaults to ``$ERNIE_NEWCORE_SHARED`` or ``../shared/newcore`` beside the repository; ``--git-dir`` to
``$ERNIE_NEWCORE_GIT_DIR`` or where the search tool's ``fetch`` puts the snapshot. CPU only is fine (about 6.6 GB of
venv, several minutes the first time).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_GIT_DIR = "/work/.mirror/hiddenswitch+pip-and-uv-installable-ComfyUI/repo"
PACK_NAME = "comfyui-ernie-image"  # comfy_headless.ComfyServer's default custom_nodes folder name

# The fork's recipe (shared/newcore/README.md, 2026-12-01): each step runs once, then its stamp says it is done.
TORCH = ["torch==2.14.1", "torchvision==0.29.1"]  # no torchaudio for 2.14
FORK_REQS_DATE = "2026-02-11T00:00:00Z"  # the fork's own date: avoids a protobuf clash
PACK_PINS = ["transformers==5.24.0", "diffusers==0.42.1", "cache-dit==1.5.3"]
# Test tools, not the fork's: pytest (tests/requirements.txt's pin) for the parity tests, transformers' serving extra
# for `transformers serve` (the remote PE twin's OpenAI-compatible server, as tests/helpers/pe_servers.py starts it).
TEST_TOOLS = ["pytest==8.4.2"]
SERVING = ["transformers[serving]==5.24.0"]

# Twins the fork (0.12.1) cannot run, with the reason.
NOT_ON_012 = {"ernie_image_turbo_native": "needs ComfyUI >= 0.19 (native ERNIE-Image UNETLoader/CLIPLoader); "
                                         "the fork is 0.12.1"}
# The released names the twins load, and which tiny model stands in (as tests/test_shared_workflows.py's
# release_models fixture links them).
RELEASE_NAMES = {
    "diffusers/ERNIE-Image-Turbo": "snapshot",
    "diffusers/ERNIE-Image": "snapshot",
    "diffusion_models/ernie-image-turbo.safetensors": "single_file",
    "diffusion_models/ernie-image.safetensors": "single_file",
    "text_encoders/ministral-3-3b.safetensors": "text_encoder_file",
    "vae/flux2-vae.safetensors": "vae_file",
    "text_encoders/ernie-image-prompt-enhancer.safetensors": "pe_single_file",
    "diffusion_models/ernie-image-turbo-Q4_K_M.gguf": "gguf_file",  # the community's file the GGUF twin names
}
TINY = {  # where scripts/tiny_models.py writes each of them under the models folder
    "snapshot": "diffusers/ERNIE-Image-Turbo-tiny",
    "single_file": "diffusion_models/ernie-image-turbo-tiny.safetensors",
    "text_encoder_file": "text_encoders/ministral-3-3b-tiny.safetensors",
    "vae_file": "vae/flux2-vae-tiny.safetensors",
    "pe_folder": "text_encoders/ernie-image-prompt-enhancer-tiny",
    "pe_single_file": "text_encoders/ernie-image-prompt-enhancer-tiny.safetensors",
    "gguf_file": "diffusion_models/ernie-image-turbo-tiny-Q4_K_M.gguf",  # --gguf
}
WORKFLOW_LORA = "loras/ernie-image-turbo-lora.safetensors"  # the LoRA twin's file (the user's own: none released)
DEFAULT_TESTS = [
    "tests/test_e2e_parity.py",
    "tests/test_inference_mode_moves.py::test_the_vae_decodes_after_moves_and_after_free",
]


def log(message: str) -> None:
    print(f"[newcore {time.strftime('%H:%M:%S')}] {message}", flush=True)


def sha256(*parts: str | bytes | Path) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.read_bytes() if isinstance(part, Path) else part.encode() if isinstance(part, str) else part)
        digest.update(b"\0")
    return digest.hexdigest()[:16]


class Stamps:
    """One file per finished step, holding the key it was done for: a changed key (new inputs) does it again."""

    def __init__(self, folder: Path):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)

    def done(self, step: str, key: str) -> bool:
        path = self.folder / step
        return path.is_file() and path.read_text() == key

    def mark(self, step: str, key: str) -> None:
        (self.folder / step).write_text(key)


def run(command: list[str], **kwargs) -> None:
    log("$ " + " ".join(str(c) for c in command))
    subprocess.run([str(c) for c in command], check=True, **kwargs)


# --- Setup ------------------------------------------------------------------------------------------------------------

def setup(work: Path, shared: Path, git_dir: Path) -> dict:
    """The fork's recipe, each step skipped when its stamp says it is done. Returns notes for the report."""
    notes: dict = {}
    stamps = Stamps(work / "stamps")
    patches = sorted(shared.glob("0*.patch"))
    if len(patches) != 2 or not (shared / "fork-reqs.txt").is_file():
        raise SystemExit(f"{shared} does not hold the recipe (0001-*.patch, 0002-*.patch, fork-reqs.txt)")
    head = subprocess.run(["git", "-C", str(git_dir), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    notes["fork_commit"] = head

    # 1. The snapshot's tree, patched.
    src = work / "src"
    src_key = sha256(head, shared / "extract_snapshot.py", *patches)
    if not (stamps.done("src", src_key) and (src / "main.py").is_file()):
        shutil.rmtree(src, ignore_errors=True)
        run([sys.executable, shared / "extract_snapshot.py", git_dir, src])
        for patch in patches:
            run(["patch", "-p1", "--forward", "-i", patch], cwd=src)
        stamps.mark("src", src_key)
    else:
        log(f"src: {src} already extracted and patched")

    # 2. The venv and its packages, in the recipe's order.
    venv = work / "venv"
    python = venv / "bin" / "python"
    if not python.is_file():
        run([sys.executable, "-m", "venv", venv])
    pip = [python, "-m", "pip", "install", "--disable-pip-version-check"]
    steps = [
        ("pip", ["-U", "pip"], ""),
        ("torch", TORCH, ""),
        ("fork-reqs", ["--uploaded-prior-to", FORK_REQS_DATE, "-r", shared / "fork-reqs.txt"],
         sha256(shared / "fork-reqs.txt")),
        ("pack-reqs", [*PACK_PINS, "-r", REPO / "requirements.txt"], sha256(REPO / "requirements.txt")),
        ("fork", ["--no-deps", "--force-reinstall", src], src_key),
        ("test-tools", TEST_TOOLS, ""),
    ]
    for step, arguments, extra in steps:
        key = sha256(" ".join(map(str, arguments)), extra)
        if stamps.done(step, key):
            log(f"venv: {step} already installed")
            continue
        run([*pip, *arguments])
        stamps.mark(step, key)
    serving_key = sha256(" ".join(SERVING), "frozen")
    if not stamps.done("serving", serving_key):
        # Only what the extra adds, at versions that fit what is installed: unconstrained, pip takes fastapi 0.165,
        # which upgrades opentelemetry-api past the fork's opentelemetry-sdk 1.39.1 pin.
        frozen = subprocess.run([python, "-m", "pip", "freeze", "--exclude-editable"], capture_output=True,
                                text=True, check=True).stdout.splitlines()
        constraints = work / "stamps" / "installed-constraints.txt"
        constraints.write_text("".join(line + "\n" for line in frozen if "==" in line and " @ " not in line))
        try:
            run([*pip, *SERVING, "-c", constraints])
            stamps.mark("serving", serving_key)
        except subprocess.CalledProcessError as error:
            notes["serving"] = f"pip install {' '.join(SERVING)} failed ({error.returncode})"
    if not (venv / "bin" / "transformers").is_file():
        notes["serving"] = notes.get("serving", "the venv has no `transformers` command")

    # 3. Tiny models in the real layouts (the pack's scripts/tiny_models.py, run by the fork's python).
    models = work / "ws" / "models"
    models_key = sha256(REPO / "scripts" / "tiny_models.py")
    if not (stamps.done("tiny-models", models_key) and (models / TINY["snapshot"] / "model_index.json").is_file()):
        shutil.rmtree(models, ignore_errors=True)
        models.mkdir(parents=True)
        run([python, "-m", "scripts.tiny_models", models, "--gguf"], cwd=REPO)
        stamps.mark("tiny-models", models_key)
    else:
        log(f"models: tiny models already in {models}")
    for name, tiny in RELEASE_NAMES.items():  # the released names, as links to the tiny models
        link = models / name
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.is_symlink():
            link.symlink_to(models / TINY[tiny], target_is_directory=(models / TINY[tiny]).is_dir())
    return notes


def refresh_pack_copy(work: Path) -> Path:
    """The pack as a user installs it (the archive's files: .comfyignore's folders left out), copied afresh at every
    run so that the run sees one state of the pack's files."""
    ignored = {".git", ".venv", ".cache", ".pytest_cache", ".ruff_cache", "__pycache__", "out", ".whl", ".gpu"}
    comfyignore = REPO / ".comfyignore"
    if comfyignore.is_file():
        ignored |= {line.strip().strip("/") for line in comfyignore.read_text().splitlines()
                    if line.strip() and not line.startswith("#")}
    target = work / "ws" / "custom_nodes" / PACK_NAME
    if target.is_symlink():
        target.unlink()
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(REPO, target, ignore=lambda folder, names: [n for n in names if n in ignored or n.endswith(".pyc")])
    return target


# --- The run (in the fork's venv) -------------------------------------------------------------------------------------

def fork_env(work: Path) -> dict[str, str]:
    """The fork writes under ~/.local/share and ~/.cache without its flags; HOME inside the work folder keeps every
    other writer (Hugging Face, torch, cache-dit) there too. Models are local: no hub."""
    home = work / "home"
    home.mkdir(parents=True, exist_ok=True)
    return {**os.environ, "HOME": str(home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1"}


def one_line(text: str, limit: int = 240) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def make_lora(path: Path) -> None:
    """The LoRA the tests give the LoRA twin (tests/helpers/lora.py: peft layout, seed 1). That module imports
    helpers.accel, which imports ComfyUI in process; a stand-in keeps it out (only deltas and lora_file are used)."""
    import types

    from safetensors.torch import save_file

    import helpers

    if "helpers.accel" not in sys.modules:
        accel = types.ModuleType("helpers.accel")

        def tiny_patcher(*_args, **_kwargs):
            raise RuntimeError("helpers.accel is not loaded in scripts/newcore/run_newcore.py")

        accel.tiny_patcher = tiny_patcher
        sys.modules["helpers.accel"] = helpers.accel = accel
    from helpers.lora import LAYERS, deltas, lora_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(lora_file("peft", deltas(LAYERS, seed=1)), str(path))


def run_twins(work: Path, only: list[str] | None, timeout: float, notes: dict) -> list[dict]:
    models = work / "ws" / "models"
    for image in (work / "ws" / "output").glob("*.png"):  # the last run's images
        image.unlink()
    make_lora(models / WORKFLOW_LORA)
    rows: list[dict] = []
    twins = sorted((REPO / "tests" / "workflows").glob("*.json"))
    if only:
        twins = [t for t in twins if t.stem in only]
    runnable = []
    for twin in twins:
        if twin.stem in NOT_ON_012:
            rows.append(dict(name=twin.stem, result="not run", seconds=None, error=NOT_ON_012[twin.stem]))
        else:
            runnable.append(twin)
    if not runnable:
        return rows

    base = work / "ws"
    server = fork_server(work, base, models)
    log(f"starting the fork's ComfyUI: {' '.join(server.args)}")
    started = time.perf_counter()
    try:
        server.start(timeout=600)
    except Exception as error:  # noqa: BLE001 - reported in the table
        (work / "results" / "server_start.txt").write_text(str(error))
        for twin in runnable:
            rows.append(dict(name=twin.stem, result="FAIL", seconds=None,
                             error="the fork's ComfyUI did not start: " + one_line(str(error).splitlines()[0]),
                             detail=str(error)[-6000:]))
        return rows
    log(f"ComfyUI (fork) serving at {server.url} after {time.perf_counter() - started:.1f} s; log {server.log_path}")
    startup = server.log().splitlines()
    notes["startup_errors"] = sorted({line.split("] ", 3)[-1] for line in startup if "[ERROR]" in line})
    try:
        for twin in runnable:
            rows.append(run_twin(server, twin, work, models, timeout, notes))
    finally:
        server.stop()
    return rows


def fork_server(work: Path, base_dir: Path, models_dir: Path):
    """A comfy_headless.ComfyServer launched the fork's way: its ``comfyui`` command (not the deprecated main.py),
    the fork's spelling of the log level (it has no ``--verbose``) and the flags that keep it inside the work folder
    (its database, no requests cache, no known-model downloads)."""
    from scripts.comfy_headless import ComfyServer

    venv_bin = work / "venv" / "bin"
    server = ComfyServer(work / "src", base_dir, REPO, models_dir, python=venv_bin / "python")
    args = [str(venv_bin / "comfyui"), *server.args[2:]]  # [python, "main.py", ...]
    i = args.index("--verbose")
    args[i:i + 2] = ["--logging-level", "DEBUG"]
    args += ["--cwd", str(base_dir), "--disable-known-models", "--disable-requests-caching",
             "--database-url", f"sqlite:///{base_dir / 'comfy.db'}"]
    server.args = args
    return server


def run_twin(server, twin: Path, work: Path, models: Path, timeout: float, notes: dict) -> dict:
    """One twin as tests/test_shared_workflows.py::test_api_twin_runs_to_an_image runs it; a row of the table."""
    from contextlib import ExitStack

    from helpers.pe_servers import transformers_serve

    graph = json.loads(twin.read_text())
    for node in graph.values():  # as tests/test_shared_workflows.py: tiny models, small images
        if node["class_type"].startswith("Empty") and "width" in node["inputs"]:
            node["inputs"].update(width=128, height=128)
        if node["class_type"] == "ErnieImagePromptEnhance":
            node["inputs"]["max_new_tokens"] = 16
    remote = any(node["class_type"] == "ErnieImagePERemote" for node in graph.values())
    if remote and "serving" in notes:
        return dict(name=twin.stem, result="not run", seconds=None,
                    error=f"no OpenAI-compatible server from the fork's venv: {notes['serving']}")
    log(f"twin {twin.stem}")
    log_start = len(server.log())
    started = time.perf_counter()
    serve_dir = work / "serve" / twin.stem
    try:
        with ExitStack() as stack:
            if remote:
                shutil.rmtree(serve_dir, ignore_errors=True)
                serve_dir.mkdir(parents=True)
                url = stack.enter_context(transformers_serve(models / TINY["pe_folder"], serve_dir))
                for node in graph.values():
                    if node["class_type"] == "ErnieImagePERemote":
                        node["inputs"]["base_url"] = url
            response = server.submit(graph)
            if response.status_code != 200:
                seconds = time.perf_counter() - started
                return dict(name=twin.stem, result="FAIL", seconds=seconds,
                            error="rejected by /prompt: " + one_line(response.text), detail=response.text)
            result = server.wait(response.json()["prompt_id"], timeout=timeout)
    except Exception as error:  # noqa: BLE001 - reported in the table
        return dict(name=twin.stem, result="FAIL", seconds=time.perf_counter() - started,
                    error=one_line(f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"),
                    detail=str(error)[-6000:])
    seconds = time.perf_counter() - started
    message = prompt_error(result.messages)
    if any(node["inputs"].get("quantization", "none") != "none" for node in graph.values()):
        # Quantization needs a CUDA GPU: on the CPU the twin must stop at the loader with the reason (as the test).
        if result.status == "error" and message and "needs an NVIDIA GPU (CUDA)" in message:
            return dict(name=twin.stem, result="pass (refused on CPU as expected)", seconds=seconds,
                        error=one_line(message.splitlines()[0], 120))
    if result.status == "success":
        images = [p for p in server.output_images(result) if p.is_file()]
        if images:
            return dict(name=twin.stem, result="pass", seconds=seconds, error="", image=str(images[0]))
        return dict(name=twin.stem, result="FAIL", seconds=seconds, error="success but no image was saved")
    try:
        server_log = server.wait_for_log("Prompt executed", log_start, timeout=30)
    except TimeoutError:
        server_log = server.log()[log_start:]
    traceback = last_traceback(server_log)
    exception_line = traceback.splitlines()[-1] if traceback else ""
    if message and exception_line.endswith(message.splitlines()[0]):
        message = exception_line  # the fork's history drops the exception's type; its log has it
    return dict(name=twin.stem, result="FAIL", seconds=seconds, error=one_line(message or f"status {result.status}"),
                detail=(traceback or server_log[-4000:]) + "\n\nhistory messages: " + json.dumps(result.messages))


def prompt_error(messages: list) -> str | None:
    """The execution error of a prompt's history ``status.messages``: upstream ComfyUI records ``[event, data]``
    pairs (what comfy_headless.PromptResult.error reads); the fork records strings ``"event: exception message"``
    and leaves the traceback out of the history."""
    for message in messages:
        if isinstance(message, (list, tuple)) and len(message) == 2 and message[0] == "execution_error":
            data = message[1]
            return f"{data.get('exception_type', '?')}: {data.get('exception_message', '')}"
        if isinstance(message, str) and message.startswith("execution_error"):
            return message.partition(": ")[2] or message
    return None


def last_traceback(text: str, frames: int = 40) -> str:
    """The last Python traceback in a log: its last ``frames`` lines, down to the exception's line."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if "Traceback (most recent call last)" in line]
    if not starts:
        return ""
    block = [lines[starts[-1]]]
    for line in lines[starts[-1] + 1:]:
        if line.strip() and not line.strip(" ^~\t"):
            continue  # the carets under each frame
        block.append(line)
        if line and not line.startswith((" ", "\t")) and not line.startswith("Traceback"):
            break  # the exception's own line ends the traceback
    return "\n".join(block[-frames:])


# What conftest.py needs to run on the fork, written into the work folder (``launcher/``) by this script:
# - ERNIE_TEST_COMFYUI must hold a main.py that comfy_headless.ComfyServer runs; the fork's own (deprecated) main.py
#   replaces the base paths with its source folder, so --base-directory is ignored and every image lands in
#   src/output, where the tests do not look. This one starts the installed fork as its `comfyui` command does.
LAUNCHER_MAIN = '''"""The installed ComfyUI fork, started as its `comfyui` command (comfy.cmd.main:entrypoint)
does, so that --base-directory holds. Written by scripts/newcore/run_newcore.py of the ERNIE-Image pack."""
import sys

from comfy.cmd.main import entrypoint

sys.exit(entrypoint())
'''
# - the pack imports ComfyUI's vanilla modules (folder_paths, nodes, ...), which the fork aliases only when it loads
#   custom nodes (comfy_compatibility.vanilla.prepare_vanilla_environment): in process (conftest.py, the tests that
#   import the pack's nodes) someone has to call it. This pytest plugin does, once conftest.py has imported ComfyUI.
LAUNCHER_PLUGIN = '''"""pytest plugin: ComfyUI's vanilla module names (folder_paths, nodes, server, ...) in
process, as the fork's custom-node loader sets them up. Written by scripts/newcore/run_newcore.py."""


def pytest_sessionstart(session):
    from comfy_compatibility.vanilla import prepare_vanilla_environment

    prepare_vanilla_environment()
'''


def write_launcher(work: Path) -> Path:
    launcher = work / "launcher"
    launcher.mkdir(parents=True, exist_ok=True)
    (launcher / "main.py").write_text(LAUNCHER_MAIN)
    (launcher / "newcore_vanilla.py").write_text(LAUNCHER_PLUGIN)
    return launcher


def run_tests(work: Path, tests: list[str], timeout: float, label: str, comfy_dir: Path,
              plugin: str | None = None) -> list[dict]:
    """``tests`` with pytest in the fork's venv (this python), ERNIE_TEST_COMFYUI = ``comfy_dir`` (conftest.py
    imports ComfyUI from there in process, and comfy_headless.ComfyServer runs its main.py); one pytest per file,
    so that a module that cannot be collected does not stop the others."""
    import xml.etree.ElementTree as ET

    results = work / "results"
    rows = []
    groups: dict[str, list[str]] = {}
    for test in tests:
        groups.setdefault(test.split("::")[0], []).append(test)
    for n, (file, ids) in enumerate(groups.items()):
        tag = f"{label}-{n}"
        junit, output_file = results / f"pytest-{tag}.xml", results / f"pytest-{tag}.log"
        junit.unlink(missing_ok=True)
        basetemp = work / "pytest" / tag
        shutil.rmtree(basetemp, ignore_errors=True)
        basetemp.parent.mkdir(parents=True, exist_ok=True)
        env = {**fork_env(work), "ERNIE_TEST_COMFYUI": str(comfy_dir)}
        command = [sys.executable, "-m", "pytest", *ids, "-p", "no:cacheprovider", "--basetemp", str(basetemp),
                   "--junitxml", str(junit), "-o", "junit_family=xunit2", "-rA", "--tb=short"]
        if plugin:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(comfy_dir), env.get("PYTHONPATH")]))
            command += ["-p", plugin]
        log(f"[{label}] ERNIE_TEST_COMFYUI={comfy_dir} " + " ".join(command))
        started = time.perf_counter()
        with open(output_file, "w") as out:
            try:
                code = subprocess.run(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                      timeout=timeout).returncode
            except subprocess.TimeoutExpired:
                code = "timeout"
        seconds = time.perf_counter() - started
        output = output_file.read_text(errors="replace")
        for i, server_log in enumerate(sorted(basetemp.glob("*/server.log"))):  # keep the servers' logs, not the
            shutil.copy(server_log, results / f"pytest-{tag}-server{i}.log")  # tiny models' copies (0.65 GB a run)
        shutil.rmtree(basetemp, ignore_errors=True)
        found = []
        if junit.is_file():
            for case in ET.parse(junit).getroot().iter("testcase"):
                classname, name = case.get("classname", ""), case.get("name", "")
                test_id = (f"{classname.replace('.', '/')}.py::{name}" if classname
                           else f"{name.replace('.', '/')}.py (collection)").removeprefix("tests/")
                problem = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
                row = dict(name=f"{test_id} [{label}]", seconds=float(case.get("time", 0)), result="pass", error="")
                if problem is not None:
                    row["result"] = {"failure": "FAIL", "error": "ERROR", "skipped": "skipped"}[problem.tag]
                    text = problem.text or ""
                    row["error"] = one_line(_exception_line(text) or problem.get("message", ""))
                    row["detail"] = text[-6000:]
                found.append(row)
        if not found:
            found.append(dict(name=f"{file} [{label}]", result="ERROR", seconds=seconds,
                              error=f"pytest exited {code} before any test ran: " + one_line(_last_error(output)),
                              detail="\n".join(output.splitlines()[-60:])))
        rows += found
    return rows


def _exception_line(text: str) -> str:
    """pytest's ``E   Error: message`` line of a failure's text, the first one (where it was raised)."""
    for line in text.splitlines():
        if line.startswith("E   ") and line[4:5].strip():
            return line[4:].strip()
    return ""


def _last_error(output: str) -> str:
    lines = [line for line in output.splitlines() if line.strip()]
    for line in reversed(lines):
        if "Error" in line or "error" in line or "Exception" in line:
            return line.strip()
    return lines[-1] if lines else "(no output)"


def report(rows: list[dict], work: Path, notes: dict) -> str:
    lines = ["| twin/test | result | seconds | error |", "|---|---|---|---|"]
    for row in rows:
        seconds = "" if row.get("seconds") is None else f"{row['seconds']:.1f}"
        error = row.get("error", "").replace("|", "\\|")
        lines.append(f"| {row['name']} | {row['result']} | {seconds} | {error} |")
    table = "\n".join(lines)
    pack = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty"], capture_output=True,
                          text=True).stdout.strip()
    details = [f"# The pack ({pack}) on the ComfyUI fork 0.12.1 (commit {notes.get('fork_commit', '?')[:10]}), "
               f"{time.strftime('%Y-%m-%d %H:%M')}", "", table, ""]
    if notes.get("startup_errors"):
        details += ["## What the fork's ComfyUI logged as ERROR at startup", "", "```", *notes["startup_errors"],
                    "```", ""]
    for row in rows:
        if row.get("detail"):
            details += [f"## {row['name']}", "", "```", row["detail"].rstrip(), "```", ""]
    (work / "results" / "report.md").write_text("\n".join(details))
    (work / "results" / "rows.json").write_text(json.dumps(rows, indent=1))
    return table


def run_phase(args: argparse.Namespace) -> int:
    sys.path[:0] = [str(REPO), str(REPO / "tests")]  # the development tools (scripts.*) and the tests' helpers
    work = args.work
    (work / "results").mkdir(parents=True, exist_ok=True)
    notes = json.loads((work / "results" / "notes.json").read_text())
    os.environ.update(fork_env(work))
    rows: list[dict] = []
    if not args.no_twins:
        refresh_pack_copy(work)
        rows += run_twins(work, args.twins, args.twin_timeout, notes)
    if not args.no_tests:
        tests = args.tests or DEFAULT_TESTS
        # As asked of conftest.py: ERNIE_TEST_COMFYUI = the fork's source (its deprecated main.py), nothing else...
        if not args.no_src_check:
            rows += run_tests(work, tests, args.test_timeout, "src", work / "src")
            for image in (work / "src" / "output").glob("*.png"):  # where the fork's main.py put the tests' images
                image.unlink()
        # ...then with the two shims that the fork's layout needs (see LAUNCHER_MAIN and LAUNCHER_PLUGIN).
        rows += run_tests(work, tests, args.test_timeout, "launcher", write_launcher(work), plugin="newcore_vanilla")
    table = report(rows, work, notes)
    print("\n" + table + "\n")
    log(f"details (tracebacks): {work / 'results' / 'report.md'}")
    # The [src] rows show what ERNIE_TEST_COMFYUI = the fork's source alone gives (it cannot work, see LAUNCHER_MAIN):
    # they do not decide the exit status.
    return 0 if all(r["result"].startswith(("pass", "not run")) for r in rows if not r["name"].endswith("[src]")) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path(os.environ.get("ERNIE_NEWCORE_WORK", "/tmp/newcore")),
                        help="work folder, outside the repository (default /tmp/newcore): src/, venv/, ws/, results/")
    parser.add_argument("--shared", type=Path,
                        default=Path(os.environ.get("ERNIE_NEWCORE_SHARED", REPO.parent / "shared" / "newcore")),
                        help="the recipe folder: README.md, 0001-*.patch, 0002-*.patch, fork-reqs.txt, "
                             "extract_snapshot.py (default $ERNIE_NEWCORE_SHARED or ../shared/newcore)")
    parser.add_argument("--git-dir", type=Path, default=Path(os.environ.get("ERNIE_NEWCORE_GIT_DIR", DEFAULT_GIT_DIR)),
                        help="the fork's fetched git snapshot (default $ERNIE_NEWCORE_GIT_DIR or %(default)s)")
    parser.add_argument("--setup-only", action="store_true", help="set the fork up and stop")
    parser.add_argument("--no-twins", action="store_true", help="skip the workflow twins")
    parser.add_argument("--no-tests", action="store_true", help="skip the parity tests")
    parser.add_argument("--no-src-check", action="store_true",
                        help="skip the [src] run of the tests (ERNIE_TEST_COMFYUI = the fork's source as it is)")
    parser.add_argument("--twins", nargs="+", help="only these twins (file stems)")
    parser.add_argument("--tests", nargs="+", help=f"pytest node ids instead of {' '.join(DEFAULT_TESTS)}")
    parser.add_argument("--twin-timeout", type=float, default=1800, help="seconds per twin (default %(default)s)")
    parser.add_argument("--test-timeout", type=float, default=3600, help="seconds per pytest run (default %(default)s)")
    parser.add_argument("--run-phase", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.work = args.work.resolve()
    if args.run_phase:
        return run_phase(args)

    if args.work == REPO or REPO in args.work.parents:
        raise SystemExit(f"--work {args.work} is inside the repository: pick a folder outside it")
    shared, git_dir = args.shared.resolve(), args.git_dir.resolve()
    if not (git_dir / "HEAD").is_file() and not (git_dir / ".git").exists():
        raise SystemExit(f"{git_dir} is not a git directory: fetch github:hiddenswitch/pip-and-uv-installable-ComfyUI")
    notes = setup(args.work, shared, git_dir)
    (args.work / "results").mkdir(parents=True, exist_ok=True)
    (args.work / "results" / "notes.json").write_text(json.dumps(notes))
    log(f"set up: {args.work}")
    if args.setup_only:
        return 0
    # The run needs the fork's packages (torch, requests, the pack's requirements): it goes on in the fork's python.
    python = args.work / "venv" / "bin" / "python"
    return subprocess.run([str(python), str(Path(__file__).resolve()), *sys.argv[1:], "--run-phase"],
                          env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}).returncode


if __name__ == "__main__":
    sys.exit(main())
