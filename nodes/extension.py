"""The V3 extension object that lists every node of the pack."""

from __future__ import annotations

from comfy_api.v0_0_2 import ComfyExtension, io


class ErnieImageExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        from .accel.nodes import ACCEL_NODES
        from .dit.nodes import DIT_NODES
        from .lora.nodes import LORA_NODES
        from .pe.nodes import PE_NODES
        from .text.nodes import TEXT_NODES

        return [*DIT_NODES, *LORA_NODES, *PE_NODES, *TEXT_NODES, *ACCEL_NODES]
