"""Text encoder nodes: load ERNIE-Image's text encoder and encode prompts into CONDITIONING."""

from __future__ import annotations

from comfy_api.v0_0_2 import io

from ..paths import check_choice, snapshot_names, snapshot_path
from .managed import ManagedTextEncoder

ErnieTextEncoderType = io.Custom("ERNIE_TEXT_ENCODER")


class ErnieImageTextEncoderLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="ErnieImageTextEncoderLoader",
            display_name="ERNIE-Image Text Encoder Loader",
            category="ERNIE-Image/loaders",
            description="Loads the Mistral3 text encoder and tokenizer of an ERNIE-Image snapshot.",
            inputs=[
                io.Combo.Input(
                    "model_name", options=snapshot_names(), tooltip="A snapshot folder under models/diffusers."
                ),
            ],
            outputs=[ErnieTextEncoderType.Output(display_name="TEXT_ENCODER")],
        )

    @classmethod
    def validate_inputs(cls, model_name: str) -> bool | str:
        return check_choice(model_name, snapshot_names(), "diffusers")

    @classmethod
    def execute(cls, model_name: str) -> io.NodeOutput:
        return io.NodeOutput(ManagedTextEncoder.from_snapshot(snapshot_path(model_name)))


class ErnieImageTextEncode(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="ErnieImageTextEncode",
            display_name="ERNIE-Image Text Encode",
            category="ERNIE-Image",
            description="Encodes a prompt as ERNIE-Image does (no chat template, true token length kept).",
            inputs=[
                ErnieTextEncoderType.Input("text_encoder"),
                io.String.Input("text", multiline=True, dynamic_prompts=True, tooltip="The prompt."),
            ],
            outputs=[io.Conditioning.Output()],
        )

    @classmethod
    def execute(cls, text_encoder: ManagedTextEncoder, text: str) -> io.NodeOutput:
        return io.NodeOutput([[text_encoder.encode(text), {}]])


TEXT_NODES = [ErnieImageTextEncoderLoader, ErnieImageTextEncode]
