"""Split a Hugging Face model and its rotations across ``N`` ranks, before ``apply`` rewrites it.

What is taken from where, and why:

- **The plan is transformers' own** (``config.base_model_tp_plan``, e.g. for Qwen3
  ``layers.*.self_attn.q_proj: colwise``, ``o_proj: rowwise``, ``mlp.down_proj: rowwise``, the
  q/k norms ``replicated_with_grad_allreduce``): the same table transformers' ``tp_plan="auto"``
  and vLLM-style engines follow, so a family is split the way its authors declared. A module the
  plan names in a style we do not know is refused.
- **The execution is plain tensors plus one ``torch.distributed.all_reduce`` per row-wise
  projection** (a forward hook on ``o_proj`` and ``down_proj``), not DTensor's
  ``parallelize_module(ColwiseParallel / RowwiseParallel)`` nor transformers' ``tp_plan``
  loading, which both leave DTensor parameters in the modules. ``apply`` then rewrites those
  modules in ways DTensor does not follow. Tried on the bundled model over 2 gloo ranks
  (docs/findings.md, ``git show 9f42812:experiments/...``): the plain HF
  forward runs, but the R_V fold (``R_V(h)^T @ W[h]`` with a plain rotation) stops at
  ``aten.bmm got mixed torch.Tensor and DTensor``, and with ``fuse`` the merged q/k/v weight
  (``merge_projections``: one buffer of the three, each Linear re-pointed at a *view* of it) is a
  DTensor that the traced graph's ``F.linear`` meets with a plain activation (``aten.mm got
  mixed ...``); only the unrotated, unfused model ran. Every pass would need rewriting for
  DTensor, and the config would still claim the whole model's head counts to the cache layout. With
  ``use_local_output`` those layers would hand plain local tensors on anyway: DTensor would only
  add per-op dispatch on the host (what CUDA graphs exist to remove) and hide where the one
  collective per block happens. Slicing first and rewriting after lets every pass, kernel and
  CUDA graph run unchanged on a model that is simply narrower: ``H_q / N`` query heads,
  ``H_kv / N`` KV heads and ``I / N`` MLP columns per rank.
- **Embedding, norms and the LM head are replicated** (the plan leaves the embedding alone and
  transformers' ``lm_head: colwise_gather_output`` is not taken): every rank computes the same
  logits, so no gather is needed and only rank 0 samples.

Head ``j`` of the query projection reads KV head ``j // g``; contiguous chunks of both keep that
pairing inside a rank (rank ``r`` holds query heads ``[r H_q/N, (r+1) H_q/N)`` and KV heads
``[r H_kv/N, (r+1) H_kv/N)``). Rotations follow the KV heads: per-KV-head ones are sliced, a
per-layer one is stored once per head and so is replicated by the same slice, and the R_V fold
then runs per slice (``fold_value_rotation`` on the rank's own heads).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from oscar_compile.architectures import ModelFingerprint, decoder_layers
from oscar_compile.artifact import ArtifactError, Rotations
from oscar_compile.kernels.determinism import is_deterministic

_COLWISE = ("colwise",)  # output features (rows of the weight) split in contiguous chunks
_ROWWISE = ("rowwise",)  # input features split; partial outputs summed over the ranks
_REPLICATED = ("replicated_with_grad_allreduce", "replicate", "replicated")


@dataclass(frozen=True)
class ShardReport:
    """What ``shard_model`` did: the rank, the full model's shape, and the modules split per style."""

    rank: int
    world_size: int
    full: ModelFingerprint
    colwise: int
    rowwise: int

    @property
    def kv_heads(self) -> range:
        """The full model's KV heads this rank holds."""
        per_rank = self.full.num_kv_heads // self.world_size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)


def check_divisible(config, world_size: int) -> None:
    """Refuse a model that ``world_size`` ranks cannot split (before any process starts)."""
    if world_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {world_size}")
    config = config.get_text_config()
    fp = ModelFingerprint.of(config)
    if fp.num_kv_heads % world_size:
        raise ValueError(f"tensor_parallel_size {world_size} does not divide the model's {fp.num_kv_heads} KV heads: "
                         f"each rank holds whole KV heads (and their pages); use a divisor of {fp.num_kv_heads}")
    intermediate = getattr(config, "intermediate_size", None)
    if intermediate is not None and intermediate % world_size:
        raise ValueError(f"tensor_parallel_size {world_size} does not divide the MLP width {intermediate}")
    if not getattr(config, "base_model_tp_plan", None):
        raise NotImplementedError(f"{fp.architecture}: its transformers config declares no base_model_tp_plan, "
                                  "so there is no tensor-parallel split to follow")


def check_rotations_layout(rotations: Rotations, full: ModelFingerprint) -> None:
    """Refuse rotations made for another head layout than the (whole) model being split."""
    diffs = rotations.fingerprint.differences(full)
    if diffs:
        raise ArtifactError("rotations were made for another head layout than this model's (check them against "
                            "the whole model, before it is split across ranks):\n  " + "\n  ".join(diffs))


def _plan(config) -> list[tuple[str, str]]:
    """(attribute path inside a decoder layer, style) from the config's plan."""
    out = []
    for pattern, style in config.base_model_tp_plan.items():
        if not pattern.startswith("layers.*."):
            raise NotImplementedError(f"tensor-parallel plan entry {pattern!r}: only per-layer modules are split")
        if style not in _COLWISE + _ROWWISE + _REPLICATED:
            raise NotImplementedError(f"tensor-parallel plan entry {pattern!r}: style {style!r} is not supported")
        out.append((pattern[len("layers.*."):], style))
    return out


def _chunk(t: torch.Tensor, dim: int, rank: int, world_size: int) -> torch.Tensor:
    size = t.shape[dim] // world_size
    return t.narrow(dim, rank * size, size).contiguous()  # a copy: the full tensor can be freed


@torch.no_grad()
def _split_linear(linear: nn.Linear, style: str, rank: int, world_size: int) -> None:
    if type(linear) is not nn.Linear:
        raise NotImplementedError(f"cannot split a {type(linear).__name__} (only nn.Linear)")
    if style in _COLWISE:
        linear.weight = nn.Parameter(_chunk(linear.weight, 0, rank, world_size), requires_grad=False)
        if linear.bias is not None:
            linear.bias = nn.Parameter(_chunk(linear.bias, 0, rank, world_size), requires_grad=False)
        linear.out_features //= world_size
    else:
        linear.weight = nn.Parameter(_chunk(linear.weight, 1, rank, world_size), requires_grad=False)
        if linear.bias is not None and rank:  # the bias is added once, by rank 0, before the sum
            linear.bias = None
        linear.in_features //= world_size


def sum_in_rank_order(partial: torch.Tensor, group=None) -> torch.Tensor:
    """The sum of every rank's ``partial``, added in rank order: ``((p0 + p1) + p2) + ...``.

    Why: NCCL and gloo pick their all-reduce algorithm (ring, tree) and its chunking from the
    message size, so an element's order of additions, and its last bits, change with the number
    of rows in the step. Gathering the partials and adding them here fixes the order for every
    element and every size (deterministic mode; one all-gather instead of one all-reduce)."""
    import torch.distributed as dist

    parts = [torch.empty_like(partial) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, partial.contiguous(), group=group)
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def _all_reduce_hook(group):
    import torch.distributed as dist

    def hook(module, args, output):
        if is_deterministic():
            return sum_in_rank_order(output, group)
        dist.all_reduce(output, group=group)  # in place: the partial sums of every rank
        return output

    return hook


def shard_model(model: nn.Module, rank: int, world_size: int, group=None) -> ShardReport:
    """Keep rank ``rank``'s slice of every split projection of ``model`` (in place) and narrow its
    config to the per-rank head counts, so ``apply``, the cache layout and the runtime see a
    model of ``H_kv / N`` KV heads. With ``world_size > 1``, ``group`` is the process group the
    row-wise projections all-reduce over. Call before ``apply`` (which refuses a rewritten model
    anyway: the passes must see the narrow projections)."""
    from oscar_compile.passes.apply import is_rewritten

    if is_rewritten(model):
        raise RuntimeError("shard the model before oscar_compile.apply rewrites it")
    config = model.config.get_text_config()
    check_divisible(config, world_size)
    full = ModelFingerprint.of(model)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside [0, {world_size})")
    counts = {"colwise": 0, "rowwise": 0}
    if world_size > 1:
        plan = _plan(config)
        hook = _all_reduce_hook(group)
        for layer in decoder_layers(model):
            for path, style in plan:
                module = layer
                for part in path.split("."):
                    module = getattr(module, part)
                if style in _REPLICATED:
                    continue
                _split_linear(module, style, rank, world_size)
                if style in _ROWWISE:
                    module.register_forward_hook(hook)
                counts["colwise" if style in _COLWISE else "rowwise"] += 1
        config.head_dim = full.head_dim  # kept explicit: head_dim = hidden / heads would now be wrong
        config.num_attention_heads = full.num_heads // world_size
        config.num_key_value_heads = full.num_kv_heads // world_size
        if getattr(config, "intermediate_size", None) is not None:
            config.intermediate_size //= world_size
    return ShardReport(rank, world_size, full, counts["colwise"], counts["rowwise"])


def shard_rotations(rotations: Rotations, rank: int, world_size: int) -> Rotations:
    """Rank ``rank``'s KV heads of every rotation (and of the key means, eigenvalues and
    covariances stored beside them): per-head rotations sliced, per-layer ones replicated."""
    fp = rotations.fingerprint
    if fp.num_kv_heads % world_size:
        raise ValueError(f"tensor_parallel_size {world_size} does not divide the rotations' {fp.num_kv_heads} KV heads")
    if world_size == 1:
        return rotations
    local = dataclasses.replace(fp, num_heads=fp.num_heads // world_size, num_kv_heads=fp.num_kv_heads // world_size)
    return Rotations(spec=rotations.spec, fingerprint=local,
                     k=[_chunk(r, 0, rank, world_size) for r in rotations.k],
                     v=[_chunk(r, 0, rank, world_size) for r in rotations.v],
                     num_tokens=rotations.num_tokens,
                     extras=[{name: _chunk(t, 0, rank, world_size) for name, t in extra.items()}
                             for extra in rotations.extras])
