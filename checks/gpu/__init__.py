"""The GPU end-to-end check: the shared workflows through ComfyUI's own executor on true-size random models.

Run ``python checks/gpu/gpu_e2e.py`` (its docstring lists the tiers and options); ``docs/DEVELOPMENT.md`` says how
to carry what it needs to a GPU machine.
"""
