"""Issue 41, finding 3: a chat template in a downloaded PE folder took all memory or hung the server. The local PE
renders only the pack's copy of Baidu's template (or a file with its digest); any other template is never rendered,
nor read whole, and its file is named once in the log.

Each hostile folder runs in a child process with its address space capped and a timeout (``helpers.bounded``): on
main the first template filled the memory (MemoryError at the cap), the second ran for hours (the timeout), the
third was the first one in ``tokenizer_config.json``, the fourth a 3 GiB file that transformers read whole.
"""

from __future__ import annotations

import json
import logging

import pytest

from comfyui_ernie_image.nodes.pe.local.enhancer import LocalPromptEnhancer
from comfyui_ernie_image.nodes.pe.local.template import shipped_template
from comfyui_ernie_image.nodes.pe.protocol import PromptSpec, SamplingParams
from comfyui_ernie_image.nodes.pe.runtime import Runtime
from helpers.bounded import run_bounded
from helpers.files import linked_copy, replace_bytes

PROMPTS = [PromptSpec("a cat", 1024, 1024), PromptSpec("一只狗", 848, 1264)]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8)
MEMORY_BOMB = "{{ 'A' * 3000000000 }}"
HOURS_OF_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


def _in_jinja(folder, template):
    replace_bytes(folder / "chat_template.jinja", template.encode())
    return folder / "chat_template.jinja"


def _in_tokenizer_config(folder, template):
    (folder / "chat_template.jinja").unlink()
    config = folder / "tokenizer_config.json"
    replace_bytes(config, json.dumps({**json.loads(config.read_text()), "chat_template": template}).encode())
    return config


def _three_gib_file(folder, _template):
    jinja = folder / "chat_template.jinja"
    jinja.unlink()
    with open(jinja, "wb") as f:
        f.truncate(3 << 30)  # sparse: no disk, but 3 GiB to whoever reads it
    return jinja


HOSTILE = {
    "memory bomb": (_in_jinja, MEMORY_BOMB, "holds a chat template the pack does not know"),
    "nested loops": (_in_jinja, HOURS_OF_LOOPS, "holds a chat template the pack does not know"),
    "memory bomb in tokenizer_config.json": (_in_tokenizer_config, MEMORY_BOMB,
                                             "(its chat_template) holds a chat template the pack does not know"),
    "a 3 GiB template file": (_three_gib_file, "", "is 3072.0 MiB, larger than a chat template's 1 MiB limit, and is "
                                                   "not read"),
}

_SETUP = """
import logging
from comfyui_ernie_image.nodes.pe.local.enhancer import LocalPromptEnhancer
from comfyui_ernie_image.nodes.pe.local.template import shipped_template
from comfyui_ernie_image.nodes.pe.protocol import PromptSpec, SamplingParams
from comfyui_ernie_image.nodes.pe.runtime import Runtime

class Recorder(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []
    def emit(self, record):
        self.messages.append(record.getMessage())

recorder = Recorder()
logging.getLogger().addHandler(recorder)
"""


def _statement(folders: dict, report) -> str:
    """Each folder's handle: its identity, then its texts twice; what it rendered and the warnings of each."""
    return f"""
params = SamplingParams(temperature=0.0, max_new_tokens={GREEDY.max_new_tokens})
specs = [PromptSpec(*spec) for spec in {[(p.prompt, p.width, p.height) for p in PROMPTS]!r}]
ran = {{}}
for case, folder in {folders!r}.items():
    recorder.messages.clear()
    handle = LocalPromptEnhancer.from_path(folder, device="cpu", dtype="float32", runtime=Runtime())
    identity = handle.identity
    texts = [c.text for c in handle.enhance(specs, params)] + [c.text for c in handle.enhance(specs, params)]
    ran[case] = {{"texts": texts, "identity": identity, "warnings": list(recorder.messages),
                 "shipped": handle._tokenizer.chat_template == shipped_template()}}
import json
with open({str(report)!r}, "w") as f:
    json.dump(ran, f)
"""


@pytest.fixture(scope="module")
def reference(tiny_models):
    """The tiny PE folder (which carries Baidu's template, as a snapshot does): its texts and template digest."""
    handle = LocalPromptEnhancer.from_path(tiny_models["pe_folder"], device="cpu", dtype="float32", runtime=Runtime())
    return [c.text for c in handle.enhance(PROMPTS, GREEDY)], handle.identity.split("|template=")[1]


def test_a_folders_own_template_is_never_rendered(tiny_models, tmp_path, reference):
    """All four folders in one capped child (one ComfyUI import): on main it ended in MemoryError or the timeout."""
    folders, where = {}, {}
    for case, (place, template, _) in HOSTILE.items():
        folder = linked_copy(tiny_models["pe_folder"], tmp_path / case.replace(" ", "-") / "prompt-enhancer")
        folders[case], where[case] = str(folder), place(folder, template)
    report = tmp_path / "report.json"
    outcome = run_bounded(_statement(folders, report), setup=_SETUP, folders={}, headroom_mb=512, timeout_s=90)
    assert outcome["outcome"] == "loaded", outcome
    assert outcome["rss_growth_mb"] < 256, outcome  # a tiny model and its tokenizer; the first bomb alone is 2.8 GiB
    texts, template_digest = reference
    for case, ran in json.loads(report.read_text()).items():
        assert ran["shipped"] and ran["texts"] == texts * 2, case
        assert ran["identity"].split("|template=")[1] == template_digest, case  # the key names what was rendered
        named = [message for message in ran["warnings"] if str(where[case]) in message]
        assert len(named) == 1, (case, ran["warnings"])  # once, though the identity and two runs each asked
        assert f"{where[case]} {HOSTILE[case][2]}" in named[0], case
        assert named[0].endswith("the pack's copy of Baidu's PE template (chat_template.jinja) is used instead")


def test_the_tiny_folder_carries_baidus_template_and_warns_of_nothing(tiny_models, caplog):
    assert (tiny_models["pe_folder"] / "chat_template.jinja").read_text(encoding="utf-8") == shipped_template()
    with caplog.at_level(logging.WARNING):
        handle = LocalPromptEnhancer.from_path(tiny_models["pe_folder"], device="cpu", runtime=Runtime())
        handle.enhance(PROMPTS[:1], GREEDY)
    assert handle._tokenizer.chat_template == shipped_template()
    assert not [r for r in caplog.records if "template" in r.getMessage()]
