"""The LoRA loader node (schema and plumbing only)."""

from __future__ import annotations

import logging

from comfy_api.v0_0_2 import io

from ..host.sampling import show_on_node
from ..paths import check_choice, model_file_path, safetensors_names
from ..plan import session
from .files import read_lora
from .patching import apply_lora

log = logging.getLogger(__name__)


class ErnieImageLoraLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="ErnieImageLoraLoader",
            display_name="ERNIE-Image LoRA Loader",
            category="ERNIE-Image/loaders",
            description="Applies an ERNIE-Image LoRA from models/loras in any layout (ComfyUI / ai-toolkit, diffusers "
            "PEFT / SimpleTuner, OneTrainer, kohya / musubi) and says how many of its layers it applied. Chain "
            "several to stack them.",
            inputs=[
                io.Model.Input("model"),
                io.Combo.Input("lora_name", options=safetensors_names("loras"), tooltip="A file in models/loras."),
                io.Float.Input("strength_model", default=1.0, min=-100.0, max=100.0, step=0.01,
                               tooltip="How strongly the LoRA changes the DiT (0: not at all), as in core's loaders."),
            ],
            outputs=[io.Model.Output()],
            hidden=[io.Hidden.unique_id, io.Hidden.prompt],
        )

    @classmethod
    def validate_inputs(cls, lora_name: str) -> bool | str:
        return check_choice(lora_name, safetensors_names("loras"), "loras")

    @classmethod
    def execute(cls, model, lora_name: str, strength_model: float) -> io.NodeOutput:
        session.plan_for_node(cls)  # the LoRA's patches change what the DiT holds: the graph is planned anew
        if strength_model == 0:
            return io.NodeOutput(model)  # as core's loaders: nothing read, nothing patched
        lora = read_lora(model_file_path("loras", lora_name), lora_name)
        patched, report = apply_lora(model, lora, strength_model, lora_name)
        log.log(logging.WARNING if report.few or report.misfits else logging.INFO, "ERNIE-Image %s", report.text())
        show_on_node(cls.hidden.unique_id, report.text())
        return io.NodeOutput(patched)


LORA_NODES = [ErnieImageLoraLoader]
