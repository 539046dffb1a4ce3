"""One grammar for the models that the pack's loaders list, and one resolver (ComfyUI adapter: ``folder_paths``).

Every loader names a model by where it lies in ComfyUI's models folder: ``<folder>/<path inside it>``, the folder
being ComfyUI's folder name. A snapshot is ``diffusers/ERNIE-Image-Turbo`` in every list; files are
``diffusion_models/ernie-image-turbo.safetensors``, ``text_encoders/ministral-3-3b.safetensors``,
``vae/flux2-vae.safetensors``, whichever loader lists them.

Saved workflows keep their old spellings. Before, each list had its own: the all-in-one loader and the text encoder's
named a snapshot bare (``ERNIE-Image-Turbo``), the DiT's and the VAE's a file bare; every other entry had its folder
in front, as now. So a value whose first part is not a folder of the list is read as its loader read a bare name
(``ModelList.legacy``); such values validate and load, but are not listed. Only an old name whose first folder is
named like the list's new folder reads otherwise now: the DiT file ``diffusion_models/diffusion_models/x`` was
``diffusion_models/x``, which now names ``diffusion_models/x`` itself (likewise ``vae/vae/…`` and a snapshot under
``diffusers/diffusers/``).

The names are checked by ``paths``' rule wherever they are joined to a folder: each source's ``path`` is one of
``paths``' lookups.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .errors import ErnieImageError
from .inputs import AliasedCombo
from .paths import check_choice, gguf_names, model_file_path, safetensors_names, snapshot_names, snapshot_path


@dataclass(frozen=True)
class Source:
    """The models of one kind that a list takes from one ComfyUI model folder: ``names`` lists them (paths relative
    to ``folder``), ``path`` finds one by such a name and refuses a name that would leave the folder."""

    folder: str
    names: Callable[[], list[str]]
    path: Callable[[str], Path]


def files(folder: str, keep: Callable[[str], bool] = lambda name: True, gguf: bool = False) -> Source:
    """The ``.safetensors`` files of ComfyUI's ``folder`` folders that ``keep`` accepts, and their ``.gguf`` files
    too where ``gguf``."""

    def names() -> list[str]:
        found = safetensors_names(folder) + (gguf_names(folder) if gguf else [])
        return [name for name in dict.fromkeys(found) if keep(name)]

    return Source(folder, names, lambda name: model_file_path(folder, name))


SNAPSHOTS = Source("diffusers", snapshot_names, snapshot_path)
# The all-in-one loader's text encoder and PE: its snapshot's, or a file of models/text_encoders instead.
FROM_SNAPSHOT = "snapshot"


@dataclass(frozen=True)
class Model:
    """A resolved choice: the folder it was found in (tells a snapshot from a file) and its path."""

    folder: str
    path: Path


@dataclass(frozen=True)
class ModelList:
    """What one loader input lists, in order, from ``sources`` (one per folder); ``legacy`` is the folder of a value
    with no folder of the list in front (how the loader read a bare name before this grammar), or None where every
    value always had its folder in front."""

    sources: tuple[Source, ...]
    legacy: str | None = None

    def options(self) -> list[str]:
        """Every model the list offers, spelled ``<folder>/<name>``."""
        return [f"{source.folder}/{name}" for source in self.sources for name in source.names()]

    def canonical(self, value: str) -> str:
        """The listed spelling of ``value``: itself when its first part is one of the list's folders, else the old
        spelling of a name in the ``legacy`` folder."""
        folder, separator, _ = value.partition("/")
        if self.legacy is None or (separator and any(folder == source.folder for source in self.sources)):
            return value
        return f"{self.legacy}/{value}"

    def resolve(self, value: str) -> Model:
        """The model ``value`` names (listed or old spelling), or an error naming it."""
        folder, _, name = self.canonical(value).partition("/")
        for source in self.sources:
            if source.folder == folder:
                return Model(folder, source.path(name))
        raise ErnieImageError(self.check(value))

    def check(self, value: str) -> bool | str:
        """A node's ``validate_inputs`` answer: True for a listed model in either spelling, or the words of the
        error."""
        where = " or models/".join(source.folder for source in self.sources)
        options = self.options()
        listed = isinstance(value, str) and self.canonical(value) in options  # a workflow may hold any JSON value
        return True if listed else check_choice(value, options, where)

    def input(self, id: str, tooltip: str) -> AliasedCombo:
        """The loader's Combo: lists ``options()`` and lets the old spellings through the pack's input check."""
        return AliasedCombo(id, options=self.options(), canonical=self.canonical, tooltip=tooltip)


# The DiT loaders' lists (the all-in-one loader's and the DiT loader's; the memory plan reads the graph's names through
# them too). Before the one grammar, the all-in-one loader listed a snapshot bare, the DiT loader a file.
SNAPSHOT_MODELS = ModelList((SNAPSHOTS,), legacy="diffusers")
DIT_MODELS = ModelList((files("diffusion_models", gguf=True), SNAPSHOTS), legacy="diffusion_models")
