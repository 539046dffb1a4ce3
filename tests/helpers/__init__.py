"""Test helpers: the headless ComfyUI server, tiny models, image comparison."""
