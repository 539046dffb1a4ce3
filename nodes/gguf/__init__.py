"""GGUF model files: a bounded header walk (``header``), the ``gguf`` package's reader with shapes in torch's order
and value checks (``reader``), and the block formats decoded in torch (``dequant``). A shared helper of the file
kind, like ``model_files``: no ComfyUI, and nothing about any one model (the DiT's names and shapes are checked by
``dit/gguf.py``)."""
