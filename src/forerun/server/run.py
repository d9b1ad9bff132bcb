"""``forerun serve``: build the engine for a model and method, then run uvicorn."""

from __future__ import annotations

import ctypes.util
import logging
import os
import sys
import threading

from forerun.build import Options, Setup, build
from forerun.draft_length import K_MAX
from forerun.drafters.adapt import save_adapted
from forerun.errors import ForerunError
from forerun.models import model_key
from forerun.server.app import Service, create_app, is_loopback
from forerun.server.limits import Limits

log = logging.getLogger("forerun")


def resolve_api_key(arg: str | None) -> str | None:
    """--api-key, else $FORERUN_API_KEY, else None (no key); an empty key is refused, not taken
    as "no key"."""
    return _check_api_key(arg if arg is not None else os.environ.get("FORERUN_API_KEY"))


def _check_api_key(key: str | None) -> str | None:
    """An empty key is refused, not taken as "no key"."""
    if key is not None and not key.strip():
        raise ForerunError("the API key is empty (--api-key or $FORERUN_API_KEY): give a key, or set neither "
                           "to serve without one")
    return key


def build_service(setup: Setup, *, name: str | None = None, api_key: str | None = None, max_batch: int = 8,
                  max_waiting: int = 64, max_tokens: int = 1024, request_timeout: float = 600.0, k_max: int = K_MAX,
                  calibrate: bool = True, max_body_bytes: int = 4 << 20, loopback_hosts: bool = False,
                  prefix_cache_mb: int = 512, progress: bool = False) -> Service:
    """The service over a built setup (``build.build``: the target, its method, trees and all):
    its batch engine with these limits, calibrated unless told not to."""
    for label, v, lo in (("--max-batch", max_batch, 1), ("--max-waiting", max_waiting, 0), ("--max-tokens", max_tokens, 1),
                         ("--k-max", k_max, 1), ("--prefix-cache-mb", prefix_cache_mb, 0)):
        if v < lo:
            raise ForerunError(f"{label} must be >= {lo}, got {v}")
    if request_timeout <= 0:
        raise ForerunError(f"--request-timeout must be > 0, got {request_timeout}")
    _check_api_key(api_key)
    model = setup.target
    engine = setup.batch_engine(max_batch=max_batch, max_waiting=max_waiting, k_max=k_max,
                                prefix_cache_mb=prefix_cache_mb)
    engine.prepare_slots()
    if calibrate and setup.drafter is not None:
        costs = engine.calibrate(progress=progress, keep_as=model_key(model))
        log.info("target pass cost by rows: %s", {r: round(t * 1000, 1) for r, t in costs.items()})
    return Service(model, engine, name=name or model.id, api_key=api_key, max_tokens=max_tokens,
                   request_timeout=request_timeout, method=setup.options.method, max_body_bytes=max_body_bytes,
                   loopback_hosts=loopback_hosts)


def _heap_trimmer():
    """A function returning freed heap pages to the system (glibc's ``malloc_trim``), or None.

    A batched pass allocates megabytes whose size changes every step (logits, prompt
    activations); glibc keeps the freed blocks in a fragmented heap, so resident memory creeps up
    over a long run. Trimming every few dozen steps hands whole free pages back; serving large
    blocks with mmap instead was measured a third slower at 16 concurrent requests."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    return lambda: trim(0)


def serve(args) -> int:
    import uvicorn  # the server extra: imported only when serving

    options = Options.from_args(args, serving=True).check()  # every option fails before the model loads
    api_key = resolve_api_key(args.api_key)
    if not 0 <= args.port <= 65535:
        raise ForerunError(f"--port must be in 0..65535, got {args.port}")
    limits = Limits(keep_alive_s=args.keep_alive_timeout, read_timeout_s=args.read_timeout,
                    max_connections=args.max_connections, max_header_bytes=args.max_header_bytes).check()
    setup = build(options)
    service = build_service(setup, name=args.served_model_name, api_key=api_key, loopback_hosts=is_loopback(args.host),
                            max_batch=args.max_batch, max_waiting=args.max_waiting, max_tokens=args.max_tokens,
                            request_timeout=args.request_timeout, k_max=args.k_max, prefix_cache_mb=args.prefix_cache_mb,
                            progress=True)
    if not service.engine.batched:
        log.warning("the %s backend decodes the sequences of a step one after another (no shared pass)",
                    type(setup.target.backend).__name__)

    refused = service.metrics.rejected
    config = uvicorn.Config(create_app(service, engine_thread=False), host=args.host, port=args.port,
                            log_level="warning", access_log=False,
                            **limits.uvicorn_kwargs(lambda status: refused.labels(status=str(status)).inc()))
    server = uvicorn.Server(config)
    web = threading.Thread(target=server.run, name="forerun-http", daemon=True)
    web.start()
    print(f"forerun: serving {service.name} ({args.method}) on http://{args.host}:{args.port}/v1", flush=True)
    engine = service.engine
    engine.housekeeping = _heap_trimmer()
    try:
        # The engine steps on the main thread (faster torch kernels there); HTTP runs beside it.
        engine.run(until=lambda: not web.is_alive())
    except KeyboardInterrupt:
        pass
    finally:
        server.should_exit = True
        web.join(timeout=10)
        save_adapted(engine.drafter, args.adapt_save)
    return 0
