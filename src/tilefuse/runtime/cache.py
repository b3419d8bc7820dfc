"""Content-addressed cubin cache on disk.

key = sha256(source, arch, NVRTC options, NVRTC version): a changed generator, flag or
compiler is a new key, never a stale hit. compile_cached keys the source without its
whole-line comments, which compile to nothing: kernels that differ only in the comments
naming them (the same GEMM in every layer of a model) share one entry and one compile. One file per entry, written to a temporary name
and renamed into place (atomic: readers see a whole entry or none). An entry carries a
checksum; a truncated or corrupted one is ignored and rebuilt.

Directory: $TILEFUSE_CACHE_DIR, else ~/.cache/tilefuse/cubin.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
import threading
from dataclasses import asdict
from pathlib import Path

from . import nvrtc
from .. import env

_MAGIC = b"TFCUBIN1"


def cache_dir() -> Path:
    folder = env.raw("TILEFUSE_CACHE_DIR")
    return Path(folder).expanduser() if folder else Path.home() / ".cache" / "tilefuse" / "cubin"


def cache_key(source: str, arch: str, options: tuple[str, ...], version: tuple[int, int]) -> str:
    h = hashlib.sha256()
    for part in (source, arch, "\0".join(options), ".".join(map(str, version))):
        h.update(part.encode())
        h.update(b"\xff")
    return h.hexdigest()


def _encode(cubin: nvrtc.Cubin) -> bytes:
    meta = json.dumps({"arch": cubin.arch, "info": asdict(cubin.info), "log": cubin.log}).encode()
    body = _MAGIC + struct.pack("<QQ", len(meta), len(cubin.data)) + meta + cubin.data
    return body + hashlib.sha256(body).digest()


def _decode(blob: bytes) -> nvrtc.Cubin | None:
    """The entry, or None if it is not a whole, intact entry."""
    head = len(_MAGIC) + 16
    if len(blob) < head + 32 or not blob.startswith(_MAGIC):
        return None
    body, digest = blob[:-32], blob[-32:]
    if hashlib.sha256(body).digest() != digest:
        return None
    n_meta, n_data = struct.unpack("<QQ", body[len(_MAGIC):head])
    if head + n_meta + n_data != len(body):
        return None
    try:
        meta = json.loads(body[head:head + n_meta])
        info = nvrtc.CompileInfo(**meta["info"])
    except (ValueError, KeyError, TypeError):
        return None
    return nvrtc.Cubin(data=body[head + n_meta:], arch=meta["arch"], info=info, log=meta["log"])


class CubinCache:
    def __init__(self, directory: Path | str | None = None):
        self.dir = Path(directory) if directory is not None else cache_dir()

    def path(self, key: str) -> Path:
        return self.dir / key[:2] / f"{key}.cubin"

    def get(self, key: str) -> nvrtc.Cubin | None:
        try:
            blob = self.path(key).read_bytes()
        except OSError:
            return None
        return _decode(blob)

    def put(self, key: str, cubin: nvrtc.Cubin) -> None:
        """Store atomically; a cache that cannot be written is not an error (just slower)."""
        target = self.path(key)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(_encode(cubin))
                os.replace(tmp, target)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except OSError:
            pass


def code_of(source: str) -> str:
    """`source` without its whole-line // comments (what the cache keys)."""
    # a comment line ending in a backslash continues onto the next line: kept, so that line
    # is not mistaken for code
    return "\n".join(line for line in source.splitlines()
                     if not line.lstrip().startswith("//") or line.rstrip().endswith("\\"))


_KEYS: dict = {}  # (source, arch, options) -> its cache key


def _key(source: str, arch: str, opts: tuple[str, ...]) -> str:
    """The cache key, memoised: a program at a new size meets most of its sources again (the
    same text: GEMMs and row kernels take their sizes as arguments). Stripping and hashing a
    64 KB GEMM source took 0.4 of a hit's 0.57 ms (CPU); a new prompt length of an 8-layer
    model looks up ~58 sources."""
    k = (source, arch, opts)
    key = _KEYS.get(k)
    if key is None:
        key = cache_key(code_of(source), arch, opts, nvrtc.version())
        if len(_KEYS) >= 256:  # (each entry holds its source: ~64 KB for a GEMM)
            _KEYS.clear()
        _KEYS[k] = key
    return key


def compile_cached(source: str, name: str, arch: str, options: tuple[str, ...] | None = None,
                   cache: CubinCache | None = None) -> tuple[nvrtc.Cubin, bool]:
    """(cubin, hit): from the cache when an intact entry exists, else compiled and stored."""
    arch = nvrtc.normalize_arch(arch)
    opts = options if options is not None else nvrtc.options_for(arch)
    cache = cache or CubinCache()
    key = _key(source, arch, tuple(opts))
    hit = cache.get(key)
    if hit is not None:
        return hit, True
    with _inflight_lock:  # another thread compiling this key: wait for its entry
        done = _inflight.get(key)
        if done is None:
            done = _inflight[key] = threading.Event()
            mine = True
        else:
            mine = False
    if not mine:
        done.wait()
        hit = cache.get(key)
        if hit is not None:
            return hit, True
        return nvrtc.compile_cuda(source, name, arch, opts), False  # it failed, or could not store it
    try:
        hit = cache.get(key)  # stored by a thread that finished between our first look and the lock
        if hit is not None:
            return hit, True
        cubin = nvrtc.compile_cuda(source, name, arch, opts)
        cache.put(key, cubin)
    finally:
        with _inflight_lock:
            del _inflight[key]
        done.set()
    return cubin, False


# Keys being compiled in this process (Program.prepare compiles kernels in parallel threads,
# and kernels that differ only in comments share a key).
_inflight: dict[str, threading.Event] = {}
_inflight_lock = threading.Lock()
