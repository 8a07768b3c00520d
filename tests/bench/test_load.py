"""The load generator end to end on the CPU: it launches a server (random tiny, or the bundled
model in both modes), loads it closed- or open-loop with streams, whole responses and hang-ups,
stops it with SIGTERM, and accounts for every request."""

from __future__ import annotations

import json
import random

import pytest

pytest.importorskip("uvicorn")

from oscar_compile.bench import load, load_runner  # noqa: E402
from oscar_compile.bench.load_datasets import Workload, server_max_model_len  # noqa: E402
from oscar_compile.bench.load_server import final_stats, server_command  # noqa: E402


def test_a_launched_load_run_accounts_for_every_request(tmp_path, capsys):
    out = tmp_path / "load.json"
    assert load.main(["--launch", "random:tiny", "--server-args", "--device cpu --max-model-len 256 --kv-memory 0.01",
                      "--concurrency", "1", "8", "--num-requests", "16", "--prompt-len", "8:40", "--output-len", "4:16",
                      "--stream-share", "0.6", "--disconnect-share", "0.5", "--max-token-id", "500",
                      "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    (run,) = result["runs"]
    assert [level["concurrency"] for level in run["levels"]] == [1, 8]
    for level in run["levels"]:
        s = level["summary"]
        assert s["requests"] == 16 == s["completed"] + s["disconnected"] + s["errors"]
        assert s["errors"] == 0 and s["errors_by_kind"] == {}
        assert s["output_tokens"] == s["requested_output_tokens"] > 0  # ignore_eos: exactly max_tokens each
        assert 0 < s["ttft_ms"]["p50"] <= s["ttft_ms"]["p99"] and 0 < s["itl_ms"]["p50"] <= s["itl_ms"]["p99"]
        assert level["pages_in_use"] == {"window": 0, "quant": 0} and level["still_running"] == 0
    assert sum(level["summary"]["disconnected"] for level in run["levels"]) > 0
    exit_ = run["server_exit"]
    assert exit_["exit_code"] == 0 and exit_["pages_in_use_at_exit"] == {"window": 0, "quant": 0}
    assert exit_["admitted"] == 8 + 32 and exit_["finished"] == exit_["admitted"]  # warm-up + two levels
    assert "TTFT p50/p90/p99 ms" in capsys.readouterr().out
    assert "--max-model-len" in exit_["command"] and run["served"]["max_model_len"] == 256  # the user's flag wins


def test_both_modes_open_loop_on_the_bundled_model(tmp_path, capsys):
    """--launch bundled --modes int2 bf16 at a request rate: one server per mode, told the
    workload's longest request, every request answered (no 400), steady-state figures in one JSON."""
    out = tmp_path / "load.json"
    assert load.main(["--launch", "bundled", "--modes", "int2", "bf16",
                      "--server-args", "--device cpu --kv-memory 0.05", "--request-rate", "20",
                      "--num-requests", "8", "--prompt-len", "8:24", "--output-len", "4:8",
                      "--stream-share", "1", "--disconnect-share", "0", "--no-warmup", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["max_model_len"] == 32 == server_max_model_len(Workload((8, 24), (4, 8)))
    assert "steady state" in result["steady_state_rule"] and result["plot"].startswith(("wrote", "no plot"))
    assert [run["mode"] for run in result["runs"]] == ["int2", "bf16"]
    for run in result["runs"]:
        assert run["served"]["max_model_len"] == 32  # the server took the workload's context
        (level,) = run["levels"]
        assert (level["mode"], level["request_rate"], level["burstiness"]) == (run["mode"], 20.0, 1.0)
        s = level["summary"]
        assert s["requests"] == s["completed"] == 8 and s["errors_by_kind"] == {}
        for key in ("ttft_ms", "tpot_ms", "itl_ms"):
            assert set(s[key]) == {"mean", "p50", "p90", "p99"} and 0 < s[key]["p50"] <= s[key]["p99"]
        assert {"requests_per_s", "output_tokens_per_s", "total_tokens_per_s", "window_s", "counted",
                "ttft_ms"} <= set(s["steady"])
        assert run["server_exit"]["exit_code"] == 0 and run["server_exit"]["refused"] == 0
    printed = capsys.readouterr().out
    assert "mode int2" in printed and "mode bf16" in printed and "20 req/s" in printed


@pytest.mark.parametrize("url", ["http://10.0.0.1:8000", "http://example.com", "https://127.0.0.1:8000"])
def test_only_loopback_servers_are_loaded(url):
    with pytest.raises(ValueError, match="only targets"):
        load.loopback_target(url, None)
    assert load.main(["--url", url, "--num-requests", "1"]) == 2


def test_loopback_urls_and_launch_commands():
    assert load.loopback_target("http://127.0.0.1:9000", "k") == load.Target("127.0.0.1", 9000, "k")
    assert load.loopback_target("http://localhost:9000", None).host == "localhost"
    assert load.loopback_target("http://[::1]:9000", None).host == "::1"
    assert server_command("random:8b", 5, ["--kv-memory", "40"])[2:] == [
        "oscar_compile.bench.serve_random", "--shape", "8b", "--host", "127.0.0.1", "--port", "5", "--kv-memory", "40"]
    assert server_command("bundled", 5, [])[2] == "oscar_compile.runtime.serve"
    with pytest.raises(ValueError, match="--launch takes"):
        server_command("/no/such/dir", 5, [])


def test_workload_draws_within_its_ranges_and_refuses_bad_ones():
    workload = Workload(prompt_len=(3, 5), output_len=(2, 2), stream_share=1.0, disconnect_share=1.0,
                             max_token_id=7)
    rng = random.Random(0)
    for _ in range(50):
        body, record, hang_up = workload.draw(rng, "m")
        assert 3 <= len(body["prompt"]) <= 5 and all(1 <= t < 7 for t in body["prompt"])
        assert body["max_tokens"] == 2 and body["stream"] and hang_up == 1 and record.stream
    with pytest.raises(ValueError, match="prompt_len"):
        Workload(prompt_len=(5, 3))
    with pytest.raises(ValueError, match="stream_share"):
        Workload(stream_share=1.5)


def test_level_flags():
    levels = load.levels_of(load.parse_args(["--request-rate", "2", "inf", "--burstiness", "0.5"]))
    assert levels == [load_runner.Level(request_rate=2.0, burstiness=0.5),
                      load_runner.Level(request_rate=float("inf"), burstiness=0.5)]
    assert load.levels_of(load.parse_args([])) == [load_runner.Level(concurrency=c) for c in (1, 16, 64)]
    both = load.levels_of(load.parse_args(["--concurrency", "4", "--request-rate", "1"]))
    assert [(lv.concurrency, lv.request_rate) for lv in both] == [(4, None), (None, 1.0)]
    with pytest.raises(ValueError, match="--num-requests"):
        load.levels_of(load.parse_args(["--request-rate", "inf", "--duration", "10"]))
    assert load.main(["--request-rate", "0"]) == 2
    with pytest.raises(SystemExit):  # --modes launches its servers
        load.parse_args(["--modes", "int2", "bf16"])


def test_final_log_line_is_parsed():
    line = ("x INFO oscar_compile.runtime.server.app: stopped: 9 HTTP requests admitted, 2 refused; "
            "9 requests (one per prompt) finished (3 aborted); KV pages in use: 0 window, 1 quant")
    assert final_stats(line) == {"admitted": 9, "refused": 2, "finished": 9, "aborted": 3,
                                 "pages_in_use_at_exit": {"window": 0, "quant": 1}}
    assert final_stats("nothing") is None


def test_a_level_prints_progress_while_it_runs(monkeypatch):
    """A level of minutes is not silent: ``progress`` gets a line every ``progress_every_s``."""
    import asyncio

    async def slow_complete(host, port, body, record, api_key, hang_up, timeout):
        await asyncio.sleep(0.05)
        record.outcome, record.end, record.num_output_tokens = "completed", 1.0, 3

    monkeypatch.setattr(load_runner, "complete", slow_complete)
    workload = Workload((4, 8), (2, 4), 0.0, 0.0, 100)
    lines: list[str] = []
    records, _ = asyncio.run(load_runner.run_level(load.Target("127.0.0.1", 1), "m", workload, 2, 8, None,
                                                   random.Random(0), progress=lines.append, progress_every_s=0.04))
    assert len(records) == 8 and len(lines) >= 2
    assert lines[0].startswith("  concurrency 2: 0 s, ") and "sending ends at 8 requests" in lines[-1]
    assert "8 requests sent, 8 done (0 errors), 24 output tokens" in load_runner.progress_line(
        "concurrency 2", records, 1.0, 120.0, None)
    # an open level: the same line, named by its rate, while the schedule sends
    lines.clear()
    level = load_runner.Level(request_rate=100.0)
    records, _ = asyncio.run(load_runner.run_open_level(load.Target("127.0.0.1", 1), "m", workload, level, 10, None,
                                                        random.Random(0), 0, progress=lines.append,
                                                        progress_every_s=0.03))
    assert len(records) == 10 and lines and lines[0].startswith("  100 req/s: 0 s, ")
