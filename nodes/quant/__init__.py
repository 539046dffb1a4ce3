"""Load-time quantization of the DiT: each method, what it needs to run and what it means for the loader
(``capability``), the quantizing itself (``quantize``) and the saved SVDQuant DiTs (``svdq_cache``). Engine: no
ComfyUI here; the DiT loaders (``nodes/loaders.py``) call it."""
