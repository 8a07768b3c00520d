"""``bench.parallel_sampling`` runs end to end on the bundled model (CPU, a short prompt)."""

from oscar_compile.bench.parallel_sampling import main


def test_one_request_of_n_runs_the_prompt_once_and_gives_the_tokens_of_n_requests(tmp_path):
    rows = main(["--prompt-len", "40", "--n", "3", "--max-tokens", "4", "--out", str(tmp_path / "rows.json")])
    one, separate = rows
    assert one["batched_tokens"] == 40 + 3 * 3 and separate["batched_tokens"] == 3 * 40 + 3 * 3
    assert one["same_tokens"] and separate["same_tokens"]
    assert one["peak_window_pages"] < separate["peak_window_pages"]  # the sink pages held once
    assert (tmp_path / "rows.json").exists()
