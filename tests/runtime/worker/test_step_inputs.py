"""Step inputs: the incremental page-table mirror and the packed per-step tensors."""
import torch

from oscar_compile.runtime.core.page_plan import CacheLayout
from oscar_compile.runtime.worker.cuda_graphs import graph_batch_sizes
from oscar_compile.runtime.worker.runner import Batch
from oscar_compile.runtime.worker.step_inputs import StepInputs, TableMirror

CPU = torch.device("cpu")


def _expected(tables, rows, width, fill):
    out = torch.full((rows, width), fill, dtype=torch.int32)
    for i, t in enumerate(tables):
        out[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
    return out


def test_table_mirror_uploads_tails_and_notices_replaced_lists():
    mirror = TableMirror(max_rows=4, width=6, device=CPU, fill=99)
    a, b = [1, 2], [3]
    assert torch.equal(mirror.update([a, b], rows=3, trim=False), _expected([a, b], 3, 6, 99))
    a.append(4)  # the block manager appends while a sequence runs
    b.extend([5, 6])
    got = mirror.update([a, b], rows=2, trim=True)
    assert torch.equal(got, _expected([a, b], 2, 6, 99)[:, :3])
    c = [7, 8, 9]  # a new list object with the old length: uploaded in full, not as a tail
    assert torch.equal(mirror.update([c, b], rows=2, trim=False), _expected([c, b], 2, 6, 99))
    # rows that held real tables become padding again, entirely
    assert torch.equal(mirror.update([b], rows=3, trim=False), _expected([b], 3, 6, 99))


def test_table_mirror_refuses_what_does_not_fit():
    mirror = TableMirror(max_rows=2, width=3, device=CPU)
    for tables, rows in (([[1, 2, 3, 4]], 1), ([[1], [2], [3]], 3)):
        try:
            mirror.update(tables, rows=rows, trim=False)
        except ValueError:
            continue
        raise AssertionError(f"{tables} accepted")


def test_step_inputs_pack_tokens_lengths_and_padding_rows():
    layout = CacheLayout.bf16(num_layers=1, num_kv_heads=1, head_dim=8, page_size=4, dtype_bytes=2)
    inputs = StepInputs(max_seqs=4, max_tokens=8, window_width=1, quant_width=5, device=CPU,
                        scratch_window=50, scratch_quant=60)
    batch = Batch(seq_ids=[0, 1], token_ids=[[11, 12, 13], [21]], positions=[[4, 5, 6], [9]], cache_lens=[4, 9],
                  history_lens=[0, 2], window_tables=[[], []], quant_tables=[[1, 2], [3, 4, 5]],
                  context_token_ids=[[], []], layout=layout)
    got = inputs.load(batch, pad_to=4, graph_shapes=True)
    assert got["input_ids"].tolist() == [[11, 12, 13, 21, 0, 0]]
    assert got["position_ids"].tolist() == [[4, 5, 6, 9, 0, 0]]
    assert got["cu_seqlens"].tolist() == [0, 3, 4, 5, 6]  # padding rows: one token each
    assert got["cache_lens"].tolist() == [4, 9, 0, 0]
    assert got["history_lens"].tolist() == [0, 2, 0, 0]
    assert torch.equal(got["quant_table"], _expected([[1, 2], [3, 4, 5]], 4, 5, 60))
    assert (got["window_table"][2:] == 50).all()
    eager = inputs.load(batch)  # no padding; tables trimmed to the longest
    assert eager["cu_seqlens"].tolist() == [0, 3, 4] and eager["quant_table"].shape == (2, 3)
    assert not inputs.fits(batch, pad_to=8)


def test_graph_batch_sizes_cover_every_batch_up_to_the_maximum():
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert graph_batch_sizes(1) == [1] and graph_batch_sizes(10) == [1, 2, 4, 8, 10]
