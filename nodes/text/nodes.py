"""Text encoder nodes: load ERNIE-Image's text encoder and encode prompts into CONDITIONING."""

from __future__ import annotations

from comfy_api.v0_0_2 import io

from ..choices import FROM_SNAPSHOT, SNAPSHOTS, Model, ModelList, files
from ..errors import ErnieImageError
from ..host.memory import device_options
from ..inputs import lm_weight_dtype_input, wants_fp8
from ..model_files import is_gguf
from ..paths import is_prompt_enhancer_file, model_file_path
from ..plan import session
from ..plan.records import CPU, STREAMED, TEXT_ENCODER
from ..plan.session import AUTO
from ..sockets import ErnieTextEncoderType
from .managed import ManagedTextEncoder


def _is_single_file(name: str) -> bool:
    """Not the weights of a Hugging Face model folder (a config.json beside them) under models/text_encoders."""
    return not (model_file_path("text_encoders", name).parent / "config.json").is_file()


# Snapshot folders, then the single-file text encoders of models/text_encoders, safetensors and GGUF (PEs are listed
# elsewhere). Before the one grammar (``choices``), a snapshot was listed bare.
TEXT_ENCODER_FILES = files("text_encoders", lambda n: not is_prompt_enhancer_file(n) and _is_single_file(n), gguf=True)
TEXT_ENCODER_MODELS = ModelList((SNAPSHOTS, TEXT_ENCODER_FILES), legacy="diffusers")
# The all-in-one loader's text encoder files (a GGUF for small cards).
TEXT_ENCODER_FILE_MODELS = ModelList((TEXT_ENCODER_FILES,))


def text_encoder_device_input(name: str) -> io.Combo.Input:
    """The text encoder's device: optional, so that workflows saved before it load unchanged."""
    return io.Combo.Input(name, options=[AUTO, *device_options()], default=AUTO, optional=True,
                          tooltip="auto: where the memory plan puts it for this card and the whole graph: on the "
                          "GPU beside the DiT, streamed through the GPU layer by layer, or on the CPU (the log states "
                          "the plan). default: where ComfyUI runs text encoders, loaded whole (the CPU when that GPU "
                          "cannot hold it at all). cpu or another GPU keeps it off the DiT's card.")


def planned_text_encoder(device: str, weight_dtype: str) -> dict:
    """The loader's ``device`` and ``weight_dtype`` with ``auto`` resolved by the graph's plan, as the keyword
    arguments of ``ManagedTextEncoder.from_snapshot`` / ``from_single_file``: the device ComfyUI manages it on,
    whether its decoder layers are fp8, whether it streams through the GPU and follows later plans."""
    fp8 = wants_fp8(session.form_setting(TEXT_ENCODER, weight_dtype, "default"))
    if device != AUTO:
        return dict(device=device, fp8=fp8)
    place = session.place(TEXT_ENCODER)  # the CPU's place: in the GPU's dtype (bf16), as core runs it there
    return dict(fp8=fp8, **_place_flags(place), follows_plan=place is not None,
                form_follows_plan=place is not None and weight_dtype == AUTO)


def _place_flags(place: str | None) -> dict:
    """A plan's place of the text encoder as ``ManagedTextEncoder``'s ``streamed`` and ``on_host``."""
    return dict(streamed=place == STREAMED, on_host=place == CPU)


def load_text_encoder(model: Model, device: str, weight_dtype: str) -> ManagedTextEncoder:
    """The text encoder ``model`` names (a snapshot, a safetensors or a GGUF file), placed as ``device`` and
    ``weight_dtype`` say (``planned_text_encoder``). A GGUF file keeps its own types: fp8 asked for in words is
    refused, fp8 the plan picks (``auto``) is not applied."""
    chosen = planned_text_encoder(device, weight_dtype)
    if model.folder == SNAPSHOTS.folder:
        return ManagedTextEncoder.from_snapshot(model.path, **chosen)
    if not is_gguf(model.path.name):
        return ManagedTextEncoder.from_single_file(model.path, **chosen)
    if wants_fp8(weight_dtype):
        raise ErnieImageError(f"weight_dtype {weight_dtype} stores the text encoder's layers in fp8, but "
                              f"{model.path} is a GGUF file, quantized already (its layers stay in their GGUF types "
                              "and are decoded as they run): set weight_dtype to auto or default, or pick the "
                              "safetensors file.")
    return ManagedTextEncoder.from_gguf(model.path, **{k: v for k, v in chosen.items()
                                                       if k not in ("fp8", "form_follows_plan")})


def text_encoder_file_input(name: str) -> io.Combo.Input:
    """The all-in-one loader's text encoder: the snapshot's, or a file of models/text_encoders; optional, last."""
    return io.Combo.Input(name, options=[FROM_SNAPSHOT, *TEXT_ENCODER_FILE_MODELS.options()], default=FROM_SNAPSHOT,
                          optional=True, tooltip="snapshot: the snapshot's text_encoder/. Or a file of "
                          "models/text_encoders: ComfyUI's ministral-3-3b.safetensors, or a GGUF of it (llama.cpp's "
                          "converter; its layers stay 4 to 8 bits and are decoded as they run: for small cards).")


def text_encoder_weight_dtype_input(name: str) -> io.Combo.Input:
    """The text encoder's weight storage (its loader's and the all-in-one loader's): optional, last."""
    return lm_weight_dtype_input(name, "text encoder")


class ErnieImageTextEncoderLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="ErnieImageTextEncoderLoader",
            display_name="ERNIE-Image Text Encoder Loader",
            category="ERNIE-Image/loaders",
            description="Loads ERNIE-Image's Mistral3 text encoder and tokenizer: from a snapshot folder, from "
            "ComfyUI's repack ministral-3-3b.safetensors (tokenizer inside) in models/text_encoders, or from a GGUF "
            "there (llama.cpp's converter; tokenizer inside, layers decoded as they run).",
            inputs=[
                TEXT_ENCODER_MODELS.input("model_name", tooltip="diffusers/<snapshot folder>, or "
                                          "text_encoders/<file>."),
                text_encoder_device_input("device"),
                text_encoder_weight_dtype_input("weight_dtype"),
            ],
            outputs=[ErnieTextEncoderType.Output(display_name="TEXT_ENCODER")],
            hidden=[io.Hidden.prompt],
        )

    @classmethod
    def validate_inputs(cls, model_name: str) -> bool | str:
        return TEXT_ENCODER_MODELS.check(model_name)

    @classmethod
    def execute(cls, model_name: str, device: str = AUTO, weight_dtype: str = AUTO) -> io.NodeOutput:
        model = TEXT_ENCODER_MODELS.resolve(model_name)
        session.plan_for_node(cls)
        return io.NodeOutput(load_text_encoder(model, device, weight_dtype))


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
            hidden=[io.Hidden.prompt],
        )

    @classmethod
    def execute(cls, text_encoder: ManagedTextEncoder, text: str) -> io.NodeOutput:
        session.plan_for_node(cls)  # a graph changed since its loaders ran (a LoRA added) is planned anew
        session.prompt_started()
        place = session.place(TEXT_ENCODER)
        if text_encoder.follows_plan and place is not None:  # the plan may have changed since its loader ran
            text_encoder.set_form(wants_fp8(session.form_setting(TEXT_ENCODER, AUTO, "default")))
            text_encoder.set_place(**_place_flags(place))
        return io.NodeOutput([[text_encoder.encode(text), {}]])


TEXT_NODES = [ErnieImageTextEncoderLoader, ErnieImageTextEncode]
