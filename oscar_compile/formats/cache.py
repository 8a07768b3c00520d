"""The cache's format, described once: typed, torch-free, below ``quant`` and the kernels.

Everything that allocates, addresses or sizes the paged KV cache reads it from here. The spec
(``oscar_compile.spec.KVCacheSpec``, the user-facing YAML model) resolves to one
:class:`LayerFormat` per layer (:meth:`LayerFormat.of`, :meth:`CacheLayout.from_spec`); the graph
passes hand a layer's format to the cache contract (``oscar_compile.cache.contract``), the HF
cache and the runtime's pools are allocated from it, and the runtime's page planner sizes pages
with the model's :class:`CacheLayout`. It sits below the kernels and the reference quantizer
(which read its constants) and below ``cache/`` (the contract and the HF cache, which use the
kernels): a module here imports nothing of the package. The rules that used to be repeated in
several modules are written here once:

- the windows (sink ``S0`` and recent ``W``) are multiples of the page size ``P``;
- a quantized layer's ``group_size`` divides ``head_dim`` and its rows are whole bytes;
- **nothing quantized, so no windows** (:func:`has_windows`): a model whose every layer keeps
  16 bits stores every token in a full-precision page (the classic paged cache, the runtime's
  BF16 mode, the ``oscar::*_bf16`` ops); windows would only add a second page table. A 16-bit
  layer *beside* INT-b layers keeps the windows, whose page tables are shared by all layers;
- the scale / zero dtypes and their byte sizes (:data:`SCALE_DTYPE_BYTES`; the reference
  quantizer maps the same names to torch dtypes);
- the byte order of the codes in a page (:func:`code_layout`) and the cache format version
  (:data:`CACHE_FORMAT_VERSION`) that every reader of stored cache state checks.

Plain integers and strings only, so the bookkeeping tests run anywhere (docs/cache-format.md).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

FULL_PRECISION_BITS = 16  # history rows kept as they are: no codes, no scale / zero
SCALE_DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}  # the spec's scale_dtype choices
_SCALE_DTYPE_ALIASES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


CACHE_FORMAT_VERSION = 2  # 1: planar code rows everywhere; 2: INT2 at head_dim 128 in masked 16-token blocks
MASKED_BLOCK_TOKENS = 16  # token rows of one masked block (512 bytes of INT2 codes at head_dim 128)
MASKED_HEAD_DIM = 128  # the one head_dim whose INT2 pages are masked (see code_layout)


def code_layout(bits: int, head_dim: int, page_size: int) -> str:
    """How a layer's code pools order their bytes: ``"masked"`` or ``"planar"`` (16-bit history rows:
    ``"rows"``), both cache format version :data:`CACHE_FORMAT_VERSION` (docs/cache-format.md).

    ``masked`` (the byte order of the INT2 decode on 8-bit integer wgmma, issue #32;
    ``kernels/layout/code_layout_ref.py``) for INT2 at head_dim 128 with pages of a multiple of 16 tokens;
    ``planar`` rows for the rest: INT4 (it takes the new decode only if its error budget holds, not
    measured yet), head_dim 64 (its value tile has one m64 tile of channels, so where the 4 rows of
    a value byte come from, two KV heads per program or a second accumulator per k-half, is a
    kernel choice still to measure; fixing a byte order now would make that choice), and pages
    that are not a multiple of 16 tokens (a masked value byte holds 4 channels of one of 16 rows).
    """
    if bits == FULL_PRECISION_BITS:
        return "rows"
    if bits == 2 and head_dim == MASKED_HEAD_DIM and page_size % MASKED_BLOCK_TOKENS == 0:
        return "masked"
    return "planar"


def check_cache_format_version(found, where: str) -> None:
    """Refuse cache state (or a graph that reads it) written under another cache format version."""
    if found != CACHE_FORMAT_VERSION:
        raise ValueError(f"{where}: KV-cache format version {found!r}, this library (cache format version "
                         f"{CACHE_FORMAT_VERSION}) reads only its own: the INT2 code byte order differs "
                         f"(docs/cache-format.md); re-export or re-create it with this version")


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
class LayerFormat:
    """The cache format of one layer: windows, page size and how its history is stored.

    The one per-layer description of the cache, derived from the spec once (:meth:`of`, or
    :meth:`CacheLayout.from_spec` for every layer): what a rewritten attention graph hands the
    cache contract (as keyword constants of its ``layer_inputs`` node, :meth:`as_kwargs`), what
    the HF cache allocates a layer from, and what the runtime's pools and page sizes are made of
    (:meth:`CacheLayout.format_of`). The defaults are the spec's (``KVCacheSpec``).

    - ``sink``, ``recent``: the full-precision windows ``S0`` and ``W`` (tokens, multiples of
      ``page_size``); both 0 when nothing in the model is quantized (:func:`has_windows`);
    - ``page_size``: tokens per page ``P``, the spec's ``kv_cache.page_size``: the one source of the
      page size (the HF cache's layers, the runtime's pools and its page bookkeeping read it from
      here; the engine config carries none);
    - ``bits``: 2 or 4 (INT-b codes with a scale / zero per group of ``group_size`` channels,
      stored as ``scale_dtype``), or 16 (history rows kept as they are).
    """

    sink: int = 64
    recent: int = 256
    page_size: int = 16
    bits: int = 2
    group_size: int = 128
    scale_dtype: str = "float16"

    @classmethod
    def of(cls, layer_spec) -> LayerFormat:
        """From a resolved ``oscar_compile.spec.LayerSpec`` (windows already resolved by apply)."""
        kv = layer_spec.kv_cache
        return cls(sink=kv.sink_tokens, recent=kv.recent_tokens, page_size=kv.page_size, bits=kv.bits,
                   group_size=kv.group_size, scale_dtype=kv.scale_dtype)

    @property
    def full_precision_pages(self) -> bool:
        """Every token in a full-precision page (the ``oscar::*_bf16`` ops): a 16-bit layer without
        windows. A 16-bit layer with windows takes the INT-b ops with bits = 16."""
        return self.bits == FULL_PRECISION_BITS and self.sink == 0 and self.recent == 0

    def history_row_bytes(self, head_dim: int, dtype_bytes: int) -> int:
        """Bytes of one history token of one KV head, K or V."""
        if self.bits == FULL_PRECISION_BITS:
            return head_dim * dtype_bytes
        num_groups = head_dim // self.group_size
        return head_dim * self.bits // 8 + 2 * num_groups * scale_dtype_bytes(self.scale_dtype)

    def as_kwargs(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class CacheLayout:
    """The cache of one model: its geometry and one :class:`LayerFormat` per layer.

    Not a second description of a layer's format (``layer_formats`` holds them): what it adds is
    what no single layer knows. The KV heads, ``head_dim`` and the model dtype's size turn the
    formats into page bytes (:attr:`window_page_bytes`, :attr:`quant_page_bytes`), which the
    page planner and the host swap space need for the model as a whole. And the page tables are
    shared by all layers (page ``i`` of a kind is row ``i`` of that kind's pool in every layer),
    so every layer has the same windows and page size: checked here, and read as
    :attr:`sink`, :attr:`recent` and :attr:`page_size`. :meth:`uniform` builds the common case
    (one format for every layer, some kept at 16 bits).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    layer_formats: tuple[LayerFormat, ...]
    dtype_bytes: int = 2

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "dtype_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if len(self.layer_formats) != self.num_layers:
            raise ValueError(
                f"layer_formats needs one entry per layer ({self.num_layers}), got {len(self.layer_formats)}"
            )
        for layer, fmt in enumerate(self.layer_formats):
            if fmt.page_size < 1:
                raise ValueError(f"layer {layer}: page_size must be >= 1, got {fmt.page_size}")
            check_windows(fmt.sink, fmt.recent, fmt.page_size)
            self._check_format(layer, fmt)
        shared = {(f.sink, f.recent, f.page_size) for f in self.layer_formats}
        if len(shared) > 1:
            raise ValueError(f"every layer needs the same (sink, recent, page_size): the page tables are shared "
                             f"by all layers, got {sorted(shared)}")

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
        """The format of layer ``layer``'s pools (its windows are every layer's)."""
        return self.layer_formats[layer]

    @classmethod
    def uniform(cls, num_layers: int, num_kv_heads: int, head_dim: int, page_size: int = 16, sink: int = 64,
                recent: int = 256, bits: int = 2, group_size: int = 128, scale_dtype: str = "float16",
                dtype_bytes: int = 2, full_precision_layers: tuple[int, ...] = ()) -> CacheLayout:
        """Every layer in one format, but ``full_precision_layers``, whose history stays at 16 bits."""
        bad = [i for i in full_precision_layers if not 0 <= i < num_layers]
        if bad:
            raise ValueError(f"full_precision_layers out of range [0, {num_layers}): {bad}")
        fmt = LayerFormat(sink=sink, recent=recent, page_size=page_size, bits=bits, group_size=group_size,
                          scale_dtype=scale_dtype)
        kept = LayerFormat(sink=sink, recent=recent, page_size=page_size, bits=FULL_PRECISION_BITS,
                           group_size=group_size, scale_dtype=scale_dtype)
        formats = tuple(kept if i in full_precision_layers else fmt for i in range(max(num_layers, 0)))
        return cls(num_layers, num_kv_heads, head_dim, formats, dtype_bytes)

    @classmethod
    def bf16(cls, num_layers: int, num_kv_heads: int, head_dim: int, page_size: int = 16,
             dtype_bytes: int = 2) -> CacheLayout:
        """The full-precision baseline: no windows, every token in a 16-bit page."""
        return cls.uniform(num_layers, num_kv_heads, head_dim, page_size=page_size, sink=0, recent=0,
                           bits=FULL_PRECISION_BITS, dtype_bytes=dtype_bytes)

    @classmethod
    def from_hf_config(cls, config, **kwargs) -> CacheLayout:
        """:meth:`uniform`, reading layers, KV heads and head_dim from a Hugging Face config (text part)."""
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        return cls.uniform(config.num_hidden_layers, num_kv_heads, head_dim, **kwargs)

    @classmethod
    def from_spec(cls, spec, config, dtype_bytes: int = 2) -> CacheLayout:
        """The layout an ``oscar_compile.spec.CompressionSpec`` asks for, per layer resolved (the
        windows as ``apply`` resolves them: dropped when nothing is quantized)."""
        base = cls.from_hf_config(config, dtype_bytes=dtype_bytes, bits=16, sink=0, recent=0)
        kv = spec.kv_cache
        layers = [spec.for_layer(i, base.num_layers).kv_cache for i in range(base.num_layers)]
        quantized = has_windows([c.bits for c in layers])
        if quantized and any((c.sink_tokens, c.recent_tokens) != (kv.sink_tokens, kv.recent_tokens) for c in layers):
            raise NotImplementedError(
                "per-layer sink/recent windows: the paged runtime shares one page table across layers"
            )
        sink, recent = (kv.sink_tokens, kv.recent_tokens) if quantized else (0, 0)
        formats = tuple(LayerFormat(sink=sink, recent=recent, page_size=kv.page_size, bits=c.bits,
                                    group_size=c.group_size, scale_dtype=c.scale_dtype) for c in layers)
        return cls(base.num_layers, base.num_kv_heads, base.head_dim, formats, dtype_bytes)

    @property
    def sink(self) -> int:
        return self.layer_formats[0].sink

    @property
    def recent(self) -> int:
        return self.layer_formats[0].recent

    @property
    def page_size(self) -> int:
        return self.layer_formats[0].page_size

    @property
    def is_full_precision(self) -> bool:
        """Every layer keeps its history at 16 bits (nothing is quantized)."""
        return all(fmt.bits == FULL_PRECISION_BITS for fmt in self.layer_formats)

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
        row_bytes = sum(fmt.history_row_bytes(self.head_dim, self.dtype_bytes) for fmt in self.layer_formats)
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
