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
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from forerun.batching import BatchEngine, BatchRequest, EngineStopped, QueueFull
from forerun.chat import chat_ids
from forerun.sampling import SamplingParams
from forerun.server.metrics import Metrics
from forerun.server.openapi import openapi_schema


TIMED_OUT = "forerun.read_timed_out"  # scope key: the request was answered 408 at the socket (server.limits)


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, retry: bool | None = None, headers: dict | None = None):
        super().__init__(message)
        self.headers = headers or {}
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.retry = retry  # x-should-retry for clients (the openai SDK reads it); None: their default

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status in (429, 503) and self.retry is not False else {}
        if self.retry is not None:
            headers["x-should-retry"] = "true" if self.retry else "false"
        headers.update(self.headers)
        return JSONResponse(self.body(), status_code=self.status, headers=headers or None)


@dataclass
class Job:
    """One validated request: token ids, limits, sampling, text stops."""

    ids: list[int]
    max_tokens: int
    params: SamplingParams
    stop: list[str]
    stream: bool
    include_usage: bool


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

    def start(self) -> None:
        if self._thread is None:
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
            raise ApiError(400, f"the prompt is {chars} characters; this model's context ({self.engine.target.max_context} "
                                f"tokens) cannot hold more than {limit}", param=param, code="context_length_exceeded")

    CHARS_PER_TOKEN = 32


# -- validation ------------------------------------------------------------------------------

def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _content_text(content, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        out = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad(f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
            out.append(part["text"])
        return "".join(out)
    raise _bad(f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content")


MAX_STOP_CHARS = 256

# Options a client may send; each one with a value that would change the output is refused rather
# than silently ignored (its no-op values pass).
_UNSUPPORTED = (
    ("logprobs", lambda v: v not in (None, False, 0)), ("top_logprobs", lambda v: v not in (None, 0)),
    ("echo", lambda v: v not in (None, False)), ("best_of", lambda v: v not in (None, 1)),
    ("suffix", lambda v: v not in (None, "")), ("tools", lambda v: v not in (None, [])),
    ("tool_choice", lambda v: v not in (None, "none")), ("functions", lambda v: v not in (None, [])),
    ("function_call", lambda v: v not in (None, "none")),
    ("response_format", lambda v: v is not None and v != {"type": "text"}),
    ("logit_bias", lambda v: v not in (None, {})), ("presence_penalty", lambda v: v not in (None, 0)),
    ("frequency_penalty", lambda v: v not in (None, 0)), ("repetition_penalty", lambda v: v not in (None, 1)),
)


def _has_lone_surrogate(obj) -> bool:
    """Whether a decoded JSON value holds a string that is not valid Unicode (a lone surrogate).
    Iterative: a body may nest as deeply as the JSON parser allowed."""
    stack = [obj]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return False


def validate(body, service: Service, chat: bool) -> Job:
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    model = body.get("model")
    if model is None:
        raise _bad("missing required field 'model'", "model")
    if not isinstance(model, str):
        raise _bad("'model' must be a string", "model")
    if model not in service.aliases:
        raise ApiError(404, f"the model '{model}' does not exist; this server serves '{service.name}'",
                       param="model", code="model_not_found")
    for name, bad in _UNSUPPORTED:
        if name in body and bad(body[name]):
            raise _bad(f"'{name}' is not supported by this server (it would change the output)", name)
    n = body.get("n")
    if n is not None and (not _is_int(n) or n != 1):
        raise _bad("only n=1 is supported", "n")

    if chat:
        msgs = body.get("messages")
        if msgs is None:
            raise _bad("missing required field 'messages'", "messages")
        if not isinstance(msgs, list) or not msgs:
            raise _bad("'messages' must be a non-empty list", "messages")
        clean = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict):
                raise _bad(f"messages[{i}] must be an object", f"messages[{i}]")
            role = m.get("role")
            if role not in ("system", "developer", "user", "assistant", "tool"):
                raise _bad(f"messages[{i}].role must be system, developer, user, assistant or tool", f"messages[{i}].role")
            if "content" not in m:
                raise _bad(f"messages[{i}] has no content", f"messages[{i}].content")
            content = m["content"]
            if content is None and role == "assistant":  # an assistant turn that only called tools
                content = ""
            clean.append({"role": "system" if role == "developer" else role, "content": _content_text(content, i)})
        service.check_prompt_chars(sum(len(m["content"]) for m in clean), "messages")
        try:
            ids = service.chat_prompt(clean)
        except Exception as e:  # a template that rejects this conversation (e.g. roles out of order)
            raise _bad(f"the chat template rejected these messages: {e}", "messages") from None
    else:
        if "prompt" not in body:
            raise _bad("missing required field 'prompt'", "prompt")
        prompt = body["prompt"]
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        vocab = service.engine.target.vocab_size
        if isinstance(prompt, str):
            if not prompt:
                raise _bad("'prompt' is empty", "prompt")
            service.check_prompt_chars(len(prompt), "prompt")
            ids = service.tokenize(prompt)
        elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
            if any(t < 0 or t >= vocab for t in prompt):
                raise _bad(f"prompt token ids must be in 0..{vocab - 1}", "prompt")
            ids = list(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, (str, list)) for t in prompt):
            raise _bad("one prompt per request (n=1, no prompt batches)", "prompt")
        elif isinstance(prompt, list) and prompt and all(isinstance(t, (int, float, bool)) for t in prompt):
            bad = next(t for t in prompt if not _is_int(t))
            raise _bad(f"prompt token ids must be integers, got {json.dumps(bad)} ({type(bad).__name__})", "prompt")
        else:
            raise _bad("'prompt' must be a string or a non-empty list of token ids", "prompt")
    if not ids:
        raise _bad("the prompt is empty after tokenization", "messages" if chat else "prompt")
    limit = service.engine.target.max_context
    if len(ids) >= limit:
        raise _bad(f"the prompt is {len(ids)} tokens; this model's context is {limit} tokens (room for one new token "
                   "is needed)", "messages" if chat else "prompt", code="context_length_exceeded")

    # chat: max_completion_tokens wins over max_tokens, but both are checked when given
    for key in ("max_tokens", "max_completion_tokens") if chat else ("max_tokens",):
        v = body.get(key)
        if v is None:
            continue
        if not _is_int(v) or v < 1:
            raise _bad(f"'{key}' must be an integer >= 1", key)
        if v > service.max_tokens:
            raise _bad(f"'{key}' is {v}; this server allows at most {service.max_tokens}", key)
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.get(key)
    if max_tokens is None:
        max_tokens = min(service.max_tokens, 16) if not chat else service.max_tokens

    temperature = body.get("temperature", 1.0)
    if temperature is None:
        temperature = 1.0
    if not _is_num(temperature) or not 0 <= temperature <= 2:
        raise _bad("'temperature' must be a number in [0, 2]", "temperature")
    top_p = body.get("top_p", 1.0)
    top_p = 1.0 if top_p is None else top_p
    if not _is_num(top_p) or not 0 < top_p <= 1:
        raise _bad("'top_p' must be a number in (0, 1]", "top_p")
    top_k = body.get("top_k", 0)
    top_k = 0 if top_k is None else top_k
    if not _is_int(top_k) or top_k < 0:
        raise _bad("'top_k' must be an integer >= 0 (0 = off)", "top_k")
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not -(2**63) <= seed < 2**63):
        raise _bad("'seed' must be a 64-bit integer", "seed")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise _bad("'stop' must be a non-empty string or a list of up to 4 non-empty strings", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        raise _bad(f"each stop string may have at most {MAX_STOP_CHARS} characters", "stop")
    stream = body.get("stream", False)
    stream = False if stream is None else stream
    if not isinstance(stream, bool):
        raise _bad("'stream' must be a boolean", "stream")
    opts = body.get("stream_options")
    opts = {} if opts is None else opts
    usage = opts.get("include_usage") if isinstance(opts, dict) else None
    # not ``usage in (True, False)``: 0, 1 and 0.0 compare equal to the booleans
    if not isinstance(opts, dict) or not (usage is None or isinstance(usage, bool)):
        raise _bad("'stream_options' must be an object with a boolean 'include_usage'", "stream_options")
    params = SamplingParams(temperature=float(temperature), top_k=top_k, top_p=float(top_p),
                            seed=None if seed is None else seed % (2**63))
    return Job(ids=ids, max_tokens=max_tokens, params=params, stop=stop, stream=stream,
               include_usage=bool(usage))


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

    def __init__(self, app, service: "Service"):
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
                raise _bad("the request body is not valid JSON") from None
            except RecursionError:
                raise _bad("the request body nests too deeply") from None
            if _has_lone_surrogate(body):
                raise _bad("the request holds a string that is not valid Unicode (a lone surrogate)")
            job = await asyncio.to_thread(validate, body, service, chat)  # tokenizing: off the event loop
        except ApiError as e:
            return e.response()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def on_event(tokens, finish):  # engine thread
            loop.call_soon_threadsafe(queue.put_nowait, (tokens, finish))

        req = BatchRequest(prompt=job.ids, max_new_tokens=job.max_tokens, params=job.params, on_event=on_event)
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
            self.finish = {"context": "length"}.get(finish, finish)
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
