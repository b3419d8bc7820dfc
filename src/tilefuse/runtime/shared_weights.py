"""Weights shared by the programs one graph compiles to, one per size.

A graph with dynamic sizes (a model under `torch.compile` whose sequence grows, as in
`generate`) compiles once per concrete size, and each compile derives its weights again:
RMSNorm's gamma folded into a matmul's weight, gate and up interleaved, RoPE's rows
permuted. Those tensors are equal from one size to the next, and without sharing every size
held a copy of nearly the whole model (a 7B model ran out of memory after a few tokens).

`WeightPool.share` replaces each weight of a new program with an equal one some live program
already holds (equal bit for bit: -0.0 is not 0.0, a NaN matches only its own bits), and
`WeightPool.on` gives one device copy per source tensor. The pool holds nothing alive itself:
what no program uses any more is freed as before.

Only tensors a compilation derived are pooled. A weight that shares memory with a live
parameter (a Linear's bias passed through as `param.detach()`) changes when the parameter is
updated in place; its own model then compiles again, but a program of another model given it
as an "equal" tensor would silently compute with the new values. The caller names those
parameters (`live`), and what aliases them is neither pooled nor replaced.
"""
from __future__ import annotations

import hashlib
import weakref

import torch
from torch.utils.weak import WeakIdKeyDictionary

SAMPLES = 4096  # elements read for a tensor's fingerprint; equal fingerprints are then compared in full

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as integers of the same width: equality of these is bit equality."""
    return t.view(_BITS[t.element_size()]) if t.element_size() in _BITS else t


def _fingerprint(t: torch.Tensor) -> bytes:
    flat = _bits(t).reshape(-1)
    step = max(1, flat.numel() // SAMPLES)
    sample = flat[::step][:SAMPLES].cpu().contiguous()
    return hashlib.blake2b(sample.numpy().tobytes(), digest_size=16).digest()


def _storage(t: torch.Tensor) -> tuple:
    return t.device, t.untyped_storage().data_ptr()


def storages(live) -> frozenset:
    """The storages (device, address) of the tensors in `live`; a frozenset is taken as such
    already (a caller that checks many tensors against one set builds it once)."""
    if isinstance(live, frozenset):
        return live
    return frozenset(_storage(t) for t in live if isinstance(t, torch.Tensor) and t.layout == torch.strided)


def _key(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.dtype, t.device, t.stride()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.data_ptr() == b.data_ptr() and a.stride() == b.stride():
        return True
    return torch.equal(_bits(a), _bits(b))


class WeightPool:
    def __init__(self):
        self._held: dict = {}  # (shape, dtype, device, strides, fingerprint) -> [weakref to tensor]
        self._copies = WeakIdKeyDictionary()  # source tensor -> {device: weakref to its copy there}
        self.shared_bytes = 0  # what sharing saved, summed over the programs it served

    def share(self, weights: dict, live=()) -> int:
        """Replace, in place, each tensor of `weights` by an equal one already pooled, and pool
        the rest, except tensors sharing memory with one of `live`; the bytes this call saved."""
        saved = 0
        self._held = {k: v for k, v in self._held.items() if any(r() is not None for r in v)}
        aliased = storages(live)
        for name, t in list(weights.items()):
            if (not isinstance(t, torch.Tensor) or t.numel() == 0 or t.layout != torch.strided or t.is_complex()
                    or _storage(t) in aliased):
                continue
            match = self._pooled(t)
            if match is not t:
                weights[name] = match
                if match.untyped_storage().data_ptr() != t.untyped_storage().data_ptr():
                    saved += t.numel() * t.element_size()
        self.shared_bytes += saved
        return saved

    def intern(self, t: torch.Tensor, live=()) -> torch.Tensor:
        """`t`, a tensor a rewrite has just derived, or an equal one already pooled. A rewrite
        calls this as it makes each weight (graph.rules.match.Editor), so a compile at a new size
        frees each value a program already holds at once, instead of holding a whole second set
        until `share` (peak memory: bench/LOG_blocks.md, session 38). A rewrite that moves no
        value may hand back a parameter itself (a weight with no norm to fold): what shares
        memory with one of `live` is neither pooled nor replaced, as in `share`."""
        if not isinstance(t, torch.Tensor) or t.numel() == 0 or t.layout != torch.strided or t.is_complex():
            return t
        if _storage(t) in storages(live):
            return t
        match = self._pooled(t)
        if match is not t and match.untyped_storage().data_ptr() != t.untyped_storage().data_ptr():
            self.shared_bytes += t.numel() * t.element_size()
        return match

    def _pooled(self, t: torch.Tensor) -> torch.Tensor:
        """An equal pooled tensor, else `t`, pooled from now on."""
        key = _key(t) + (_fingerprint(t),)
        refs = [r for r in self._held.get(key, ()) if r() is not None]
        match = next((c for c in (r() for r in refs) if c is not None and _same(c, t)), None)
        if match is None:
            refs.append(weakref.ref(t))
            match = t
        self._held[key] = refs
        return match

    def on(self, value, device: torch.device) -> torch.Tensor:
        """`value` contiguous on `device`, one copy per source and device for all programs."""
        if not isinstance(value, torch.Tensor):
            return torch.as_tensor(value).to(device).contiguous()
        per = self._copies.get(value)
        if per is None:
            per = self._copies[value] = {}
        ref = per.get(str(device))
        copy = ref() if ref is not None else None
        if copy is None:
            copy = value.to(device).contiguous()
            per[str(device)] = weakref.ref(copy)
        return copy
