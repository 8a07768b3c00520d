"""The cache's shape, described once: typed, torch-free, at the bottom of the tree.

Everything that allocates, addresses or sizes the paged KV cache reads it from here: the spec
resolves to it (:meth:`CacheLayout.from_spec`, :meth:`LayerCache.of`), the graph passes hand a
:class:`LayerCache` to the cache contract (``oscar_compile.cache.contract``), the HF cache and
the runtime's pools are allocated from it, and the runtime's page planner sizes pages with it.
The rules that used to be repeated in several modules are written here once:

- the windows (sink ``S0`` and recent ``W``) are multiples of the page size ``P``;
- a quantized layer's ``group_size`` divides ``head_dim`` and its rows are whole bytes;
- **nothing quantized, so no windows** (:func:`has_windows`): a model whose every layer keeps
  16 bits stores every token in a full-precision page (the classic paged cache, the runtime's
  BF16 mode, the ``oscar::*_bf16`` ops); windows would only add a second page table. A 16-bit
  layer *beside* INT-b layers keeps the windows, whose page tables are shared by all layers;
- the scale / zero dtypes and their byte sizes (:data:`SCALE_DTYPE_BYTES`; the reference
  quantizer maps the same names to torch dtypes).

Plain integers and strings only, so the bookkeeping tests run anywhere (docs/cache-format.md).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

FULL_PRECISION_BITS = 16  # history rows kept as they are: no codes, no scale / zero
SCALE_DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}  # the spec's scale_dtype choices
_SCALE_DTYPE_ALIASES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


def scale_dtype_bytes(name: str) -> int:
    """Bytes of one scale (or zero) stored as ``name`` (a spec name, or fp16 / bf16 / fp32)."""
    return SCALE_DTYPE_BYTES[_SCALE_DTYPE_ALIASES.get(name, name)]


def check_windows(sink: int, recent: int, page_size: int) -> None:
    """S0 and W must be non-negative multiples of P (a window page never straddles sink/recent)."""
    if sink < 0 or recent < 0 or sink % page_size or recent % page_size:
        raise ValueError(f"sink ({sink}) and recent ({recent}) must be non-negative multiples of "
                         f"page_size ({page_size})")


def num_history_tokens(cache_len: int, sink: int, recent: int, history_floor: int = 0) -> int:
    """History tokens (positions ``[S0, L - W)``) of a sequence holding ``cache_len`` tokens.

    ``history_floor`` is the history length a prefix-cache hit started from (the runtime's
    block manager): history never shrinks below it."""
    return max(history_floor, cache_len - recent - sink, 0)


def num_pages_for(num_tokens: int, page_size: int) -> int:
    """Pages that hold ``num_tokens`` tokens."""
    return math.ceil(num_tokens / page_size)


def has_windows(bits_per_layer) -> bool:
    """Whether a model whose layers store their history at these bits keeps sink / recent windows:
    only when some layer is quantized (see the module docstring)."""
    return any(bits != FULL_PRECISION_BITS for bits in bits_per_layer)


@dataclass(frozen=True)
class LayerCache:
    """The pools of one layer: windows, page size and how its history is stored.

    What a rewritten attention graph hands the cache contract (as keyword constants of its
    ``layer_inputs`` node, :meth:`as_kwargs`), and what the HF cache allocates a layer from.
    """

    sink: int
    recent: int
    page_size: int
    bits: int
    group_size: int
    scale_dtype: str

    @classmethod
    def of(cls, layer_spec) -> "LayerCache":
        """From a resolved ``oscar_compile.spec.LayerSpec`` (windows already resolved by apply)."""
        kv = layer_spec.kv_cache
        return cls(kv.sink_tokens, kv.recent_tokens, kv.page_size, kv.bits, kv.group_size, kv.scale_dtype)

    @property
    def full_precision_pages(self) -> bool:
        """Every token in a full-precision page (the ``oscar::*_bf16`` ops): a 16-bit layer without
        windows. A 16-bit layer with windows takes the INT-b ops with bits = 16."""
        return self.bits == FULL_PRECISION_BITS and self.sink == 0 and self.recent == 0

    def as_kwargs(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class LayerFormat:
    """How one layer stores its history: INT-b codes with scale/zero per group, or 16-bit rows."""

    bits: int = 2
    group_size: int = 128
    scale_dtype: str = "float16"

    def history_row_bytes(self, head_dim: int, dtype_bytes: int) -> int:
        """Bytes of one token of one KV head, K or V."""
        if self.bits == 16:
            return head_dim * dtype_bytes
        num_groups = head_dim // self.group_size
        return head_dim * self.bits // 8 + 2 * num_groups * scale_dtype_bytes(self.scale_dtype)


@dataclass(frozen=True)
class CacheLayout:
    """Shape of the cache of one model: what a page holds and how many bytes it costs.

    ``bits`` / ``group_size`` / ``scale_dtype`` describe every layer's history unless
    ``layer_formats`` (one per layer) says otherwise; ``full_precision_layers`` is the shorthand
    for layers kept at 16 bits. Sink and recent windows are the same for every layer: the page
    tables are shared by all layers.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int = 16
    sink: int = 64
    recent: int = 256
    bits: int = 2
    group_size: int = 128
    scale_dtype: str = "float16"
    dtype_bytes: int = 2
    full_precision_layers: tuple[int, ...] = field(default_factory=tuple)
    layer_formats: tuple[LayerFormat, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size", "dtype_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        check_windows(self.sink, self.recent, self.page_size)
        bad = [i for i in self.full_precision_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"full_precision_layers out of range [0, {self.num_layers}): {bad}")
        if self.layer_formats and len(self.layer_formats) != self.num_layers:
            raise ValueError(
                f"layer_formats needs one entry per layer ({self.num_layers}), got {len(self.layer_formats)}"
            )
        for layer in range(self.num_layers):
            self._check_format(layer, self.format_of(layer))

    def _check_format(self, layer: int, fmt: LayerFormat) -> None:
        if fmt.bits not in (2, 4, 16):
            raise ValueError(f"layer {layer}: bits must be 2, 4 or 16, got {fmt.bits}")
        if fmt.bits == 16:
            return
        if fmt.group_size < 1 or self.head_dim % fmt.group_size:
            raise ValueError(
                f"layer {layer}: group_size must divide head_dim={self.head_dim}, got {fmt.group_size}"
            )
        if (self.head_dim * fmt.bits) % 8:
            raise ValueError(f"layer {layer}: head_dim * bits must be whole bytes, got {self.head_dim}")
        if _SCALE_DTYPE_ALIASES.get(fmt.scale_dtype, fmt.scale_dtype) not in SCALE_DTYPE_BYTES:
            raise ValueError(
                f"layer {layer}: scale_dtype must be one of {sorted([*SCALE_DTYPE_BYTES, *_SCALE_DTYPE_ALIASES])}, "
                f"got {fmt.scale_dtype!r}"
            )

    def format_of(self, layer: int) -> LayerFormat:
        if self.layer_formats:
            return self.layer_formats[layer]
        if layer in self.full_precision_layers:
            return LayerFormat(bits=16)
        return LayerFormat(self.bits, self.group_size, self.scale_dtype)

    @classmethod
    def bf16(cls, num_layers: int, num_kv_heads: int, head_dim: int, page_size: int = 16,
             dtype_bytes: int = 2) -> "CacheLayout":
        """The full-precision baseline: no windows, every token in a 16-bit page."""
        return cls(num_layers, num_kv_heads, head_dim, page_size=page_size, sink=0, recent=0,
                   bits=16, dtype_bytes=dtype_bytes)

    @classmethod
    def from_hf_config(cls, config, **kwargs) -> "CacheLayout":
        """Read layers, KV heads and head_dim from a Hugging Face config (text part)."""
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        return cls(config.num_hidden_layers, num_kv_heads, head_dim, **kwargs)

    @classmethod
    def from_spec(cls, spec, config, dtype_bytes: int = 2) -> "CacheLayout":
        """The layout an ``oscar_compile.spec.CompressionSpec`` asks for, per layer resolved."""
        base = cls.from_hf_config(config, dtype_bytes=dtype_bytes, bits=16, sink=0, recent=0)
        kv = spec.kv_cache
        layers = [spec.for_layer(i, base.num_layers).kv_cache for i in range(base.num_layers)]
        quantized = has_windows([c.bits for c in layers])
        if quantized and any((c.sink_tokens, c.recent_tokens) != (kv.sink_tokens, kv.recent_tokens) for c in layers):
            raise NotImplementedError(
                "per-layer sink/recent windows: the paged runtime shares one page table across layers"
            )
        formats = tuple(LayerFormat(c.bits, c.group_size, c.scale_dtype) for c in layers)
        sink, recent = (kv.sink_tokens, kv.recent_tokens) if quantized else (0, 0)
        return cls(base.num_layers, base.num_kv_heads, base.head_dim, page_size=kv.page_size,
                   sink=sink, recent=recent, bits=kv.bits,
                   group_size=kv.group_size, scale_dtype=kv.scale_dtype, dtype_bytes=dtype_bytes,
                   layer_formats=formats)

    def layer_cache(self, layer: int) -> "LayerCache":
        """What layer ``layer``'s pools look like (the windows are shared by every layer)."""
        fmt = self.format_of(layer)
        return LayerCache(self.sink, self.recent, self.page_size, fmt.bits, fmt.group_size, fmt.scale_dtype)

    @property
    def is_full_precision(self) -> bool:
        """Every layer keeps its history at 16 bits (nothing is quantized)."""
        return all(self.format_of(layer).bits == 16 for layer in range(self.num_layers))

    @property
    def num_window_pages_per_seq(self) -> int:
        return (self.sink + self.recent) // self.page_size

    @property
    def num_sink_pages(self) -> int:
        return self.sink // self.page_size

    @property
    def window_page_bytes(self) -> int:
        """K and V, all layers, ``P`` tokens in the model dtype."""
        row = self.head_dim * self.dtype_bytes
        return 2 * self.num_layers * self.num_kv_heads * self.page_size * row

    @property
    def quant_page_bytes(self) -> int:
        """K and V, all layers, ``P`` history tokens: codes + scale + zero, or 16-bit rows."""
        row_bytes = sum(self.format_of(layer).history_row_bytes(self.head_dim, self.dtype_bytes)
                        for layer in range(self.num_layers))
        return 2 * self.num_kv_heads * self.page_size * row_bytes

    def num_history_tokens(self, num_cached_tokens: int, history_floor: int = 0) -> int:
        """History tokens held when the cache holds ``num_cached_tokens`` (positions from S0).

        ``history_floor`` is the history length a prefix-cache hit started from (see
        page_manager): history never shrinks below it.
        """
        return num_history_tokens(num_cached_tokens, self.sink, self.recent, history_floor)

    def num_quant_pages_for(self, num_history_tokens: int) -> int:
        return num_pages_for(num_history_tokens, self.page_size)

    def num_pages_for_seq(self, num_tokens: int) -> tuple[int, int]:
        """(window pages, quant pages) one sequence of ``num_tokens`` cached tokens needs."""
        return (self.num_window_pages_per_seq,
                self.num_quant_pages_for(self.num_history_tokens(num_tokens)))
