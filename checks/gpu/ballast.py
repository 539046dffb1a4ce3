"""Another program holding part of the GPU, for the check's ``held<GiB>`` modes (``gpu_e2e.py``): it takes all the
GPU's free memory but ``GiB`` and keeps it until its standard input closes.

Unlike an emulated card (``card<GiB>``: torch's memory fraction in ComfyUI's own process and a patched
``mem_get_info``), everything that reads the device sees it, as on a user's card where a display and other programs
hold memory: core's memory queries and the pack's plan, and the driver's free memory that comfy-aimdo sizes its pool
by (on the fork with dynamic VRAM, emulated 8 and 12 GB cards ran out of memory with aimdo's pool the whole emulated
card and the device 54 GiB free: bench/RESULTS.md, session 42).

    python checks/gpu/ballast.py 8     # all but 8 GiB of the free memory held, until stdin closes
"""

from __future__ import annotations

import sys

GIB = 2**30


def bytes_to_hold(free: int, keep_gib: float) -> int:
    """The bytes to take of ``free`` so that ``keep_gib`` GiB stay free; ValueError where there is not more."""
    keep = int(keep_gib * GIB)
    if free <= keep:
        raise ValueError(f"the GPU has {free / GIB:.1f} GiB free, not more than the {keep_gib:g} GiB to leave free")
    return free - keep


def main() -> None:
    keep_gib = float(sys.argv[1])
    import torch

    free, _ = torch.cuda.mem_get_info()  # after this process's own CUDA context
    held = torch.empty(bytes_to_hold(free, keep_gib), dtype=torch.uint8, device="cuda")
    print(f"held {held.numel() / GIB:.1f} GiB, {keep_gib:g} GiB left free", flush=True)
    sys.stdin.read()  # until the check closes it (or ends)


if __name__ == "__main__":
    main()
