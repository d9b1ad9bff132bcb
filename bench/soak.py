"""A hostile soak of ``forerun serve``: a loadtest with invalid requests mixed in, while other
clients abandon bodies half-sent, trickle bodies byte by byte, hold idle connections and send
oversized headers, and a probe asks ``/health`` twice a second throughout.

    python bench/soak.py [--model smollm2] [--method ngram] [--requests 300] [--concurrency 16]
                         [--invalid-fraction 0.3] [--out FILE.json]

It starts the server itself (``--read-timeout 5``, ``--keep-alive-timeout 2`` so the slow
clients are answered within the run), then reports: 5xx answers on the wire (the loadtest's
count), ``forerun:request_rejected`` by status from ``/metrics``, the server's resident memory
after the first 50 requests and at the end, and how many health probes failed or were slow.
Exit status 1 if any 5xx was seen on the wire or in the metrics, or a health probe failed.
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import subprocess
import sys
import threading
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(port, path, timeout=5.0):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("GET", path)
        r = c.getresponse()
        return r.status, r.read().decode()
    finally:
        c.close()


def hostile(port: int, stop: threading.Event, counts: dict) -> None:
    """Abandoned bodies, trickled bodies, idle connections and 1 MB headers, round after round."""
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 400\r\n\r\n")
    while not stop.is_set():
        for kind in ("abandon", "trickle", "idle", "big-header"):
            if stop.is_set():
                return
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=30)
                if kind == "abandon":
                    s.sendall(head + b'{"model": "x", "prompt": "he')
                    time.sleep(0.05)
                elif kind == "trickle":
                    s.sendall(head)
                    for ch in b'{"model": "x", "prompt": "hello", "max_tokens": 2':
                        s.sendall(bytes([ch]))
                        time.sleep(0.5)
                        if stop.is_set():
                            break
                elif kind == "idle":
                    s.recv(1)  # until the server closes it
                else:
                    try:
                        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n")
                    except OSError:
                        pass
                    s.recv(65536)
                s.close()
                counts[kind] = counts.get(kind, 0) + 1
            except OSError as e:
                counts[f"{kind}: {type(e).__name__}"] = counts.get(f"{kind}: {type(e).__name__}", 0) + 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--method", default="ngram")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--invalid-fraction", type=float, default=0.3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "forerun.cli", "serve", "--model", args.model, "--method", args.method,
                               "--port", str(port), "--threads", str(args.threads), "--max-batch", "8",
                               "--read-timeout", "5", "--keep-alive-timeout", "2"])
    report: dict = {"model": args.model, "method": args.method, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    try:
        for _ in range(600):
            try:
                if get(port, "/health", 1)[0] == 200:
                    break
            except OSError:
                pass
            if server.poll() is not None:
                print("the server did not start", file=sys.stderr)
                return 1
            time.sleep(0.5)
        stop = threading.Event()
        probes = {"ok": 0, "failed": 0, "slowest_s": 0.0}
        import psutil

        rss: list[int] = []

        def probe():
            while not stop.is_set():
                rss.append(psutil.Process(server.pid).memory_info().rss)
                t = time.perf_counter()
                try:
                    ok = get(port, "/health", 10)[0] == 200
                except OSError:
                    ok = False
                probes["ok" if ok else "failed"] += 1
                probes["slowest_s"] = max(probes["slowest_s"], round(time.perf_counter() - t, 3))
                time.sleep(0.5)

        bad: dict = {}
        threads = [threading.Thread(target=probe, daemon=True), threading.Thread(target=hostile, args=(port, stop, bad), daemon=True)]
        for t in threads:
            t.start()
        import tempfile

        tmp = tempfile.mkdtemp(prefix="forerun-soak-")
        lt = subprocess.run([sys.executable, "-m", "forerun.cli", "loadtest", "--url", f"http://127.0.0.1:{port}",
                             "--concurrency", str(args.concurrency), "--requests", str(args.requests),
                             "--invalid-fraction", str(args.invalid_fraction), "--out", f"{tmp}/loadtest.json"],
                            capture_output=True, text=True)
        stop.set()
        for t in threads:
            t.join(timeout=40)
        try:
            with open(f"{tmp}/loadtest.json") as f:
                lt_report = json.load(f)
        except (OSError, ValueError):
            print(lt.stdout[-2000:], lt.stderr[-2000:], file=sys.stderr)
            return 1
        level = next(iter(lt_report["methods"].values()))["levels"][0]
        metrics = get(port, "/metrics")[1]
        rejected = {}
        for line in metrics.splitlines():
            if line.startswith("forerun:request_rejected_total{"):
                rejected[line.split('status="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
        mb = [round(r / 2**20) for r in rss]
        report.update({"loadtest": {k: level.get(k) for k in ("requests", "ok", "invalid_sent", "invalid_answered_4xx",
                                                             "server_errors_5xx", "connection_failures", "stream_errors",
                                                             "status_counts", "output_tokens_per_s", "wall_s") if k in level},
                       "rss_mb": {"first": mb[0] if mb else None, "after_a_quarter": mb[len(mb) // 4] if mb else None,
                                  "max": max(mb) if mb else None, "end": mb[-1] if mb else None},
                       "hostile_clients": bad, "metrics_rejected": rejected, "health_probes": probes})
        print(json.dumps(report, indent=1))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
        wire_5xx = level.get("server_errors_5xx", 0) or 0
        metric_5xx = sum(v for k, v in rejected.items() if k.startswith("5"))
        return 0 if wire_5xx == 0 and metric_5xx == 0 and probes["failed"] == 0 else 1
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    sys.exit(main())
