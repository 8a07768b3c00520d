"""``oscar-compile serve --replicas N``: the serve command's flags, run as N engine replicas on a
Ray cluster behind one endpoint (runtime/server/ray_serve/).

Without ``--ray-address`` it starts a local cluster (``ray.init``); with one (``auto``, or
``host:port`` of ``ray start --head``) it joins that cluster, and Ray Serve places the replicas on
its nodes. Each replica builds its engine from ``EngineRecipe``: the model, spec, rotations and
engine flags of the single-process server, assembled on the replica's node (README, "Many
replicas on a Ray cluster"). Ray is the ``[ray]`` extra: without it this command says so.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("oscar_compile.runtime.serve")


@dataclass(frozen=True)
class EngineRecipe:
    """How a replica builds its engine (picklable: Ray sends it to each replica). Called there:
    (LLMEngine, its other tensor-parallel ranks or None), as ``assembly.build_app`` builds them."""

    model: str | None
    spec: str | None
    rotations: str | None
    config: Any  # EngineConfig
    device: str = "auto"
    tensor_parallel_size: int = 1

    def __call__(self):
        from oscar_compile.assembly import assemble_for_serving

        built = assemble_for_serving(self.model, self.spec, self.rotations, config=self.config, device=self.device,
                                     tensor_parallel_size=self.tensor_parallel_size)
        return built.engine, built.tensor_parallel


def served_names(args: argparse.Namespace) -> list[str]:
    """The served model names (the model directory's name unless ``--served-model-name``)."""
    if args.served_model_name:
        return list(args.served_model_name)
    from oscar_compile.loading import resolve_model_dir

    return [resolve_model_dir(args.model).name]


def build_application(args: argparse.Namespace, engine, server, router: str = "prefix"):
    """The Ray Serve application the flags describe (not yet running): ``engine`` is their
    EngineConfig, ``server`` their ServerConfig (``cli.serve`` reads both from the flags)."""
    from oscar_compile.runtime.server.ray_serve.ingress import ReplicaPlacement
    from oscar_compile.runtime.server.ray_serve.ingress import build_application as build

    on_gpu = args.device == "cuda" or (args.device == "auto" and _cluster_has_gpus())
    placement = ReplicaPlacement(num_cpus=args.replica_cpus,
                                 num_gpus=float(args.tensor_parallel_size) if on_gpu else 0.0)
    recipe = EngineRecipe(args.model, args.spec, args.rotations, engine, args.device, args.tensor_parallel_size)
    return build(recipe, served_names(args), server, num_replicas=args.replicas,
                 max_num_seqs=engine.scheduler.max_num_seqs, placement=placement, router=router)


def _cluster_has_gpus() -> bool:
    import ray

    return ray.cluster_resources().get("GPU", 0) > 0


def serve(args: argparse.Namespace, engine, server) -> int:
    """Start (or join) the cluster, run the application on ``--host``/``--port`` until interrupted."""
    try:
        import ray
        from ray import serve as ray_serve
    except ImportError:
        print("error: --replicas needs Ray Serve: pip install 'oscar_compile[ray]'", file=sys.stderr)
        return 2
    ray.init(address=args.ray_address, include_dashboard=False, logging_level=args.log_level.upper())
    try:
        ray_serve.start(http_options={"host": args.host, "port": args.port})
        try:
            app = build_application(args, engine, server)
        except (FileNotFoundError, ValueError, NotImplementedError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        ray_serve.run(app, name="oscar", route_prefix="/")
        logger.info("serving %d replicas on http://%s:%d", args.replicas, args.host, args.port)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        ray_serve.shutdown()
        ray.shutdown()
