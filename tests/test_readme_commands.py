"""The README's commands, run as written on the bundled model: a README command that breaks fails CI.

Each block the README marks with ``<!-- readme-test: NAME -->`` is read from the README itself:
- ``serve``: the set-up command's last step (``python -m oscar_compile.runtime.serve``), started
  on a free port (the README's 8000 may be taken);
- ``curl`` and ``openai``: run against that server, with the port put in place of 8000;
- ``cli``: every ``oscar-compile`` line, in a fresh folder (their outputs are relative paths).
The install steps are what CI's fresh venv did (.ci/run).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}
pytestmark = pytest.mark.skipif(not (REPO / "oscar_compile" / "bundled" / "oscar-tiny-qwen3" / "config.json").exists(),
                                reason="the bundled model is not shipped")


def readme_block(name: str) -> str:
    """The fenced block right after ``<!-- readme-test: NAME -->``."""
    match = re.search(rf"<!-- readme-test: {name} -->\n```\w*\n(.*?)\n```", README, re.S)
    assert match, f"README has no block marked readme-test: {name}"
    return match.group(1)


def commands(block: str) -> list[str]:
    """Shell commands of a block: continuation lines joined, comments dropped."""
    joined = block.replace("\\\n", " ")
    return [line.split("  #")[0].strip() for line in joined.splitlines() if line.strip() and not line.startswith("#")]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _cli(command: str) -> list[str]:
    """``oscar-compile ...`` through the installed script, else the module (same arguments)."""
    assert command.startswith("oscar-compile ")
    script = shutil.which("oscar-compile", path=str(Path(sys.executable).parent))
    head = [script] if script else [sys.executable, "-m", "oscar_compile.cli"]
    return head + command.split()[1:]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    setup = commands(readme_block("serve"))
    assert len(setup) == 1
    serve = setup[0].split("&&")[-1].strip()
    assert serve == "python -m oscar_compile.runtime.serve", serve
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, *serve.split()[1:], "--port", str(port)], cwd=REPO, env=ENV,
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                assert time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.5)
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def _on_port(text: str, port: int) -> str:
    return text.replace("localhost:8000", f"127.0.0.1:{port}").replace("127.0.0.1:8000", f"127.0.0.1:{port}")


def test_curl_commands(server):
    completion, metrics = (_on_port(c, server) for c in commands(readme_block("curl")))
    out = subprocess.run(["bash", "-c", completion], capture_output=True, text=True, timeout=120, check=True).stdout
    body = json.loads(out)
    assert body["object"] == "text_completion" and body["choices"][0]["text"], body
    out = subprocess.run(["bash", "-c", metrics], capture_output=True, text=True, timeout=60, check=True).stdout
    assert "oscar_requests_finished_total" in out and "oscar_time_to_first_token_seconds_bucket" in out


def test_openai_snippet(server):
    pytest.importorskip("openai")
    code = _on_port(readme_block("openai"), server)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip()  # the model's answer


def test_cli_commands(tmp_path):
    lines = commands(readme_block("cli"))
    assert [line.split()[1] for line in lines] == ["demo", "calibrate", "eval", "export"]
    for line in lines:
        proc = subprocess.run(_cli(line), cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{line}\n{proc.stderr[-3000:]}"
        if line.startswith("oscar-compile demo"):
            assert re.search(r"INT2 history read at the last step: [1-9]\d* of", proc.stdout), proc.stdout[-2000:]
    assert (tmp_path / "rot.safetensors").is_file()
    results = json.loads((tmp_path / "eval-out" / "results.json").read_text())
    assert list(results["methods"]) == ["bf16", "oscar-int2"] and "1024" in results["perplexity"]
    assert (tmp_path / "compressed-model" / "config.json").is_file()
