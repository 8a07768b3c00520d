"""Page geometry of the paged KV cache and how a memory budget becomes page counts.

The cache (docs/cache-format.md) has two kinds of pages, each a fixed pool shared by all layers
(page ``i`` of a kind is row ``i`` of that kind's pool in every layer):

- **window pages** hold full-precision tokens: the ``S0`` sink tokens and the ring of the ``W``
  most recent tokens. Every sequence owns ``(S0 + W) / P`` of them from admission to finish.
- **quant pages** hold ``P`` history tokens each (positions ``[S0, L - W)``), one more every ``P``
  demoted tokens. A layer the spec keeps at 16 bits stores its history rows in full precision, so
  a quant page is bigger than ``P`` INT-b tokens when such layers exist; the page ids stay the same
  for every layer, only the per-layer pool dtype differs.

"BF16 mode" (the side-by-side baseline) is ``bits=16`` with ``S0 = W = 0``: every token lives in a
full-precision "quant" page at ``quant_table[p // P]``, row ``p % P`` - the classic paged layout.

Nothing here touches torch: the geometry is plain integers so the bookkeeping tests run anywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

SCALE_DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "fp16": 2, "bf16": 2, "fp32": 4}
GIB = 1024**3


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
        return head_dim * self.bits // 8 + 2 * num_groups * SCALE_DTYPE_BYTES[self.scale_dtype]


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
        for name in ("sink", "recent"):
            value = getattr(self, name)
            if value < 0 or value % self.page_size:
                raise ValueError(
                    f"{name} must be a non-negative multiple of page_size={self.page_size}, "
                    f"got {value}"
                )
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
        if fmt.scale_dtype not in SCALE_DTYPE_BYTES:
            raise ValueError(
                f"layer {layer}: scale_dtype must be one of {sorted(SCALE_DTYPE_BYTES)}, "
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
        quantized = any(c.bits != 16 for c in layers)  # else no windows at all (apply.resolve_layers)
        if quantized and any((c.sink_tokens, c.recent_tokens) != (kv.sink_tokens, kv.recent_tokens) for c in layers):
            raise NotImplementedError(
                "per-layer sink/recent windows: the paged runtime shares one page table across layers"
            )
        formats = tuple(LayerFormat(c.bits, c.group_size, c.scale_dtype) for c in layers)
        return cls(base.num_layers, base.num_kv_heads, base.head_dim, page_size=kv.page_size,
                   sink=kv.sink_tokens, recent=kv.recent_tokens, bits=kv.bits,
                   group_size=kv.group_size, scale_dtype=kv.scale_dtype, dtype_bytes=dtype_bytes,
                   layer_formats=formats)

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
        block_manager): history never shrinks below it.
        """
        return max(history_floor, num_cached_tokens - self.recent - self.sink, 0)

    def num_quant_pages_for(self, num_history_tokens: int) -> int:
        return math.ceil(num_history_tokens / self.page_size)

    def num_pages_for_seq(self, num_tokens: int) -> tuple[int, int]:
        """(window pages, quant pages) one sequence of ``num_tokens`` cached tokens needs."""
        return (self.num_window_pages_per_seq,
                self.num_quant_pages_for(self.num_history_tokens(num_tokens)))


@dataclass(frozen=True)
class PagePlan:
    num_window_pages: int
    num_quant_pages: int


def plan_pages(layout: CacheLayout, kv_memory_bytes: int, max_num_seqs: int,
               expected_seq_len: int) -> PagePlan:
    """Split a KV memory budget into window and quant pages.

    The split is fixed at start-up because each kind is a preallocated pool per layer. Window pages
    cap how many sequences run at once, quant pages cap how many tokens of history fit in total;
    sizing both for ``expected_seq_len`` tokens per sequence balances them at that length (shorter
    sequences leave history unused, longer ones run fewer at a time). The windows of at least one
    sequence always fit, or the budget is refused.
    """
    if kv_memory_bytes <= 0:
        raise ValueError(f"kv memory must be > 0 bytes, got {kv_memory_bytes}")
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    num_window, num_quant = layout.num_pages_for_seq(max(expected_seq_len, 1))
    window_bytes = num_window * layout.window_page_bytes
    seq_bytes = window_bytes + num_quant * layout.quant_page_bytes
    num_seqs = min(max_num_seqs, kv_memory_bytes // seq_bytes) if seq_bytes else max_num_seqs
    if window_bytes and num_seqs < 1:
        if kv_memory_bytes < window_bytes:
            raise ValueError(
                f"kv memory of {kv_memory_bytes / GIB:.3f} GiB cannot hold the windows of one "
                f"sequence ({window_bytes / GIB:.3f} GiB)"
            )
        num_seqs = 1
    num_window_pages = num_seqs * num_window
    left = kv_memory_bytes - num_window_pages * layout.window_page_bytes
    num_quant_pages = left // layout.quant_page_bytes
    if num_quant_pages < 1:
        raise ValueError(
            f"kv memory of {kv_memory_bytes / GIB:.3f} GiB leaves no room for a history page "
            f"({layout.quant_page_bytes} bytes)"
        )
    return PagePlan(num_window_pages, int(num_quant_pages))
