"""``sweep(...)``: per-layer sensitivity, then the mixed-precision spec that fits a bit budget.

1. Calibrate the base spec once (or load ``<rotations_dir>/<spec>.safetensors``), on the
   calibration split.
2. On held-out windows (the *end* of the held-out file, sensitivity.tail_windows; the file must
   differ from the calibration one), measure the continuation's KL to BF16 with the base spec,
   then with each layer alone stored in each other affordable format (formats.py: INT4, 16-bit,
   optionally smaller groups): a layer's gain for a format is the drop of that KL.
   Keys and values are measured together: the spec, the cache and the kernels store both at one
   precision per layer, so a split they cannot serve is not offered.
3. Choose one format per layer maximising the summed gain with the average asymptotic bits per
   element at most the budget: an exact knapsack (allocation.py).
4. Measure the chosen spec on the same windows (predicted KL = base KL - summed gains, against
   the measured one: the check that the single-layer gains add up).

Same inputs and seed give the same spec: the windows are fixed, calibration and the
measurements are deterministic (``torch.manual_seed(seed)`` before calibrating covers OptR), and
the knapsack breaks ties by cost, then by layer order.
"""
from __future__ import annotations

import datetime
import logging
import time
from dataclasses import asdict, dataclass
from fractions import Fraction
from pathlib import Path
from typing import Optional, Sequence

import torch

from ..architectures import ModelFingerprint
from ..loading import load_model, resolve_device
from .allocation import BudgetError, Choice, allocate, budget_units
from .formats import UPGRADE_BITS, Format, layer_formats, resolved_layers, with_format, with_formats
from .heldout import bos_id, read_tokens, resolve_paths
from .methods import Method, resolve_method
from .prepare import method_rotations
from .quantizers import spec_quantizers
from .sensitivity import continuation_divergence, tail_windows

logger = logging.getLogger(__name__)
FORMAT = "oscar_compile.sweep"
FORMAT_VERSION = 1


@dataclass
class SweepConfig:
    """Everything ``sweep`` reads. ``spec``: a spec .yaml or a shipped spec name.

    budget: average bits per element of the history over layers (asymptotic, as ``eval``'s column).
    context: window length in tokens (BOS included); scored_tokens: the continuation scored.
    num_windows: held-out windows (taken from the end of the data file).
    upgrade_bits / group_sizes: the formats offered on top of each layer's base format.
    calib_tokens: cap on the spec's calibration tokens (quick runs).
    """

    spec: str = "oscar-int2"
    budget: float | str = 2.5
    model: Optional[str] = None
    data: Optional[str] = None
    calib: Optional[str] = None
    rotations_dir: Optional[str] = None
    context: int = 4096
    scored_tokens: int = 256
    num_windows: int = 8
    batch_size: int = 1
    upgrade_bits: tuple[int, ...] = UPGRADE_BITS
    group_sizes: tuple[int, ...] = ()
    calib_tokens: Optional[int] = None
    device: str = "auto"
    dtype: str = "auto"
    seed: int = 0
    progress: bool = False

    def __post_init__(self) -> None:
        self.upgrade_bits, self.group_sizes = tuple(self.upgrade_bits), tuple(self.group_sizes)
        try:
            if Fraction(str(self.budget)) <= 0:
                raise ValueError
        except ValueError:
            raise ValueError(f"the budget must be a positive number of bits per element, got {self.budget!r}") from None
        if not 0 < self.scored_tokens < self.context:
            raise ValueError(f"scored_tokens ({self.scored_tokens}) must lie between 1 and context - 1 ({self.context - 1})")
        for name in ("num_windows", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        bad = [b for b in self.upgrade_bits if b not in (4, 16)]
        if bad:
            raise ValueError(f"upgrade bits must be 4 or 16, got {bad}")


def _choices(formats: list[list[Format]], floor: int, budget: int) -> list[list[tuple[Format, bool]]]:
    """(format, affordable) per layer: a format whose extra cost alone exceeds the slack is never measured."""
    slack = budget - floor
    return [[(f, f.cost - layer[0].cost <= slack) for f in layer] for layer in formats]


def plan(spec_name: str, budget, head_dim: int, num_layers: int, upgrade_bits=UPGRADE_BITS,
         group_sizes: Sequence[int] = ()) -> tuple[Method, list[list[Format]], int, int]:
    """(method, formats per layer, floor, budget) in bits per row summed over layers; checks the budget.

    Raises :class:`BudgetError` when the budget is below the base formats' cost (the 2-bit codes
    plus their scales, for an INT2 spec), before any model is loaded.
    """
    method = resolve_method(spec_name)
    if method.spec is None:
        raise ValueError(f"{spec_name}: the sweep starts from a compression spec, not the KIVI baseline")
    formats = [layer_formats(method.spec, i, head_dim, num_layers, upgrade_bits, group_sizes) for i in range(num_layers)]
    if all(f[0].bits == 16 for f in formats):
        raise ValueError(f"{spec_name} quantizes no layer: there is nothing to allocate")
    floor = sum(f[0].cost for f in formats)
    units = budget_units(budget, head_dim, num_layers)
    if units < floor:
        raise BudgetError(f"budget {budget} bits per element is below what {method.name} costs at its cheapest: "
                          f"{floor / (head_dim * num_layers):g} bits per element (its base formats, "
                          f"{', '.join(sorted({f[0].name for f in formats}))}, codes plus fp16 scale and zero per group)")
    return method, formats, floor, units


def sweep(config: Optional[SweepConfig] = None, out: Optional[str | Path] = None, **settings) -> dict:
    """Run the sweep; returns the results dict (with ``"spec"``: the mixed CompressionSpec).

    With ``out`` (a ``.yaml`` path) writes the spec there and ``.json`` / ``.md`` / ``.png``
    beside it (sweep_report.py). Pass a :class:`SweepConfig` or its fields as keywords.
    """
    if config is not None and settings:
        raise TypeError("pass either a SweepConfig or keyword settings, not both")
    cfg = config if config is not None else SweepConfig(**settings)
    t0 = time.time()
    model_dir, data_path, calib_path = resolve_paths(cfg.model, cfg.data, cfg.calib)  # refuses data == calib
    from transformers import AutoConfig

    fp = ModelFingerprint.of(AutoConfig.from_pretrained(model_dir))
    method, formats, floor, units = plan(cfg.spec, cfg.budget, fp.head_dim, fp.num_layers, cfg.upgrade_bits,
                                         cfg.group_sizes)
    model, tokenizer = load_model(model_dir, resolve_device(cfg.device), cfg.dtype, tokenizer_required=False)
    bos = bos_id(model, tokenizer)
    torch.manual_seed(cfg.seed)
    rot_dir = None if cfg.rotations_dir is None else Path(cfg.rotations_dir)
    rotations, rot_note = method_rotations(model, method, rot_dir, lambda: read_tokens(calib_path, tokenizer), bos,
                                           None, cfg.progress, cfg.calib_tokens)
    windows = tail_windows(read_tokens(data_path, tokenizer), cfg.context, cfg.num_windows, bos)
    device = next(model.parameters()).device

    def quantizers(spec):
        return spec_quantizers(resolved_layers(spec, fp.head_dim, fp.num_layers), rotations, fp.head_dim, device)

    base = quantizers(method.spec)
    probes = {"base": base}
    choices = _choices(formats, floor, units)
    for i, layer in enumerate(choices):
        for j, (fmt, affordable) in enumerate(layer):
            if j and affordable:
                probes[(i, j)] = base[:i] + quantizers(with_format(method.spec, i, fmt))[i:i + 1] + base[i + 1:]
    measured = continuation_divergence(model, probes, windows, cfg.scored_tokens, cfg.batch_size, cfg.progress,
                                       desc="sweep: layer sensitivity")
    kl_base = measured["base"]["kl"]
    table = [[Choice(fmt.cost, 0.0 if j == 0 else (kl_base - measured[(i, j)]["kl"] if (i, j) in measured else None))
              for j, (fmt, _) in enumerate(layer)] for i, layer in enumerate(choices)]
    picked = allocate(table, units)
    mixed = with_formats(method.spec, {i: formats[i][j] for i, j in enumerate(picked)})
    check = continuation_divergence(model, {"mixed": quantizers(mixed)}, windows, cfg.scored_tokens, cfg.batch_size,
                                    cfg.progress, desc="sweep: chosen spec")["mixed"]
    results = {
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": str(model_dir), "fingerprint": asdict(fp), "data": str(data_path), "calib": str(calib_path),
        "device": str(device), "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "settings": {k: v for k, v in asdict(cfg).items() if k != "progress"} | {"budget": str(cfg.budget)},
        "base": {"name": method.name, "source": method.source, "rotations": rot_note, "kl": kl_base,
                 "nll": measured["base"]["nll"]},
        "measure": "KL(p_bf16 || p) of the next-token distribution, nats per scored token",
        "windows": {"count": int(windows.shape[0]), "context": cfg.context, "scored_tokens": cfg.scored_tokens,
                    "taken_from": "the end of the data file"},
        "budget": {"bits_per_element": float(Fraction(str(cfg.budget))), "row_bits_total": units,
                   "floor_bits_per_element": floor / (fp.head_dim * fp.num_layers)},
        "layers": [_layer_row(i, layer, picked[i], measured, kl_base) for i, layer in enumerate(choices)],
        "chosen": {"bits_per_element": sum(formats[i][j].cost for i, j in enumerate(picked)) / (fp.head_dim * fp.num_layers),
                   "predicted_kl": kl_base - sum(table[i][j].gain for i, j in enumerate(picked)),
                   "kl": check["kl"], "nll": check["nll"]},
        "spec": mixed,
    }
    results["runtime_s"] = time.time() - t0
    if out is not None:
        from .sweep_report import write_sweep_outputs

        results["files"] = write_sweep_outputs(results, Path(out))
    return results


def _layer_row(i: int, layer, picked: int, measured: dict, kl_base: float) -> dict:
    options = []
    for j, (fmt, affordable) in enumerate(layer):
        entry = {"format": fmt.name, "bits": fmt.bits, "group_size": fmt.group_size, "row_bits": fmt.cost}
        if j == 0:
            entry.update(kl=kl_base, gain=0.0)
        elif (i, j) in measured:
            m = measured[(i, j)]
            entry.update(kl=m["kl"], gain=kl_base - m["kl"], nll=m["nll"])
        else:
            entry.update(kl=None, gain=None, skipped="its extra bits alone exceed the budget")
        options.append(entry)
    return {"layer": i, "options": options, "chosen": layer[picked][0].name}


__all__ = ["BudgetError", "SweepConfig", "plan", "sweep"]
