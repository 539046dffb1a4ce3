"""The Prompt Enhancer: protocol, local and remote backends, result cache, ComfyUI nodes.

The engine modules (``protocol``, ``decode``, ``weights``, ``local``, ``remote``, ``cache``, ``runtime``) import no
ComfyUI; ``comfy_runtime`` and ``nodes`` are the ComfyUI side.
"""
