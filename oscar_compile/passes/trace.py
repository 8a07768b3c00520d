"""Trace a Hugging Face attention module's forward into a torch.fx graph.

Plain ``symbolic_trace`` fails on HF attention code for three reasons, each handled here:
- ``(*hidden_states.shape[:-1], -1, head_dim)`` star-unpacks a shape: the tracer knows the
  rank of ``hidden_states`` (3) and hands out its shape as a tuple of ``size(i)`` proxies;
- the attention call goes through ``ALL_ATTENTION_FUNCTIONS`` into code with data-dependent
  branches: while tracing, the model's attention implementation is a marker that records one
  ``attention_site`` node instead of being traced into;
- ``apply_rotary_pos_emb`` is recorded as one node (the passes insert the key/query rotation right
  after it), by swapping the module-global for a recorder during the trace. With Hugging Face's
  ``kernels`` package installed, transformers wraps that function in a hub-kernel module
  (``plain_function`` below); the node then records the plain function it wraps.
Submodules (projections, q/k norms) stay leaves: the passes act on whole projections.
The traced function takes ``(hidden_states, cos, sin, attention_mask, cache)``, the same for the
transformers versions we support (the cache argument changed name, not position).
"""
from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Callable, Iterator

import torch
import torch.fx
from torch import nn
from transformers import AttentionInterface

SITE_IMPLEMENTATION = "oscar_fx_site"


def attention_site(query, key, value, attention_mask, **kwargs):
    """Stands for the model's attention call in a traced graph; a pass replaces or binds it."""
    raise RuntimeError("attention_site is a graph marker: bind it with passes.swap_attention before running")


def _record_site(module, query, key, value, attention_mask, **kwargs):
    return query.tracer.create_proxy("call_function", attention_site, (query, key, value, attention_mask), kwargs)


AttentionInterface.register(SITE_IMPLEMENTATION, _record_site)


class _ShapedProxy(torch.fx.Proxy):
    def __getattr__(self, name):
        if name == "shape" and "rank" in self.node.meta:
            return tuple(self.size(i) for i in range(self.node.meta["rank"]))
        return super().__getattr__(name)


class AttentionTracer(torch.fx.Tracer):
    def proxy(self, node: torch.fx.Node) -> torch.fx.Proxy:
        return _ShapedProxy(node, self)

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return True

    def create_proxy(self, kind, target, args, kwargs, name=None, type_expr=None, proxy_factory_fn=None):
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
        if kind == "placeholder" and target == "hidden_states":
            proxy.node.meta["rank"] = 3  # [B, T, hidden]
        return proxy


def plain_function(fn: Callable) -> Callable:
    """The plain Python function behind ``fn``, which may be a hub-kernel wrapper.

    When the ``kernels`` package is importable, ``@use_kernel_forward_from_hub(name)`` turns a
    function into an instance of an ``nn.Module`` class (``Func``) whose ``forward`` calls the
    function, unless ``kernelize()`` swapped in a kernel from the Hub. We never kernelize (there is
    no network, and the passes replace these ops themselves), so the wrapper always computes the
    plain function. An fx ``call_function`` node needs a target with a ``__name__`` for its code,
    and the passes find RoPE by that name: record the plain function.
    """
    if inspect.isfunction(fn):
        return fn
    if isinstance(fn, nn.Module) and hasattr(type(fn), "kernel_layer_name"):
        wrapped = inspect.getclosurevars(type(fn).forward).nonlocals.get("func")
        if inspect.isfunction(wrapped):
            return wrapped
    raise NotImplementedError(
        f"{fn!r} (kernel layer {getattr(fn, 'kernel_layer_name', None)!r}) is not a plain function, and the function it"
        " wraps could not be found: this `kernels` package wraps hub functions in a way oscar_compile does not know")


@contextlib.contextmanager
def _tracing_hooks(module: nn.Module, fn_globals: dict) -> Iterator[None]:
    rope = fn_globals.get("apply_rotary_pos_emb")
    if rope is None:
        raise NotImplementedError(f"{type(module).__name__}: no apply_rotary_pos_emb in its module; cannot locate RoPE")
    target = plain_function(rope)

    def record_rope(q, k, cos, sin, *args, **kwargs):
        return q.tracer.create_proxy("call_function", target, (q, k, cos, sin, *args), kwargs)

    saved_impl = module.config._attn_implementation
    fn_globals["apply_rotary_pos_emb"] = record_rope
    module.config._attn_implementation = SITE_IMPLEMENTATION
    try:
        yield
    finally:
        fn_globals["apply_rotary_pos_emb"] = rope
        module.config._attn_implementation = saved_impl


def trace_attention(module: nn.Module) -> torch.fx.GraphModule:
    """The module's forward as a GraphModule over ``(hidden_states, cos, sin, attention_mask, cache)``."""
    forward = inspect.unwrap(type(module).forward)

    def traced(self, hidden_states, cos, sin, attention_mask, cache):
        return forward(self, hidden_states, (cos, sin), attention_mask, cache)

    root = copy.copy(module)  # shares submodules and parameters; only the class differs
    root.__class__ = type(f"Traced{type(module).__name__}", (type(module),), {"forward": traced})
    with _tracing_hooks(module, forward.__globals__):
        graph = AttentionTracer().trace(root)
    return torch.fx.GraphModule(module, graph, class_name=f"Oscar{type(module).__name__}")
