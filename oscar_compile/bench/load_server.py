"""The server the load generator starts for itself: a child process on a free loopback port.

A separate process, not a thread: the figures must not include the load generator's own work on
the server's interpreter, and SIGTERM at the end exercises the real graceful shutdown, whose
final log line says how many KV pages were still in use when the process exited.
"""

from __future__ import annotations

import http.client
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from oscar_compile.spec import specs_dir

MODES = ("int2", "bf16")
# the server's last log line (server/app.py): HTTP requests admitted and refused, then requests
# (one per prompt) finished and aborted
FINAL_LINE = re.compile(r"stopped: (\d+) HTTP requests admitted, (\d+) refused; (\d+) requests \(one per prompt\) "
                        r"finished \((\d+) aborted\); KV pages in use: (\d+) window, (\d+) quant")


def server_command(launch: str, port: int, extra_args: list[str]) -> list[str]:
    """``bundled``, ``random:<shape>`` or a model directory -> the command that serves it."""
    if launch == "bundled":
        cmd = [sys.executable, "-m", "oscar_compile.runtime.serve"]
    elif launch.startswith("random:"):
        cmd = [sys.executable, "-m", "oscar_compile.bench.serve_random", "--shape", launch.split(":", 1)[1]]
    elif Path(launch).is_dir():
        cmd = [sys.executable, "-m", "oscar_compile.runtime.serve", "--model", launch]
    else:
        raise ValueError(f"--launch takes bundled, random:<shape> or a model directory, got {launch!r}")
    return cmd + ["--host", "127.0.0.1", "--port", str(port), *extra_args]


def mode_args(launch: str, mode: str | None) -> list[str]:
    """The flags that serve ``launch`` in ``mode`` (int2 or bf16; None: the server's default).

    ``random:<shape>``: its ``--mode``. The bundled model: the shipped OSCAR INT2 spec and
    rotations, or the BF16 spec. A model directory: Hadamard INT2 (needs no calibration), or BF16."""
    if mode is None:
        return []
    if mode not in MODES:
        raise ValueError(f"--modes takes {' and '.join(MODES)}, got {mode!r}")
    if launch.startswith("random:"):
        return ["--mode", mode]
    name = "bf16" if mode == "bf16" else "oscar-int2" if launch == "bundled" else "hadamard-int2"
    return ["--spec", str(specs_dir() / f"{name}.yaml")]


def launch_args(launch: str, mode: str | None, server_args: list[str], max_model_len: int) -> list[str]:
    """The flags after the port: the mode's, ``--max-model-len`` (the workload's longest request,
    unless ``server_args`` sets it), then ``server_args``."""
    given = any(a == "--max-model-len" or a.startswith("--max-model-len=") for a in server_args)
    context = [] if given else ["--max-model-len", str(max_model_len)]
    return [*mode_args(launch, mode), *context, *server_args]


def final_stats(log: str) -> dict | None:
    found = FINAL_LINE.findall(log)
    if not found:
        return None
    admitted, refused, finished, aborted, window, quant = (int(x) for x in found[-1])
    return {"admitted": admitted, "refused": refused, "finished": finished, "aborted": aborted,
            "pages_in_use_at_exit": {"window": window, "quant": quant}}


class LaunchedServer:
    def __init__(self, launch: str, extra_args: list[str], api_key: str | None, log_path: Path,
                 startup_timeout_s: float = 1200.0):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.command = server_command(launch, self.port, extra_args)
        self.log_path = log_path
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if api_key:
            env["OSCAR_API_KEY"] = api_key  # not on the command line, where ps would show it
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + startup_timeout_s
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start; see {self.log_path}")
            time.sleep(0.5)

    def _healthy(self) -> bool:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
            conn.request("GET", "/health")
            return conn.getresponse().status == 200
        except OSError:
            return False

    def stop(self, timeout_s: float = 120.0) -> dict:
        """SIGTERM, wait for the drain; what the server said on the way out."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        stats = final_stats(self.log_path.read_text(errors="replace"))
        return {"exit_code": self.proc.returncode, "log": str(self.log_path), "command": self.command,
                **(stats or {"pages_in_use_at_exit": None})}
