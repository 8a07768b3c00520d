"""Plain HTTP to the Ray Serve proxy, and what the tests compare of a response."""

from __future__ import annotations

import http.client
import json

_VOLATILE = ("id", "created")  # differ between any two responses


def post(port: int, path: str, body: dict, timeout: float = 120) -> tuple[int, dict | list[dict | str]]:
    """(status, JSON body) — or, for a stream, (status, its events: JSON dicts and "[DONE]")."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    text = response.read().decode()
    conn.close()
    if body.get("stream") and response.status == 200:
        events = [chunk[len("data: "):] for chunk in text.split("\n\n") if chunk.startswith("data: ")]
        return response.status, [e if e == "[DONE]" else json.loads(e) for e in events]
    return response.status, json.loads(text)


def get(port: int, path: str, timeout: float = 30) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request("GET", path)
    response = conn.getresponse()
    text = response.read().decode()
    conn.close()
    return response.status, text


def stable(payload):
    """``payload`` without its ids and timestamps."""
    if isinstance(payload, list):
        return [stable(p) for p in payload]
    if isinstance(payload, dict):
        return {k: v for k, v in payload.items() if k not in _VOLATILE}
    return payload


def metric_values(text: str, name: str) -> dict[str, float]:
    """``{labels: value}`` of the samples of ``name`` in a Prometheus exposition."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            key, _, value = line.rpartition(" ")
            out[key[len(name):]] = float(value)
    return out
