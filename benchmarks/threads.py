"""torch's CPU threads against another CPU-bound process: the same shift grid with ``--threads`` 1 and torch's
default, each alone and beside a busy loop, interleaved in rounds, wall clock of the whole command.

    python benchmarks/threads.py --rounds 2 --n-segments 1 --n-contexts 2 --offsets 0,447

Prints each setting's best and median time, the machine's load average before each run (other work on the
machine counts too), and the ratios side by side. The busy loop is one Python process spinning on the CPU,
started by this script and ended by its process id.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _timed(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True, text=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--n-segments", default="1")
    parser.add_argument("--n-contexts", default="2")
    parser.add_argument("--offsets", default="0,447")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 0], help="0: torch's default (one per core)")
    args = parser.parse_args()
    times: dict[tuple[int, bool], list[float]] = {}
    loads: dict[tuple[int, bool], list[float]] = {}
    with tempfile.TemporaryDirectory() as folder:
        for round_ in range(args.rounds):
            for busy in (False, True):
                spinner = (subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None)
                try:
                    for threads in args.threads:
                        command = [sys.executable, "-m", "equivariance_probe.cli", "shift", "-o",
                                   str(Path(folder) / f"{round_}-{busy}-{threads}"), "--model", args.model,
                                   "--n-segments", args.n_segments, "--n-contexts", args.n_contexts, "--offsets",
                                   args.offsets, "--no-figures", "--no-progress",
                                   *(["--threads", str(threads)] if threads else [])]
                        loads.setdefault((threads, busy), []).append(os.getloadavg()[0])
                        elapsed = _timed(command)
                        times.setdefault((threads, busy), []).append(elapsed)
                        print(f"round {round_}: threads {threads or 'default'}, busy loop {'on' if busy else 'off'}: "
                              f"{elapsed:.1f} s (load average before {loads[(threads, busy)][-1]:.1f})", flush=True)
                finally:
                    if spinner is not None:
                        spinner.kill()
                        spinner.wait()
    print(f"\ncores {os.cpu_count()}; {args.model}, {args.n_segments} segment(s) x {args.n_contexts} contexts x "
          f"offsets {args.offsets}; best / median of {args.rounds} rounds")
    for busy in (False, True):
        cells = {threads: (min(times[(threads, busy)]), statistics.median(times[(threads, busy)]))
                 for threads in args.threads}
        row = ", ".join(f"threads {threads or 'default'} {best:.1f} / {median:.1f} s" for threads, (best, median)
                        in cells.items())
        if 1 in cells and 0 in cells:
            row += f"; default / 1 thread, best over best: {cells[0][0] / cells[1][0]:.2f}x"
        print(f"busy loop {'on ' if busy else 'off'}: {row}")


if __name__ == "__main__":
    main()
