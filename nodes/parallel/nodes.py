"""The parallel node: MODEL in, MODEL out (schema and plumbing only)."""

from __future__ import annotations

from comfy_api.v0_0_2 import io

from .patching import apply_parallel
from .split import CFG, MODES


class ErnieImageParallel(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="ErnieImageParallel",
            display_name="ERNIE-Image Parallel",
            category="ERNIE-Image/acceleration",
            description="Runs each DiT forward on several CUDA GPUs, the image equal to one GPU's: a worker process "
            "per extra GPU holds its own copy of the DiT (loaded on the first run, stopped by /free or when no "
            "workflow uses it). Works with LoRAs and the Cache-DiT node. Put the text encoder and the PE on another "
            "GPU with their loaders' device input.",
            inputs=[
                io.Model.Input("model"),
                io.Combo.Input("mode", options=list(MODES), default=CFG,
                               tooltip="cfg: cond and uncond of a CFG > 1 run on different GPUs (where ComfyUI "
                               "batches them; otherwise as sequence). sequence: the image tokens split across the "
                               "GPUs, attention through all-to-alls (Ulysses), for CFG 1 (Turbo) too."),
                io.Int.Input("gpus", default=2, min=2, max=8,
                             tooltip="GPUs to use, ComfyUI's own first; 32 heads split evenly: 2, 4 or 8."),
            ],
            outputs=[io.Model.Output()],
        )

    @classmethod
    def execute(cls, model, mode: str = CFG, gpus: int = 2) -> io.NodeOutput:
        return io.NodeOutput(apply_parallel(model, mode, gpus))


PARALLEL_NODES = [ErnieImageParallel]
