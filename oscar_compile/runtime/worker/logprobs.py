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


@torch.inference_mode()
def score_tokens(logits: torch.Tensor, targets: list[int], k: int) -> ScoredTokens:
    """Logprob and rank of ``targets[n]`` under ``logits[n]``, and the ``k`` best tokens.

    logits: ``[N, V]`` any float dtype (computed in float32); rank 1 is the most likely token
    (1 + the number of tokens strictly more likely, as vLLM counts). Reads the values back to
    the host (one sync).
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    target = torch.tensor(targets, dtype=torch.int64, device=logits.device)[:, None]  # [N, 1]
    chosen = logprobs.gather(1, target)  # [N, 1]
    ranks = (logprobs > chosen).sum(dim=-1) + 1  # [N]
    top = logprobs.topk(k, dim=-1) if k else None
    return ScoredTokens(
        logprobs=chosen.squeeze(1).tolist(), ranks=ranks.tolist(),
        top_ids=top.indices.tolist() if top is not None else [[] for _ in targets],
        top_logprobs=top.values.tolist() if top is not None else [[] for _ in targets])
