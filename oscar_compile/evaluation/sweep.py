"""``sweep(...)``: per-layer sensitivity, then the mixed-precision spec that fits a bit budget.

1. Calibrate the base spec once (or load ``<rotations_dir>/<spec>.safetensors``), on the
   calibration split.
2. On held-out windows (the *end* of the held-out file, sensitivity.tail_windows; the file must
   differ from the calibration one), measure the continuation's KL to BF16 with the base spec,
   then with each layer alone stored in each other affordable format (mixed_precision.py: INT4, 16-bit,
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

import dataclasses
import datetime
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from fractions import Fraction
from pathlib import Path

import torch

from ..architectures import ModelFingerprint
from ..loading import load_model, resolve_device
from ..spec_fit import fit_spec
from .allocation import BudgetError, Choice, allocate, budget_units
from .heldout import bos_id, read_tokens, resolve_paths
from .methods import Method, resolve_method
from .mixed_precision import UPGRADE_BITS, Format, layer_formats, resolved_layers, with_format, with_formats
from .prepare import method_rotations
from .quantizers import spec_quantizers
from .sensitivity import continuation_divergence, reference_logprobs, reference_nll, tail_windows

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
    model: str | None = None
    data: str | None = None
    calib: str | None = None
    rotations_dir: str | None = None
    context: int = 4096
    scored_tokens: int = 256
    num_windows: int = 8
    batch_size: int = 1
    upgrade_bits: tuple[int, ...] = UPGRADE_BITS
    group_sizes: tuple[int, ...] = ()
    calib_tokens: int | None = None
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
            raise ValueError(f"scored_tokens ({self.scored_tokens}) must lie between 1 and context - 1 "
                             f"({self.context - 1})")
        for name in ("num_windows", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        bad = [b for b in self.upgrade_bits if b not in (4, 16)]
        if bad:
            raise ValueError(f"upgrade bits must be 4 or 16, got {bad}")


def plan(spec_name: str, budget, head_dim: int, num_layers: int, upgrade_bits=UPGRADE_BITS,
         group_sizes: Sequence[int] = ()) -> tuple[Method, list[list[Format]], int, int]:
    """(method, formats per layer, floor, budget) in bits per row summed over layers; checks the budget.

    The method's spec comes back fitted to the model (the sweep's one fit). Raises :class:`BudgetError`
    when the budget is below the base formats' cost (the 2-bit codes plus their scales, for an INT2 spec),
    before any model is loaded.
    """
    method = resolve_method(spec_name)
    if method.spec is None:
        raise ValueError(f"{spec_name}: the sweep starts from a compression spec, not the KIVI baseline")
    method = dataclasses.replace(method, spec=fit_spec(method.spec, head_dim, num_layers))
    formats = [layer_formats(method.spec, i, head_dim, num_layers, upgrade_bits, group_sizes)
               for i in range(num_layers)]
    if all(f[0].bits == 16 for f in formats):
        raise ValueError(f"{spec_name} quantizes no layer: there is nothing to allocate")
    floor = sum(f[0].cost for f in formats)
    units = budget_units(budget, head_dim, num_layers)
    if units < floor:
        raise BudgetError(f"budget {budget} bits per element is below what {method.name} costs at its cheapest: "
                          f"{floor / (head_dim * num_layers):g} bits per element (its base formats, "
                          f"{', '.join(sorted({f[0].name for f in formats}))}, codes plus scale and zero per group)")
    return method, formats, floor, units


@dataclass
class Sensitivity:
    """What steps 1-2 measured, and what step 4 needs to measure a chosen spec (the model, the windows)."""

    cfg: SweepConfig
    method: Method
    formats: list[list[Format]]
    floor: int
    measured: dict
    header: dict
    quantizers: Callable
    model: object
    windows: torch.Tensor
    reference: list  # BF16 log-probabilities per batch (sensitivity.reference_logprobs)

    def gains(self, i: int, j: int) -> float | None:
        if j == 0:
            return 0.0
        m = self.measured.get((i, j))
        return None if m is None else self.measured["base"]["kl"] - m["kl"]


def measure(cfg: SweepConfig, budgets: Sequence) -> Sensitivity:
    """Steps 1-2 for every format affordable under the largest of ``budgets`` (all checked first)."""
    model_dir, data_path, calib_path = resolve_paths(cfg.model, cfg.data, cfg.calib)  # refuses data == calib
    from transformers import AutoConfig

    fp = ModelFingerprint.of(AutoConfig.from_pretrained(model_dir))
    plans = [plan(cfg.spec, b, fp.head_dim, fp.num_layers, cfg.upgrade_bits, cfg.group_sizes) for b in budgets]
    method, formats, floor, _ = plans[0]
    units = max(p[3] for p in plans)
    model, tokenizer = load_model(model_dir, resolve_device(cfg.device), cfg.dtype, tokenizer_required=False)
    bos = bos_id(model, tokenizer)
    torch.manual_seed(cfg.seed)
    rot_dir = None if cfg.rotations_dir is None else Path(cfg.rotations_dir)
    rotations, rot_note = method_rotations(model, method, rot_dir, lambda: read_tokens(calib_path, tokenizer), bos,
                                           None, cfg.progress, cfg.calib_tokens)
    windows = tail_windows(read_tokens(data_path, tokenizer), cfg.context, cfg.num_windows, bos)
    device = next(model.parameters()).device

    def quantizers(spec, only: slice = slice(None)):
        layers = resolved_layers(spec, fp.num_layers)[only]
        return spec_quantizers(layers, rotations, fp.head_dim, device)

    base = quantizers(method.spec)
    probes = {"base": base}
    for i, layer in enumerate(formats):
        for j, fmt in enumerate(layer):
            if j and fmt.cost - layer[0].cost <= units - floor:  # else its extra bits alone exceed every budget
                probe = quantizers(with_format(method.spec, i, fmt), slice(i, i + 1))  # layer i's alone
                probes[(i, j)] = base[:i] + probe + base[i + 1:]
    reference = reference_logprobs(model, windows, cfg.scored_tokens, cfg.batch_size)
    measured = continuation_divergence(model, probes, windows, reference, cfg.scored_tokens, cfg.batch_size,
                                       cfg.progress, desc="sweep: layer sensitivity")
    header = {
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": str(model_dir), "fingerprint": asdict(fp), "data": str(data_path), "calib": str(calib_path),
        "device": str(device), "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "settings": {k: v for k, v in asdict(cfg).items() if k not in ("progress", "budget")},
        "base": {"name": method.name, "source": method.source, "rotations": rot_note, "kl": measured["base"]["kl"],
                 "nll": measured["base"]["nll"]},
        "bf16": {"nll": reference_nll(reference, windows, cfg.batch_size)},
        "measure": "KL(p_bf16 || p) of the next-token distribution, nats per scored token",
        "windows": {"count": int(windows.shape[0]), "context": cfg.context, "scored_tokens": cfg.scored_tokens,
                    "taken_from": "the end of the data file"},
    }
    return Sensitivity(cfg, method, formats, floor, measured, header, quantizers, model, windows, reference)


def choose(sens: Sensitivity, budget) -> dict:
    """Steps 3-4 at one budget: the knapsack, the mixed spec and its measured KL (the results dict)."""
    fp = sens.header["fingerprint"]
    row = fp["head_dim"] * fp["num_layers"]
    units = budget_units(budget, fp["head_dim"], fp["num_layers"])
    if units < sens.floor:
        raise BudgetError(f"budget {budget} is below the floor of {sens.floor / row:g} bits per element")
    table = [[Choice(fmt.cost, sens.gains(i, j)) for j, fmt in enumerate(layer)]
             for i, layer in enumerate(sens.formats)]
    picked = allocate(table, units)
    mixed = with_formats(sens.method.spec, {i: sens.formats[i][j] for i, j in enumerate(picked)})
    cfg = sens.cfg
    check = continuation_divergence(sens.model, {"mixed": sens.quantizers(mixed)}, sens.windows, sens.reference,
                                    cfg.scored_tokens, cfg.batch_size, cfg.progress, desc="sweep: chosen spec")["mixed"]
    kl_base = sens.measured["base"]["kl"]
    return sens.header | {
        "settings": sens.header["settings"] | {"budget": str(budget)},
        "budget": {"bits_per_element": float(Fraction(str(budget))), "row_bits_total": units,
                   "floor_bits_per_element": sens.floor / row},
        "layers": [_layer_row(i, layer, picked[i], sens) for i, layer in enumerate(sens.formats)],
        "chosen": {"bits_per_element": sum(sens.formats[i][j].cost for i, j in enumerate(picked)) / row,
                   "predicted_kl": kl_base - sum(table[i][j].gain for i, j in enumerate(picked)),
                   "kl": check["kl"], "nll": check["nll"]},
        "spec": mixed,
    }


def sweep(config: SweepConfig | None = None, out: str | Path | None = None, **settings) -> dict:
    """Run the sweep at ``config.budget``; returns the results dict (``"spec"``: the mixed CompressionSpec).

    With ``out`` (a ``.yaml`` path) writes the spec there and ``.json`` / ``.md`` / ``.png``
    beside it (sweep_report.py). Pass a :class:`SweepConfig` or its fields as keywords.
    :func:`sweep_budgets` measures once for several budgets.
    """
    if config is not None and settings:
        raise TypeError("pass either a SweepConfig or keyword settings, not both")
    cfg = config if config is not None else SweepConfig(**settings)
    return sweep_budgets(cfg, [cfg.budget], None if out is None else [out])[0]


def sweep_budgets(cfg: SweepConfig, budgets: Sequence, outs: Sequence[str | Path] | None = None) -> list[dict]:
    """One measurement, one mixed spec per budget (written to ``outs[k]`` when given)."""
    if not budgets:
        raise ValueError("no budget given")
    if outs is not None and len(outs) != len(budgets):
        raise ValueError(f"{len(budgets)} budgets but {len(outs)} output paths")
    for b in budgets:
        SweepConfig(**{**asdict(cfg), "budget": b})  # the same checks for every budget, before any work
    t0 = time.time()
    sens = measure(cfg, budgets)
    results = []
    for k, budget in enumerate(budgets):
        res = choose(sens, budget)
        res["runtime_s"] = time.time() - t0
        if outs is not None:
            from .sweep_report import write_sweep_outputs

            res["files"] = write_sweep_outputs(res, Path(outs[k]))
        results.append(res)
    return results


def _layer_row(i: int, layer: list[Format], picked: int, sens: Sensitivity) -> dict:
    options = []
    for j, fmt in enumerate(layer):
        entry = {"format": fmt.name, "bits": fmt.bits, "group_size": fmt.group_size, "row_bits": fmt.cost}
        m = sens.measured["base"] if j == 0 else sens.measured.get((i, j))
        if m is None:
            entry.update(kl=None, gain=None, skipped="its extra bits alone exceed the budget")
        else:
            entry.update(kl=m["kl"], gain=sens.gains(i, j), nll=m["nll"])
        options.append(entry)
    return {"layer": i, "options": options, "chosen": layer[picked].name}


__all__ = ["BudgetError", "Sensitivity", "SweepConfig", "choose", "measure", "plan", "sweep", "sweep_budgets"]
