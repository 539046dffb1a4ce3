"""The chat template the local PE renders: the pack's copy of Baidu's, never a downloaded folder's own.

A chat template is a program that runs on every prompt, and Jinja's sandbox stops attribute escapes but bounds no
work: ``{{ 'A' * 3000000000 }}`` takes gigabytes, two nested ``range(100000)`` loops hold the worker for hours, and
neither sees Cancel. So a folder's template (``chat_template.jinja``, ``tokenizer_config.json``'s ``chat_template``)
is rendered only when its sha256 is one the pack knows (``KNOWN_DIGESTS``: Baidu's published file, which is the
pack's copy); any other gets a warning in the log, once per file and content, naming the file, and the pack's
template is used instead. A template file is read only up to ``TEMPLATE_LIMIT_BYTES`` (Baidu's is 0.6 KiB), and
transformers never reads it (``tokenizer_folder``). No ComfyUI.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ...model_files import read_json

BAIDU_CHAT_TEMPLATE = Path(__file__).with_name("chat_template.jinja")
# ``pe_tokenizer/chat_template.jinja`` of baidu/ERNIE-Image-Turbo (revision bc68c81e), byte for byte the file above.
KNOWN_DIGESTS = frozenset({"0c859484eecf01db103acd02c332610163ee425cd46866d6cb126ee1bee974ea"})
TEMPLATE_LIMIT_BYTES = 1 << 20
TEMPLATE_FILE = "chat_template.jinja"
_TEMPLATE_ENTRIES = (TEMPLATE_FILE, "additional_chat_templates")  # what transformers would read as templates
_warned: set[tuple[str, str]] = set()


def shipped_template() -> str:
    """The pack's copy of Baidu's PE chat template."""
    return BAIDU_CHAT_TEMPLATE.read_text(encoding="utf-8")


def chat_template(folder: Path | None) -> str:
    """The template to render for the tokenizer in ``folder`` (None: ComfyUI's single file, which carries none): the
    folder's own when the pack knows its digest, else the pack's, with a warning for each unknown one."""
    for where, text in _folder_templates(folder) if folder is not None else ():
        if text is None:
            continue
        digest = _digest(text)
        if digest in KNOWN_DIGESTS:
            return text
        _warn(where, digest, f"holds a chat template the pack does not know (sha256 {digest[:16]}…): a template is "
              "code run on every prompt, unbounded")
    return shipped_template()


@contextlib.contextmanager
def tokenizer_folder(folder: Path) -> Iterator[Path]:
    """``folder`` as transformers may read it: a temporary folder of links to its files, its templates left out
    (``from_pretrained`` reads a ``chat_template.jinja`` whole, whatever its size)."""
    with tempfile.TemporaryDirectory(prefix="ernie-pe-tokenizer-") as staged:
        for entry in folder.iterdir():
            if entry.name not in _TEMPLATE_ENTRIES:
                (Path(staged) / entry.name).symlink_to(entry.resolve())
        yield Path(staged)


def _folder_templates(folder: Path) -> Iterator[tuple[str, str | None]]:
    """``(where, text)`` of each template in the folder, in transformers' order of precedence; text None for a
    file that is not read (warned about here)."""
    jinja = folder / TEMPLATE_FILE
    if jinja.exists():
        yield str(jinja), _read_bounded(jinja)
    config = folder / "tokenizer_config.json"
    template = read_json(config).get("chat_template") if config.is_file() else None  # read_json: at most 1 MiB
    if template:
        text = template if isinstance(template, str) else json.dumps(template, ensure_ascii=False, sort_keys=True)
        yield f"{config} (its chat_template)", text


def _read_bounded(path: Path) -> str | None:
    """A template file's text, or None (with a warning) for one that is too large, not a regular file or unreadable:
    it is not read at all (a FIFO would block the reading, a 3 GB file fill the memory)."""
    try:
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):
            _warn(str(path), "not a file", "is not a regular file and is not read")
            return None
        if info.st_size > TEMPLATE_LIMIT_BYTES:
            _warn(str(path), f"{info.st_size} bytes",
                  f"is {info.st_size / 2**20:.1f} MiB, larger than a chat template's "
                  f"{TEMPLATE_LIMIT_BYTES // 2**20} MiB limit, and is not read")
            return None
        with open(path, "rb") as f:
            data = f.read(TEMPLATE_LIMIT_BYTES + 1)
    except OSError as error:
        _warn(str(path), "unreadable", f"cannot be read ({type(error).__name__})")
        return None
    return data.decode("utf-8", errors="replace")


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _warn(where: str, content: str, why: str) -> None:
    """One warning per file and content: a template that changes is told again, one that stays is not repeated."""
    if (where, content) in _warned:
        return
    _warned.add((where, content))
    logging.warning("ERNIE-Image PE: %s %s; the pack's copy of Baidu's PE template (%s) is used instead", where, why,
                    BAIDU_CHAT_TEMPLATE.name)
