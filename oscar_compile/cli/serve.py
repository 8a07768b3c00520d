"""``oscar-compile serve`` (and ``python -m oscar_compile.runtime.serve``): load a model and serve the OpenAI API.

Without ``--model`` it serves the bundled tiny model (``oscar_compile/bundled/oscar-tiny-qwen3``)
compressed with ``specs/oscar-int2.yaml`` and the rotations shipped beside it. With ``--model``
the default spec is ``specs/bf16.yaml`` (the same paged runtime, no compression) unless
``--spec`` says otherwise; ``--rotations`` defaults to ``<model>/rotations/<spec name>.safetensors``
when that file exists.

This module parses the flags; ``oscar_compile.assembly`` assembles the model, its compression
and the runtime (``assemble_for_serving``), as it does for ``LLM``, and builds the app over it
(``build_app``, the one app factory).

The server binds 127.0.0.1 unless told otherwise; binding another address without an API key
(``--api-key`` or ``OSCAR_API_KEY``) logs a warning. SIGTERM / SIGINT drain it (runtime/server/shutdown.py).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import ipaddress
import logging
import os
import sys

from oscar_compile.formats.prefill import DEFAULT_PREFILL_SEMANTICS, PREFILL_SEMANTICS
from oscar_compile.runtime.core.config import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_PIECEWISE_MAX_TOKENS,
    DEFAULT_SWAP_SPACE_GB,
    PREFIX_HITS,
)

logger = logging.getLogger("oscar_compile.runtime.serve")  # the name users' log filters were given


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def build_parser(prog: str = "python -m oscar_compile.runtime.serve", add_help: bool = True) -> argparse.ArgumentParser:
    """The serve flags; ``oscar_compile.bench.serve_random`` adds its own to them, and
    ``oscar-compile serve`` takes them as its parent parser (``add_help=False``)."""
    parser = argparse.ArgumentParser(prog=prog, description="OpenAI-compatible server for oscar_compile models",
                                     add_help=add_help)
    parser.add_argument("--model", help="Hugging Face model directory (default: the bundled tiny model)")
    parser.add_argument("--spec", help="compression spec YAML (default: oscar-int2 for the bundled model, else bf16)")
    parser.add_argument("--rotations", help="rotation artifact (default: <model>/rotations/<spec name>.safetensors)")
    parser.add_argument("--served-model-name", nargs="+", metavar="NAME",
                        help="model ids clients may use; responses and /v1/models report the first "
                             "(default: the directory name)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--gpu-memory-utilization", type=float, metavar="SHARE",
                        help="share of the GPU's memory this server may fill (weights, the largest step, its "
                             "buffers and the KV cache, which gets what a profile run of the largest step leaves; "
                             "the share must be free at start); the start stops with an error when too little is "
                             "left (default: 0.9, as in vLLM; not used on the CPU, which keeps --kv-memory or "
                             "1 GiB, nor with --kv-memory)")
    parser.add_argument("--kv-memory", type=float, metavar="GIB",
                        help="KV cache budget in GiB, overriding --gpu-memory-utilization's plan; on a GPU a "
                             "profile run of the largest step checks that it fits (default: the plan; 1 GiB on "
                             "the CPU)")
    parser.add_argument("--max-model-len", type=int, help="context length (default: the model's)")
    parser.add_argument("--max-num-seqs", type=int,
                        help=f"sequences running at once (default: {DEFAULT_MAX_NUM_SEQS})")
    parser.add_argument("--max-num-batched-tokens", type=int,
                        help=f"token budget of one step (prefill chunks + decodes) (default: "
                             f"{DEFAULT_MAX_NUM_BATCHED_TOKENS})")
    parser.add_argument("--prefill-staging-memory", type=float, metavar="GIB",
                        help="with --prefill-semantics prompt-exact: full-precision staging of prompts prefilled "
                             "in chunks, on top of --kv-memory (default: the history of one prompt of the context "
                             "length; 0: off, later chunks read earlier ones quantized)")
    parser.add_argument("--swap-space", type=float, metavar="GIB",
                        help=f"host memory preempted sequences swap to (default {DEFAULT_SWAP_SPACE_GB:g}; 0: "
                             "recompute them)")
    parser.add_argument("--no-prefix-caching", action="store_true", help="disable prefix reuse")
    parser.add_argument("--prefix-hits", choices=PREFIX_HITS, default=None,
                        help="what a prefix-cache hit reuses: under decode-consistent prefill (the default), sink "
                             "and history up to a BF16 window snapshot (exact); the sink only (a hit computes what a "
                             "miss does); or, under prompt-exact prefill, sink and INT-b history pages (the "
                             "continuation reads the shared prefix quantized); default: snapshot under "
                             "decode-consistent prefill, history under prompt-exact")
    parser.add_argument("--snapshot-interval", type=int, default=None, metavar="TOKENS",
                        help="with --prefix-hits snapshot: tokens between a sequence's window snapshots, besides the "
                             "one at its prompt's end, a multiple of the page size (default: twice the tokens whose "
                             "INT-b history costs a snapshot's bytes)")
    parser.add_argument("--prefill-semantics", choices=PREFILL_SEMANTICS, default=DEFAULT_PREFILL_SEMANTICS,
                        help="what prompt tokens read from the cache: decode-consistent (as a decode step at their "
                             "position: chunked, batched and recomputed prefills and prefix hits equal the decode "
                             "steps) or prompt-exact (the prompt in full precision within itself, staged across "
                             "chunks) (default: %(default)s)")
    parser.add_argument("--deterministic", action="store_true",
                        help="batch invariance and run-to-run determinism: the same request gives the same "
                             "logprobs alone or in any batch (batch-invariant matmuls, fixed attention splits; "
                             "CUDA graphs stay on; on a GPU, chunked prefill is not covered yet). Slower: see the "
                             "README")
    parser.add_argument("--no-cuda-graphs", action="store_true", help="launch every step eagerly (no CUDA graphs)")
    parser.add_argument("--piecewise-max-tokens", type=int, metavar="N",
                        help="prefill and mixed steps of up to N tokens replay piecewise CUDA graphs (everything "
                             "but attention, captured per padded token count at start); 0: they run eagerly "
                             f"(default {DEFAULT_PIECEWISE_MAX_TOKENS})")
    parser.add_argument("--no-overlap", action="store_true",
                        help="run one step at a time "
                             "(by default a step's host work overlaps the next step on the device)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                        help="split the model over N processes, one per GPU (gloo on CPU): attention heads, KV "
                             "heads (each rank holds its own KV heads' pages) and MLP columns; N must divide the "
                             "KV heads (default 1)")
    parser.add_argument("--log-level", default="info",
                        choices=("critical", "error", "warning", "info", "debug"))
    _add_server_args(parser)
    _add_replica_args(parser)
    return parser


def _add_replica_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("replicas on a Ray cluster (the [ray] extra; cli/serve_replicas.py)")
    group.add_argument("--replicas", type=int, default=None, metavar="N",
                       help="serve N engine replicas behind one endpoint on Ray Serve, routed by shared prompt "
                            "prefix (default: one engine in this process)")
    group.add_argument("--ray-address", default=None, metavar="ADDR",
                       help="with --replicas: the Ray cluster to join ('auto', or host:port of 'ray start --head'; "
                            "default: start a local one)")
    group.add_argument("--replica-cpus", type=float, default=1.0, metavar="N",
                       help="with --replicas: CPUs each replica reserves (fractions allowed; default: %(default)s)")


def _add_server_args(parser: argparse.ArgumentParser) -> None:
    from oscar_compile.runtime.server import server_config as defaults

    group = parser.add_argument_group("access and limits")
    group.add_argument("--api-key", default=os.environ.get("OSCAR_API_KEY") or None,
                       help="require 'Authorization: Bearer KEY' on /v1/* (default: $OSCAR_API_KEY; unset: open)")
    group.add_argument("--metrics-require-key", action="store_true", help="/metrics needs the key too")
    group.add_argument("--max-body-bytes", type=int, default=defaults.DEFAULT_MAX_BODY_BYTES,
                       help="larger request bodies get 413 (default: %(default)s)")
    group.add_argument("--max-waiting-requests", type=int, default=defaults.DEFAULT_MAX_WAITING_REQUESTS,
                       help="with this many requests queued, new ones get 503 + Retry-After (default: %(default)s)")
    group.add_argument("--request-timeout", type=float, metavar="S",
                       help="abort a request (408, pages freed) still running after S seconds (default: none)")
    group.add_argument("--shutdown-timeout", type=float, metavar="S", default=defaults.DEFAULT_SHUTDOWN_TIMEOUT_S,
                       help="on SIGTERM/SIGINT, time for in-flight requests to finish (default: %(default)s)")
    group.add_argument("--default-max-tokens", type=int, default=defaults.DEFAULT_CHAT_MAX_TOKENS,
                       help="max_tokens of a chat request that sets none, capped by the context "
                            "(default: %(default)s; completions keep OpenAI's 16)")
    group.add_argument("--strict-fields", action="store_true",
                       help="refuse unknown request fields with 400 (default: ignore them, as vLLM does, "
                            "with a warning and the /metrics counter oscar_ignored_request_fields_total)")
    group.add_argument("--chat-template", metavar="FILE",
                       help="Jinja chat template to render messages with (default: the tokenizer's)")
    _add_tool_args(parser)


def _add_tool_args(parser: argparse.ArgumentParser) -> None:
    from oscar_compile.runtime.server.tool_parsers import TOOL_PARSERS

    group = parser.add_argument_group("tool calls (as vLLM's flags)")
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='allow tool_choice "auto" (also what tools without a tool_choice mean): the model '
                            "decides, --tool-call-parser reads its calls (required and named choices need neither)")
    group.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS),
                       help="the model's tool-call format: hermes (Hermes, Qwen2.5/Qwen3, the bundled model)")


def server_config(args: argparse.Namespace):
    """The ServerConfig the flags describe (ValueError for a bad value)."""
    from oscar_compile.runtime.server.server_config import ServerConfig

    if args.api_key == "":
        raise ValueError("--api-key must not be empty")
    return ServerConfig(api_key=args.api_key, metrics_require_key=args.metrics_require_key,
                        max_body_bytes=args.max_body_bytes, max_waiting_requests=args.max_waiting_requests,
                        request_timeout_s=args.request_timeout, shutdown_timeout_s=args.shutdown_timeout,
                        default_chat_max_tokens=args.default_max_tokens, strict_fields=args.strict_fields,
                        chat_template=read_chat_template(args.chat_template),
                        tool_call_parser=args.tool_call_parser, enable_auto_tool_choice=args.enable_auto_tool_choice)


def read_chat_template(path: str | None) -> str | None:
    """The text of ``--chat-template FILE`` (FileNotFoundError naming it when it is missing)."""
    if path is None:
        return None
    from pathlib import Path

    if not Path(path).is_file():
        raise FileNotFoundError(f"--chat-template: no such file: {path}")
    text = Path(path).read_text(encoding="utf-8")
    if not text.strip():
        raise ValueError(f"--chat-template: {path} is empty")
    return text


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """The warning to log when ``host`` is reachable from other machines and no key is set."""
    if api_key is not None:
        return None
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        loopback = False
    if loopback:
        return None
    return (f"binding {host} without an API key: anyone who can reach this address can use the "
            f"server; pass --api-key or set OSCAR_API_KEY")


def app_from_args(args: argparse.Namespace):
    """Load the model the flags name and return (FastAPI app, served model name)."""
    server = server_config(args)  # refuse bad flags before loading anything
    from oscar_compile.assembly import assemble_for_serving, build_app

    built = assemble_for_serving(args.model, args.spec, args.rotations, config=engine_config(args),
                                 device=args.device, tensor_parallel_size=args.tensor_parallel_size)
    return build_app(built, args.served_model_name, server)


def engine_config(args: argparse.Namespace):
    """The EngineConfig the flags describe: a flag left out takes the config's own default
    (core/config.py), the one place each default is written."""
    from oscar_compile.runtime.engine_config import EngineConfig

    given = dict(kv_memory_gb=args.kv_memory, gpu_memory_utilization=args.gpu_memory_utilization,
                 max_num_seqs=args.max_num_seqs,
                 max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                 prefill_staging_memory_gb=args.prefill_staging_memory, swap_space_gb=args.swap_space,
                 prefix_hits=args.prefix_hits, snapshot_interval=args.snapshot_interval,
                 prefill_semantics=args.prefill_semantics, piecewise_max_tokens=args.piecewise_max_tokens)
    return EngineConfig(enable_prefix_caching=not args.no_prefix_caching, cuda_graphs=not args.no_cuda_graphs,
                        overlap_steps=not args.no_overlap, deterministic=args.deterministic,
                        **{name: value for name, value in given.items() if value is not None})


def compression_for(args: argparse.Namespace, model_dir):
    """(spec path, rotations path or None) the server compresses the model with."""
    from oscar_compile.assembly import default_compression

    return default_compression(model_dir, args.spec, args.rotations, bundled=args.model is None)


def main(argv: list[str] | None = None) -> int:
    return serve(parse_args(argv))


def add_parser(sub) -> None:
    """``oscar-compile serve``: the same flags, the same assembly."""
    p = sub.add_parser("serve", parents=[build_parser(add_help=False)],
                       help="serve a model over the OpenAI API (as python -m oscar_compile.runtime.serve)")
    p.set_defaults(func=serve)


ALLOCATOR_SETTINGS = "PYTORCH_CUDA_ALLOC_CONF"


def default_allocator_settings(args: argparse.Namespace, environ=os.environ) -> None:
    """Expandable segments for a one-GPU server whose user set no allocator settings. The memory
    plan promises the live tensors' peak; the default allocator's cache of split blocks, over steps
    of many shapes, held 77.2 GiB of an H100's 79.2 for a 71.3 GiB share, expandable segments 72.7
    (the plan's GPU test, bench/results/2026-12-07-gpu-int2-prefill-step, calls c and d). Set before
    the first CUDA allocation, which reads it. Not under tensor parallelism, untried there."""
    if args.tensor_parallel_size == 1 and args.device != "cpu" and ALLOCATOR_SETTINGS not in environ:
        environ[ALLOCATOR_SETTINGS] = "expandable_segments:True"


def serve(args: argparse.Namespace) -> int:
    """Build the app the flags describe and serve it (``main`` and ``oscar-compile serve``)."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    default_allocator_settings(args)
    if args.replicas is not None:
        if args.replicas < 1:
            print(f"error: --replicas must be >= 1, got {args.replicas}", file=sys.stderr)
            return 2
        from oscar_compile.cli.serve_replicas import serve as serve_replicas

        try:  # refuse bad flags before starting anything
            server = server_config(args)
        except (FileNotFoundError, ValueError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        warning = exposure_warning(args.host, args.api_key)
        if warning:
            logger.warning(warning)
        return serve_replicas(args, engine_config(args), server)
    if args.ray_address is not None:
        print("error: --ray-address needs --replicas", file=sys.stderr)
        return 2
    try:
        app, _ = app_from_args(args)
    except (FileNotFoundError, ValueError, NotImplementedError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        with frozen_startup_heap():
            run_server(app, args)
    finally:
        if app.state.tensor_parallel is not None:
            app.state.tensor_parallel.close()
    return 0


@contextlib.contextmanager
def frozen_startup_heap():
    """While serving, the garbage collector leaves alone what startup built (``gc.freeze``): the
    model's modules, the rewritten graphs, the CUDA graphs' tensors, Triton's caches. A full
    collection walks every tracked object and stops the engine's thread meanwhile: an INT2 batch
    32 had eight mixed steps of 70-85 ms against forwards of 21 ms
    (bench/results/2026-12-05-gpu-int2-prefill-end-to-end, call 12), as vLLM, SGLang and
    TensorRT-LLM found too (they freeze after warm-up: lower ITL p99). Unfrozen at the end, so that
    a process that serves again (the tests) collects as usual."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def run_server(app, args: argparse.Namespace) -> None:
    """Serve ``app`` until SIGTERM / SIGINT has drained it."""
    warning = exposure_warning(args.host, args.api_key)
    if warning:
        logger.warning(warning)
    import uvicorn

    from oscar_compile.runtime.server.shutdown import DrainingServer

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=5)
    DrainingServer(config, app.state.admission, args.shutdown_timeout).run()


if __name__ == "__main__":
    sys.exit(main())
