"""The memory plan (engine: plain Python, no ComfyUI): one frozen record per model the graph uses (``records``),
the costs measured on this machine (``costs``), and the pure function that places every model (``planner``)."""
