"""``forerun loadtest``: N concurrent streaming clients on loopback against ``forerun serve``.

Without ``--url`` it starts one server per method (``--methods none,ngram``) as a subprocess,
runs every concurrency level against it, and stops it, so speculation on and off are measured
in one run on the same machine. Each client streams (TTFT = first text chunk) and reads the
token count from the final usage chunk. ``--invalid-fraction`` mixes in malformed requests and
counts 5xx answers and failed connections; the server's resident memory is sampled after the
first 50 requests and at the end.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

from forerun.errors import ForerunError
from forerun.plots import loadtest_chart

BUILTIN_PROMPTS = [
    "Explain how a hash table works and when it is a bad choice.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Summarize the causes of the French Revolution in a few paragraphs.",
    "Translate into German: The weather is nice today and we are going for a walk in the park.",
    "A train travels 120 km in 1.5 hours. What is its average speed? Explain step by step.",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring and tests.",
    "What are the main differences between mitochondria and chloroplasts?",
    "Give me five ideas for a birthday party for a ten-year-old.",
]

INVALID = [
    (b"{not json", "/v1/completions"),
    (b'{"prompt": "hello"}', "/v1/completions"),
    (b'{"model": "MODEL", "prompt": "hello", "max_tokens": -3}', "/v1/completions"),
    (b'{"model": "MODEL", "prompt": "hello", "max_tokens": 1000000}', "/v1/completions"),
    (b'{"model": "MODEL", "prompt": "hello", "temperature": "warm"}', "/v1/completions"),
    (b'{"model": "MODEL", "prompt": "hello", "top_p": 7}', "/v1/completions"),
    (b'{"model": "no-such-model", "prompt": "hello"}', "/v1/completions"),
    (b'{"model": "MODEL", "prompt": ["a", "b"]}', "/v1/completions"),
    (b'{"model": "MODEL", "messages": [{"role": "wizard", "content": "hi"}]}', "/v1/chat/completions"),
    (b'{"model": "MODEL", "messages": "hi"}', "/v1/chat/completions"),
    (b'{"model": "MODEL", "prompt": "hello", "n": 3}', "/v1/completions"),
    (b'{"model": "MODEL", "prompt": [-1, 5]}', "/v1/completions"),
    (b"[]", "/v1/chat/completions"),
    (b'{"model": "MODEL"}', "/v1/does-not-exist"),
]


def parse_urls(urls: list[str] | str | None) -> dict[str, str]:
    """``--url`` values, ``NAME=URL`` or a bare URL, as {name: url} in the order given."""
    if not urls:
        return {}
    urls = [urls] if isinstance(urls, str) else list(urls)
    out: dict[str, str] = {}
    for i, u in enumerate(urls):
        name, sep, url = u.partition("=")
        if not sep or "://" in name:  # a bare URL (whose query may hold '=')
            name, url = ("external" if len(urls) == 1 else f"server{i + 1}"), u
        name, url = name.strip(), url.strip()
        if not name or not url.startswith(("http://", "https://")) or not urlparse(url).hostname:
            raise ForerunError(f"--url must be URL or NAME=URL with an http(s) URL, got {u!r}")
        if name in out:
            raise ForerunError(f"--url names {name!r} twice")
        out[name] = url
    return out


ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def comparison_table(report: dict) -> str:
    """Markdown: output tokens/s of every server or method at every concurrency level, each with
    its ratio to the best of the others at that level, and its median time to first token."""
    runs = report["methods"]
    levels = sorted({lv["concurrency"] for r in runs.values() for lv in r["levels"]})
    tps = {name: {lv["concurrency"]: lv["output_tokens_per_s"] for lv in r["levels"]} for name, r in runs.items()}
    ttft = {name: {lv["concurrency"]: lv.get("ttft_p50_s") for lv in r["levels"]} for name, r in runs.items()}
    lines = ["| server | " + " | ".join(f"c={c} tokens/s (vs best other), TTFT p50" for c in levels) + " |",
             "|---|" + "---|" * len(levels)]
    for name in runs:
        cells = []
        for c in levels:
            mine = tps[name].get(c)
            others = [t[c] for n, t in tps.items() if n != name and t.get(c)]
            if mine is None:
                cells.append("-")
            else:
                t = ttft[name].get(c)
                cells.append(f"{mine:.1f}" + (f" ({mine / max(others):.2f}x)" if others else "")
                             + (f", {t * 1000:.0f} ms" if t is not None else ""))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def read_extra_body(path: str | None) -> dict | None:
    """``--extra-body FILE``: a JSON object whose fields every request carries."""
    if not path:
        return None
    try:
        with open(path) as f:
            extra = json.load(f)
    except OSError as e:
        raise ForerunError(f"--extra-body {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise ForerunError(f"--extra-body {path} is not valid JSON: {e}") from None
    if not isinstance(extra, dict):
        raise ForerunError(f"--extra-body {path} must hold a JSON object")
    return extra


def load_prompts(path: str | None) -> list[str]:
    if not path:
        return list(BUILTIN_PROMPTS)
    by_cat: dict[str, list[str]] = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                turns = row.get("turns") or []
                if turns and isinstance(turns[0], str) and turns[0].strip():
                    by_cat.setdefault(str(row.get("category", "")), []).append(turns[0])
    if not by_cat:
        raise ForerunError(f"no prompts found in {path}")
    # round-robin over categories, so that any number of requests spans them all
    out = []
    for i in range(max(len(v) for v in by_cat.values())):
        out += [v[i] for v in by_cat.values() if i < len(v)]
    return out


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


class _Client:
    def __init__(self, url: str, api_key: str | None):
        u = urlparse(url)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def get(self, path: str, timeout: float = 10) -> tuple[int, bytes]:
        c = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            c.request("GET", path, headers=self.headers)
            r = c.getresponse()
            return r.status, r.read()
        finally:
            c.close()

    def stream(self, body: dict, timeout: float, path: str = "/v1/completions") -> dict:
        """One streaming completion (or chat completion): status, text, tokens, ttft, per-token latency."""
        t0 = time.perf_counter()
        c = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            c.request("POST", path, body=json.dumps(body), headers=self.headers)
            r = c.getresponse()
            if r.status != 200:
                r.read()
                return {"status": r.status}
            text, tokens, t_first, spec = [], 0, None, None
            while True:
                line = r.fp.readline()
                if not line:
                    break
                line = line.strip()
                if not line.startswith(b"data: "):
                    continue
                data = line[6:]
                if data == b"[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    return {"status": 200, "stream_error": obj["error"].get("message")}
                for ch in obj.get("choices", []):
                    piece = ch.get("text") or (ch.get("delta") or {}).get("content")
                    if piece:
                        if t_first is None:
                            t_first = time.perf_counter()
                        text.append(piece)
                if obj.get("usage"):
                    tokens = obj["usage"]["completion_tokens"]
                    spec = obj["usage"].get("speculative")
            t_end = time.perf_counter()
            return {"status": 200, "text": "".join(text), "tokens": tokens, "latency": t_end - t0,
                    "ttft": (t_first or t_end) - t0,
                    "tpot": (t_end - t_first) / (tokens - 1) if t_first is not None and tokens > 1 else None,
                    "speculative": spec}
        finally:
            c.close()

    def raw(self, path: str, data: bytes, timeout: float) -> int:
        c = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            c.request("POST", path, body=data, headers=self.headers)
            r = c.getresponse()
            r.read()
            return r.status
        finally:
            c.close()


def run_level(url: str, model: str, prompts: list[str], concurrency: int, n_requests: int, *, max_tokens: int,
              temperature: float, invalid_fraction: float = 0.0, time_limit: float = 600.0, api_key: str | None = None,
              on_count=None, seed: int = 0, endpoint: str = "completions", extra_body: dict | None = None) -> dict:
    """``n_requests`` requests from ``concurrency`` client threads; returns the level's figures.
    ``endpoint``: ``completions`` (the prompt sent raw) or ``chat`` (as one user message);
    ``extra_body``: fields every valid request carries besides (e.g. a ``response_format``)."""
    client = _Client(url, api_key)
    rng = random.Random(seed)
    plan = []
    for i in range(n_requests):
        if invalid_fraction and rng.random() < invalid_fraction:
            data, path = rng.choice(INVALID)
            plan.append(("invalid", path, data.replace(b"MODEL", model.encode())))
        else:
            plan.append(("valid", i % len(prompts), None))
    lock = threading.Lock()
    nxt = iter(range(n_requests))
    results: list[dict] = [None] * n_requests  # type: ignore[list-item]
    done = [0]
    t_start = time.perf_counter()
    deadline = t_start + time_limit

    def worker():
        while True:
            with lock:
                i = next(nxt, None)
            if i is None or time.perf_counter() > deadline:
                return
            kind, a, data = plan[i]
            try:
                if kind == "valid":
                    body = {"model": model, "max_tokens": max_tokens, "temperature": temperature,
                            "stream": True, "stream_options": {"include_usage": True}, "seed": i, **(extra_body or {})}
                    if endpoint == "chat":
                        body["messages"] = [{"role": "user", "content": prompts[a]}]
                    else:
                        body["prompt"] = prompts[a]
                    res = client.stream(body, timeout=max(60.0, time_limit), path=ENDPOINTS[endpoint])
                else:
                    res = {"status": client.raw(a, data, timeout=60)}
            except (OSError, http.client.HTTPException, ValueError) as e:
                res = {"status": None, "exception": f"{type(e).__name__}: {e}"}
            res["kind"], res["index"] = kind, a if kind == "valid" else None
            results[i] = res
            with lock:
                done[0] += 1
                if on_count is not None:
                    on_count(done[0])

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t_start
    ran = [r for r in results if r is not None]
    ok = [r for r in ran if r["kind"] == "valid" and r.get("status") == 200 and "text" in r]
    statuses: dict[str, int] = {}
    for r in ran:
        statuses[str(r.get("status"))] = statuses.get(str(r.get("status")), 0) + 1
    tokens = sum(r["tokens"] for r in ok)
    spec = [r["speculative"] for r in ok if r.get("speculative")]
    passes = sum(s["target_passes"] for s in spec)
    return {
        "concurrency": concurrency, "requests": len(ran), "skipped": n_requests - len(ran), "ok": len(ok),
        "invalid_sent": sum(1 for r in ran if r["kind"] == "invalid"),
        "invalid_answered_4xx": sum(1 for r in ran if r["kind"] == "invalid" and r.get("status") and 400 <= r["status"] < 500),
        "status_counts": statuses, "server_errors_5xx": sum(1 for r in ran if r.get("status") and r["status"] >= 500),
        "connection_failures": sum(1 for r in ran if r.get("status") is None),
        "stream_errors": sum(1 for r in ran if r.get("stream_error")),
        "wall_s": wall, "requests_per_s": len(ok) / wall if wall else 0.0, "output_tokens": tokens,
        "output_tokens_per_s": tokens / wall if wall else 0.0,
        "ttft_p50_s": _pct([r["ttft"] for r in ok], 0.5), "ttft_p99_s": _pct([r["ttft"] for r in ok], 0.99),
        "tpot_p50_s": _pct([r["tpot"] for r in ok if r["tpot"]], 0.5),
        "tpot_p99_s": _pct([r["tpot"] for r in ok if r["tpot"]], 0.99),
        "mean_accepted_length": (sum(s["accepted_tokens"] for s in spec) + passes) / passes if passes else None,
        "texts": {str(r["index"]): r["text"] for r in ok},
        **({"valid_json": sum(_is_json(r["text"]) for r in ok)} if extra_body else {}),
    }


def report_name(name: str) -> str:
    """A served model's name as a report keeps it: a path under the home folder written from ``~``
    (llama-server names its model by the file's path), so that a report can be shared."""
    home = os.path.expanduser("~").rstrip(os.sep)
    return "~" + name[len(home):] if home and name.startswith(home + os.sep) else name


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(args, method: str, log) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "forerun", "serve", "--model", args.model, "--method", method, "--port", str(port),
           "--backend", args.backend, "--max-batch", str(args.max_batch), "--max-tokens", str(max(args.max_tokens, 64)),
           "--max-waiting", str(max(64, 4 * args.max_batch))]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    log(f"starting: {' '.join(cmd[1:])}")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    client = _Client(url, args.api_key)
    t0 = time.time()
    while time.time() - t0 < 900:
        if proc.poll() is not None:
            raise ForerunError(f"the server exited with code {proc.returncode}: {proc.stderr.read()[-2000:]}")
        try:
            if client.get("/health", timeout=2)[0] == 200:
                log(f"server up after {time.time() - t0:.0f} s")
                return proc, url
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise ForerunError("the server did not start within 900 s")


def _rss(pid: int | None) -> int | None:
    if pid is None:
        return None
    try:
        import psutil  # the server extra: a client-only install reports no memory

        return psutil.Process(pid).memory_info().rss
    except Exception:  # noqa: BLE001 - no psutil, or the process is gone: no memory figure
        return None


def run_loadtest(args, log=print) -> dict:
    levels = [int(x) for x in str(args.concurrency).split(",") if x.strip()]
    if not levels or any(c < 1 or c > 256 for c in levels):
        raise ForerunError(f"--concurrency must be integers in 1..256, got {args.concurrency!r}")
    if not 0 <= args.invalid_fraction <= 1:
        raise ForerunError(f"--invalid-fraction must be in [0, 1], got {args.invalid_fraction}")
    if args.max_tokens < 1:
        raise ForerunError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.requests is not None and args.requests < 1:
        raise ForerunError(f"--requests must be >= 1, got {args.requests}")
    prompts = load_prompts(args.prompts)
    extra = read_extra_body(getattr(args, "extra_body", None))
    endpoint = getattr(args, "endpoint", "completions")
    if endpoint not in ENDPOINTS:
        raise ForerunError(f"--endpoint must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}")
    servers = parse_urls(args.url)  # name -> URL of running servers, or {} to start our own
    methods = list(servers) if servers else [m for m in args.methods.split(",") if m]
    # running servers say which model they serve (per server, "served_model" below)
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "model": None if servers else args.model,
              "max_tokens": args.max_tokens, "endpoint": ENDPOINTS[endpoint],
              "temperature": args.temperature, "invalid_fraction": args.invalid_fraction, "cpu_count": os.cpu_count(),
              **({"extra_body": extra} if extra else {}),
              "methods": {}}
    for method in methods:
        proc, url = (None, servers[method]) if servers else _start_server(args, method, log)
        try:
            model = args.model
            code, body = _Client(url, args.api_key).get("/v1/models")
            if code == 200:
                model = json.loads(body)["data"][0]["id"]
            out = {"served_model": report_name(model), "levels": []}
            for c in levels:
                n = args.requests or max(26, 4 * c)
                mem = {}

                def on_count(k, pid=proc.pid if proc else None, mem=mem):
                    if k == min(50, n):
                        mem["rss_after_50"] = _rss(pid)
                    if k % 50 == 0:
                        mem.setdefault("rss_every_50", []).append(_rss(pid))

                # one unmeasured request first: the server's first pass pays one-time costs
                run_level(url, model, prompts, 1, 1, max_tokens=4, temperature=0.0, api_key=args.api_key, endpoint=endpoint)
                res = run_level(url, model, prompts, c, n, max_tokens=args.max_tokens, temperature=args.temperature,
                                invalid_fraction=args.invalid_fraction, time_limit=args.time_limit, api_key=args.api_key,
                                on_count=on_count, endpoint=endpoint, extra_body=extra)
                res.update(mem)
                res["rss_end"] = _rss(proc.pid if proc else None)
                res["server_alive"] = proc is None or proc.poll() is None
                log(f"{method} c={c}: {res['ok']}/{res['requests']} ok, {res['output_tokens_per_s']:.1f} tok/s, "
                    f"{res['requests_per_s']:.2f} req/s, TTFT p50 {res['ttft_p50_s'] or 0:.2f} s, "
                    f"per-token p50 {1000 * (res['tpot_p50_s'] or 0):.1f} ms, 5xx {res['server_errors_5xx']}")
                out["levels"].append(res)
            report["methods"][method] = out
        finally:
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    if "none" in report["methods"] and args.temperature == 0:
        base = {lv["concurrency"]: lv for lv in report["methods"]["none"]["levels"]}
        for m, r in report["methods"].items():
            for lv in r["levels"]:
                b = base.get(lv["concurrency"])
                if b and b["output_tokens_per_s"]:
                    lv["vs_none"] = lv["output_tokens_per_s"] / b["output_tokens_per_s"]
                if b:
                    same = [k for k in lv["texts"] if k in b["texts"]]
                    lv["greedy_equal_to_none"] = f"{sum(lv['texts'][k] == b['texts'][k] for k in same)}/{len(same)}"
    if args.temperature == 0:  # greedy output may not depend on the load: each level against the first
        for r in report["methods"].values():
            first = r["levels"][0] if r["levels"] else None
            for lv in r["levels"][1:]:
                same = [k for k in lv["texts"] if k in first["texts"]]
                lv["greedy_equal_to_first_level"] = f"{sum(lv['texts'][k] == first['texts'][k] for k in same)}/{len(same)}"
    if len(report["methods"]) > 1:
        report["table"] = comparison_table(report)
        log(report["table"])
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))

        loadtest_chart(report, Path(args.out).with_suffix(".png"))
    for r in report["methods"].values():
        for lv in r["levels"]:
            lv.pop("texts", None)
    return report
