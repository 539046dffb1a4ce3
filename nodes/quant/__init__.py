"""Load-time quantization of the DiT: each method, what it needs to run and what it means for the loader
(``capability``), the quantizing itself (``quantize``) and the saved quantized DiTs (``saved``, ``torchao_file``).
Engine: no ComfyUI here; the DiT loaders (``nodes/loaders.py``) call it."""
