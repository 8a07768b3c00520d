"""The prefix-hit measurement on the bundled model (one short window, CPU)."""
import math

from oscar_compile.evaluation.prefix_hits import run


def test_a_miss_scores_the_prompt_as_bf16_and_a_hit_reads_the_prefix_quantized():
    result = run(None, "oscar-int2", prefix=448, continuation=32, num_windows=1)  # history [64, 192)
    ppl = result["perplexity"]
    assert all(math.isfinite(v) and v > 1 for v in ppl.values())
    # one forward over the whole window reads nothing back quantized: the rotations alone,
    # orthogonal, change the logits by float32 rounding only
    assert abs(result["miss_vs_bf16"]) < 1e-4
    assert result["hit_vs_miss"] > 1e-3  # the hit read the prefix's history back in INT2 (+2.6 % here)
