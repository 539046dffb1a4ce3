"""The remote PE backend (engine: plain Python, no ComfyUI): the OpenAI-compatible client (``enhancer``), one bounded
HTTP exchange (``bounded_http``), the address rules (``url``) and the API-key rules (``key_policy``)."""
