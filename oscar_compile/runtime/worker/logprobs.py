"""Prompt logprobs: each prompt token's log-probability under the model's logits at the position
before it, its rank, and the k best tokens there (vLLM's ``prompt_logprobs``).

The model's own distribution: a plain log-softmax of the logits, before any penalty, bias or
grammar mask (vLLM's default). The token's logprob and the top-k values are read from the same
float32 tensor, so when the token is the most likely one its logprob and the top-1 value are the
very same number (lm-eval decides greediness by exact float equality).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ScoredTokens:
    """Host values for ``N`` scored positions: ``top_ids`` / ``top_logprobs`` are ``[N][k]``."""

    logprobs: list[float]
    ranks: list[int]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


# the rows scored at once: a [rows, V] float32 block of about 512 MiB (883 rows at Qwen3's
# vocabulary). Whole, an 8192-token step's scoring held its log-softmax and its comparison mask
# beside the logits (10 GiB at Qwen3's vocabulary) and ran past the memory plan's share.
SCORE_BLOCK_BYTES = 1 << 29


@torch.inference_mode()
def score_tokens(logits: torch.Tensor, targets: list[int], k: int, rows: list[int] | None = None) -> ScoredTokens:
    """Logprob and rank of ``targets[n]`` under the logits of row ``rows[n]`` (row ``n`` when
    ``rows`` is None), and the ``k`` best tokens.

    logits: ``[R, V]`` any float dtype (computed in float32); rank 1 is the most likely token
    (1 + the number of tokens strictly more likely, as vLLM counts). Rows are scored a block of
    :data:`SCORE_BLOCK_BYTES` at a time (each row's values do not depend on the block), gathered
    per block: no whole copy of the logits. Reads the values back to the host (one sync).
    """
    if not targets:
        return ScoredTokens([], [], [], [])
    device = logits.device
    step = max(1, SCORE_BLOCK_BYTES // (4 * logits.shape[-1]))
    target = torch.tensor(targets, dtype=torch.int64, device=device)[:, None]  # [N, 1]
    index = torch.tensor(rows, dtype=torch.int64, device=device) if rows is not None else None
    chosen, ranks, top_values, top_ids = [], [], [], []
    for a in range(0, len(targets), step):
        block = logits[a:a + step] if index is None else logits[index[a:a + step]]
        logprobs = torch.log_softmax(block.float(), dim=-1)  # [block, V]
        chosen.append(logprobs.gather(1, target[a:a + step]))  # [block, 1]
        ranks.append((logprobs > chosen[-1]).sum(dim=-1) + 1)
        if k:
            top = logprobs.topk(k, dim=-1)
            top_values.append(top.values)
            top_ids.append(top.indices)
        del block, logprobs  # freed before the next block is made: one block's tensors at a time
    return ScoredTokens(
        logprobs=torch.cat(chosen).squeeze(1).tolist(), ranks=torch.cat(ranks).tolist(),
        top_ids=torch.cat(top_ids).tolist() if k else [[] for _ in targets],
        top_logprobs=torch.cat(top_values).tolist() if k else [[] for _ in targets])
