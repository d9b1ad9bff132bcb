"""What one core's AVX2 integer products can reach: the instruction patterns of the integer
tile's inner loop, each alone in a loop of 12 independent chains, in G instructions (or patterns)
a second on one core. Without VNNI a 32-product vector of 4-bit codes against 8-bit activations is
``vpmaddubsw`` plus an int16 add (``vpaddw``), and the tile's weight layout (8 weight rows x 4
columns a vector) takes each row's 4 activation codes as a broadcast: the patterns below price
that broadcast, from memory (as the tile does) and from a register, against a product whose
activations are already laid out (a memory operand). Used for docs/kernels.md ("The activations'
broadcast in AVX2 products"). A shared machine's speed moves from run to run: take the best of
several rounds.

    python bench/experiments/product_peak.py [--rounds 3] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

# name -> (one chain's instructions with {i} its accumulator, instructions a chain)
PATTERNS = {
    "vpmaddubsw": ("vpmaddubsw %%ymm1, %%ymm0, %%ymm{i}", 1),
    "vpmaddwd": ("vpmaddwd %%ymm1, %%ymm0, %%ymm{i}", 1),
    "vfmadd231ps": ("vfmadd231ps %%ymm1, %%ymm0, %%ymm{i}", 1),
    "vpaddw": ("vpaddw %%ymm0, %%ymm1, %%ymm{i}", 1),
    "vpbroadcastd (mem)": ("vpbroadcastd (%1), %%ymm{i}", 1),
    "vpshufd": ("vpshufd $0x55, %%ymm0, %%ymm{i}", 1),
    "product: vpmaddubsw + vpaddw": ("vpmaddubsw %%ymm1, %%ymm0, %%ymm3\\n\\tvpaddw %%ymm3, %%ymm{i}, %%ymm{i}", 2),
    "product, activations from memory": ("vpmaddubsw (%1), %%ymm0, %%ymm3\\n\\tvpaddw %%ymm3, %%ymm{i}, %%ymm{i}", 2),
    "product after vpbroadcastd (mem)": (
        "vpbroadcastd (%1), %%ymm2\\n\\tvpmaddubsw %%ymm2, %%ymm0, %%ymm3\\n\\tvpaddw %%ymm3, %%ymm{i}, %%ymm{i}", 3),
    "product after vpbroadcastd (reg)": (
        "vpbroadcastd %%xmm1, %%ymm2\\n\\tvpmaddubsw %%ymm2, %%ymm0, %%ymm3\\n\\tvpaddw %%ymm3, %%ymm{i}, %%ymm{i}", 3),
}
# --vnni: the VNNI tiles' product, one instruction a vector (8 or 16 weight rows x 4 columns: 32 or
# 64 products), the activations' 4 codes broadcast from memory (embedded in the 512-bit form)
VNNI_PATTERNS = {
    "vpdpbusd ymm (32 products)": ("vpdpbusd %%ymm1, %%ymm0, %%ymm{i}", 1),
    "vpdpbusd ymm, activations broadcast from memory": ("vpbroadcastd (%1), %%ymm2\\n\\tvpdpbusd %%ymm2, %%ymm0, %%ymm{i}", 2),
    "vpdpbusd zmm (64 products)": ("vpdpbusd %%zmm1, %%zmm0, %%zmm{i}", 1),
    "vpdpbusd zmm, embedded broadcast from memory": ("vpdpbusd (%1)%{{1to16%}}, %%zmm0, %%zmm{i}", 1),
}

HEAD = r"""
#include <stdio.h>
#include <stdint.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
#define ITERS 20000000LL
int main(void) {
    int32_t mem[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    double t, dt;
    long long n;
"""

CLOBBER = ",".join(f'"ymm{r}"' for r in range(16))


def source(patterns: dict) -> str:
    body = [HEAD]
    for name, (ins, _) in patterns.items():
        chains = "".join(ins.format(i=i) + "\\n\\t" for i in range(4, 16))
        body.append(f'    n = ITERS; t = now();\n'
                    f'    __asm__ volatile("1:\\n\\t{chains}dec %0\\n\\tjnz 1b" : "+r"(n) : "r"(mem) : "memory", {CLOBBER});\n'
                    f'    dt = now() - t; printf("%.4f\\n", ITERS * 12.0 / dt / 1e9);\n')
    body.append("    return 0;\n}\n")
    return "".join(body)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--vnni", action="store_true", help="also the VNNI products (AVX-512 VNNI machines)")
    args = ap.parse_args()
    patterns = {**PATTERNS, **(VNNI_PATTERNS if args.vnni else {})}
    flags = ["-mavx2", "-mfma"] + (["-mavx512f", "-mavx512vnni", "-mavx512vl"] if args.vnni else [])
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "peak.c", Path(tmp) / "peak"
        src.write_text(source(patterns))
        subprocess.run(["cc", "-O2", *flags, str(src), "-o", str(exe)], check=True)
        runs = [[float(x) for x in subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()]
                for _ in range(args.rounds)]
    best = {name: max(r[j] for r in runs) for j, name in enumerate(patterns)}
    width = max(map(len, patterns))
    print(f"{'pattern (12 chains, one core)':<{width}}  G patterns/s (best of {args.rounds})")
    for name, g in best.items():
        print(f"{name:<{width}}  {g:6.2f}")
    if args.out:
        from forerun.machine import cpu_name

        args.out.write_text(json.dumps({"cpu": cpu_name(), "rounds": runs, "best_g_per_s": best,
                                        "instructions_per_pattern": {k: v[1] for k, v in patterns.items()}}, indent=1))


if __name__ == "__main__":
    main()
