"""OpenAI-compatible HTTP server over the batched speculative engine.

The engine runs on its own thread (``BatchEngine.run``); request handlers validate, tokenize,
submit a ``BatchRequest`` and receive its tokens through an asyncio queue. Every error is
answered in the OpenAI error shape; no request can stop the engine thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import threading
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from forerun.backends.ckernels import release_threads
from forerun.batching import BatchEngine, BatchRequest, EngineStopped, QueueFull
from forerun.chat import chat_ids
from forerun.server.metrics import Metrics
from forerun.server.openapi import openapi_schema
from forerun.server.requests import TIMED_OUT, ApiError, Job, bad_request, has_lone_surrogate, validate

# The engine's finish reasons as the OpenAI API names them: it has no reason of its own for the
# context limit, so a generation cut there ends with "length", as one cut by max_tokens does.
API_FINISH = {"context": "length"}


class Service:
    """Model + engine thread + metrics; ``create_app(service)`` puts HTTP in front of it."""

    def __init__(self, model, engine: BatchEngine, *, name: str, api_key: str | None = None, max_tokens: int = 1024,
                 request_timeout: float = 600.0, method: str = "ngram", max_body_bytes: int = 4 << 20,
                 loopback_hosts: bool = False):
        self.model = model
        self.tokenizer = model.tokenizer
        self.engine = engine
        self.name = name
        # Requests may also name the model as it was given on the command line (e.g. ``smollm2``).
        self.aliases = {name, getattr(model, "name", name)}
        self.api_key = api_key
        self.max_tokens = max_tokens
        self.request_timeout = request_timeout
        self.method = method
        self.max_body_bytes = max_body_bytes  # larger bodies are answered 413 before they are read whole
        # bound to loopback: only requests addressed to a loopback name are served, so that a web
        # page whose name resolves to 127.0.0.1 (DNS rebinding) cannot drive the server
        self.loopback_hosts = loopback_hosts
        # prompts are tokenized off the event loop, one at a time (a tokenizer is not made for
        # concurrent calls)
        self.tokenizer_lock = threading.Lock()
        self.metrics = Metrics(engine)
        engine.on_step = self.metrics.on_step
        self.created = int(time.time())
        self._thread: threading.Thread | None = None
        self._grammars: dict = {}  # Grammar -> TokenGrammar, the most recent GRAMMARS_KEPT
        self._grammar_lock = threading.Lock()

    GRAMMARS_KEPT = 64

    def bind_grammar(self, grammar):
        """``grammar`` over the served model's tokens, compiled once per distinct grammar."""
        with self._grammar_lock:
            bound = self._grammars.pop(grammar, None)
            if bound is None:
                bound = grammar.bind(self.tokenizer, self.engine.target.vocab_size, self.engine.decoder.eos)
            self._grammars[grammar] = bound  # newest last
            while len(self._grammars) > self.GRAMMARS_KEPT:
                self._grammars.pop(next(iter(self._grammars)))
            return bound

    def start(self) -> None:
        if self._thread is None:
            release_threads()  # this thread's kernel workers (calibration): the engine thread runs the model now
            self._thread = threading.Thread(target=self.engine.run, name="forerun-engine", daemon=True)
            self._thread.start()

    def engine_dead(self) -> str | None:
        """Why the engine loop is not running, or None while it is."""
        if self.engine.dead:
            return self.engine.dead
        if self._thread is not None and not self._thread.is_alive():
            return "the engine thread has stopped"
        return None

    def stop(self) -> None:
        self.engine.stop()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    # -- prompts ---------------------------------------------------------------------------
    def chat_prompt(self, messages: list[dict]) -> list[int]:
        with self.tokenizer_lock:
            return chat_ids(self.tokenizer, messages)

    def tokenize(self, text: str) -> list[int]:
        with self.tokenizer_lock:
            return self.tokenizer(text).input_ids

    def check_prompt_chars(self, chars: int, param: str) -> None:
        """Refuse text too long for the context before tokenizing it: no tokenizer of a supported
        model averages more than ``CHARS_PER_TOKEN`` characters a token on text, so such a prompt
        could not fit and would only hold a worker for seconds."""
        limit = self.engine.target.max_context * self.CHARS_PER_TOKEN
        if chars > limit:
            raise ApiError(400, f"the prompt is {chars} characters; {self.context_text()}, which cannot hold more than "
                                f"{limit} characters", param=param, code="context_length_exceeded")

    def context_text(self) -> str:
        """The context limit a refused prompt ran into, said as what it is: the server's (set by
        ``--max-context``) where it is below the model's own, else the model's."""
        limit = self.engine.target.max_context
        cfg = getattr(self.model, "config", None)
        own = getattr(cfg, "max_position_embeddings", None)
        if own is not None and limit < own:
            return (f"this server's context limit is {limit} tokens (--max-context; the model's own context is "
                    f"{own} tokens)")
        return f"this model's context is {limit} tokens"

    CHARS_PER_TOKEN = 32


# -- validation ------------------------------------------------------------------------------

# -- text assembly ---------------------------------------------------------------------------

class TextAssembler:
    """Token ids in, text deltas out: holds back an unfinished character and any tail that could
    still become a stop string; cuts the text where a stop string appears.

    Decoding is incremental: each push decodes only the tokens since the last settled point,
    with a few tokens before it as context (the text of a token can depend on its neighbour, e.g.
    a leading space), and takes what goes beyond that context's own text. Stop strings are looked
    for only in the new text and the longest stop string's length before it."""

    CONTEXT = 4  # tokens decoded before the new ones, for the new ones' text

    def __init__(self, tokenizer, stop: list[str]):
        self.tok = tokenizer
        self.stop = stop
        self.longest = max((len(x) for x in stop), default=0)
        self.ids: list[int] = []
        self.text = ""  # the settled text
        self.settled = 0  # tokens whose text is in self.text
        self.sent = 0
        self.searched = 0  # self.text before this has no stop string starting in it
        self.stopped = False

    def _settle(self, final: bool) -> None:
        start = max(0, self.settled - self.CONTEXT)
        before = self.tok.decode(self.ids[start: self.settled], skip_special_tokens=True)
        now = self.tok.decode(self.ids[start:], skip_special_tokens=True)
        if not now.startswith(before):  # the context decodes differently now: take all from the start
            start, before = 0, ""
            now = self.tok.decode(self.ids, skip_special_tokens=True)
            self.text = ""
        tail = now[len(before):]
        if not final and tail.endswith("\ufffd"):  # a multi-byte character still arriving
            return
        self.text += tail
        self.settled = len(self.ids)

    def push(self, ids: list[int], final: bool = False) -> str:
        self.ids.extend(ids)
        self._settle(final)
        text = self.text
        lo = max(0, self.searched - self.longest)
        cut = min((i for i in (text.find(x, lo) for x in self.stop) if i >= 0), default=-1)
        self.searched = len(text)
        if cut >= 0:
            self.stopped = True
            safe = cut
        else:
            safe = len(text)
            if not final:
                for x in self.stop:  # hold back a tail that may still grow into a stop string
                    for n in range(min(len(x) - 1, safe), 0, -1):
                        if text.endswith(x[:n], 0, safe):
                            safe = min(safe, len(text) - n)
                            break
        delta = text[self.sent: safe] if safe > self.sent else ""
        self.sent = max(self.sent, safe)
        return delta


# -- the app ---------------------------------------------------------------------------------

def is_loopback(host: str) -> bool:
    """Whether a host name or address (``--host``, or a Host header without its port) is the
    loopback interface: ``localhost`` or a literal loopback address (127.0.0.0/8, ::1), parsed as
    an address. A name that merely starts with ``127.`` (``127.0.0.1.example.com``) is not."""
    host = host.strip().lower()
    if host == "localhost":
        return True
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _loopback_host(header: bytes) -> bool:
    """Whether a Host header names the loopback interface (with or without a port)."""
    host = header.decode("latin-1").strip().lower()
    if host.startswith("["):  # [::1]:8000
        end = host.find("]")
        rest = host[end + 1:]
        if end < 0 or (rest and not (rest.startswith(":") and rest[1:].isdigit())):
            return False
        host = host[: end + 1]
    elif ":" in host:  # name:port (a bare IPv6 address is not a valid Host header)
        host, _, port = host.rpartition(":")
        if not port.isdigit():
            return False
    return is_loopback(host)


class _Guard:
    """The API key and a last-resort JSON 500, as plain ASGI middleware: it passes ``receive``
    through untouched, so a handler sees its client disconnect (a function middleware would hide
    it). Every answer of 400 or more is counted in the metrics."""

    def __init__(self, app, service: Service):
        self.app, self.service = app, service

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rejected = self.service.metrics.rejected
        started = False

        async def counted(message):  # every answer goes out here: those of 400 or more are counted
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if message["status"] >= 400:
                    rejected.labels(status=str(message["status"])).inc()
            await send(message)

        headers = dict(scope.get("headers") or ())
        refusal = None
        if self.service.loopback_hosts and not _loopback_host(headers.get(b"host", b"")):
            refusal = ApiError(421, "this server answers only requests addressed to localhost or 127.0.0.1",
                               code="misdirected_request")
        elif self.service.api_key is not None and scope.get("path") != "/health":
            auth = headers.get(b"authorization", b"").decode("latin-1")
            token = auth[7:] if auth.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(token.encode(), self.service.api_key.encode()):
                refusal = ApiError(401, "missing or invalid API key (Authorization: Bearer KEY)",
                                   "authentication_error", code="invalid_api_key",
                                   headers={"WWW-Authenticate": 'Bearer realm="forerun"'})
        if refusal is not None:
            await refusal.response()(scope, receive, counted)
            return
        try:
            await self.app(scope, receive, counted)
        except ClientDisconnect:  # the client left mid-request: its doing, not a server error
            if not started and not scope.get(TIMED_OUT):  # a read timeout was answered (408) and counted already
                rejected.labels(status="499").inc()
        except Exception as e:  # noqa: BLE001 - last resort: a JSON 500, the server keeps running
            if started:  # too late to answer: the connection is dropped
                raise
            await ApiError(500, f"internal error: {type(e).__name__}", "server_error").response()(scope, receive, counted)


def create_app(service: Service, engine_thread: bool = True) -> FastAPI:
    """``engine_thread``: run the engine on a thread of its own while the app runs; ``forerun serve``
    passes False and runs the engine on the main thread instead (torch's CPU kernels run measurably
    slower when called from a secondary thread: 20 vs 29 tokens/s here)."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if engine_thread:
            service.start()
        try:
            yield
        finally:
            if engine_thread:
                service.stop()

    app = FastAPI(title="forerun", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    metrics = service.metrics

    app.add_middleware(_Guard, service=service)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return ApiError(exc.status_code, str(exc.detail), kind).response()

    @app.get("/health")
    async def health():
        dead = service.engine_dead()
        if dead:
            return JSONResponse({"status": "dead", "error": dead}, status_code=503)
        return {"status": "ok", "running": service.engine.n_running, "waiting": service.engine.n_waiting}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/openapi.json")
    async def openapi():
        return openapi_schema(service.name, service.engine.target.vocab_size, service.max_tokens)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": service.name, "object": "model", "created": service.created,
                                            "owned_by": "forerun"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _serve(request, chat=True)

    async def _serve(request: Request, chat: bool):
        t0 = time.perf_counter()
        try:
            ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
            if ctype != "application/json":
                raise ApiError(415, f"the request body must be JSON, sent as Content-Type: application/json "
                                    f"(got {ctype or 'none'!r})", code="unsupported_media_type")
            raw = await _read_body(request, service.max_body_bytes)
            try:
                body = json.loads(raw)
            except (ValueError, UnicodeDecodeError):
                raise bad_request("the request body is not valid JSON") from None
            except RecursionError:
                raise bad_request("the request body nests too deeply") from None
            if has_lone_surrogate(body):
                raise bad_request("the request holds a string that is not valid Unicode (a lone surrogate)")
            job = await asyncio.to_thread(validate, body, service, chat)  # tokenizing: off the event loop
        except ApiError as e:
            return e.response()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def on_event(tokens, finish):  # engine thread
            loop.call_soon_threadsafe(queue.put_nowait, (tokens, finish))

        req = BatchRequest(prompt=job.ids, max_new_tokens=job.max_new_tokens, params=job.params, grammar=job.grammar,
                           on_event=on_event)
        try:
            service.engine.submit(req)
        except QueueFull as e:
            return ApiError(429, f"the server is at capacity: {e}", "rate_limit_error", code="queue_full").response()
        except EngineStopped as e:
            return ApiError(503, str(e), "server_error", code="engine_stopped", retry=False).response()
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        run = _Run(service, req, job, queue, t0, chat, rid)
        if job.stream:
            return StreamingResponse(run.events(request), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await run.collect(request)

    return app


class _Run:
    """One submitted request as seen by its handler: tokens in from the engine, text out."""

    def __init__(self, service: Service, req: BatchRequest, job: Job, queue: asyncio.Queue, t0: float, chat: bool,
                 rid: str):
        self.service, self.req, self.job, self.queue, self.t0, self.chat, self.rid = service, req, job, queue, t0, chat, rid
        self.text = TextAssembler(service.tokenizer, job.stop)
        self.n_tokens = 0
        self.t_first = None
        self.finish = None
        self.created = int(time.time())

    async def _next(self, request: Request, poll_disconnect: bool = True):
        """The next engine event, watching the deadline and (with ``poll_disconnect``, after half a
        second without events) the client's connection. ``None`` on the queue means the client left."""
        deadline = self.t0 + self.service.request_timeout
        while True:
            left = deadline - time.perf_counter()
            if left <= 0:
                raise TimeoutError
            try:
                event = await asyncio.wait_for(self.queue.get(), timeout=min(0.5, left))
            except asyncio.TimeoutError:
                if poll_disconnect and await request.is_disconnected():
                    raise ConnectionError from None
                continue
            if event is None:
                raise ConnectionError
            return event

    async def _watch_disconnect(self, request: Request) -> None:
        """Wait for the client to go away (the body is read already, so the next message is the
        disconnect), then cancel the request and wake the handler."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.service.engine.cancel(self.req)
        self.queue.put_nowait(None)

    def _take(self, tokens: list[int], finish: str | None) -> str:
        if tokens and self.t_first is None:
            self.t_first = time.perf_counter()
            self.service.metrics.ttft.observe(self.t_first - self.t0)
        self.n_tokens += len(tokens)
        delta = self.text.push(tokens, final=finish is not None)
        if self.text.stopped:
            if finish is None:
                self.service.engine.cancel(self.req)  # a stop string: no more tokens are needed
            self.finish = "stop"
        elif finish is not None:  # engine reasons: stop (EOS), length, context, cancelled, error
            self.finish = API_FINISH.get(finish, finish)
        return delta

    def _record_end(self) -> None:
        m = self.service.metrics
        now = time.perf_counter()
        m.e2e.observe(now - self.t0)
        m.prompt_tokens.inc(len(self.job.ids))
        m.generation_tokens.inc(self.n_tokens)
        if self.t_first is not None and self.n_tokens > 1:
            m.tpot.observe((now - self.t_first) / (self.n_tokens - 1))
        m.finished.labels(finished_reason=self.finish or "abort").inc()

    def _timeout(self) -> ApiError:
        return ApiError(504, f"the request did not finish within {self.service.request_timeout:g} s", "timeout",
                        code="request_timeout", retry=False)  # a retry would run as long again

    def _failed(self) -> ApiError:
        return ApiError(500, f"generation failed: {self.req.error}", "server_error", retry=False)

    def _envelope(self, obj: str, choices: list, **extra) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.service.name, "choices": choices,
                **extra}

    def usage(self) -> dict:
        s = self.req.stats
        return {"prompt_tokens": len(self.job.ids), "completion_tokens": self.n_tokens,
                "total_tokens": len(self.job.ids) + self.n_tokens,
                "speculative": {"method": self.service.method, "target_passes": s.target_passes, "drafted_tokens": s.drafted,
                                "accepted_tokens": s.accepted, "acceptance_rate": round(s.acceptance_rate, 4),
                                "mean_accepted_length": round(s.mean_accepted_len, 4)}}

    async def collect(self, request: Request):
        parts = []
        watcher = asyncio.ensure_future(self._watch_disconnect(request))  # the client may leave at any token
        try:
            while self.finish is None:
                tokens, finish = await self._next(request, poll_disconnect=False)
                parts.append(self._take(tokens, finish))
        except TimeoutError:
            self.service.engine.cancel(self.req)
            return self._timeout().response()
        except ConnectionError:
            self.service.engine.cancel(self.req)
            return Response(status_code=499)
        finally:
            watcher.cancel()
        if self.req.error:
            return self._failed().response()
        self._record_end()
        text = "".join(parts)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": self.finish}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": self.finish}
            obj = "text_completion"
        return JSONResponse(self._envelope(obj, [choice], usage=self.usage()))

    def _chunk(self, delta: str | None, finish: str | None, first: bool = False) -> str:
        if self.chat:
            d = {} if delta is None else {"content": delta}
            if first:
                d = {"role": "assistant", "content": ""}
            choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
        return _sse(self._envelope(self._chunk_object, [choice]))

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    async def events(self, request: Request):
        done = False
        try:
            if self.chat:
                yield self._chunk(None, None, first=True)
            while self.finish is None:
                try:
                    tokens, finish = await self._next(request)
                except TimeoutError:
                    self.service.engine.cancel(self.req)
                    yield _sse(self._timeout().body())
                    break
                delta = self._take(tokens, finish)
                if delta:
                    yield self._chunk(delta, None)
            if self.req.error:
                yield _sse(self._failed().body())
            elif self.finish is not None:
                self._record_end()
                yield self._chunk(None, self.finish)
                if self.job.include_usage:
                    yield _sse(self._envelope(self._chunk_object, [], usage=self.usage()))
            yield "data: [DONE]\n\n"
            done = True
        except ConnectionError:
            pass
        finally:
            if not done:  # the client left: free the slot now
                self.service.engine.cancel(self.req)


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, or a 413 as soon as it is known to exceed ``limit`` bytes (from its
    Content-Length, or while it arrives)."""
    too_big = ApiError(413, f"the request body exceeds this server's limit of {limit} bytes", code="request_too_large")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


def _sse(obj: dict) -> str:
    """One server-sent event carrying a JSON object."""
    return f"data: {json.dumps(obj)}\n\n"
