"""The pack's development tools (tests, the demo, the benchmarks and the GPU check use them; ComfyUI never does).

Import them from the repository root as ``scripts.<module>`` (pytest puts the root on ``sys.path``; the demo runs
``python -m scripts.run_workflow``). ComfyUI loads the pack from the root's ``__init__.py``, which imports only
``nodes``: nothing here is imported when the pack loads.
"""
