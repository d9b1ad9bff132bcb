"""Kernel worker threads: a thread that stops running the model gives its OpenMP team back
(``ckernels.release_threads``), so that another thread's passes do not share the cores with idle
workers that libgomp then puts to sleep at every region (a one-token step of SmolLM2 3-4x slower)."""

import os
import threading
import time

import pytest
import torch
from test_integer_path import integer_model

from forerun.backends.ckernels import _openmp_runtime, release_threads
from forerun.batching import BatchEngine, BatchRequest
from forerun.engine import Engine

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task") or _openmp_runtime() is None,
                                reason="counts the process's threads through /proc; needs libgomp")


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _settles_at(n: int, within: float = 1.0) -> bool:
    """The thread count reaches n within a second (a released worker exits on its own)."""
    end = time.time() + within
    while _threads() != n and time.time() < end:
        time.sleep(0.01)
    return _threads() == n


def test_running_the_model_then_stopping_gives_the_workers_back():
    torch.set_num_threads(2)
    _, lm = integer_model("llama")
    release_threads()
    base = _threads()
    lm.backend.forward(torch.tensor([5, 6, 7]), 0)  # a pass: this thread's team (one worker beside it)
    assert _settles_at(base + 1)
    release_threads()
    assert _settles_at(base)
    eng = Engine(lm.backend, None, lm.eos_token_ids)
    out = eng.generate([5, 6, 7, 8], max_new_tokens=6).token_ids
    assert _settles_at(base)  # generate gave its team back
    # on another thread: the same tokens, and that thread's team is gone when it ends its generate
    got = []
    th = threading.Thread(target=lambda: got.append(eng.generate([5, 6, 7, 8], max_new_tokens=6).token_ids))
    th.start()
    th.join()
    assert got == [out] and _settles_at(base)


def test_the_batch_engine_gives_its_workers_back_when_idle():
    torch.set_num_threads(2)
    _, lm = integer_model("llama")
    be = BatchEngine(lm.backend, lm.eos_token_ids, drafter=None, max_batch=2)
    be.prepare_slots()  # zeroes caches on this thread, then gives the team back
    base = _threads()
    th = threading.Thread(target=be.run, daemon=True)
    th.start()
    assert _settles_at(base + 1)  # the engine's own thread, idle: no team yet
    done = threading.Event()
    be.submit(BatchRequest(prompt=[5, 6, 7, 8], max_new_tokens=6,
                           on_event=lambda toks, fin: done.set() if fin is not None else None))
    assert done.wait(30)
    assert _threads() == base + 2  # just idle: it keeps its team for the next request ...
    assert _settles_at(base + 1, within=be.RELEASE_IDLE_S + 1.0)  # ... and gives it back once idle a while
    be.stop()
    th.join(timeout=10)
