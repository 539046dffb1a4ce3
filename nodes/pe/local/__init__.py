"""The local PE backend (engine: plain torch and transformers, no ComfyUI): the lazy handle (``enhancer``), where the
weights come from (``weights``), decoding (``decode``, ``attention``, ``fused``) and batches (``batching``)."""
