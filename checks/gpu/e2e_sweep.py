"""The GPU end-to-end check's sweep table: per card size and workflow, the pack's plan and its predicted warm prompt
next to the measured one, the first run, the bytes copied host <-> GPU in one warm prompt, the peaks, and the lines
about out-of-memory, retries and fallbacks the log held.

``gpu_e2e.py`` prints it after its runs (``--cards 6.5,10,11.2``) and writes it to ``sweep.md``; this module also makes
one table from the rows of several runs (each call's ``e2e.jsonl``), as the sweep spans lent machines' calls:

    python -m checks.gpu.e2e_sweep out/a/e2e.jsonl out/b/e2e.jsonl
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

# The pack's line for a plan, e.g. "ERNIE-Image: plan for 10.9 GiB usable: DiT GGUF Q4_K resident (5.0 GiB), text
# encoder fp8 streamed (3.7 GB per prompt), VAE resident; predicted warm 2.0 s; 3.6 GiB held in host RAM" (the
# host RAM since 2026-12-05). The plan's text runs to the last "; predicted warm" (it may hold semicolons of its own).
PLAN = re.compile(r"ERNIE-Image: plan for (?P<usable>\d+(?:\.\d+)?) GiB usable: (?P<plan>.*); "
                  r"predicted warm (?P<predicted>\d+(?:\.\d+)?) s(?:; (?P<host>\d+(?:\.\d+)?) GiB held in host RAM)?")
PREDICTION_BOUND = 0.3  # issue 43: the measured warm prompt within ±30 % of the predicted one


def parse_plan(line: str) -> dict | None:
    """The plan line's usable GiB, the plan's text, the predicted warm seconds and the host RAM its models hold (None
    in a line from before it said); None for any other line."""
    match = PLAN.search(line)
    if match is None:
        return None
    return dict(usable_gib=float(match["usable"]), plan=match["plan"].strip(),
                predicted_s=float(match["predicted"]), host_gib=float(match["host"]) if match["host"] else None)


def maxima(runs: list[dict], *keys: str) -> list[float]:
    """The largest value of each of ``keys`` over ``runs`` (0 where none has it)."""
    return [max((r.get(key) or 0 for r in runs), default=0) for key in keys]


def gpu_peak(runs: list[dict]) -> str:
    """Torch's peak allocated / reserved GiB over ``runs``, NVML's whole device (this process) and comfy-aimdo's
    count where they were sampled; ``-`` without CUDA statistics."""
    allocated, reserved, device, process = maxima(runs, "peak_allocated_gib", "peak_reserved_gib", "nvml_peak_gib",
                                                  "nvml_process_peak_gib")
    aimdo = max((r.get("aimdo_peak_gib", -1) for r in runs), default=-1)
    nvml = (f" / {device:.1f}" + (f" ({process:.1f})" if process else "")) if device else ""
    nvml += f" / aimdo {aimdo:.1f}" if aimdo >= 0 else ""
    return f"{allocated:.1f} / {reserved:.1f}{nvml}" if reserved or device else "-"


def host_ram(runs: list[dict], digits: int = 0) -> str:
    """The process's peak resident memory over ``runs`` (GiB), with its anonymous, file-backed and shared peaks and
    what the last run left resident; empty without a figure."""
    ram, anon, file, shmem = maxima(runs, "peak_rss_gib", "peak_rss_anon_gib", "peak_rss_file_gib",
                                    "peak_rss_shmem_gib")
    if not ram:
        return ""
    parts = [f"anon {anon:.{digits}f}", f"file {file:.{digits}f}"] if anon else []
    parts += [f"shmem {shmem:.{digits}f}"] if shmem else []
    now = runs[-1].get("rss_now_gib") if runs else None
    parts += [f"after the last prompt {now:.{digits}f}"] if now else []
    return f"{ram:.{digits}f}" + (f" ({', '.join(parts)})" if parts else "")


def _megabytes(n: int) -> str:
    return f"{n / 1e6:,.0f} MB"


def _copied(runs: list[dict]) -> str:
    moved = next((r["copied_bytes"] for r in runs if r.get("run") == "copies" and "copied_bytes" in r), None)
    if moved is None:
        return "-"
    host, back = moved.get("HtoD", 0), moved.get("DtoH", 0)
    return f"{_megabytes(host + back)} (HtoD {_megabytes(host)}{_detail(moved, 'HtoD')}, " \
           f"DtoH {_megabytes(back)}{_detail(moved, 'DtoH')})"


def _detail(moved: dict, direction: str) -> str:
    """What the profiler told of one direction's copies besides their bytes, where it was recorded (older records
    have neither): those from or to pageable memory (and how many copies), and the copies' time on the GPU."""
    if f"{direction} us" not in moved:
        return ""
    pageable, copies = moved.get(f"{direction} pageable", 0), moved.get(f"{direction} pageable copies")
    count = f" in {copies:,} copies" if copies else ""
    return f": {_megabytes(pageable)} pageable{count}, {moved[f'{direction} us'] / 1e3:,.0f} ms"


def _result(runs: list[dict]) -> str:
    failed = [r for r in runs if not r.get("ok")]
    if not failed:
        return "ok"
    error = " ".join(str(failed[0].get("error", "?")).split())[:160].replace("|", "/")  # one line: a table cell
    return f"**{failed[0].get('run', '?')}: {error}**"


def sweep_row(runs: list[dict]) -> str:
    """One line of the sweep table from the rows of one mode and workflow (in the order they ran)."""
    mode = runs[0]["mode"]
    card = runs[0].get("card_gib")
    plans = [plan for r in runs for plan in r.get("plans", [])]
    plan = parse_plan(plans[-1]) if plans else None  # the last: a plan made again (a retry) replaces the first
    where = f"{card:g}" if card is not None else f"{mode} (whole GPU)"
    where += " free (the rest held)" if mode.startswith("held") else ""
    if plan is not None:
        where += f" ({plan['usable_gib']:g} usable)"
    plan_text = plan["plan"] if plan else ("unread: " + plans[-1][:200] if plans else "no plan")
    warm = [r["seconds"] for r in runs if str(r.get("run", "")).startswith("warm") and r.get("ok") and r.get("seconds")]
    median = statistics.median(warm) if warm else None
    measured = (f"{median:.2f} ({min(warm):.2f}–{max(warm):.2f}, {len(warm)} prompts)" if len(warm) > 1 else
                f"{median:.2f}" if warm else "-")
    ratio = "-"
    if plan and median and plan["predicted_s"]:
        value = median / plan["predicted_s"]
        ratio = f"{value:.2f}" if abs(value - 1) <= PREDICTION_BOUND else f"**{value:.2f}**"
    first = next((f"{r['seconds']:.1f}" for r in runs if r.get("run") == "first" and r.get("seconds")), "-")
    trouble = [r["oom_retry_fallback"] for r in runs if "oom_retry_fallback" in r]
    predicted = f"{plan['predicted_s']:.2f}" if plan else "no plan"
    ram = host_ram(runs, digits=1) or "-"
    if plan and plan["host_gib"] is not None:
        ram += f"; the plan's models {plan['host_gib']:.1f}"
    cells = [where, runs[0]["workflow"], plan_text.replace("|", "/"), predicted, measured, ratio, first, _copied(runs),
             gpu_peak(runs), ram, str(sum(trouble)) if trouble else "-", _result(runs)]
    return "| " + " | ".join(cells) + " |"


def sweep_table(rows: list[dict]) -> str:
    """The sweep: one line per mode and workflow, each workflow's lines by card size (whole-GPU modes after)."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["mode"], row["workflow"]), []).append(row)
    workflows = list(dict.fromkeys(workflow for _, workflow in groups))

    def order(key: tuple[str, str]) -> tuple:
        card = groups[key][0].get("card_gib")
        return workflows.index(key[1]), card is None, card or 0.0, key[0]

    lines = ["| card GiB (usable per the plan) | workflow | plan | predicted warm s | measured warm s: median "
             "(min–max) | measured / predicted | first run s | copied host↔GPU in one warm prompt | peak GiB alloc / "
             "reserved / NVML device (process) | host RAM peak GiB (anon, file); the plan's models | "
             "out-of-memory / retry / fallback lines | result |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [sweep_row(groups[key]) for key in sorted(groups, key=order)]
    return "\n".join(lines)


def merged(runs_by_file: list[list[dict]]) -> list[dict]:
    """The rows of several runs of the check, a mode and workflow run again in a later file replacing the earlier
    rows, and the earlier rows of that mode that name no workflow ("(mode)" not started, "(process)" stopped)."""
    rows: dict[tuple[str, str], list[dict]] = {}
    for runs in runs_by_file:
        again = {(r["mode"], r["workflow"]) for r in runs}
        modes = {mode for mode, _ in again}
        rows = {key: group for key, group in rows.items()
                if key not in again and not (key[0] in modes and key[1] in ("(mode)", "(process)"))}
        for r in runs:
            rows.setdefault((r["mode"], r["workflow"]), []).append(r)
    return [r for group in rows.values() for r in group]


def main() -> None:
    parser = argparse.ArgumentParser(description="One sweep table from the rows of one or more runs of gpu_e2e.py")
    parser.add_argument("jsonl", type=Path, nargs="+", help="e2e.jsonl files (gpu_e2e.py's --out), oldest first: "
                        "a card and workflow run again in a later file replaces the earlier rows (and the card's "
                        "earlier 'not started' or 'process stopped' rows)")
    args = parser.parse_args()
    print(sweep_table(merged([[json.loads(line) for line in path.read_text().splitlines() if line.strip()]
                              for path in args.jsonl])))


if __name__ == "__main__":
    main()
