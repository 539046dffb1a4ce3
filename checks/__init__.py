"""Checks of the product beyond the test suite: ``gpu/``, the GPU end-to-end check. Not loaded by ComfyUI."""
