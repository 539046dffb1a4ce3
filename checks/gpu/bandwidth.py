"""Host → GPU copy bandwidth, pinned and pageable: what streamed weights can move per second on this machine.

    python checks/gpu/bandwidth.py            # 1 GiB, best of 5 each

The streaming recipes of small cards copy their weights at every step; their warm time on another machine scales
with these figures (a PCIe 4.0 ×16 card reaches about 25 GB/s pinned, PCIe 5.0 about 50).
"""

from __future__ import annotations

import argparse
import time

import torch


def gb_per_s(source: torch.Tensor, target: torch.Tensor, repeats: int) -> float:
    """The best of ``repeats`` copies of ``source`` into ``target``, in GB/s."""
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        target.copy_(source, non_blocking=source.is_pinned())
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return source.nbytes / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    n = int(args.gib * 2**30)
    target = torch.empty(n, dtype=torch.uint8, device="cuda")
    pageable = torch.ones(n, dtype=torch.uint8)
    pinned = pageable.pin_memory()
    print(f"{torch.cuda.get_device_name()}: host → GPU {args.gib:g} GiB, best of {args.repeats}: "
          f"pinned {gb_per_s(pinned, target, args.repeats):.1f} GB/s, "
          f"pageable {gb_per_s(pageable, target, args.repeats):.1f} GB/s; "
          f"GPU → host pinned {gb_per_s(target, pinned, args.repeats):.1f} GB/s", flush=True)


if __name__ == "__main__":
    main()
