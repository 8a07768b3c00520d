"""Start a tensor-parallel group: rank 0 in this process, ranks ``1 .. N-1`` spawned, one per device.

Every rank loads the whole model on the CPU (``RankSetup.load``, a picklable callable: a model
directory, or a seeded random-weight builder for benchmarks), keeps its slice
(``shard.shard_model``), moves it to its device (``cuda:rank``, or the CPU) and compresses it with
its slice of the rotations (``compress``: the same passes as one device, on a narrower model).
Rank 0 then builds the engine. On CUDA with ``gpu_memory_utilization`` set (and no
``kv_memory_gb``) every rank first runs the memory plan's profile run in lockstep
(``profile_ranks``): the smallest remainder sizes the pages; with neither set, the smallest
default budget of the ranks does (``_smallest_kv_budget``). When
the block manager has sized the pools rank 0 sends the runner's arguments to the other ranks,
which build the same ``CompressedRunner`` (same page ids, their own KV heads) and follow rank 0's
steps (``oscar_compile.runtime.worker.tp_runner``).

Process groups go through ``torch.distributed``'s TCP rendezvous on a free loopback port:
NCCL on CUDA (the all-reduces), gloo on CPU, and a gloo group for the step messages in both.
What cannot run is refused before any process starts: KV heads (or the MLP width) that ``N``
does not divide, more ranks than CUDA devices, rotations made for another head layout.
"""
from __future__ import annotations

import atexit
import logging
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from oscar_compile.artifact import Rotations
from oscar_compile.compress import compress
from oscar_compile.runtime.core.memory_plan import MemoryProfile, StepRow
from oscar_compile.runtime.core.page_plan import GIB
from oscar_compile.runtime.engine_config import EngineConfig, build_engine, default_kv_memory_bytes
from oscar_compile.runtime.worker.compressed_runner import CompressedRunner, runner_kwargs
from oscar_compile.runtime.worker.memory_profile import measure_step_memory, weight_bytes
from oscar_compile.runtime.worker.runner import RunnerFactory
from oscar_compile.runtime.worker.tp_runner import RankGroup, TensorParallelError, TensorParallelRunner, follow_steps
from oscar_compile.spec import CompressionSpec
from oscar_compile.tensor_parallel.shard import (
    ShardReport,
    check_divisible,
    check_rotations_layout,
    shard_model,
    shard_rotations,
)

logger = logging.getLogger(__name__)
_CONTROL_TIMEOUT = timedelta(days=30)  # a following rank waits for the next step as long as the server idles


@dataclass(frozen=True)
class RankSetup:
    """What every rank builds, picklable (ranks are spawned, not forked).

    ``load()`` returns ``(model, tokenizer)``: the whole model on the CPU in its serving dtype.
    ``spec`` / ``rotations`` as ``compress`` takes them (rotations for the whole model: each rank
    slices its own). ``timeout_s`` bounds every collective of a step (a rank that stops answering
    fails the group after it).
    """

    load: Callable[[], tuple]
    spec: Any
    rotations: Any
    config: EngineConfig | None
    device_type: str
    timeout_s: float = 300.0
    log_level: int = logging.INFO


def load_model_dir(model_dir: str, dtype) -> tuple:
    """``RankSetup.load`` for a model directory (module level, so a spawned rank can call it)."""
    from oscar_compile.loading import load_model

    return load_model(model_dir, "cpu", dtype, tokenizer_required=False)  # LLM(tokenizer=...) may bring one


def check_launch(model_config, world_size: int, device: torch.device) -> None:
    """Refuse a split that cannot run, before any process starts."""
    check_divisible(model_config, world_size)
    if device.type == "cuda" and torch.cuda.device_count() < world_size:
        raise ValueError(f"tensor_parallel_size {world_size} needs one CUDA device per rank; "
                         f"torch sees {torch.cuda.device_count()}")


def prepare_rank(setup: RankSetup, ranks: RankGroup) -> tuple:
    """(the handle ``apply`` returned, tokenizer, engine config, shard report) of this rank: loaded,
    split, moved, compressed."""
    model, tokenizer = setup.load()
    report = shard_model(model, ranks.rank, ranks.world_size, ranks.data_group)
    device = torch.device("cuda", ranks.rank) if setup.device_type == "cuda" else torch.device("cpu")
    model.to(device)
    compressed, config, _ = compress(model, setup.spec, _rank_rotations(setup.rotations, report), setup.config)
    cache = config.cache
    if cache.kv_memory_gb is None and cache.gpu_memory_utilization is None and device.type == "cuda":
        config = replace(config, kv_memory_gb=_smallest_kv_budget(device, ranks) / GIB)
    return compressed, tokenizer, config, report


def _smallest_kv_budget(device: torch.device, ranks: RankGroup) -> int:
    """The default KV budget (a share of free memory) of the rank with the least: every rank
    allocates the page counts rank 0 plans, so rank 0's own budget could overfill another GPU."""
    free = torch.tensor([default_kv_memory_bytes(device)], dtype=torch.int64, device=device)
    dist.all_reduce(free, op=dist.ReduceOp.MIN, group=ranks.data_group)
    return int(free.item())


def _rank_runner_kwargs(model, page_manager, config) -> dict:
    """Every rank's runner arguments: the engine's, less piecewise CUDA graphs (prefill and mixed
    steps run eagerly on the ranks). Their captures and replays, which all-reduce inside the
    pieces, have not run on several GPUs yet (multi-GPU machines were not lent to the sessions
    that built them); decode graphs stay on."""
    return {**runner_kwargs(model, page_manager, config), "piecewise_max_tokens": 0}


def profile_ranks(compressed, layout, kwargs: dict, rows: list[StepRow], ranks: RankGroup) -> list[MemoryProfile]:
    """Every rank's memory profile (runtime/worker/memory_profile.py), in rank order: each builds
    the profile runner of ``kwargs`` (the steps of its construction and the largest step of
    ``rows`` all-reduce in lockstep) and measures its own device; rank 0 samples, as it does when
    serving (no prompt logits across ranks). Every rank calls this (rank 0 after sending
    ``("profile", kwargs, rows)``); the engine plans from the tightest."""
    device = torch.device("cuda", ranks.rank)
    mine = measure_step_memory(lambda: CompressedRunner(compressed, layout, **kwargs), rows, device,
                               weight_bytes(compressed.model, device), score_prompts=False, sample=ranks.rank == 0)
    numbers = torch.tensor([mine.total, mine.before, mine.peak_in_use, mine.profile_pools, mine.weights],
                           dtype=torch.int64, device=device)
    gathered = [torch.empty_like(numbers) for _ in range(ranks.world_size)]
    dist.all_gather(gathered, numbers, group=ranks.data_group)
    return [MemoryProfile(*(int(x) for x in t.tolist())) for t in gathered]


def _rank_rotations(rotations, report: ShardReport) -> Rotations | None:
    if rotations is None:
        return None  # compress makes data-free ones for the narrow model
    if not isinstance(rotations, Rotations):
        rotations = Rotations.load(rotations)
    check_rotations_layout(rotations, report.full)
    return shard_rotations(rotations, report.rank, report.world_size)


def _log_rank(report: ShardReport, runner: CompressedRunner, kwargs: dict) -> None:
    layout = runner.layout
    logger.info("tensor-parallel rank %d of %d: KV heads %d..%d of %d; KV pages: %d window (%d B each), %d quant "
                "(%d B each), %d staging", report.rank, report.world_size, report.kv_heads.start,
                report.kv_heads.stop - 1, report.full.num_kv_heads, kwargs["num_window_pages"],
                layout.window_page_bytes, kwargs["num_quant_pages"], layout.quant_page_bytes,
                kwargs["num_staging_pages"])


def join_group(rank: int, world_size: int, port: int, device_type: str, timeout_s: float,
               find_dead_rank: Callable[[], str | None] = lambda: None) -> RankGroup:
    """Join the group at ``127.0.0.1:port`` as ``rank``: NCCL on CUDA (``cuda:rank``), gloo on
    CPU, plus the gloo control group; collectives time out after ``timeout_s``. Rank 0 hosts the
    rendezvous store and waits for the others to check in, watching ``find_dead_rank``: a rank
    that dies while it starts (an import error, say) fails the start at once instead of leaving
    rank 0 waiting for the timeout."""
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0, timeout=timeout,
                          wait_for_workers=False)
    if rank == 0:
        _wait_for_ranks(store, world_size, find_dead_rank, timeout_s)
    else:
        store.set(f"oscar_tp_rank{rank}", "up")
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=_CONTROL_TIMEOUT)
    if device_type == "cuda":  # NCCL's communicator is made lazily: here, not inside a graph capture
        dist.all_reduce(torch.zeros(1, device="cuda"))
        torch.cuda.synchronize()
    return RankGroup(rank, world_size, dist.group.WORLD, control, find_dead_rank)


def _wait_for_ranks(store, world_size: int, find_dead_rank: Callable[[], str | None], timeout_s: float) -> None:
    keys = [f"oscar_tp_rank{rank}" for rank in range(1, world_size)]
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            store.wait(keys, timedelta(seconds=0.5))
            return
        except RuntimeError:  # DistStoreError: not every rank is up yet
            dead = find_dead_rank()
            if dead is not None:
                raise TensorParallelError(f"tensor-parallel start failed: {dead} (its log says why)") from None
            if time.monotonic() > deadline:
                raise TensorParallelError(f"tensor-parallel ranks did not start within {timeout_s:.0f} s") from None


def _worker_main(rank: int, world_size: int, port: int, setup: RankSetup) -> None:
    # Ctrl-C reaches the whole process group: rank 0 drains the server and then stops this rank
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=setup.log_level, format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s")
    if setup.device_type == "cpu":  # the ranks share the host's cores
        torch.set_num_threads(max(1, torch.get_num_threads() // world_size))
    try:
        ranks = join_group(rank, world_size, port, setup.device_type, setup.timeout_s)
        compressed, _, config, report = prepare_rank(setup, ranks)
        message = ranks.receive()
        while message[0] == "profile":  # the memory plan's profile run (engine_config.planned_kv_bytes)
            profile_ranks(compressed, config.layout, message[1], message[2], ranks)
            message = ranks.receive()
        if message[0] == "runner":
            runner = CompressedRunner(compressed, config.layout, **message[1])
            _log_rank(report, runner, message[1])
            follow_steps(runner, ranks)
    except BaseException:
        logger.exception("tensor-parallel rank %d failed", rank)
        sys.exit(1)
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TensorParallelGroup:
    """Rank 0's handle on the group: the spawned ranks, the process groups, the runner factory."""

    def __init__(self, setup: RankSetup, world_size: int):
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialized in this process: one tensor-parallel "
                               "engine per process (close the previous one first)")
        self.setup = setup
        port = free_port()
        context = torch.multiprocessing.get_context("spawn")
        self.processes = [context.Process(target=_worker_main, args=(rank, world_size, port, setup), daemon=True,
                                          name=f"oscar-tp-rank{rank}") for rank in range(1, world_size)]
        for process in self.processes:
            process.start()
        try:
            self.ranks = join_group(0, world_size, port, setup.device_type, setup.timeout_s, self.find_dead_rank)
        except BaseException:
            self._stop_processes(timeout_s=1.0)
            raise
        self.runner: TensorParallelRunner | None = None
        atexit.register(self.close)

    def _stop_processes(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for process in self.processes:
            process.join(max(deadline - time.monotonic(), 0.1))
            if process.exitcode is None:
                logger.warning("tensor-parallel %s did not stop; terminating it", process.name)
                process.terminate()
                process.join(1.0)
        self.processes = []

    def find_dead_rank(self) -> str | None:
        for rank, process in enumerate(self.processes, start=1):
            if process.exitcode is not None:
                return f"rank {rank} (pid {process.pid}) exited with code {process.exitcode}"
        return None

    def prepare(self) -> tuple:
        """Rank 0's (model, tokenizer, engine config, make_runner for ``build_engine``)."""
        compressed, tokenizer, config, report = prepare_rank(self.setup, self.ranks)

        def build(page_manager) -> TensorParallelRunner:
            kwargs = _rank_runner_kwargs(compressed.model, page_manager, config)
            try:
                self.ranks.send(("runner", kwargs))
            except RuntimeError as err:  # a rank died while it loaded or compressed its slice
                raise self.ranks.fail(err) from err
            local = CompressedRunner(compressed, config.layout, **kwargs)
            _log_rank(report, local, kwargs)
            self.runner = TensorParallelRunner(local, self.ranks)
            return self.runner

        def profile(page_manager, rows) -> list[MemoryProfile]:
            kwargs = _rank_runner_kwargs(compressed.model, page_manager, config)
            try:
                self.ranks.send(("profile", kwargs, rows))
            except RuntimeError as err:
                raise self.ranks.fail(err) from err
            return profile_ranks(compressed, config.layout, kwargs, rows, self.ranks)

        capabilities = replace(CompressedRunner.capabilities_for(config.cache.prefill_semantics),
                               prompt_logits=False, tensor_parallel_size=self.ranks.world_size)
        return compressed.model, tokenizer, config, RunnerFactory(capabilities, build, profile)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the other ranks and leave the process groups (idempotent)."""
        if not self.processes and not dist.is_initialized():
            return
        if self.runner is not None:
            self.runner.close()
        elif self.find_dead_rank() is None:
            try:
                self.ranks.send(("stop",))
            except RuntimeError as err:
                logger.warning("could not stop the tensor-parallel ranks: %s", err)
        self._stop_processes(timeout_s)
        if dist.is_initialized():
            dist.destroy_process_group()
        atexit.unregister(self.close)


def start(model_dir, spec, rotations, config: EngineConfig | None, world_size: int, device: torch.device,
          dtype=None, timeout_s: float = 300.0) -> TensorParallelGroup:
    """Check the split, then start the group for a model directory (``LLM`` and ``serve``)."""
    from functools import partial

    from transformers import AutoConfig

    from oscar_compile.loading import resolve_dtype
    from oscar_compile.spec_fit import fit_spec_to_model_dir

    model_config = AutoConfig.from_pretrained(str(model_dir))
    check_launch(model_config, world_size, device)
    if spec is not None and not isinstance(spec, CompressionSpec):
        spec = CompressionSpec.from_yaml(spec)
    if spec is not None:
        spec = fit_spec_to_model_dir(spec, model_dir)
    if rotations is not None:  # refuse rotations of another layout here, not in every rank
        from oscar_compile.architectures import ModelFingerprint

        loaded = rotations if isinstance(rotations, Rotations) else Rotations.load(rotations)
        check_rotations_layout(loaded, ModelFingerprint.of(model_config))
    setup = RankSetup(partial(load_model_dir, str(model_dir), resolve_dtype(dtype, device)), spec, rotations,
                      config, device.type, timeout_s, logging.getLogger().getEffectiveLevel())
    return TensorParallelGroup(setup, world_size)


def start_engine(model_dir, spec, rotations, config: EngineConfig | None, world_size: int, device: torch.device,
                 dtype=None, tokenizer=None) -> tuple:
    """(group, rank 0's model, tokenizer, engine) over ``world_size`` ranks (``tokenizer`` in place
    of the model directory's); the ranks are stopped again when anything fails on the way."""
    group = start(model_dir, spec, rotations, config, world_size, device, dtype)
    try:
        model, loaded_tokenizer, config, make_runner = group.prepare()
        tokenizer = tokenizer or loaded_tokenizer
        if tokenizer is None:
            raise ValueError(f"{model_dir} holds no tokenizer: pass tokenizer=")
        return group, model, tokenizer, build_engine(model, tokenizer, config, make_runner=make_runner)
    except BaseException:
        group.close()
        raise
