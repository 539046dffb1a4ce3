"""The V3 extension object that lists every node of the pack: the loaders where the features meet, then each
feature's own."""

from __future__ import annotations

from comfy_api.v0_0_2 import ComfyExtension, io


class ErnieImageExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        from . import planning  # noqa: F401  (registers the graph's memory plan with every loader)
        from .accel.nodes import ACCEL_NODES
        from .dit.nodes import DIT_NODES
        from .inputs import guard_nodes
        from .loaders import LOADER_NODES
        from .lora.nodes import LORA_NODES
        from .parallel.nodes import PARALLEL_NODES
        from .pe.nodes import PE_NODES
        from .text.nodes import TEXT_NODES

        # Every node checks its inputs against its own schema when it runs (inputs.py): ComfyUI does not, for
        # Combo values and for linked numbers.
        return guard_nodes([*LOADER_NODES, *DIT_NODES, *LORA_NODES, *PE_NODES, *TEXT_NODES, *ACCEL_NODES,
                            *PARALLEL_NODES])
