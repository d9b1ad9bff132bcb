"""The OpenAI-compatible server, live on loopback, driven by the official openai client and raw HTTP."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from serving import setup_for  # noqa: E402

from forerun.engine import Engine  # noqa: E402
from forerun.server.run import build_service  # noqa: E402


class Live:
    """uvicorn on a free loopback port, in a thread."""

    def __init__(self, service, limits=None):
        import uvicorn

        from forerun.server.app import create_app
        from forerun.server.limits import Limits

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.service = service
        refused = service.metrics.rejected  # as forerun serve configures uvicorn
        kw = (limits or Limits()).uvicorn_kwargs(lambda status: refused.labels(status=str(status)).inc())
        cfg = uvicorn.Config(create_app(service), host="127.0.0.1", port=self.port, log_level="error", access_log=False,
                             **kw)
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        for _ in range(200):
            if self.server.started:
                break
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self, key="none"):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=30)

    def request(self, method, path, body=None, headers=None, raw=None, with_headers=False):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        data = raw if raw is not None else (None if body is None else json.dumps(body))
        c.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        r = c.getresponse()
        text = r.read().decode()
        c.close()
        try:
            out = r.status, json.loads(text)
        except ValueError:
            out = r.status, text
        return (*out, r.headers) if with_headers else out

    def rejected(self) -> dict:
        """/metrics' forerun:request_rejected counts by status."""
        text = self.request("GET", "/metrics")[1]
        out = {}
        for line in text.splitlines():
            if line.startswith("forerun:request_rejected_total{"):
                status = line.split('status="')[1].split('"')[0]
                out[status] = float(line.rsplit(" ", 1)[1])
        return out

    def close(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def live(gemma):
    srv = Live(build_service(setup_for(gemma, "ngram"), name="tiny", max_batch=4, max_tokens=100))
    yield srv
    srv.close()


def _plain_text(gemma, ids, n):
    out = Engine(gemma.backend.fork(), None, gemma.eos_token_ids).generate(ids, max_new_tokens=n).token_ids
    return gemma.tokenizer.decode(out, skip_special_tokens=True), out


def test_openai_client_completion_chat_and_streaming(live, gemma):
    client = live.client()
    assert [m.id for m in client.models.list().data] == ["tiny"]
    r = client.completions.create(model="tiny", prompt="w5 w6 w7 w5 w6 w7", max_tokens=12, temperature=0)
    ids = gemma.tokenizer("w5 w6 w7 w5 w6 w7").input_ids
    want, toks = _plain_text(gemma, ids, 12)
    assert r.choices[0].text == want
    assert r.usage.completion_tokens == len(toks) and r.usage.prompt_tokens == len(ids)
    spec = r.usage.model_extra["speculative"]
    assert spec["method"] == "ngram" and spec["target_passes"] >= 1 and spec["mean_accepted_length"] >= 1

    chunks = list(client.completions.create(model="tiny", prompt="w5 w6 w7 w5 w6 w7", max_tokens=12, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")

    msgs = [{"role": "system", "content": "w9"}, {"role": "user", "content": "w5 w6"}]
    chat = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0)
    assert chat.choices[0].message.role == "assistant"
    stream = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == chat.choices[0].message.content
    assert stream[-1].usage.completion_tokens == chat.usage.completion_tokens
    # sampling with a seed repeats itself
    a = client.completions.create(model="tiny", prompt="w5 w6", max_tokens=8, temperature=1.0, top_p=0.9, seed=7)
    b = client.completions.create(model="tiny", prompt="w5 w6", max_tokens=8, temperature=1.0, top_p=0.9, seed=7,
                                  extra_body={"top_k": 20})
    c = client.completions.create(model="tiny", prompt="w5 w6", max_tokens=8, temperature=1.0, top_p=0.9, seed=7)
    assert a.choices[0].text == c.choices[0].text
    assert b.usage.completion_tokens >= 1
    # the top_k extension reaches the sampler: top_k = 1 leaves only the argmax, whatever the seed
    one = client.completions.create(model="tiny", prompt="w5 w6", max_tokens=8, temperature=1.0, seed=3,
                                    extra_body={"top_k": 1})
    assert one.choices[0].text == _plain_text(gemma, gemma.tokenizer("w5 w6").input_ids, 8)[0]


def test_stop_strings_cut_the_text(live, gemma):
    client = live.client()
    full = client.completions.create(model="tiny", prompt="w5 w6 w7", max_tokens=20, temperature=0).choices[0].text
    words = full.split()
    assert len(words) >= 4
    stop = words[3]
    cut = full[: full.find(stop)]
    r = client.completions.create(model="tiny", prompt="w5 w6 w7", max_tokens=20, temperature=0, stop=[stop])
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    s = list(client.completions.create(model="tiny", prompt="w5 w6 w7", max_tokens=20, temperature=0, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in s) == cut


def test_greedy_outputs_under_concurrency_equal_each_alone(live, gemma):
    g = torch.Generator().manual_seed(3)
    prompts = [[2] + torch.randint(4, 96, (4,), generator=g).tolist() * 3 for _ in range(10)]
    want = [_plain_text(gemma, p, 24)[0] for p in prompts]
    client = live.client()

    def one(p):
        return client.completions.create(model="tiny", prompt=p, max_tokens=24, temperature=0).choices[0].text

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(one, prompts))
    assert got == want


BAD = [
    ("/v1/completions", None, "{not json", 400),
    ("/v1/completions", [1, 2], None, 400),
    ("/v1/completions", {"prompt": "w5"}, None, 400),
    ("/v1/completions", {"model": "tiny"}, None, 400),
    ("/v1/completions", {"model": 5, "prompt": "w5"}, None, 400),
    ("/v1/completions", {"model": "gpt-9", "prompt": "w5"}, None, 404),
    ("/v1/completions", {"model": "tiny", "prompt": ""}, None, 400),
    ("/v1/completions", {"model": "tiny", "prompt": 17}, None, 400),
    ("/v1/completions", {"model": "tiny", "prompt": [5, 999999]}, None, 400),
    ("/v1/completions", {"model": "tiny", "prompt": ["w5", "w6"]}, None, 400),
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "max_tokens": 0}, None, 400),
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "max_tokens": "5"}, None, 400),
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "max_tokens": 101}, None, 400),
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "temperature": -1}, None, 400),
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "temperature": "hot"}, None, 400),
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "top_p": 0}, None, 400),
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "top_k": -2}, None, 400),
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "top_k": 1.5}, None, 400),
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "seed": "x"}, None, 400),
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "n": 2}, None, 400),
    # found by the long schemathesis run: falsy non-objects and numbers that compare equal to booleans
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "stream_options": False}, None, 400),
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "stream_options": {"include_usage": 0.0}}, None, 400),
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "stream_options": {"include_usage": 1}}, None, 400),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "w5"}], "max_completion_tokens": 3,
                              "max_tokens": ["x"]}, None, 400),
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "stream": "yes"}, None, 400),
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "stop": ["a", "b", "c", "d", "e"]}, None, 400),
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "stop": 3}, None, 400),
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "stop": ["w" * 257]}, None, 400),
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "logprobs": 2}, None, 400),
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "logit_bias": {"5": 100}}, None, 400),
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "presence_penalty": 0.5}, None, 400),
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "frequency_penalty": 1}, None, 400),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "w5"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, None, 400),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "w5"}],
                              "tool_choice": "required"}, None, 400),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "w5"}],
                              "response_format": {"type": "json_object"}}, None, 400),
    ("/v1/completions", None, b'{"model": "tiny", "prompt": "w5", "x": ' + b"[" * 100000 + b"]" * 100000 + b"}", 400),
    ("/v1/completions", None, b'{"model": "tiny\\ud800", "prompt": "w5"}', 400),
    ("/v1/completions", None, b'{"model": "tiny", "prompt": "w5\\udfff"}', 400),
    ("/v1/completions", {"model": "tiny", "prompt": " ".join(["w5"] * 300)}, None, 400),  # past the 256-token context
    ("/v1/chat/completions", {"model": "tiny"}, None, 400),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, None, 400),
    ("/v1/chat/completions", {"model": "tiny", "messages": "hi"}, None, 400),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "robot", "content": "w5"}]}, None, 400),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user"}]}, None, 400),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": 5}]}, None, 400),
    ("/v1/nowhere", {"model": "tiny"}, None, 404),
]


@pytest.mark.parametrize("path,body,raw,status", BAD)
def test_bad_inputs_get_openai_errors(live, path, body, raw, status):
    code, resp = live.request("POST", path, body=body, raw=raw)
    assert code == status, resp
    assert isinstance(resp, dict) and set(resp["error"]) >= {"message", "type", "param", "code"}
    assert resp["error"]["message"]


@pytest.mark.parametrize("field,value", [("top_p", 1.5), ("top_p", True), ("temperature", 2.5), ("temperature", False),
                                         ("seed", 2**63), ("seed", -(2**63) - 1), ("seed", 1.5), ("top_k", True),
                                         ("max_tokens", True), ("max_tokens", 0)])
def test_sampling_settings_out_of_range_are_400s_naming_the_parameter(live, field, value):
    """Each bound of the sampling settings kept: a value past it (or a boolean where a number is
    meant) is a 400 whose ``param`` names the field, before any work."""
    code, resp = live.request("POST", "/v1/completions", body={"model": "tiny", "prompt": "w5", field: value})
    assert code == 400 and resp["error"]["param"] == field, resp


def test_oversized_bodies_and_prompts_are_refused_before_the_work(live):
    """413 for a body over the limit (by Content-Length, and while it arrives without one); a
    prompt too long for any tokenization to fit the context is refused without tokenizing it."""
    service = live.service
    limit = service.max_body_bytes
    big = {"model": "tiny", "prompt": "w5 " * (limit // 3 + 10)}
    code, resp = live.request("POST", "/v1/completions", body=big)
    assert code == 413 and resp["error"]["code"] == "request_too_large"
    c = http.client.HTTPConnection("127.0.0.1", live.port, timeout=30)  # chunked: no Content-Length
    c.putrequest("POST", "/v1/completions")
    c.putheader("Content-Type", "application/json")
    c.putheader("Transfer-Encoding", "chunked")
    c.endheaders()
    chunk = b"x" * 65536
    try:
        for _ in range(limit // len(chunk) + 2):
            c.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        c.send(b"0\r\n\r\n")
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server answered and closed before the body was all sent
    r = c.getresponse()
    assert r.status == 413
    c.close()

    calls = []
    tokenize = service.tokenize
    service.tokenize = lambda text: calls.append(len(text)) or tokenize(text)
    try:
        chars = service.engine.target.max_context * service.CHARS_PER_TOKEN + 1
        code, resp = live.request("POST", "/v1/completions", body={"model": "tiny", "prompt": "w" * chars})
        assert code == 400 and resp["error"]["code"] == "context_length_exceeded" and calls == []
        code, resp = live.request("POST", "/v1/chat/completions",
                                  body={"model": "tiny", "messages": [{"role": "user", "content": "w" * chars}]})
        assert code == 400 and resp["error"]["code"] == "context_length_exceeded"
        code, _ = live.request("POST", "/v1/completions", body={"model": "tiny", "prompt": "w5 w6", "max_tokens": 2})
        assert code == 200 and calls == [5]  # normal prompts are tokenized (off the event loop)
    finally:
        service.tokenize = tokenize
    assert live.request("GET", "/health")[0] == 200


def test_json_only_and_loopback_host_names_only(gemma, live, monkeypatch):
    """A body sent as another content type is refused (415); bound to loopback, a request whose
    Host names another site (DNS rebinding from a web page) is refused (421); empty API keys are
    refused, and the key may come from the environment."""
    from forerun.errors import ForerunError
    from forerun.server.app import is_loopback
    from forerun.server.run import resolve_api_key

    body = {"model": "tiny", "prompt": "w5", "max_tokens": 1}
    code, resp = live.request("POST", "/v1/completions", body=body, headers={"Content-Type": "text/plain"})
    assert code == 415 and resp["error"]["code"] == "unsupported_media_type"
    assert live.request("POST", "/v1/completions", body=body)[0] == 200
    assert live.request("GET", "/v1/models", headers={"Host": "evil.example"})[0] == 200  # not bound to loopback

    srv = Live(build_service(setup_for(gemma, "none"), name="tiny", calibrate=False, loopback_hosts=True))
    try:
        for host, status in (("evil.example", 421), ("evil.example:80", 421), (f"127.0.0.1:{srv.port}", 200),
                             (f"localhost:{srv.port}", 200), ("[::1]:80", 200), ("LOCALHOST", 200), ("127.0.0.2", 200),
                             # names that only look like loopback (a rebinding page can own them)
                             (f"127.attacker.example:{srv.port}", 421), ("127.0.0.1.evil.com", 421),
                             ("127.0.0.1.nip.io:80", 421), ("localhost.evil.com", 421), ("127.1", 421),
                             ("[::1]evil", 421), ("[::1]:x", 421), ("127.0.0.1:80:80", 421), ("::1", 421),
                             ("[::ffff:7f00:1]x", 421), ("", 421)):
            assert srv.request("GET", "/v1/models", headers={"Host": host})[0] == status, host
    finally:
        srv.close()
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and not is_loopback("0.0.0.0")
    assert is_loopback("::1") and is_loopback("[::1]") and is_loopback("127.255.0.9")
    assert not any(is_loopback(h) for h in ("127.attacker.example", "127.0.0.1.evil.com", "127.", "::2", "10.0.0.1"))

    monkeypatch.delenv("FORERUN_API_KEY", raising=False)
    assert resolve_api_key(None) is None and resolve_api_key("k1") == "k1"
    monkeypatch.setenv("FORERUN_API_KEY", "from-env")
    assert resolve_api_key(None) == "from-env" and resolve_api_key("k1") == "k1"
    for empty in ("", "  "):
        with pytest.raises(ForerunError, match="empty"):
            resolve_api_key(empty)
        with pytest.raises(ForerunError, match="empty"):
            build_service(setup_for(gemma, "none"), api_key=empty, calibrate=False)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_health_reports_a_dead_engine(gemma):
    """The engine loop dying answers the requests it held (500), refuses new ones (503) and turns
    /health to 503."""
    service = build_service(setup_for(gemma, "none"), name="tiny", calibrate=False)
    srv = Live(service)
    try:
        assert srv.request("GET", "/health") == (200, {"status": "ok", "running": 0, "waiting": 0})

        def broken_step():
            raise SystemExit("engine bug")  # not an Exception: nothing inside the loop catches it

        service.engine.step = broken_step
        body = {"model": "tiny", "prompt": "w5", "max_tokens": 2}
        code, resp = srv.request("POST", "/v1/completions", body=body)
        assert code == 500 and "engine bug" in resp["error"]["message"]
        code, resp = srv.request("GET", "/health")
        assert code == 503 and resp["status"] == "dead" and "engine bug" in resp["error"]
        c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
        c.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        r = c.getresponse()
        resp = json.loads(r.read())
        assert r.status == 503 and resp["error"]["code"] == "engine_stopped"
        assert r.getheader("x-should-retry") == "false"  # retrying would meet the same dead engine
    finally:
        srv.close()


def test_valid_variants_are_accepted_and_tiny_temperatures_are_greedy(live, gemma):
    """Requests real clients send that are valid (nulls for defaults, no-op values of unsupported
    options, tool turns) are served; a temperature too small to divide by decodes greedily."""
    ok = [{"model": "tiny", "prompt": "w5 w6", "max_tokens": 3, "n": None, "stream_options": {"include_usage": None},
           "logit_bias": {}, "presence_penalty": 0, "frequency_penalty": None, "tools": None, "response_format": {"type": "text"}},
          {"model": "tiny", "messages": [{"role": "user", "content": "w5"}, {"role": "assistant", "content": None},
                                         {"role": "tool", "content": "w7"}, {"role": "user", "content": "w8"}],
           "max_tokens": 3, "tool_choice": "none", "tools": []}]
    for body in ok:
        code, resp = live.request("POST", "/v1/chat/completions" if "messages" in body else "/v1/completions", body=body)
        assert code == 200, resp
    greedy = live.request("POST", "/v1/completions", body={"model": "tiny", "prompt": "w5 w6", "max_tokens": 6,
                                                          "temperature": 0})[1]["choices"][0]["text"]
    for t in (1e-38, 1e-30, 5e-6):
        code, resp = live.request("POST", "/v1/completions", body={"model": "tiny", "prompt": "w5 w6", "max_tokens": 6,
                                                                  "temperature": t, "seed": 3})
        assert code == 200 and resp["choices"][0]["text"] == greedy, t


def test_wrong_method_and_server_survives(live):
    code, resp = live.request("GET", "/v1/completions")
    assert code == 405 and "error" in resp
    assert live.request("GET", "/health")[0] == 200


def test_metrics_present_and_moving(live):
    def scrape():
        code, text = live.request("GET", "/metrics")
        assert code == 200
        vals = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                k, v = line.rsplit(" ", 1)
                vals[k] = float(v)
        return vals

    before = scrape()
    for name in ("forerun:spec_decode_num_drafts_total", "forerun:num_requests_running", "forerun:num_requests_waiting",
                 "forerun:time_to_first_token_seconds_count", "forerun:time_per_output_token_seconds_count",
                 "forerun:spec_decode_num_accepted_tokens_total", "forerun:spec_decode_mean_accepted_length"):
        assert name in before, name
    live.client().completions.create(model="tiny", prompt="w5 w6 w7 w5 w6 w7 w5 w6", max_tokens=20, temperature=0)
    after = scrape()
    assert after["forerun:generation_tokens_total"] > before["forerun:generation_tokens_total"]
    assert after["forerun:time_to_first_token_seconds_count"] == before["forerun:time_to_first_token_seconds_count"] + 1
    assert after["forerun:spec_decode_num_draft_tokens_total"] > before["forerun:spec_decode_num_draft_tokens_total"]
    assert any(k.startswith('forerun:spec_decode_num_accepted_tokens_per_pos_total{position="0"}') for k in after)


def test_disconnect_mid_stream_frees_the_slot(gemma):
    service = build_service(setup_for(gemma, "ngram"), name="tiny", max_batch=2, max_tokens=200, calibrate=False)
    slow = service.engine.decoder.step

    def slow_pass(*a, **kw):  # make generation outlast the client
        time.sleep(0.03)
        return slow(*a, **kw)

    service.engine.decoder.step = slow_pass
    srv = Live(service)
    try:
        c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
        c.request("POST", "/v1/completions", body=json.dumps({"model": "tiny", "prompt": "w5 w9", "max_tokens": 200,
                                                              "temperature": 0, "stream": True}),
                  headers={"Content-Type": "application/json"})
        r = c.getresponse()
        assert r.status == 200
        r.fp.readline()
        assert service.engine.n_running == 1
        c.sock.shutdown(socket.SHUT_RDWR)
        c.close()
        t0 = time.time()
        while service.engine.n_running and time.time() - t0 < 5:
            time.sleep(0.02)
        assert service.engine.n_running == 0
        assert time.time() - t0 < 2.5  # freed promptly, long before the 200 tokens would be done
    finally:
        srv.close()


def test_disconnect_without_streaming_frees_the_slot(gemma):
    """A client that leaves a non-streaming request while tokens keep coming stops its generation."""
    service = build_service(setup_for(gemma, "none"), name="tiny", max_batch=2, max_tokens=200, calibrate=False)
    slow, submit = service.engine.decoder.step, service.engine.submit
    submitted = []

    def slow_pass(*a, **kw):  # a token every ~20 ms: events keep coming, so no idle check would look
        time.sleep(0.02)
        return slow(*a, **kw)

    service.engine.decoder.step = slow_pass
    service.engine.submit = lambda req: submitted.append(req) or submit(req)
    srv = Live(service)
    try:
        c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
        c.request("POST", "/v1/completions", body=json.dumps({"model": "tiny", "prompt": "w5 w9", "max_tokens": 200,
                                                              "temperature": 0}),
                  headers={"Content-Type": "application/json"})
        t0 = time.time()
        while service.engine.n_running == 0 and time.time() - t0 < 5:
            time.sleep(0.01)
        time.sleep(0.3)
        assert service.engine.n_running == 1
        c.sock.shutdown(socket.SHUT_RDWR)
        c.close()
        t0 = time.time()
        while service.engine.n_running and time.time() - t0 < 10:
            time.sleep(0.02)
        assert service.engine.n_running == 0 and time.time() - t0 < 1.5
        req = submitted[0]
        assert req.cancelled and req.produced < 150  # stopped by the disconnect, not by finishing
    finally:
        srv.close()


def test_auth_queue_and_timeout(gemma):
    service = build_service(setup_for(gemma, "none"), name="tiny", api_key="s3cret", max_batch=1, max_waiting=0,
                            max_tokens=200, request_timeout=0.6, calibrate=False)
    slow = service.engine.decoder.step

    def slow_pass(*a, **kw):
        time.sleep(0.02)
        return slow(*a, **kw)

    service.engine.decoder.step = slow_pass
    srv = Live(service)
    try:
        assert srv.request("GET", "/health")[0] == 200  # no key needed
        code, resp, headers = srv.request("GET", "/v1/models", with_headers=True)
        assert code == 401 and resp["error"]["code"] == "invalid_api_key"
        assert headers["WWW-Authenticate"].startswith("Bearer")
        assert srv.request("GET", "/metrics", headers={"Authorization": "Bearer wrong"})[0] == 401
        assert srv.request("GET", "/v1/models", headers={"Authorization": "Bearer s3cret"})[0] == 200
        with pytest.raises(openai.AuthenticationError):
            srv.client("bad").completions.create(model="tiny", prompt="w5", max_tokens=2)
        ok = srv.client("s3cret").completions.create(model="tiny", prompt="w5", max_tokens=2, temperature=0)
        assert ok.usage.completion_tokens >= 1

        # one slot, no waiting room: a second concurrent request is turned away with 429
        body = {"model": "tiny", "prompt": "w5 w6", "max_tokens": 200, "temperature": 0}
        key = {"Authorization": "Bearer s3cret"}
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(srv.request, "POST", "/v1/completions", body, key)
            t0 = time.time()
            while service.engine.n_running == 0 and time.time() - t0 < 5:
                time.sleep(0.01)
            code, resp = srv.request("POST", "/v1/completions", body, key)
            assert code == 429 and resp["error"]["code"] == "queue_full"
            code, resp = first.result()
        assert code == 504 and resp["error"]["code"] == "request_timeout"  # 200 slow tokens outlast 0.6 s
        t0 = time.time()
        while service.engine.n_running and time.time() - t0 < 5:
            time.sleep(0.02)
        assert service.engine.n_running == 0
    finally:
        srv.close()


def _assemble(tok, ids, stop, seed):
    """Push ids in random chunks through a TextAssembler: (concatenated deltas, stopped)."""
    import random

    from forerun.server.app import TextAssembler

    rng = random.Random(seed)
    ta, out, i = TextAssembler(tok, stop), [], 0
    while i < len(ids) and not ta.stopped:
        n = rng.randint(1, 4)
        out.append(ta.push(ids[i: i + n], final=i + n >= len(ids)))
        i += n
    return "".join(out), ta.stopped


def _expected(tok, ids, stop):
    text = tok.decode(ids, skip_special_tokens=True)
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


@pytest.mark.parametrize("seed", range(4))
def test_incremental_text_equals_decoding_the_whole_output(gemma, seed):
    """Deltas decoded a few tokens at a time add up to the full decode, cut at the first stop string."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, gemma.backend.vocab_size, (60,), generator=g).tolist()
    text = gemma.tokenizer.decode(ids, skip_special_tokens=True)
    for stop in ([], [text[40:47]], [text[100:103], "zz-none"], ["never there"]):
        assert _assemble(gemma.tokenizer, ids, stop, seed) == _expected(gemma.tokenizer, ids, stop)


@pytest.mark.bundled
def test_incremental_text_on_a_real_tokenizer(smollm2):
    """SmolLM2's byte-level BPE, with multi-byte characters split across tokens and a stop string."""
    tok = smollm2.tokenizer
    ids = tok("Café crème, naïve façade — 東京 🚀🚀 and ünïcödé everywhere; then STOP here.").input_ids
    for seed in range(5):
        for stop in ([], ["STOP"], ["🚀 and"], ["東"]):
            assert _assemble(tok, ids, stop, seed) == _expected(tok, ids, stop)


def test_loadtest_compares_named_servers_in_one_table(gemma, capsys):
    """--url NAME=URL, repeated: every server measured at every level, one table with each one's
    ratio to the best of the others."""
    from forerun.cli import main
    from forerun.errors import ForerunError
    from forerun.server.loadtest import comparison_table, parse_urls

    assert parse_urls(["http://h:1/v1?a=b"]) == {"external": "http://h:1/v1?a=b"}
    assert parse_urls(["a=http://h:1", "http://h:2"]) == {"a": "http://h:1", "server2": "http://h:2"}
    for bad in (["a=ftp://h"], ["a=http://h:1", "a=http://h:2"], ["=http://h:1"], ["a=nothing"]):
        with pytest.raises(ForerunError):
            parse_urls(bad)
    report = {"methods": {"x": {"levels": [{"concurrency": 1, "output_tokens_per_s": 30.0}]},
                          "y": {"levels": [{"concurrency": 1, "output_tokens_per_s": 20.0}]}}}
    assert "| x | 30.0 (1.50x) |" in comparison_table(report) and "| y | 20.0 (0.67x) |" in comparison_table(report)

    a = Live(build_service(setup_for(gemma, "none"), name="tiny", calibrate=False))
    b = Live(build_service(setup_for(gemma, "ngram"), name="tiny", calibrate=False))
    try:
        code = main(["loadtest", "--url", f"plain={a.url}", "--url", f"ngram={b.url}", "--concurrency", "1,2",
                     "--requests", "4", "--max-tokens", "6"])
        assert code == 0
        out = capsys.readouterr()
        report = json.loads(out.out)
        assert list(report["methods"]) == ["plain", "ngram"]
        for r in report["methods"].values():
            assert [lv["concurrency"] for lv in r["levels"]] == [1, 2] and all(lv["ok"] == 4 for lv in r["levels"])
        assert "| plain |" in report["table"] and "| ngram |" in report["table"] and report["table"] in out.err
    finally:
        a.close()
        b.close()


def test_a_loadtest_report_names_a_model_file_from_the_home_folder(monkeypatch, tmp_path):
    """llama-server names its model by the file's path: the report keeps it from ``~``."""
    from forerun.server.loadtest import report_name

    monkeypatch.setenv("HOME", str(tmp_path / "u"))
    assert report_name(str(tmp_path / "u" / ".cache" / "m.gguf")) == "~/.cache/m.gguf"
    assert report_name(str(tmp_path / "u2" / "m.gguf")) == str(tmp_path / "u2" / "m.gguf")  # not under home
    assert report_name("qwen2.5-coder-1.5b") == "qwen2.5-coder-1.5b"


def _raw(port, data: bytes = b"", timeout=10.0) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    if data:
        s.sendall(data)
    return s


def _read_all(s: socket.socket) -> bytes:
    out = b""
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:  # a reset instead of an answer fails the callers' checks
            return out + b"<reset>"
        if not chunk:
            return out
        out += chunk


def _status(resp: bytes) -> int:
    return int(resp.split(b" ", 2)[1]) if resp.startswith(b"HTTP/1.1 ") else -1


def test_a_client_leaving_mid_body_is_counted_499_not_500(live):
    before = live.rejected()
    for _ in range(3):
        s = _raw(live.port, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                            b"Content-Length: 1000\r\n\r\n" + b'{"model": "tiny", ')
        time.sleep(0.05)
        s.close()
    for _ in range(100):
        after = live.rejected()
        if after.get("499", 0) - before.get("499", 0) >= 3:
            break
        time.sleep(0.05)
    assert after.get("499", 0) - before.get("499", 0) == 3
    assert after.get("500", 0) == before.get("500", 0)
    assert live.request("GET", "/health")[0] == 200


def test_token_id_prompts_say_what_is_wrong(live):
    for prompt, word in (([5, 6.5], "6.5"), ([True, 5], "true"), ([1.0], "1.0"), ([5, False], "false")):
        code, resp = live.request("POST", "/v1/completions", body={"model": "tiny", "prompt": prompt, "max_tokens": 1})
        assert code == 400, prompt
        msg = resp["error"]["message"]
        assert "must be integers" in msg and word in msg and "one prompt per request" not in msg, msg
    code, resp = live.request("POST", "/v1/completions", body={"model": "tiny", "prompt": ["w5", "w6"]})
    assert code == 400 and "one prompt per request" in resp["error"]["message"]


def test_connection_limits(gemma):
    """Idle connections close after the keep-alive time, from the start; a head or body that does
    not arrive in time gets 408; a head over the limit gets 431 (read by the client, no reset);
    connections beyond the cap get 503. Every refusal is counted in /metrics."""
    from forerun.server.limits import Limits

    service = build_service(setup_for(gemma, "none"), name="tiny", calibrate=False)
    srv = Live(service, Limits(keep_alive_s=0.6, read_timeout_s=1.0, max_connections=4, max_header_bytes=4096,
                               linger_s=1.0))
    try:
        t = time.perf_counter()
        idle = _raw(srv.port)
        assert _read_all(idle) == b""  # closed by the server, without a request
        assert 0.4 < time.perf_counter() - t < 5
        idle.close()

        # a body sent one byte at a time: 408 after the read timeout (not served minutes later)
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Content-Length: 200\r\n\r\n")
        slow = _raw(srv.port, head)
        t = time.perf_counter()
        slow.settimeout(0.2)
        got = b""
        for ch in b'{"model": "tiny", "prompt": "w5 w6", "max_tokens": 2}':
            try:
                slow.sendall(bytes([ch]))
                got += slow.recv(65536)
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                break
            if got:
                break
        slow.settimeout(10)
        got += _read_all(slow)
        assert _status(got) == 408 and b"request_timeout" in got, got[:200]
        assert time.perf_counter() - t < 5
        slow.close()
        # a head that never ends
        s = _raw(srv.port, b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        assert _status(_read_all(s)) == 408
        s.close()

        # a 1 MB header: 431 with a JSON body, no reset
        s = _raw(srv.port)
        try:
            s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        got = _read_all(s)
        assert _status(got) == 431 and b"request_header_too_large" in got, got[:200]
        s.close()
        code, _ = srv.request("GET", "/v1/models", headers={"X-Ok": "a" * 2000})  # under the limit: served
        assert code == 200

        # the cap: 4 open connections, the fifth is refused at once
        time.sleep(2.0)  # the refused connections above have lingered and closed
        held = [_raw(srv.port) for _ in range(4)]
        time.sleep(0.1)
        extra = _raw(srv.port)
        got = _read_all(extra)
        assert _status(got) == 503 and b"too_many_connections" in got and b"retry-after: 1" in got.lower(), got[:200]
        extra.close()
        for h in held:
            h.close()
        time.sleep(0.2)
        assert srv.request("GET", "/health")[0] == 200
        counts = srv.rejected()
        assert counts.get("408") == 2 and counts.get("431") == 1 and counts.get("503") == 1, counts
        assert "500" not in counts and "499" not in counts, counts
    finally:
        srv.close()


def test_limits_are_checked():
    from forerun.errors import ForerunError
    from forerun.server.limits import Limits

    for bad in ({"keep_alive_s": 0}, {"read_timeout_s": -1}, {"max_connections": 0}, {"max_header_bytes": 10}):
        with pytest.raises(ForerunError):
            Limits(**bad).check()
    assert Limits().check().max_connections == 128


def test_served_sampling_follows_the_target():
    """Sampled completions through HTTP, 8 at a time (batched passes, n-gram drafts), follow the
    target's own distribution at the first two positions on a target with spread-out
    distributions (``spread.py``); the settings in the request reach the sampler."""
    from conftest import VOCAB
    from spread import PROMPT, SETTINGS, bound, exact, spread_target, tv

    lm = spread_target()
    srv = Live(build_service(setup_for(lm, "ngram"), name="tiny", max_batch=8, calibrate=False))
    setting = "t1.4-k6-p0.85"
    marg, _ = exact(lm, setting)
    n = 600
    counts = torch.zeros(2, VOCAB, dtype=torch.float64)

    def one(seed):
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "seed": seed, **SETTINGS[setting]}
        code, resp = srv.request("POST", "/v1/completions", body=body)
        assert code == 200, resp
        return lm.tokenizer(resp["choices"][0]["text"], add_special_tokens=False).input_ids

    try:
        with ThreadPoolExecutor(8) as pool:
            for ids in pool.map(one, range(n)):
                assert len(ids) == 2, ids
                counts[0, ids[0]] += 1
                counts[1, ids[1]] += 1
    finally:
        srv.close()
    for j in (0, 1):
        assert tv(counts[j], marg[j]) < bound(marg[j], n), (j, tv(counts[j], marg[j]))
