"""The bench's llama.cpp peer, in a process of its own: llama.cpp's plain greedy decoding as its
own tools run it.

forerun's llama.cpp backend changes llama.cpp for its whole process: it switches off ggml's tiled
K-quant product (``GGML_CPU_TILED_MM=0``: it rounds differently from the one-row product, which
exact verification cannot have) and keeps full sliding-window caches (rollback needs them). A
peer inside the bench's process would inherit both. This module runs in a child process started
without either, with llama.cpp's defaults (``llama-cli`` and ``llama-server`` use the same ones):
repacked weights, the tiled product, flash attention as llama.cpp chooses, ``swa_full`` off,
batches of 2048 and micro-batches of 512, greedy sampling by llama.cpp's own sampler. The cache is
cleared before the clock starts, as a server's slot is ready before its request arrives.

Protocol (``python -m forerun.llamacpp_peer MODEL.gguf --threads N --n-ctx C``): the child answers
one line ``{"ready": ..., "info": ...}`` once loaded, then one JSON reply per JSON request line
``{"prompt": [ids], "max_new": N, "eos": [ids]}`` -> ``{"out": [ids], "prefill_s": s, "wall_s": s}``;
EOF ends it. Replies are the lines starting with ``@`` (llama.cpp may print to stdout too).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from forerun.backends.llamacpp_lib import llama_cpp_info, quiet

PREFIX = "@"


def _say(obj: dict) -> None:
    sys.stdout.write(PREFIX + json.dumps(obj) + "\n")
    sys.stdout.flush()


class Peer:
    """One model and one context with llama.cpp's default parameters."""

    def __init__(self, path: str, threads: int, n_ctx: int):
        import llama_cpp as L  # optional (the llamacpp extra); this module runs only for the llama.cpp peer

        self.L = L
        L.llama_backend_init()
        quiet(L)
        mp = L.llama_model_default_params()
        mp.n_gpu_layers = 0
        self.model = L.llama_model_load_from_file(path.encode(), mp)
        if not self.model:
            raise SystemExit(f"llama.cpp could not load {path}")
        cp = L.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_threads = cp.n_threads_batch = threads
        cp.no_perf = True
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise SystemExit(f"llama.cpp could not create a context of {n_ctx} positions")
        self.n_ctx = n_ctx
        self.n_batch = int(cp.n_batch)
        self.mem = L.llama_get_memory(self.ctx)
        self.chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        L.llama_sampler_chain_add(self.chain, L.llama_sampler_init_greedy())

    def info(self) -> dict:
        return {**llama_cpp_info(self.L),
                "tiled_mm_env": os.environ.get("GGML_CPU_TILED_MM"),  # unset: llama.cpp's default (on)
                "settings": "llama.cpp defaults in a process of its own (tiled product on, swa_full off, "
                            f"n_ctx {self.n_ctx}, n_batch {self.n_batch})"}

    def _decode(self, ids: list[int]) -> None:
        L = self.L
        arr = (L.llama_token * len(ids))(*ids)
        if L.llama_decode(self.ctx, L.llama_batch_get_one(arr, len(ids))) != 0:
            raise RuntimeError("llama_decode failed")

    def generate(self, prompt: list[int], max_new: int, eos: set[int]) -> dict:
        L = self.L
        L.llama_memory_clear(self.mem, True)  # outside the clock
        L.llama_sampler_reset(self.chain)
        t0 = time.perf_counter()
        for s in range(0, len(prompt), self.n_batch):
            self._decode(prompt[s: s + self.n_batch])
        prefill = time.perf_counter() - t0
        limit = min(max_new, self.n_ctx - len(prompt))
        out: list[int] = []
        while len(out) < limit:
            tok = int(L.llama_sampler_sample(self.chain, self.ctx, -1))
            out.append(tok)
            if tok in eos or len(out) >= limit:
                break
            self._decode([tok])
        return {"out": out, "prefill_s": prefill, "wall_s": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m forerun.llamacpp_peer")
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--n-ctx", type=int, default=4096)
    a = ap.parse_args(argv)
    peer = Peer(a.model, a.threads, a.n_ctx)
    _say({"ready": True, "info": peer.info()})
    for line in sys.stdin:
        if not line.strip():
            break
        req = json.loads(line)
        _say(peer.generate(list(req["prompt"]), int(req["max_new"]), set(req.get("eos", []))))


if __name__ == "__main__":
    main()
