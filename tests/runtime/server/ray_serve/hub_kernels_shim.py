"""Until issue 38 lands: make transformers see the HF ``kernels`` package as absent.

transformers >= 5.25 requires ``kernels``; when it is importable, ``apply_rotary_pos_emb`` becomes
a ``Func`` module that the attention tracer (passes/trace.py) cannot name, so every ``apply()``
fails (issue 38, being fixed in the passes). These tests are about serving, not the passes: they
run the engine as the project runs it without ``kernels``. ``hide`` runs before transformers is
imported, in the test process and in every Ray worker (``worker_process_setup_hook``). Delete this
module once the passes work with ``kernels`` installed.
"""


def hide() -> None:
    """The hub decorators as they are without ``kernels``: the class or function unchanged."""
    import transformers.integrations.hub_kernels as hub_kernels

    def unchanged(*args, **kwargs):
        return lambda obj: obj

    hub_kernels.use_kernelized_func = unchanged
    hub_kernels.use_kernel_forward_from_hub = unchanged
    hub_kernels.use_kernel_func_from_hub = unchanged
    unwrap_loaded()


def unwrap_loaded() -> None:
    """In models already imported (the test process imports Qwen3 before any test runs): the
    plain function back in place of the ``Func`` module that wraps it."""
    import sys

    for name, module in list(sys.modules.items()):
        if not name.startswith("transformers.models.") or ".modeling_" not in name:
            continue
        wrapped = getattr(module, "apply_rotary_pos_emb", None)
        if type(wrapped).__name__ != "Func":
            continue
        for cell in type(wrapped).forward.__closure__ or ():
            inner = cell.cell_contents
            if callable(inner) and getattr(inner, "__name__", None) == "apply_rotary_pos_emb":
                module.apply_rotary_pos_emb = inner
