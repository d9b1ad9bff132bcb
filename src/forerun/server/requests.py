"""A request's body checked and read: every field the OpenAI API defines either honoured or
refused with a 400 in its error shape (``ApiError``), the result a ``Job`` the server runs."""

from __future__ import annotations

import json
from dataclasses import dataclass

from fastapi.responses import JSONResponse

from forerun.constrain import Grammar
from forerun.errors import ForerunError
from forerun.sampling import SamplingParams

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
    max_new_tokens: int  # the request's max_tokens (or max_completion_tokens), as the engine names it
    params: SamplingParams
    stop: list[str]
    stream: bool
    include_usage: bool
    grammar: object = None  # a ``forerun.constrain.TokenGrammar`` (structured output), or None


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _content_text(content, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        out = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
            out.append(part["text"])
        return "".join(out)
    raise bad_request(f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content")


MAX_STOP_CHARS = 256


# Options a client may send; each one with a value that would change the output is refused rather
# than silently ignored (its no-op values pass).
_UNSUPPORTED = (
    ("logprobs", lambda v: v not in (None, False, 0)), ("top_logprobs", lambda v: v not in (None, 0)),
    ("echo", lambda v: v not in (None, False)), ("best_of", lambda v: v not in (None, 1)),
    ("suffix", lambda v: v not in (None, "")), ("tools", lambda v: v not in (None, [])),
    ("tool_choice", lambda v: v not in (None, "none")), ("functions", lambda v: v not in (None, [])),
    ("function_call", lambda v: v not in (None, "none")),
    ("logit_bias", lambda v: v not in (None, {})), ("presence_penalty", lambda v: v not in (None, 0)),
    ("frequency_penalty", lambda v: v not in (None, 0)), ("repetition_penalty", lambda v: v not in (None, 1)),
)


def has_lone_surrogate(obj) -> bool:
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


def validate(body, service, chat: bool) -> Job:
    """The request ``body`` for ``service`` (an ``app.Service``: its model, limits and method), checked."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    model = body.get("model")
    if model is None:
        raise bad_request("missing required field 'model'", "model")
    if not isinstance(model, str):
        raise bad_request("'model' must be a string", "model")
    if model not in service.aliases:
        raise ApiError(404, f"the model '{model}' does not exist; this server serves '{service.name}'",
                       param="model", code="model_not_found")
    for name, bad in _UNSUPPORTED:
        if name in body and bad(body[name]):
            raise bad_request(f"'{name}' is not supported by this server (it would change the output)", name)
    n = body.get("n")
    if n is not None and (not _is_int(n) or n != 1):
        raise bad_request("only n=1 is supported", "n")

    if chat:
        msgs = body.get("messages")
        if msgs is None:
            raise bad_request("missing required field 'messages'", "messages")
        if not isinstance(msgs, list) or not msgs:
            raise bad_request("'messages' must be a non-empty list", "messages")
        clean = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict):
                raise bad_request(f"messages[{i}] must be an object", f"messages[{i}]")
            role = m.get("role")
            if role not in ("system", "developer", "user", "assistant", "tool"):
                raise bad_request(f"messages[{i}].role must be system, developer, user, assistant or tool", f"messages[{i}].role")
            if "content" not in m:
                raise bad_request(f"messages[{i}] has no content", f"messages[{i}].content")
            content = m["content"]
            if content is None and role == "assistant":  # an assistant turn that only called tools
                content = ""
            clean.append({"role": "system" if role == "developer" else role, "content": _content_text(content, i)})
        service.check_prompt_chars(sum(len(m["content"]) for m in clean), "messages")
        try:
            ids = service.chat_prompt(clean)
        except Exception as e:  # noqa: BLE001 - a template that rejects this conversation (e.g. roles out of order)
            raise bad_request(f"the chat template rejected these messages: {e}", "messages") from None
    else:
        if "prompt" not in body:
            raise bad_request("missing required field 'prompt'", "prompt")
        prompt = body["prompt"]
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        vocab = service.engine.target.vocab_size
        if isinstance(prompt, str):
            if not prompt:
                raise bad_request("'prompt' is empty", "prompt")
            service.check_prompt_chars(len(prompt), "prompt")
            ids = service.tokenize(prompt)
        elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
            if any(t < 0 or t >= vocab for t in prompt):
                raise bad_request(f"prompt token ids must be in 0..{vocab - 1}", "prompt")
            ids = list(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, (str, list)) for t in prompt):
            raise bad_request("one prompt per request (n=1, no prompt batches)", "prompt")
        elif isinstance(prompt, list) and prompt and all(isinstance(t, (int, float, bool)) for t in prompt):
            bad = next(t for t in prompt if not _is_int(t))
            raise bad_request(f"prompt token ids must be integers, got {json.dumps(bad)} ({type(bad).__name__})", "prompt")
        else:
            raise bad_request("'prompt' must be a string or a non-empty list of token ids", "prompt")
    if not ids:
        raise bad_request("the prompt is empty after tokenization", "messages" if chat else "prompt")
    limit = service.engine.target.max_context
    if len(ids) >= limit:
        raise bad_request(f"the prompt is {len(ids)} tokens; {service.context_text()} (room for one new token is needed)",
                          "messages" if chat else "prompt", code="context_length_exceeded")

    # chat: max_completion_tokens wins over max_tokens, but both are checked when given
    for key in ("max_tokens", "max_completion_tokens") if chat else ("max_tokens",):
        v = body.get(key)
        if v is None:
            continue
        if not _is_int(v) or v < 1:
            raise bad_request(f"'{key}' must be an integer >= 1", key)
        if v > service.max_tokens:
            raise bad_request(f"'{key}' is {v}; this server allows at most {service.max_tokens}", key)
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.get(key)
    if max_tokens is None:
        max_tokens = min(service.max_tokens, 16) if not chat else service.max_tokens

    temperature = body.get("temperature", 1.0)
    if temperature is None:
        temperature = 1.0
    if not _is_num(temperature) or not 0 <= temperature <= 2:
        raise bad_request("'temperature' must be a number in [0, 2]", "temperature")
    top_p = body.get("top_p", 1.0)
    top_p = 1.0 if top_p is None else top_p
    if not _is_num(top_p) or not 0 < top_p <= 1:
        raise bad_request("'top_p' must be a number in (0, 1]", "top_p")
    top_k = body.get("top_k", 0)
    top_k = 0 if top_k is None else top_k
    if not _is_int(top_k) or top_k < 0:
        raise bad_request("'top_k' must be an integer >= 0 (0 = off)", "top_k")
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not -(2**63) <= seed < 2**63):
        raise bad_request("'seed' must be a 64-bit integer", "seed")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise bad_request("'stop' must be a non-empty string or a list of up to 4 non-empty strings", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        raise bad_request(f"each stop string may have at most {MAX_STOP_CHARS} characters", "stop")
    stream = body.get("stream", False)
    stream = False if stream is None else stream
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean", "stream")
    opts = body.get("stream_options")
    opts = {} if opts is None else opts
    usage = opts.get("include_usage") if isinstance(opts, dict) else None
    # not ``usage in (True, False)``: 0, 1 and 0.0 compare equal to the booleans
    if not isinstance(opts, dict) or not (usage is None or isinstance(usage, bool)):
        raise bad_request("'stream_options' must be an object with a boolean 'include_usage'", "stream_options")
    params = SamplingParams(temperature=float(temperature), top_k=top_k, top_p=float(top_p),
                            seed=None if seed is None else seed % (2**63))
    return Job(ids=ids, max_new_tokens=max_tokens, params=params, stop=stop, stream=stream,
               include_usage=bool(usage), grammar=_grammar(body, service))


GRAMMAR_FIELDS = ("response_format", "json_schema", "regex", "grammar")


def _grammar(body: dict, service):
    """The output's constraint: OpenAI's ``response_format`` (``json_object``, ``json_schema``),
    or one of the extensions ``json_schema`` (a schema, as llama-server takes it), ``regex`` and
    ``grammar`` (Lark, llguidance's dialect). Bound to the served model's tokens (cached)."""
    given = [k for k in GRAMMAR_FIELDS if body.get(k) is not None and body.get(k) != {"type": "text"}]
    if not given:
        return None
    if len(given) > 1:
        raise bad_request(f"give at most one of {', '.join(GRAMMAR_FIELDS)} (got {', '.join(given)})", given[1])
    key, v = given[0], body[given[0]]
    try:
        if key == "response_format":
            if not isinstance(v, dict) or v.get("type") not in ("text", "json_object", "json_schema"):
                raise bad_request("'response_format' must be an object whose 'type' is text, json_object or "
                                  "json_schema", "response_format")
            if v["type"] == "json_object":
                grammar = Grammar.json_object()
            else:
                spec = v.get("json_schema")
                if not isinstance(spec, dict):
                    raise bad_request("'response_format.json_schema' must be an object holding a 'schema'",
                                      "response_format.json_schema")
                schema = spec.get("schema")
                if schema is None:  # a name alone: any JSON object
                    grammar = Grammar.json_object()
                elif not isinstance(schema, dict):
                    raise bad_request("'response_format.json_schema.schema' must be a JSON object",
                                      "response_format.json_schema.schema")
                else:
                    key = "response_format.json_schema.schema"
                    grammar = Grammar.json_schema(schema)
        elif key == "json_schema":
            if not isinstance(v, dict):
                raise bad_request("'json_schema' must be a JSON object (a schema)", "json_schema")
            grammar = Grammar.json_schema(v)
        elif key == "regex":
            if not isinstance(v, str) or not v:
                raise bad_request("'regex' must be a non-empty string", "regex")
            grammar = Grammar.regex(v)
        else:
            if not isinstance(v, str) or not v.strip():
                raise bad_request("'grammar' must be a non-empty Lark grammar", "grammar")
            grammar = Grammar.lark(v)
        return service.bind_grammar(grammar)
    except ForerunError as e:
        raise bad_request(str(e), key) from None
