"""The settings of one evaluation run, checked up front so a bad value fails before any model loads."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from ..formats.prefill import DEFAULT_PREFILL_SEMANTICS, check_prefill_semantics
from .names import DEFAULT_METHODS, NEEDLE_MODES, TASKS


@dataclass
class EvalConfig:
    """Everything ``evaluate`` reads. Paths left None default to the bundled model and its splits.

    contexts: window lengths C (tokens, BOS included) for perplexity, agreement and needle.
    num_samples: held-out windows per context (perplexity, agreement) and for the layer metrics.
    ppl_tokens: continuation tokens scored per window (the rest is prefilled).
    gen_tokens: BF16 greedy tokens per agreement prompt.
    metrics_context: window length of the per-layer metrics (None: the largest context).
    metric_queries: last query positions scored by the per-layer metrics.
    needle_per_cell: prompts per (length, depth) cell; 0 skips the needle task.
    calib_tokens: cap on every spec's ``calibration.num_tokens`` (and seq_len), for quick runs.
    prefill_semantics: what prompt tokens read from the cache (formats/prefill.py), as the
    engine's ``--prefill-semantics`` and with its default (decode-consistent): the measured model
    is the served one.
    """

    model: str | None = None
    specs: tuple[str, ...] = DEFAULT_METHODS
    contexts: tuple[int, ...] = (1024, 2048, 4096)
    rotations_dir: str | None = None
    calib: str | None = None
    data: str | None = None
    out: str | None = None
    num_samples: int = 8
    device: str = "auto"
    dtype: str = "auto"
    ppl_tokens: int = 256
    gen_tokens: int = 64
    metrics_context: int | None = None
    metric_queries: int = 128
    needle_per_cell: int = 20
    needle_depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    needle_mode: str = "context"
    batch_size: int = 4
    calib_tokens: int | None = None
    tasks: tuple[str, ...] = TASKS
    prefill_semantics: str = DEFAULT_PREFILL_SEMANTICS
    seed: int = 0
    progress: bool = False
    deterministic: bool = False

    def __post_init__(self) -> None:
        self.specs, self.contexts = tuple(self.specs), tuple(int(c) for c in self.contexts)
        self.needle_depths, self.tasks = tuple(float(d) for d in self.needle_depths), tuple(self.tasks)
        if not self.contexts or min(self.contexts) < 2:
            raise ValueError(f"contexts must be lengths of at least 2 tokens, got {self.contexts}")
        for name in ("num_samples", "ppl_tokens", "gen_tokens", "metric_queries", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.calib_tokens is not None and self.calib_tokens < 2:
            raise ValueError(f"calib_tokens must be at least 2, got {self.calib_tokens}")
        if self.needle_per_cell < 0:
            raise ValueError(f"needle_per_cell must be >= 0, got {self.needle_per_cell}")
        if any(not 0.0 <= d <= 1.0 for d in self.needle_depths):
            raise ValueError(f"needle depths must lie in [0, 1], got {self.needle_depths}")
        if self.needle_mode not in NEEDLE_MODES:
            raise ValueError(f"needle_mode must be one of {NEEDLE_MODES}, got {self.needle_mode!r}")
        check_prefill_semantics(self.prefill_semantics)
        unknown = set(self.tasks) - set(TASKS)
        if unknown:
            raise ValueError(f"unknown tasks {sorted(unknown)}; choose from {TASKS}")
        shortest = min(self.contexts)
        for task, name in (("perplexity", "ppl_tokens"), ("agreement", "gen_tokens")):
            if task in self.tasks and getattr(self, name) >= shortest:
                raise ValueError(f"{name} ({getattr(self, name)}) must be shorter than the shortest context "
                                 f"({shortest})")
        if "layers" in self.tasks and self.metric_queries >= self.layers_context:
            raise ValueError(f"metric_queries ({self.metric_queries}) must be shorter than the metrics context "
                             f"({self.layers_context})")

    @property
    def layers_context(self) -> int:
        return self.metrics_context if self.metrics_context is not None else max(self.contexts)

    @property
    def out_dir(self) -> Path | None:
        return None if self.out is None else Path(self.out)

    def to_dict(self) -> dict:
        return asdict(self)
