"""A thin numpy driver for the exported graphs: it owns the cache buffers, demotes, generates greedily.

Imports numpy and onnxruntime only (no torch; the cache format's version and block size come from
``formats.cache``, which imports nothing): an exported directory runs where those two do.

Per layer, token-major buffers (the graph inputs are their first rows, no copies):
- sink [S0, H, D] float32: positions [0, min(L, S0));
- a ring of W slots [W, H, D] float32: the recent window. A new token at position >= S0 takes
  the slot of the oldest when the ring is full, and that oldest token is demoted: quantized by
  ``quantize.onnx`` (all layers' demotions of a step in one call) and appended to the history;
- history codes [N, H, D * b / 8] uint8 (planar rows), or [ceil(N / 16), H, 512] for masked INT2
  (16-token blocks, each demoted token's bit pairs ORed in), and scale / zero [N, H, D / G],
  grown by doubling.
Writing T tokens at once leaves the same state as writing them one by one, as in the PyTorch cache
(docs/cache-format.md): a prompt's middle goes to the history through the same quantizer.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..formats.cache import MASKED_BLOCK_TOKENS as BLOCK  # tokens of a masked history block
from ..formats.cache import check_cache_format_version

MANIFEST = "manifest.json"
FORMAT = "oscar_compile.onnx"
FORMAT_VERSION = 2  # 2: the manifest names the cache format version and the codes' byte order
_SCALE_DTYPES = {"float16": np.float16, "float32": np.float32}


class _Grown:
    """A token-major array that grows by doubling; ``view`` is its first ``num`` rows."""

    def __init__(self, row_shape: tuple, dtype):
        self.data = np.zeros((16, *row_shape), dtype=dtype)
        self.num = 0

    def extend(self, rows: np.ndarray) -> None:
        need = self.num + len(rows)
        if need > len(self.data):
            grown = np.zeros((max(need, 2 * len(self.data)), *self.data.shape[1:]), dtype=self.data.dtype)
            grown[:self.num] = self.data[:self.num]
            self.data = grown
        self.data[self.num:need] = rows
        self.num = need

    @property
    def view(self) -> np.ndarray:
        return self.data[:self.num]


class _MaskedBlocks:
    """History codes in masked 16-token blocks [NB, H, 512] uint8 (docs/cache-format.md), grown by
    doubling; ``view`` is the blocks holding the first ``num`` tokens. The buffer starts zeroed
    and a token's bit pairs are written once, so each demotion ORs them in (``np.bitwise_or.at``:
    a value byte takes 4 channels of one token, a key byte one channel of 4 tokens)."""

    def __init__(self, num_kv_heads: int, byte: np.ndarray, pair: np.ndarray):
        self.data = np.zeros((1, num_kv_heads, 32 * BLOCK), dtype=np.uint8)
        self.byte, self.pair = byte, pair  # [16, D] each: where (row, channel) lives
        self.num = 0

    def extend(self, codes: np.ndarray) -> None:
        """Append tokens' unpacked codes [m, H, D] uint8."""
        m, H, _ = codes.shape
        need = -(-(self.num + m) // BLOCK)
        if need > len(self.data):
            grown = np.zeros((max(need, 2 * len(self.data)), *self.data.shape[1:]), dtype=np.uint8)
            grown[:len(self.data)] = self.data
            self.data = grown
        n = np.arange(self.num, self.num + m)
        blk, row = n // BLOCK, n % BLOCK
        pair = self.pair[row]  # [m, D]
        p3 = pair[:, None, :]
        stored = (np.where(p3 == 3, codes ^ 2, codes) << (2 * p3)).astype(np.uint8)  # pair 3: (c + 2) mod 4
        blocks = np.broadcast_to(blk[:, None], pair.shape).ravel()
        for h in range(H):
            np.bitwise_or.at(self.data[:, h, :], (blocks, self.byte[row].ravel()), stored[:, h, :].ravel())
        self.num += m

    @property
    def view(self) -> np.ndarray:
        return self.data[:-(-self.num // BLOCK)]


@dataclass
class LayerState:
    """One layer's cache: sink, recent ring, history (see the module docstring)."""

    sink_k: np.ndarray
    sink_v: np.ndarray
    ring_k: np.ndarray
    ring_v: np.ndarray
    history: dict  # field name (hist_k_codes, ...) -> _Grown
    num_sink: int = 0
    num_recent: int = 0
    ring_oldest: int = 0  # slot of the oldest recent token once the ring is full

    def inputs(self) -> list[np.ndarray]:
        """The step graph's cache inputs of this layer, in graphs.CACHE_FIELDS order."""
        h = self.history
        return [self.sink_k[:self.num_sink], self.sink_v[:self.num_sink],
                h["hist_k_codes"].view, h["hist_k_scale"].view, h["hist_k_zero"].view,
                h["hist_v_codes"].view, h["hist_v_scale"].view, h["hist_v_zero"].view,
                self.ring_k[:self.num_recent], self.ring_v[:self.num_recent]]

    def write(self, k: np.ndarray, v: np.ndarray, position: int, sink: int, recent: int) -> tuple[list, list]:
        """Place new tokens k, v: [T, H, D] at positions [position, position + T); the demoted
        tokens' (keys, values), oldest first, for the quantizer."""
        out_k, out_v = [], []
        for t in range(len(k)):
            if position + t < sink:
                self.sink_k[self.num_sink], self.sink_v[self.num_sink] = k[t], v[t]
                self.num_sink += 1
            elif recent == 0:  # no recent window: straight to the history
                out_k.append(k[t])
                out_v.append(v[t])
            elif self.num_recent < recent:
                self.ring_k[self.num_recent], self.ring_v[self.num_recent] = k[t], v[t]
                self.num_recent += 1
            else:
                slot = self.ring_oldest
                out_k.append(self.ring_k[slot].copy())
                out_v.append(self.ring_v[slot].copy())
                self.ring_k[slot], self.ring_v[slot] = k[t], v[t]
                self.ring_oldest = (slot + 1) % recent
        return out_k, out_v

    @property
    def num_history(self) -> int:
        return self.history["hist_k_scale"].num

    def nbytes(self) -> int:
        """Bytes of the state the graphs read: windows as held, history rows in use."""
        row = self.sink_k.itemsize * int(np.prod(self.sink_k.shape[1:]))  # one [H, D] window row
        return (self.num_sink + self.num_recent) * 2 * row + sum(g.view.nbytes for g in self.history.values())


@dataclass
class Cache:
    """The whole cache of one sequence: a LayerState per layer and the length L."""

    layers: list[LayerState]
    length: int = 0
    num_demoted: int = field(default=0)

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)


class OnnxGenerator:
    """Run an ``oscar-compile export --format onnx`` directory with ONNX Runtime (batch 1).

    ``step(ids, cache)`` runs one forward of the new tokens and writes them into ``cache``;
    ``generate(prompt, max_new_tokens)`` is greedy decoding.
    """

    def __init__(self, export_dir: str | Path, num_threads: int | None = None,
                 providers: Sequence[str] = ("CPUExecutionProvider",)):
        import onnxruntime as ort

        self.dir = Path(export_dir)
        path = self.dir / MANIFEST
        if not path.is_file():
            raise FileNotFoundError(f"no {MANIFEST} in {self.dir}: not an `oscar-compile export --format onnx` "
                                    "directory")
        m = json.loads(path.read_text())
        if m.get("format") != FORMAT or m.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{path}: format {m.get('format')!r} version {m.get('format_version')!r}, "
                             f"this driver reads {FORMAT} version {FORMAT_VERSION}")
        check_cache_format_version(m.get("cache_format_version"), str(path))
        self.manifest = m
        options = ort.SessionOptions()
        if num_threads:
            options.intra_op_num_threads = num_threads
            options.inter_op_num_threads = 1
        providers = list(providers)
        self.step_session = ort.InferenceSession(str(self.dir / m["step"]["graph"]), options, providers=providers)
        self.quantize_session = ort.InferenceSession(str(self.dir / m["quantize"]["graph"]), options,
                                                     providers=providers)
        self.eos_token_ids = tuple(m["eos_token_ids"])

    def new_cache(self) -> Cache:
        m = self.manifest
        H, D, bits, G = m["num_kv_heads"], m["head_dim"], m["bits"], m["group_size"]
        if m["scale_dtype"] not in _SCALE_DTYPES:
            raise NotImplementedError(f"scale_dtype {m['scale_dtype']} has no numpy dtype: export float16 or float32")
        sdt = _SCALE_DTYPES[m["scale_dtype"]]
        rows = {"codes": ((H, D * bits // 8), np.uint8), "scale": ((H, D // G), sdt), "zero": ((H, D // G), sdt)}

        def window(num_tokens: int) -> np.ndarray:
            return np.zeros((num_tokens, H, D), np.float32)

        masked = m["code_layout"] == "masked"
        maps = {kind: (np.asarray(mp["byte"]), np.asarray(mp["pair"]))
                for kind, mp in m.get("code_layout_maps", {}).items()}
        layers = []
        for _ in range(m["num_layers"]):
            history = {f"hist_{kind}_{part}": _MaskedBlocks(H, *maps[kind]) if masked and part == "codes"
                       else _Grown(*rows[part])
                       for kind in ("k", "v") for part in ("codes", "scale", "zero")}
            layers.append(LayerState(sink_k=window(m["sink_tokens"]), sink_v=window(m["sink_tokens"]),
                                     ring_k=window(m["recent_tokens"]), ring_v=window(m["recent_tokens"]),
                                     history=history))
        return Cache(layers)

    def step(self, token_ids: Sequence[int], cache: Cache) -> np.ndarray:
        """Forward ``token_ids`` (the next T tokens) over ``cache`` and write them into it: logits [T, V]."""
        m = self.manifest
        T = len(token_ids)
        if T == 0:
            raise ValueError("step needs at least one token")
        if cache.length + T > m["max_position_embeddings"]:
            raise ValueError(f"{cache.length + T} tokens exceed the model's {m['max_position_embeddings']} positions")
        feeds = {"input_ids": np.asarray(token_ids, np.int64).reshape(1, T),
                 "position_ids": np.arange(cache.length, cache.length + T, dtype=np.int64).reshape(1, T)}
        names = m["step"]["inputs"][2:]
        arrays = [a for layer in cache.layers for a in layer.inputs()]
        feeds.update({name: np.ascontiguousarray(a) for name, a in zip(names, arrays, strict=True)})
        logits, *new_kv = self.step_session.run(None, feeds)
        self._write(cache, new_kv)
        return logits[0]

    def _write(self, cache: Cache, new_kv: list[np.ndarray]) -> None:
        m = self.manifest
        demoted = [layer.write(new_kv[2 * i], new_kv[2 * i + 1], cache.length, m["sink_tokens"], m["recent_tokens"])
                   for i, layer in enumerate(cache.layers)]
        cache.length += len(new_kv[0])
        counts = [len(k) for k, _ in demoted]
        if not sum(counts):
            return
        k = np.stack([t for ks, _ in demoted for t in ks])  # [n, H, D]: every layer's demotions at once
        v = np.stack([t for _, vs in demoted for t in vs])
        quantized = dict(zip(m["quantize"]["outputs"], self.quantize_session.run(None, {"k": k, "v": v}), strict=True))
        start = 0
        for layer, n in zip(cache.layers, counts, strict=True):
            for name, rows in quantized.items():
                layer.history[f"hist_{name}"].extend(rows[start:start + n])
            start += n
        cache.num_demoted += sum(counts)

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int,
                 stop_token_ids: Iterable[int] | None = None) -> list[int]:
        """Greedy tokens after ``prompt_ids`` (stops after a stop token; default: the model's EOS ids)."""
        stop = set(self.eos_token_ids if stop_token_ids is None else stop_token_ids)
        cache = self.new_cache()
        logits = self.step(list(prompt_ids), cache)
        out: list[int] = []
        while len(out) < max_new_tokens:
            token = int(np.argmax(logits[-1]))
            out.append(token)
            if token in stop or len(out) == max_new_tokens:
                break
            logits = self.step([token], cache)
        return out
