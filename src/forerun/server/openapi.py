"""The server's OpenAPI 3.0 description, served at ``/openapi.json``.

Written by hand because the handlers validate raw JSON themselves (OpenAI's wire format, with
errors in OpenAI's shape): the schema states exactly what ``app.validate`` accepts, so that
clients can generate code from it and fuzzers (schemathesis, in the test suite) can drive the
server with valid and invalid requests and check every answer against it.
"""

from __future__ import annotations

_SAMPLING = {
    "max_tokens": {"type": "integer", "minimum": 1, "nullable": True},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2, "nullable": True},
    "top_p": {"type": "number", "exclusiveMinimum": True, "minimum": 0, "maximum": 1, "nullable": True},
    "top_k": {"type": "integer", "minimum": 0, "nullable": True, "description": "0: off"},
    "seed": {"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1, "nullable": True},
    "n": {"type": "integer", "minimum": 1, "maximum": 1, "nullable": True},
    "stop": {"nullable": True, "oneOf": [
        {"type": "string", "minLength": 1, "maxLength": 256},
        {"type": "array", "maxItems": 4, "items": {"type": "string", "minLength": 1, "maxLength": 256}}]},
    "stream": {"type": "boolean", "nullable": True},
    # structured output: at most one of these four (a grammar the server cannot compile is a 400)
    "response_format": {"type": "object", "nullable": True, "required": ["type"], "properties": {
        "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
        "json_schema": {"type": "object", "properties": {"name": {"type": "string"}, "strict": {"type": "boolean"},
                                                         "schema": {"type": "object"}}}}},
    "json_schema": {"type": "object", "nullable": True, "description": "a JSON schema the output keeps to"},
    "regex": {"type": "string", "minLength": 1, "nullable": True, "description": "a regex the output matches whole"},
    "grammar": {"type": "string", "minLength": 1, "nullable": True,
                "description": "a Lark grammar (llguidance's dialect) the output keeps to"},
    "stream_options": {"type": "object", "nullable": True,
                       "properties": {"include_usage": {"type": "boolean", "nullable": True}}},
}

_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": "string", "nullable": True}, "code": {"type": "string", "nullable": True}}}}}

# one server-sent event: ``data:`` holds a chunk as JSON, the last one ``[DONE]``
_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}

_USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
          "properties": {"prompt_tokens": {"type": "integer"}, "completion_tokens": {"type": "integer"},
                         "total_tokens": {"type": "integer"}, "speculative": {"type": "object"}}}


def _envelope(obj: str, choice: dict) -> dict:
    return {"type": "object", "required": ["id", "object", "created", "model", "choices"],
            "properties": {"id": {"type": "string"}, "object": {"type": "string", "enum": [obj]},
                           "created": {"type": "integer"}, "model": {"type": "string"},
                           "choices": {"type": "array", "items": choice}, "usage": _USAGE}}


def _errors(*codes: int) -> dict:
    why = {400: "invalid request", 401: "missing or wrong API key", 404: "no such model", 413: "body too large",
           415: "body not sent as application/json", 421: "Host is not this machine (server bound to loopback)",
           429: "queue full: retry later", 500: "generation failed", 503: "the engine has stopped",
           504: "the request timed out"}
    return {str(c): {"description": why[c], "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
            for c in codes}


def _post(summary: str, request: str, response: dict) -> dict:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{request}"}}}},
        "responses": {
            "200": {"description": "the completion (JSON), or with stream: true a stream of server-sent events",
                    "content": {"application/json": {"schema": response},
                                "text/event-stream": {"schema": _EVENT}}},
            **_errors(400, 401, 404, 413, 415, 421, 429, 500, 503, 504)},
    }}


def openapi_schema(model: str, vocab_size: int, max_tokens: int) -> dict:
    """The description of a server serving ``model`` (the only id it accepts)."""
    sampling = dict(_SAMPLING, max_tokens=dict(_SAMPLING["max_tokens"], maximum=max_tokens))
    completion = {
        "type": "object", "required": ["model", "prompt"],
        "properties": {
            "model": {"type": "string", "enum": [model]},
            "prompt": {"oneOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}},
                {"type": "array", "minItems": 1, "maxItems": 1, "description": "a batch of one prompt",
                 "items": {"oneOf": [{"type": "string", "minLength": 1},
                                     {"type": "array", "minItems": 1, "items": {
                                         "type": "integer", "minimum": 0, "maximum": vocab_size - 1}}]}}]},
            **sampling},
    }
    part = {"type": "object", "required": ["type", "text"],
            "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}
    message = {
        "type": "object", "required": ["role", "content"],
        "properties": {"role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool"]},
                       "content": {"nullable": True, "oneOf": [{"type": "string"}, {"type": "array", "items": part}],
                                   "description": "null only on assistant turns"}},
    }
    chat = {
        "type": "object", "required": ["model", "messages"],
        "properties": {"model": {"type": "string", "enum": [model]},
                       "messages": {"type": "array", "minItems": 1, "items": message},
                       "max_completion_tokens": sampling["max_tokens"], **sampling},
    }
    text_choice = {"type": "object", "required": ["index", "text", "finish_reason"],
                   "properties": {"index": {"type": "integer"}, "text": {"type": "string"},
                                  "finish_reason": {"type": "string", "nullable": True}}}
    chat_choice = {"type": "object", "required": ["index", "message", "finish_reason"],
                   "properties": {"index": {"type": "integer"}, "finish_reason": {"type": "string", "nullable": True},
                                  "message": {"type": "object", "required": ["role", "content"],
                                              "properties": {"role": {"type": "string"}, "content": {"type": "string"}}}}}
    json_ok = lambda desc, schema: {"200": {"description": desc, "content": {"application/json": {"schema": schema}}}}  # noqa: E731
    return {
        "openapi": "3.0.3",
        "info": {"title": "forerun", "version": "1", "description": "OpenAI-compatible completions with lossless speculative decoding"},
        "paths": {
            "/health": {"get": {"summary": "liveness", "responses": {
                **json_ok("the engine runs", {"type": "object", "required": ["status"], "properties": {"status": {"type": "string"}}}),
                "503": {"description": "the engine has stopped", "content": {"application/json": {"schema": {"type": "object"}}}}}}},
            "/v1/models": {"get": {"summary": "the served model", "responses": {
                **json_ok("one model", {"type": "object", "required": ["object", "data"], "properties": {
                    "object": {"type": "string"}, "data": {"type": "array", "items": {
                        "type": "object", "required": ["id"], "properties": {"id": {"type": "string"}}}}}}),
                **_errors(401, 421)}}},
            "/v1/completions": _post("text completion", "CompletionRequest", _envelope("text_completion", text_choice)),
            "/v1/chat/completions": _post("chat completion", "ChatCompletionRequest", _envelope("chat.completion", chat_choice)),
        },
        "components": {"schemas": {"CompletionRequest": completion, "ChatCompletionRequest": chat, "Error": _ERROR}},
    }
