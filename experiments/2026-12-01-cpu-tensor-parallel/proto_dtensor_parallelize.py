"""Rejected: DTensor's ``parallelize_module`` (ColwiseParallel / RowwiseParallel) under ``apply``.

    OMP_NUM_THREADS=1 python experiments/2026-12-01-cpu-tensor-parallel/proto_dtensor_parallelize.py   # 2 ranks, gloo

What it printed on 2026-12-01 (torch 2.13.0+cpu, transformers 5.24, the bundled model; q/k/v and
gate/up column-wise, o_proj and down_proj row-wise, per decoder layer):

    plain HF forward with DTensor TP: ok
    naive-int2 (no rotation), fuse=False: ok
    naive-int2 (no rotation), fuse=True: aten.mm.default got mixed torch.Tensor and DTensor
        (the traced graph's F.linear(hidden_states, oscar_qkv_weight): merge_projections made the
        merged q/k/v weight a DTensor, the activation is a plain tensor)
    oscar-int2, fuse=False and fuse=True: aten.bmm.default got mixed torch.Tensor and DTensor
        (fold_value_rotation: R_V(h)^T @ W[h] with the rotation a plain tensor)

So DTensor carries only the unrotated, unfused model; the shipped path (R_V fold, merged GEMMs)
would need every pass rewritten for DTensor. oscar_compile/tensor_parallel/shard.py slices plain
tensors before ``apply`` instead (its docstring says what else that buys).
"""
import copy
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def main(rank):
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29555", rank=rank, world_size=2)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from oscar_compile.artifact import Rotations
    from oscar_compile.calibration import calibrate
    from oscar_compile.loading import BUNDLED_MODEL_DIR, load_model
    from oscar_compile.passes import apply
    from oscar_compile.spec import shipped_spec

    mesh = init_device_mesh("cpu", (2,))
    model, _ = load_model(BUNDLED_MODEL_DIR, "cpu")
    plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}
    for layer in model.model.layers:
        parallelize_module(layer, mesh, plan)
    ids = torch.tensor([[5, 6, 7, 8]])
    model(ids)
    if rank == 0:
        print("plain HF forward with DTensor TP: ok")
    oscar = Rotations.load(BUNDLED_MODEL_DIR / "rotations" / "oscar-int2.safetensors")
    for name in ("naive-int2", "oscar-int2"):
        for fuse in (False, True):
            m = copy.deepcopy(model)
            spec = shipped_spec(name)
            try:
                apply(m, spec, oscar if name == "oscar-int2" else calibrate(m, spec), fuse=fuse)
                m(ids)
                result = "ok"
            except Exception as err:
                frame = traceback.extract_tb(err.__traceback__)[-1]
                result = f"{err} ({frame.filename.rsplit('/', 1)[-1]}:{frame.lineno})"
            if rank == 0:
                print(f"{name}, fuse={fuse}: {result[:200]}")
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(main, nprocs=2)
