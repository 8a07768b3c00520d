"""The bit allocation of ``oscar-compile sweep``: an exact multiple-choice knapsack over layers.

Each layer stores its history in one of a few formats (its base format, e.g. INT2 with fp16
scale/zero per group, or a more precise one). A format costs a whole number of bits per cached
row of ``head_dim`` elements (codes plus scale and zero per group: the eval report's asymptotic
bits per element times ``head_dim``), and buys a measured reduction of the error (the gain,
sensitivity.py). The allocation picks one format per layer that maximises the summed gain with
the summed cost at most the budget. Costs are integers, so dynamic programming over
(layer, cost) finds the optimum exactly and never exceeds the budget: a greedy by gain per bit
can both miss the optimum and, rounding a fractional choice, the budget. Torch-free.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction


class BudgetError(ValueError):
    """A budget the allocation cannot meet (below the cheapest format of every layer)."""


@dataclass(frozen=True)
class Choice:
    """One format a layer may take: its integer cost and its gain (None: not measured, not allowed)."""

    cost: int
    gain: float | None


def budget_units(budget: float | str | Fraction, row_elements: int, num_layers: int) -> int:
    """The budget in bits per row summed over layers: floor(budget * head_dim * num_layers).

    ``budget`` is the average bits per element; read through its decimal text so that 2.3
    means 23/10 and not the nearest binary float below it.
    """
    exact = Fraction(str(budget)) if not isinstance(budget, Fraction) else budget
    return math.floor(exact * row_elements * num_layers)


def allocate(choices: Sequence[Sequence[Choice]], budget: int) -> list[int]:
    """The index of the chosen format per layer: max sum of gains, sum of costs <= ``budget``.

    choices[l][0] is layer l's base format (gain 0.0 by definition); a choice whose gain is None
    is never picked. Ties go to the cheaper total, then to the earlier format of the earlier
    layers, so the result is a function of the inputs alone. Raises :class:`BudgetError` when
    even the cheapest formats cost more than ``budget``.
    """
    if not choices:
        raise ValueError("no layers to allocate")
    floor = sum(min(c.cost for c in layer if c.gain is not None) for layer in choices)
    if floor > budget:
        raise BudgetError(f"the budget ({budget} bits per row summed over layers) is below the cheapest formats "
                          f"({floor})")
    costs = [c.cost for layer in choices for c in layer]
    unit = math.gcd(*costs) or 1  # every total is a multiple of it: a smaller table, the same optimum
    cap = budget // unit
    NEG = float("-inf")
    best = [0.0] + [NEG] * cap  # best[c]: max gain of the layers so far at total cost exactly c * unit
    picks: list[list[int]] = []  # picks[l][c]: the format of layer l on the best path to c
    for layer in choices:
        new, pick = [NEG] * (cap + 1), [-1] * (cap + 1)
        for j, choice in enumerate(layer):
            if choice.gain is None:
                continue
            w = choice.cost // unit
            for c in range(w, cap + 1):
                prev = best[c - w]
                if prev != NEG and prev + choice.gain > new[c]:
                    new[c], pick[c] = prev + choice.gain, j
        best = new
        picks.append(pick)
    top = max(v for v in best if v != NEG)
    c = next(c for c, v in enumerate(best) if v == top)  # the cheapest total reaching the best gain
    chosen = [0] * len(choices)
    for li in range(len(choices) - 1, -1, -1):
        j = picks[li][c]
        chosen[li] = j
        c -= choices[li][j].cost // unit
    return chosen


__all__ = ["BudgetError", "Choice", "allocate", "budget_units"]
