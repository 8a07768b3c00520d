"""The per-step attention plan (``AttentionDispatch.plan``) on a CPU: the memoized choice and launch
plan are the ones a fresh plan gives, for every case the dispatch tests cover; a change of mode
between calls (deterministic mode, the device check) is a new key, never a stale plan; the
setting (``OSCAR_ATTENTION_KERNEL``) is read once, when a dispatch is built; a step's plans end
with the step; and a wrapper handed the plan launches exactly what it plans itself (same grid,
same arguments: bitwise the same output)."""
from __future__ import annotations

import itertools

import pytest
import torch

from oscar_compile.formats.op_args import AttentionArgs
from oscar_compile.kernels.attention import attention_dispatch as ad
from oscar_compile.kernels.determinism import deterministic


@pytest.fixture(autouse=True)
def sm90(monkeypatch):
    """An sm_90 device unless a test says otherwise."""
    monkeypatch.setattr(ad, "gluon_device_problem", lambda index: None)


def _args(N=4, B=4, H_q=32, H_kv=8, D=128, P=16, bits=2, group=None, sdt=torch.float16, wdt=torch.bfloat16,
          qcols=8, wcols=20, sink=64, recent=256, lens=100) -> AttentionArgs:
    """An ``oscar::attention`` call of these shapes (empty pools: the plan reads shapes only)."""
    cpb = D // 2 if bits == 16 else D * bits // 8
    codes = torch.empty(2, H_kv, P, cpb, dtype=torch.uint8)
    scales = torch.empty(2, H_kv, P, 1, dtype=sdt)
    win = torch.empty(2, H_kv, P, D, dtype=wdt)
    cu = torch.linspace(0, N, B + 1).round().to(torch.int32)
    return AttentionArgs(torch.empty(N, H_q, D, dtype=wdt), torch.empty(N, H_kv, D, dtype=wdt),
                         torch.empty(N, H_kv, D, dtype=wdt), cu, torch.full((B,), lens, dtype=torch.int32),
                         torch.zeros(B, wcols, dtype=torch.int32), torch.zeros(B, qcols, dtype=torch.int32),
                         win, win.clone(), codes, scales, scales.clone(), codes.clone(), scales.clone(),
                         scales.clone(), D ** -0.5, sink, recent, bits, group or D)


CASES = {  # the shapes of the dispatch tests (test_attention_gluon_compile, _gluon_int8_cpu, _extend)
    "int2 decode": {}, "int2 GQA 16": {"H_q": 128, "H_kv": 8}, "int4 decode": {"bits": 4},
    "int2 head_dim 64": {"D": 64}, "bits 8": {"bits": 8}, "group 64": {"group": 64},
    "prefill-like": {"N": 40}, "int4 prefill": {"N": 40, "bits": 4}, "16-bit prefill": {"N": 40, "bits": 16},
    "no history pages": {"N": 40, "qcols": 0}, "head_dim 96": {"N": 40, "D": 96}, "page 8": {"P": 8},
    "fp32 windows": {"wdt": torch.float32}, "bf16 scales": {"sdt": torch.bfloat16},
    "64 over 1 heads": {"H_q": 64, "H_kv": 1, "bits": 4}, "empty batch": {"N": 0},
    "long history, batch 1": {"N": 1, "B": 1, "qcols": 2048}, "int4 long": {"N": 8, "bits": 4, "qcols": 512},
}


def _fresh(a: AttentionArgs, forced: str = "auto") -> tuple[str, str]:
    return ad.choose_attention_kernel(a.q, a.k, a.k_win, a.k_codes, a.k_scale, a.bits, a.group_size,
                                      a.cache_lens.shape[0], a.window_table, a.quant_table, forced=forced)


@pytest.mark.parametrize("problem", [None, "compute capability 8.0"])
@pytest.mark.parametrize("forced", ["auto", "triton"])
@pytest.mark.parametrize("case", list(CASES))
def test_memoized_plan_is_the_fresh_one(monkeypatch, case, forced, problem):
    monkeypatch.setattr(ad, "gluon_device_problem", lambda index: problem)
    dispatch = ad.AttentionDispatch(forced)
    a = _args(**CASES[case])
    first = dispatch.plan(a)  # planned
    again = dispatch.plan(_args(**CASES[case]))  # memoized: other tensors, same shapes
    assert again is first and len(dispatch.plans) == 1
    assert first[:2] == _fresh(a, forced)
    assert first.launch == ad.launch_plan(first.kernel, a)
    if first.kernel in ("gluon", "gluon_int8") and a.q.shape[0]:
        assert first.launch["nsplit"] >= 1 and first.launch["win_splits"] >= 1
    elif first.kernel == "triton" and a.q.shape[0] and a.q.shape[-1] != 96:  # (head_dim 96: the reference)
        assert len(first.launch["launch_plan"]) == 4
    else:
        assert first.launch == {}


def test_tensor_values_share_a_plan_and_shapes_do_not():
    dispatch = ad.AttentionDispatch("auto")
    a = _args(qcols=64)
    plan = dispatch.plan(a)
    grown = a._replace(cache_lens=a.cache_lens + 700, quant_table=a.quant_table + 3)  # values only
    assert dispatch.plan(grown) is plan
    wider = dispatch.plan(_args(qcols=512))  # a wider table: another split plan
    assert wider is not plan and wider.launch != plan.launch
    assert dispatch.plan(_args(qcols=64, sink=16, recent=32)) is not plan


def test_a_new_mode_between_calls_is_never_a_stale_plan(monkeypatch):
    a = _args()
    dispatch, forced_gluon = ad.AttentionDispatch("auto"), ad.AttentionDispatch("gluon")
    assert dispatch.plan(a).kernel == "gluon_int8"
    assert ad.AttentionDispatch("triton").plan(a)[:2] == ("triton", f"{ad.ENV}=triton")
    with deterministic():
        assert dispatch.plan(a)[:2] == ("triton", "deterministic mode")
        assert dispatch.plan(a).launch["launch_plan"][2] == 1  # split_tokens() splits, one window program
        for _ in range(2):  # an error every time, not a memoized plan
            with pytest.raises(RuntimeError, match="no deterministic mode"):
                forced_gluon.plan(a)
    assert dispatch.plan(a).kernel == "gluon_int8"
    monkeypatch.setattr(ad, "gluon_device_problem", lambda index: "compute capability 8.0")
    assert dispatch.plan(a)[:2] == ("triton", "compute capability 8.0")


def test_the_setting_is_read_when_the_dispatch_is_built(monkeypatch):
    a = _args()
    monkeypatch.setenv(ad.ENV, " Triton ")
    dispatch = ad.AttentionDispatch()
    assert dispatch.kernel == "triton"
    monkeypatch.setenv(ad.ENV, "auto")  # later changes reach new dispatches only
    assert dispatch.plan(a)[:2] == ("triton", f"{ad.ENV}=triton")
    assert ad.AttentionDispatch().plan(a).kernel == "gluon_int8"
    monkeypatch.setenv(ad.ENV, "fastest")
    with pytest.raises(ValueError, match="auto, gluon, triton"):
        ad.AttentionDispatch()
    with pytest.raises(ValueError, match="auto, gluon, triton"):
        ad.AttentionDispatch("fastest")


def test_memo_is_bounded():
    dispatch = ad.AttentionDispatch("auto", max_plans=4)
    plans = [dispatch.plan(_args(qcols=c)) for c in range(1, 8)]
    assert len(dispatch.plans) == 4
    assert dispatch.plan(_args(qcols=7)) is plans[-1]  # the newest stay
    assert dispatch.plan(_args(qcols=1)) is not plans[0]  # the oldest went (planned again, equal)
    assert dispatch.plan(_args(qcols=1)) == plans[0]
    unplanned = ad.AttentionDispatch("auto", max_plans=0)  # bench.serve --plan-ab's baseline
    assert unplanned.plan(_args()) is not unplanned.plan(_args()) and not unplanned.plans


def test_a_step_owns_its_plans_and_serves_its_thread(monkeypatch):
    """Inside ``step()`` the dispatch runs the thread's calls (``attention_cuda``) and plans once for
    every layer; its plans end with the step; another thread, and the thread after the step, get
    the default dispatch."""
    import threading

    ran = []
    monkeypatch.setattr(ad, "run_planned", lambda plan, a: ran.append(plan))
    outside = ad.AttentionDispatch("auto", usage=ad.KernelUsage())
    monkeypatch.setattr(ad, "default_attention_dispatch", lambda: outside)
    dispatch = ad.AttentionDispatch("triton", usage=ad.KernelUsage())
    a = _args()
    with dispatch.step():
        assert ad.active_attention_dispatch() is dispatch
        for _ in range(3):  # three layers: one plan
            ad.attention_cuda(a)
        assert len(dispatch.plans) == 1 and ran[0] is ran[1] is ran[2]
        other = []
        thread = threading.Thread(target=lambda: other.append(ad.active_attention_dispatch()))
        thread.start()
        thread.join()
        assert other == [outside]
    assert not dispatch.plans and ad.active_attention_dispatch() is outside
    assert dispatch.usage.snapshot() == {"triton": f"{ad.ENV}=triton"} and not outside.usage.snapshot()
    with dispatch.step():
        ad.attention_cuda(a)
    assert ran[3] is not ran[0] and ran[3] == ran[0]  # a new step plans again, the same plan
    ad.attention_cuda(a)
    assert outside.usage.snapshot() == {"gluon_int8": "sm_90, INT2 codes masked in place"}


class _Recorder:
    """Stands for a jitted kernel: ``kernel[grid](*args, **kwargs)`` records the launch."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, args, kwargs))


def _same(x):
    """A launch argument as the comparison sees it: tensors by shape, dtype, strides (and the values
    of small integer ones: cu_seqlens, the query block prefix); fresh buffers differ in address only."""
    if not isinstance(x, torch.Tensor):
        return x
    small = x.numel() <= 64 and not x.is_floating_point()
    return tuple(x.shape), x.dtype, x.stride(), x.tolist() if small else None


def _launch_signature(launch) -> tuple:
    grid, args, kwargs = launch
    return grid, tuple(_same(x) for x in args), tuple(sorted((k, _same(v)) for k, v in kwargs.items()))


WRAPPERS = {  # (module, its kernels, the shapes of the call)
    "int8 decode": ("attention_gluon_int8", ("_decode_int8_kernel",), {}),
    "int8 decode, 32k, batch 1": ("attention_gluon_int8", ("_decode_int8_kernel",), {"N": 1, "B": 1, "qcols": 2048}),
    "int8 decode, GQA 16": ("attention_gluon_int8", ("_decode_int8_kernel",), {"N": 8, "qcols": 40, "H_q": 128}),
    "gluon int4": ("attention_gluon", ("_decode_kernel",), {"bits": 4}),
    "gluon int4, 8k": ("attention_gluon", ("_decode_kernel",), {"bits": 4, "N": 2, "B": 1, "qcols": 512}),
    "gluon head_dim 64": ("attention_gluon", ("_decode_kernel",), {"D": 64, "qcols": 300}),
    "triton 16-bit prefill": ("attention_triton", ("_attn_kernel", "attn_kernel_prefill"), {"N": 40, "bits": 16}),
    "triton 16-bit decode": ("attention_triton", ("_attn_kernel", "attn_kernel_prefill"),
                             {"bits": 16, "qcols": 600}),
    "triton prefill, no pages": ("attention_triton", ("_attn_kernel", "attn_kernel_prefill"), {"N": 40, "qcols": 0}),
}


@pytest.mark.parametrize("det", [False, True])
@pytest.mark.parametrize("forced", ["auto", "triton"])
@pytest.mark.parametrize("sms", [4, 132])
@pytest.mark.parametrize("case", list(WRAPPERS))
def test_a_wrapper_given_the_plan_launches_what_it_plans(monkeypatch, case, sms, forced, det):
    """The op through the dispatch (the plan passed in, planned then memoized) and the
    wrapper planning for itself launch the same grids with the same arguments."""
    import importlib

    dispatch = ad.AttentionDispatch(forced, usage=ad.KernelUsage())
    a = _args(**WRAPPERS[case][2])
    with deterministic(det):
        kernel = dispatch.plan(a).kernel
    module = {"gluon_int8": "attention_gluon_int8", "gluon": "attention_gluon", "triton": "attention_triton"}[kernel]
    mod = importlib.import_module(f"oscar_compile.kernels.attention.decode.{module}")
    rec = _Recorder()
    names = ("_decode_int8_kernel",) if kernel == "gluon_int8" else ("_decode_kernel",) if kernel == "gluon" else (
        "_attn_kernel", "attn_kernel_prefill")
    for name in names:
        monkeypatch.setattr(mod, name, rec)
    monkeypatch.setattr(mod, "num_sms", lambda device: sms)
    for name in ("merge_partials", "merge_partials_in_order"):
        if hasattr(mod, name):
            monkeypatch.setattr(mod, name, lambda *args, **kwargs: None)
    dispatch.plans.clear()  # (planned again under the patched SM count)
    with deterministic(det):
        for _ in range(3):  # planned, then memoized twice
            dispatch.run(a)
        getattr(mod, module)(**a._asdict())  # the wrapper's own plan
    assert len(rec.launches) == 4 and len(dispatch.plans) == 1
    want = _launch_signature(rec.launches[-1])
    assert all(_launch_signature(got) == want for got in rec.launches[:-1])
    if kernel != "triton":
        assert not det and forced == "auto"


def test_early_load_rule_is_the_wrappers():
    from oscar_compile.kernels.attention.decode import attention_gluon_int8 as k8

    for max_hist, nsplit in itertools.product((256, 1024, 8192, 131072), (1, 2, 8, 64)):
        split = -(-max_hist // nsplit)
        assert k8.early_load_for(max_hist, nsplit) == (-(-split // k8.STEP_TOKENS) <= k8.EARLY_STEPS)
    assert k8.early_load_for(131072, 1, deterministic=True) == (k8.DET_SPLIT_TOKENS // k8.STEP_TOKENS
                                                                <= k8.EARLY_STEPS)
