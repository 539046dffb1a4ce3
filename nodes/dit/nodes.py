"""The DiT's scheduler and the VAE loader (schemas and plumbing only); the DiT loaders are ``nodes/loaders.py``."""

from __future__ import annotations

from comfy_api.v0_0_2 import io

from ..choices import ModelList, files
from ..plan import session
from .schedule import DEFAULT_SHIFT, reference_sigmas
from .vae import load_vae

# Before the one grammar (``choices``), the VAE loader listed a file bare.
VAE_MODELS = ModelList((files("vae"),), legacy="vae")


class ErnieImageScheduler(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="ErnieImageScheduler",
            display_name="ERNIE-Image Scheduler",
            category="ERNIE-Image",
            description="The exact sigmas of diffusers' ErnieImagePipeline: shift applied to linspace(1, 0, steps+1). "
            "Turbo: 8 steps; Base: 50 steps.",
            inputs=[
                io.Model.Input("model", tooltip="The model to sample (orders this node after the loader, like "
                               "core's BasicScheduler)."),
                io.Int.Input("steps", default=8, min=1, max=1000),
                io.Float.Input("shift", default=DEFAULT_SHIFT, min=0.01, max=100.0, step=0.01,
                               tooltip="4.0 is ERNIE-Image's trained shift (ComfyUI's native ERNIE uses 3.0)."),
            ],
            outputs=[io.Sigmas.Output()],
            hidden=[io.Hidden.prompt],
        )

    @classmethod
    def execute(cls, model, steps: int, shift: float) -> io.NodeOutput:
        # Runs again whenever its model or steps change, also where ComfyUI reuses every loader's output: a LoRA
        # of core's loaders put after the DiT's loader, or new steps, are planned anew before the sampling.
        session.plan_for_node(cls)
        return io.NodeOutput(reference_sigmas(steps, shift))


class ErnieImageVAELoader(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="ErnieImageVAELoader",
            display_name="ERNIE-Image VAE Loader",
            category="ERNIE-Image/loaders",
            description="Loads the Flux.2 VAE file (flux2-vae.safetensors) for ERNIE-Image latents with the trained "
            "batch-norm epsilon, so it decodes exactly as diffusers does (core's VAE Loader assumes 1e-4).",
            inputs=[VAE_MODELS.input("vae_name", tooltip="A file in models/vae, listed as vae/<file>.")],
            outputs=[io.Vae.Output()],
        )

    @classmethod
    def validate_inputs(cls, vae_name: str) -> bool | str:
        return VAE_MODELS.check(vae_name)

    @classmethod
    def execute(cls, vae_name: str) -> io.NodeOutput:
        return io.NodeOutput(load_vae(VAE_MODELS.resolve(vae_name).path))


DIT_NODES = [ErnieImageScheduler, ErnieImageVAELoader]
