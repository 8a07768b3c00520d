"""The step messages rank 0 sends: Batches survive the trip, and tables travel as appended tails."""
from __future__ import annotations

import pickle

from oscar_compile.formats.cache import CacheLayout
from oscar_compile.runtime.worker.runner import Batch
from oscar_compile.runtime.worker.tp_runner import StepDecoder, StepEncoder

LAYOUT = CacheLayout.bf16(2, 1, 16, page_size=4)


def _batch(tables: list[list[int]], quant: list[list[int]], staging=(), **kw) -> Batch:
    n = len(tables)
    fields = dict(seq_ids=list(range(n)), token_ids=[[1, 2]] + [[3]] * (n - 1),
                  positions=[[5, 6]] + [[9]] * (n - 1), cache_lens=[5] + [9] * (n - 1), history_lens=[0] * n,
                  window_tables=tables, quant_tables=quant, context_token_ids=[()] * n, layout=LAYOUT,
                  staging_tables=staging)
    fields.update(kw)
    return Batch(**fields)


def _trip(encoder: StepEncoder, decoder: StepDecoder, batch: Batch) -> tuple[Batch, dict]:
    message = pickle.loads(pickle.dumps(encoder.encode(batch, 0)))  # what the control group carries
    return decoder.decode(message), message


def test_batches_survive_the_trip_and_tables_grow_by_their_tails():
    encoder, decoder = StepEncoder(), StepDecoder(LAYOUT)
    window, quant_a, quant_b = [0, 1], [4, 5, 6], [7]
    first, message = _trip(encoder, decoder, _batch([window, [2, 3]], [quant_a, quant_b]))
    assert message["quant_tables"] == [(-1, [4, 5, 6]), (-1, [7])]  # first sight: whole tables
    for name in ("seq_ids", "token_ids", "positions", "cache_lens", "history_lens", "window_tables", "quant_tables"):
        assert getattr(first, name) == getattr(_batch([window, [2, 3]], [quant_a, quant_b]), name)
    row0 = first.quant_tables[0]
    quant_a.append(8)  # the block manager appends to a running sequence's table
    second, message = _trip(encoder, decoder, _batch([window, [2, 3]], [quant_a, quant_b],
                                                     pending_rows=(1,), pending_src=(0,)))
    assert message["quant_tables"] == [(3, [8]), (1, [])]
    assert second.quant_tables[0] is row0 and row0 == [4, 5, 6, 8]  # extended in place: the mirror sends only 8
    assert (second.pending_rows, second.pending_src) == ((1,), (0,))
    # rows shift (sequence 0 finished): a table seen at another row, or a new list, is sent whole
    third, message = _trip(encoder, decoder, _batch([[2, 3]], [quant_b]))
    assert message["quant_tables"] == [(-1, [7])] and third.quant_tables == [[7]]
    reallocated = [9, 10]
    fourth, message = _trip(encoder, decoder, _batch([[2, 3]], [reallocated]))
    assert message["quant_tables"] == [(-1, [9, 10])] and fourth.quant_tables == [[9, 10]]


def test_staging_tables_travel_only_on_steps_that_stage():
    encoder, decoder = StepEncoder(), StepDecoder(LAYOUT)
    staging = [11, 12]
    staged, message = _trip(encoder, decoder, _batch([[0]], [[1]], staging=(staging,), staging_ends=(0,)))
    assert staged.staging_tables == ([11, 12],) and staged.staging_ends == (0,)
    plain, message = _trip(encoder, decoder, _batch([[0]], [[1]]))
    assert "staging_tables" not in message and plain.staging_tables == ()
    staging.append(13)
    again, message = _trip(encoder, decoder, _batch([[0]], [[1]], staging=(staging,)))
    assert message["staging_tables"] == [(2, [13])] and again.staging_tables == ([11, 12, 13],)
