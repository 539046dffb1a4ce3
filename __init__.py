"""ERNIE-Image for ComfyUI: loaders, prompt enhancer and accelerators for Baidu's ERNIE-Image.

ComfyUI calls ``comfy_entrypoint()``; importing this file loads nothing heavy.
"""


async def comfy_entrypoint():
    from .nodes.extension import ErnieImageExtension

    return ErnieImageExtension()
