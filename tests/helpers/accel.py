"""In-process sampling of the tiny DiT through ComfyUI's own sampler, for the accelerator tests."""

from __future__ import annotations

import comfy.sample
import comfy.samplers
import torch

from comfyui_ernie_image.nodes.dit.build import load_dit
from comfyui_ernie_image.nodes.dit.model import make_model_patcher
from comfyui_ernie_image.nodes.dit.schedule import reference_sigmas

TEXT_DIM = 32  # tiny text encoder width (scripts/tiny_models.py)


def tiny_patcher(snapshot):
    """The tiny snapshot's DiT as the pack's MODEL (float32, CPU)."""
    return make_model_patcher(load_dit(snapshot, torch.float32))


def text(length: int, seed: int) -> torch.Tensor:
    """A stand-in prompt embedding ``[1, length, 32]``."""
    return torch.randn(1, length, TEXT_DIM, generator=torch.manual_seed(seed))


def sample(model, *, steps: int = 8, cfg: float = 4.0, prompt: torch.Tensor | None = None,
           negative: torch.Tensor | None = None, size: tuple[int, int] = (8, 8), seed: int = 1,
           sampler: str = "euler", callback=None) -> torch.Tensor:
    """ComfyUI's SamplerCustom path (``comfy.sample.sample_custom``) on the reference sigmas; returns the latent."""
    prompt = text(7, 100) if prompt is None else prompt
    negative = text(3, 200) if negative is None else negative  # another length: batched CFG pads
    noise = torch.randn(1, 128, *size, generator=torch.manual_seed(seed))
    with torch.inference_mode():
        return comfy.sample.sample_custom(
            model, noise, cfg, comfy.samplers.ksampler(sampler), reference_sigmas(steps), [[prompt, {}]],
            [[negative, {}]], torch.zeros_like(noise), callback=callback, disable_pbar=True, seed=seed,
        )


def module_state(model) -> list[dict[str, int]]:
    """The instance attributes (name → object id) of the DiT, its block list and every block: equal before and
    after a run when the run left no trace (no patched forward, no cache-dit attributes, no compiled call)."""
    dit = model.model.diffusion_model
    return [{k: id(v) for k, v in vars(m).items()} for m in (dit, dit.layers, *dit.layers)]


class CallCounter:
    """Counts the calls of some blocks (forward hooks): which blocks a step really computed."""

    def __init__(self, model, indices: list[int]):
        layers = model.model.diffusion_model.layers
        self.calls = dict.fromkeys(indices, 0)
        self._handles = [layers[i].register_forward_hook(self._hook(i)) for i in indices]

    def _hook(self, index: int):
        def hook(module, args, output):
            self.calls[index] += 1
        return hook

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def held_bytes(obj, seen: set[int] | None = None, storages: dict[int, int] | None = None) -> int:
    """Bytes of the tensor storages reachable from ``obj`` through containers and plain objects' attributes (not
    through torch modules): what a cache context keeps."""
    seen, storages = set() if seen is None else seen, {} if storages is None else storages
    if id(obj) in seen or isinstance(obj, (torch.nn.Module, type)):
        return sum(storages.values())
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        storages[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
    elif isinstance(obj, dict):
        for value in obj.values():
            held_bytes(value, seen, storages)
    elif isinstance(obj, (list, tuple, set)):
        for value in obj:
            held_bytes(value, seen, storages)
    elif hasattr(obj, "__dict__"):
        for value in vars(obj).values():
            held_bytes(value, seen, storages)
    return sum(storages.values())


def predict(patcher) -> torch.Tensor:
    """One forward of ``patcher``'s DiT on a fixed 4×4 latent and 6-token prompt, under inference mode."""
    torch.manual_seed(5)
    x, prompt = torch.randn(1, 128, 4, 4), text(6, 1)
    with torch.inference_mode():
        return patcher.model.diffusion_model(x, torch.tensor([500.0]), prompt, [6])
