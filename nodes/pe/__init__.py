"""The Prompt Enhancer: what the backends share, the local and the remote backend, the result cache, the nodes.

Engine (no ComfyUI): ``protocol``, ``cache``, ``runtime`` (the host interface, plain torch), ``local/`` and
``remote/``. ComfyUI side: ``comfy_runtime`` (the host as ComfyUI's model management, interrupt and progress bar),
``locate`` (ComfyUI's model folders) and ``nodes``, which builds the handles with ``ComfyRuntime``.
"""
