"""The pack's own socket types, shared by the nodes that make and take them (the features' nodes and the
all-in-one loader). The names are what saved workflows hold: never rename them."""

from __future__ import annotations

from comfy_api.v0_0_2 import io

ErniePEType = io.Custom("ERNIE_PE")  # a local or remote Prompt Enhancer handle
ErnieTextEncoderType = io.Custom("ERNIE_TEXT_ENCODER")
