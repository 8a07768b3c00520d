"""``CompressedModel``: what :func:`~oscar_compile.passes.apply` returns, handed on explicitly.

``apply`` rewrites the model in place (as torchao's ``quantize_`` does), so the model stays the
object one calls and ``generate()``s. What the rewrite produced besides the model's own code
travels in this handle instead of on the model: the report, each layer's cache format, the
constants its graph passes the INT-b ops, and the prefill semantics its ``generate()`` reads.
``compress()`` gives it to the runtime's runner, the benches read the report from it, and the
forward pre-hook that ``apply`` installs closes over it.

It does not stand in for the model (no attribute access or ``__call__`` passed on): the handle
and the module it describes stay two objects, and ``handle.model`` is the module.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from torch import nn

from ..cache.op_constants import OpConstants
from ..formats.cache import LayerFormat
from ..formats.prefill import DECODE_CONSISTENT, DEFAULT_PREFILL_SEMANTICS, check_prefill_semantics
from .report import ApplyReport


@dataclass(eq=False)
class CompressedModel:
    """A model rewritten by ``apply`` and what the rewrite made.

    - ``model``: the rewritten module (the same object ``apply`` was given).
    - ``report``: what was done per layer (:class:`~oscar_compile.passes.report.ApplyReport`;
      ``print(handle)`` prints its table).
    - ``formats``: layer ``i``'s cache format, as the ``generate()`` cache and the runtime
      allocate its pages.
    - ``constants``: layer index -> the scale and clip ratios its graph passes the INT-b ops, read
      back from the rewritten graph (cache/op_constants.py); the INT-b layers only. Code that runs
      a layer's ops beside its graph (staged rows, decode-consistent prefill) passes these.
    - ``attention_cores``: layer index -> the calls its graph makes between its two cache nodes
      (cache/attention_core.py), which the runtime's piecewise CUDA graphs run between their
      pieces; a layer whose graph has no such core is missing, and its steps run eagerly.
    - ``prefill_semantics``: what prompt tokens of ``generate()`` and ``model(..., use_cache=True)``
      read (formats/prefill.py); change it with :meth:`set_prefill_semantics`.
    """

    model: nn.Module = field(repr=False)
    report: ApplyReport = field(repr=False)
    formats: tuple[LayerFormat, ...]
    constants: Mapping[int, OpConstants] = field(repr=False)
    attention_cores: Mapping[int, Callable] = field(default_factory=dict, repr=False)
    prefill_semantics: str = DEFAULT_PREFILL_SEMANTICS

    def __post_init__(self):
        check_prefill_semantics(self.prefill_semantics)

    def set_prefill_semantics(self, semantics: str) -> None:
        """``decode-consistent`` (the default, the engine's) or ``prompt-exact``, for the caches the
        model's forward creates from now on (a cache already returned keeps its own)."""
        self.prefill_semantics = check_prefill_semantics(semantics)

    @property
    def decode_consistent(self) -> Mapping[int, OpConstants] | None:
        """What :class:`~oscar_compile.cache.hf_cache.OscarCache` takes: the op constants under
        decode-consistent prefill, None under prompt-exact."""
        return self.constants if self.prefill_semantics == DECODE_CONSISTENT else None

    def __str__(self) -> str:
        return str(self.report)
