"""This CPU's peak VDPBF16PS rate (the compute ceiling of the AVX512-BF16 attention and
linear kernels): builds dpbf16_peak.cpp with g++ -O2 -march=native -fopenmp and runs it on
1 thread and on every core, 8 / 16 / 24 independent chains each.

    python benchmark/kernels/dpbf16_peak.py --name dpbf16_peak_zen4

Writes benchmark/results/<name>.json (the CPU's model line and flags beside the rows).
Run it with the CPU to itself: another process on a core halves what it reads.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(os.path.dirname(HERE), "results")


def cpu_line() -> str:
    info = open("/proc/cpuinfo").read().split("\n\n")[0]
    keep = ("model name", "cpu family", "model\t")
    return "; ".join(line.strip() for line in info.splitlines() if line.startswith(keep))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=200_000_000)
    ap.add_argument("--name", default="dpbf16_peak")
    a = ap.parse_args(argv)
    if " avx512_bf16" not in open("/proc/cpuinfo").read():
        raise SystemExit("this CPU has no AVX512-BF16 (VDPBF16PS): nothing to measure here")
    exe = os.path.join(tempfile.mkdtemp(prefix="dpbf16_"), "peak")
    subprocess.run(["g++", "-O2", "-march=native", "-fopenmp",
                    os.path.join(HERE, "dpbf16_peak.cpp"), "-o", exe], check=True)
    out = subprocess.run([exe, str(a.iters)], check=True, capture_output=True, text=True).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    for r in rows:
        r.pop("sink", None)
        print(r)
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, a.name + ".json"), "w") as f:
        json.dump({"command": "python benchmark/kernels/dpbf16_peak.py " + " ".join(
            argv if argv is not None else sys.argv[1:]), "cpu": cpu_line(), "iters": a.iters,
            "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
