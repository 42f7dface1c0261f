#!/usr/bin/env python3
"""Load on `folio serve`: N clients at once, each sending M chat requests, and what came back.

Prints one JSON document: requests sent, answered (200), refused as busy (429), anything else
(lost: a connection error, another status), the wall time, answered requests per second, and
the answered requests' latency (mean, median, p90, max) — the mean first: a user feels it.
Standard library only (threads and urllib), so it runs wherever the server does.

  tools/serve_load.py http://127.0.0.1:8642/v1 --model context:samples --clients 16 --requests 4 \
      --question "what is the secret code of amber falcon ?" --max-tokens 16
"""

import argparse
import json
import statistics
import threading
import time
import urllib.error
import urllib.request


def one(base: str, body: bytes) -> tuple[int, float]:
    started = time.perf_counter()
    request = urllib.request.Request(f"{base}/chat/completions", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=600) as r:
            json.load(r)
            status = r.status
    except urllib.error.HTTPError as e:
        json.load(e)
        status = e.code
    except Exception:  # a connection refused, reset or timed out: a lost request
        status = 0
    return status, time.perf_counter() - started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("base")
    p.add_argument("--model", required=True)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--requests", type=int, default=4, help="per client")
    p.add_argument("--question", default="hello")
    p.add_argument("--max-tokens", type=int, default=16)
    a = p.parse_args()
    body = json.dumps({"model": a.model, "temperature": 0, "max_tokens": a.max_tokens,
                       "messages": [{"role": "user", "content": a.question}]}).encode()
    results: list[tuple[int, float]] = []
    lock = threading.Lock()

    def client() -> None:
        for _ in range(a.requests):
            r = one(a.base, body)
            with lock:
                results.append(r)

    started = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(a.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    ok = sorted(s for code, s in results if code == 200)
    busy = sum(1 for code, _ in results if code == 429)
    lost = len(results) - len(ok) - busy
    pct = lambda q: ok[min(len(ok) - 1, round(q * (len(ok) - 1)))] if ok else None
    print(json.dumps({
        "clients": a.clients, "requests": len(results), "answered": len(ok), "busy_429": busy, "lost": lost,
        "wall_s": round(wall, 3), "answered_per_s": round(len(ok) / wall, 2),
        "latency_s": {"mean": round(statistics.fmean(ok), 3) if ok else None, "median": pct(0.5) and round(pct(0.5), 3),
                      "p90": pct(0.9) and round(pct(0.9), 3), "max": ok and round(ok[-1], 3)},
    }))


if __name__ == "__main__":
    main()
