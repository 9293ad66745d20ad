"""Reading checkpoint directories: config.json and weights, without executing any code from the directory.

Weights come from ``model.safetensors``, sharded ``model-0000X-of-0000N.safetensors`` with
``model.safetensors.index.json``, or ``pytorch_model*.bin`` (``torch.load(weights_only=True)``).

Safetensors files are read with plain ``readinto`` into freshly allocated tensors rather than through mmap: a mapped
file's resident pages count in the process's RSS on top of the parameters, which would double the host memory needed
to load a model. Each tensor is converted to the target dtype and device as soon as it is read, so the host never
holds more than the final weights plus one tensor in flight.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import struct
from pathlib import Path
from typing import Iterator

import torch

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


class CheckpointError(ValueError):
    """The directory is not a loadable checkpoint of the expected family; the message says what is wrong."""


def read_config(path: str | os.PathLike) -> dict:
    path = Path(path)
    cfg_file = path / "config.json"
    if not path.is_dir():
        raise CheckpointError(f"model path {str(path)!r} is not a directory")
    if not cfg_file.is_file():
        raise CheckpointError(f"{str(path)!r} has no config.json")
    with open(cfg_file) as f:
        try:
            cfg = json.load(f)
        except ValueError as e:
            raise CheckpointError(f"{str(cfg_file)!r} is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{str(cfg_file)!r} is not a JSON object")
    return cfg


def generation_defaults(path: str | os.PathLike) -> dict:
    """The checkpoint's own generation defaults (``generation_config.json``, as Hugging Face writes it), or {}.
    Used: ``max_new_tokens``, the default length when a request or command gives none."""
    f = Path(path) / "generation_config.json"
    try:
        data = json.loads(f.read_text()) if f.is_file() else {}
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{f}: {e}")
    return data if isinstance(data, dict) else {}


def default_max_new_tokens(path: str | os.PathLike, fallback: int) -> int:
    n = generation_defaults(path).get("max_new_tokens")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else fallback


def weight_files(path: str | os.PathLike) -> list[Path]:
    """The weight files of a checkpoint directory, in a stable order."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
        missing = [name for name in files if not (path / name).is_file()]
        if missing:
            raise CheckpointError(f"{str(path)!r}: shards named in model.safetensors.index.json are missing: {missing}")
        return [path / name for name in files]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    shards = sorted(path.glob("model-*-of-*.safetensors"))
    if shards:
        return shards
    bin_index = path / "pytorch_model.bin.index.json"
    if bin_index.is_file():
        with open(bin_index) as f:
            return [path / name for name in sorted(set(json.load(f)["weight_map"].values()))]
    bins = sorted(path.glob("pytorch_model*.bin"))
    if bins:
        return bins
    raise CheckpointError(
        f"{str(path)!r} holds no weights: expected model.safetensors, model-*-of-*.safetensors with "
        "model.safetensors.index.json, or pytorch_model*.bin"
    )


def safetensors_header(file: Path) -> tuple[dict, int]:
    """(header without __metadata__, offset of the data section)."""
    with open(file, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        try:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:       # (garbage: read it and a length of 2**63 is a MemoryError)
                raise ValueError(f"a header of {n} bytes in a file of {size}")
            header = json.loads(f.read(n))
            if not isinstance(header, dict):
                raise ValueError("the header is not a JSON object")
        except (struct.error, ValueError) as e:
            raise CheckpointError(f"{file.name}: corrupt or truncated safetensors header ({e})")
    header.pop("__metadata__", None)
    try:
        end = max((int(v["data_offsets"][1]) for v in header.values()), default=0)
    except (KeyError, TypeError, IndexError, ValueError) as e:
        raise CheckpointError(f"{file.name}: corrupt safetensors header (a tensor without data_offsets: {e!r})")
    if 8 + n + end > size:      # a file cut short (a copy still being written): refused before any tensor is read
        raise CheckpointError(f"{file.name}: truncated: its header describes {8 + n + end} bytes, the file has {size}")
    return header, 8 + n


def tensor_shapes(path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in the checkpoint, read from headers only (no weights loaded)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in weight_files(path):
        if file.suffix == ".safetensors":
            header, _ = safetensors_header(file)
            shapes.update({k: tuple(v["shape"]) for k, v in header.items()})
        else:
            sd = torch.load(file, map_location="meta", weights_only=True)
            shapes.update({k: tuple(v.shape) for k, v in sd.items()})
    return shapes


def _read_into(f, dest: torch.Tensor, offset: int, what: str) -> None:
    """Fill the contiguous CPU tensor ``dest`` with bytes from ``offset`` of the open file ``f``."""
    view = memoryview(dest.view(torch.uint8).reshape(-1).numpy())
    f.seek(offset)
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise CheckpointError(f"{what} is truncated")
        got += n


def _runs(shape: list[int], shard) -> Iterator[tuple[int, int]]:
    """(element offset, element count) of the contiguous runs that make up ``shard``'s slices of a C-contiguous
    tensor of ``shape``, in the order the sliced tensor holds them."""
    inner = 1
    for n in shape[shard.dim + 1:]:
        inner *= n
    outer = 1
    for n in shape[:shard.dim]:
        outer *= n
    full = shape[shard.dim]
    for o in range(outer):
        for start, length in shard.ranges:
            yield (o * full + start) * inner, length * inner


def sliced(t: torch.Tensor, shard) -> torch.Tensor:
    """A tensor's slices as ``shard`` names them (worker/models/parallel.py), concatenated."""
    return torch.cat([t.narrow(shard.dim, s, n) for s, n in shard.ranges], dim=shard.dim)


def iter_tensors(path: str | os.PathLike, wanted: set[str] | None = None,
                 shards: dict | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, CPU tensor in the file's dtype), one at a time; ``wanted`` restricts which are read. A tensor
    named in ``shards`` (name -> parallel.Shard) is read as those slices only: from safetensors files, only their
    bytes are read."""
    shards = shards or {}
    for file in weight_files(path):
        if file.suffix == ".safetensors":
            header, data_start = safetensors_header(file)
            with open(file, "rb", buffering=0) as f:
                for name, meta in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
                    if wanted is not None and name not in wanted:
                        continue
                    dtype = SAFETENSORS_DTYPES.get(meta["dtype"])
                    if dtype is None:
                        raise CheckpointError(f"{file.name}: tensor {name} has unsupported dtype {meta['dtype']}")
                    begin, end = meta["data_offsets"]
                    what = f"{file.name} (tensor {name})"
                    shard = shards.get(name)
                    if shard is None:
                        buf = torch.empty(end - begin, dtype=torch.uint8)
                        _read_into(f, buf, data_start + begin, what)
                        yield name, buf.view(dtype).reshape(meta["shape"])
                        continue
                    shape = list(meta["shape"])
                    out_shape = shape[:shard.dim] + [sum(n for _, n in shard.ranges)] + shape[shard.dim + 1:]
                    out = torch.empty(out_shape, dtype=dtype)
                    flat, at = out.view(-1), 0
                    size = out.element_size()
                    for offset, count in _runs(shape, shard):
                        _read_into(f, flat[at:at + count], data_start + begin + offset * size, what)
                        at += count
                    yield name, out
        else:
            sd = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            for name in list(sd):
                if wanted is None or name in wanted:
                    t = sd.pop(name)
                    yield name, (t if name not in shards else sliced(t, shards[name]).clone())
            del sd


def check_shapes(path: str | os.PathLike, expected: dict[str, tuple[int, ...]], family: str) -> None:
    """Raise CheckpointError naming missing tensors and mismatched shapes."""
    found = tensor_shapes(path)
    missing = sorted(k for k in expected if k not in found)
    wrong = sorted(f"{k}: expected {list(expected[k])}, found {list(found[k])}"
                   for k in expected if k in found and tuple(found[k]) != tuple(expected[k]))
    if missing or wrong:
        parts = [f"{str(path)!r} is not a {family} checkpoint matching its config.json."]
        if missing:
            shown = missing[:20]
            more = f" (and {len(missing) - 20} more)" if len(missing) > 20 else ""
            parts.append(f"Missing tensors: {', '.join(shown)}{more}.")
        if wrong:
            parts.append(f"Mismatched shapes: {'; '.join(wrong[:20])}.")
        raise CheckpointError(" ".join(parts))


def load_state_dict(path: str | os.PathLike, names: dict[str, str], dtype: torch.dtype,
                    device: torch.device, shards: dict | None = None) -> dict[str, torch.Tensor]:
    """Read the tensors named by ``names`` (checkpoint name -> module name), cast each one to ``dtype`` on
    ``device`` as soon as it is read (``shards``: see :func:`iter_tensors`). Returns module-name -> tensor."""
    out: dict[str, torch.Tensor] = {}
    for name, t in iter_tensors(path, set(names), shards):
        out[names[name]] = t.to(device=device, dtype=dtype)
        del t
    return out


_INITS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "kaiming_uniform_",
          "kaiming_normal_", "xavier_uniform_", "xavier_normal_")


@contextlib.contextmanager
def _no_init():
    """``torch.nn.init`` as no-ops while a model is built on the meta device: its parameters get the checkpoint's
    values, and a random fill of a meta tensor goes through torch's reference implementations, whose first use
    imports ``torch._dynamo`` (a second of every worker's start-up)."""
    saved = {name: getattr(torch.nn.init, name) for name in _INITS}
    for name in _INITS:
        setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def load_native(path: str | os.PathLike, make, family: str, device: torch.device, dtype: torch.dtype,
                prefix: str = ""):
    """Build ``make()`` on the meta device, check every parameter against the checkpoint (tensor ``prefix + name``),
    read the weights straight into ``dtype`` on ``device``, build the RoPE tables: the model, in eval mode.

    A parameter marked with a ``shard`` (tensor parallelism: worker/models/parallel.py) holds slices of its
    checkpoint tensor: the checkpoint's shape is checked whole, and only the slices are read."""
    with torch.device("meta"), _no_init():
        model = make()
    params = dict(model.named_parameters())
    shards = {prefix + n: p.shard for n, p in params.items() if getattr(p, "shard", None) is not None}
    expected = {}
    for n, p in params.items():
        shape = list(p.shape)
        s = shards.get(prefix + n)
        if s is not None:
            shape[s.dim] = s.full
        expected[prefix + n] = tuple(shape)
    check_shapes(path, expected, family)
    model.load_state_dict(load_state_dict(path, {prefix + n: n for n in params}, dtype, device, shards),
                          strict=True, assign=True)
    model.init_rope()
    # what reload_native needs later (assign=True replaced the meta parameters, and their shard marks with them)
    model.checkpoint_prefix, model.checkpoint_shards, model.checkpoint_shapes = prefix, shards, expected
    return model.eval().requires_grad_(False)


def _expected(model) -> tuple[dict, dict, dict]:
    """(checkpoint name -> parameter, checkpoint name -> shard, checkpoint name -> whole shape) of a model that
    load_native built."""
    prefix = model.checkpoint_prefix
    params = {prefix + n: p for n, p in model.named_parameters()}
    return params, model.checkpoint_shards, model.checkpoint_shapes


def check_reload(model, path: str | os.PathLike, family: str) -> None:
    """Raise CheckpointError unless ``path`` holds every tensor ``model`` was loaded with, in the same shapes (headers
    only: nothing is read or changed)."""
    check_shapes(path, _expected(model)[2], family)


RELOAD_CHUNK_BYTES = 64 << 20


@torch.no_grad()
def reload_native(model, path: str | os.PathLike, family: str, chunk_bytes: int = RELOAD_CHUNK_BYTES) -> None:
    """Copy the weights of ``path`` into ``model`` (built by load_native) in place: never a second model, and at most
    ``chunk_bytes`` in flight on the host (a whole tensor from safetensors is read and copied in slices of rows; a
    tensor-parallel shard or a .bin tensor at most whole), each slice copied straight into its parameter on the
    device. Check with :func:`check_reload` first: a failure half-way leaves the model mixed."""
    params, shards, _ = _expected(model)
    seen = set()
    for file in weight_files(path):
        if file.suffix != ".safetensors":
            continue
        header, data_start = safetensors_header(file)
        with open(file, "rb", buffering=0) as f:
            for name, meta in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
                if name not in params or name in shards or name in seen:
                    continue
                dtype = SAFETENSORS_DTYPES.get(meta["dtype"])
                if dtype is None:
                    raise CheckpointError(f"{file.name}: tensor {name} has unsupported dtype {meta['dtype']}")
                shape, begin = list(meta["shape"]), meta["data_offsets"][0]
                dest = params[name]
                if len(shape) < 2:
                    shape, dest = [max(1, math.prod(shape))] + [1], dest.view(-1, 1)
                row = math.prod(shape[1:]) * torch.empty((), dtype=dtype).element_size()
                step = max(1, chunk_bytes // max(1, row))
                for r0 in range(0, shape[0], step):
                    n = min(step, shape[0] - r0)
                    buf = torch.empty([n] + shape[1:], dtype=dtype)
                    _read_into(f, buf, data_start + begin + r0 * row, f"{file.name} (tensor {name})")
                    dest[r0:r0 + n].copy_(buf)
                seen.add(name)
    rest = set(params) - seen
    if rest:
        for name, t in iter_tensors(path, rest, shards):
            params[name].copy_(t)
            seen.add(name)
            del t
    if seen != set(params):
        raise CheckpointError(f"{str(path)!r}: tensors missing while reloading: {sorted(set(params) - seen)[:10]}")


VERSION_FILES = ("config.json", "generation_config.json")


def _fingerprint(path: Path) -> list:
    files = [*weight_files(path), *(path / n for n in VERSION_FILES if (path / n).is_file())]
    return [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def model_version(path: str | os.PathLike) -> dict:
    """Which weights a checkpoint directory holds: its absolute path and a content hash (BLAKE2b, 16 bytes, over
    every weight file and config.json / generation_config.json, names and bytes). The hash is computed once per
    directory state and kept under ``$DLLM_CACHE/versions`` (keyed by the path and the files' names, sizes and
    mtimes; a lock makes the workers of one machine compute it once), so the same weights give the same hash on
    every worker and every node."""
    import fcntl
    import hashlib
    path = Path(path).resolve()
    fp = _fingerprint(path)
    key = hashlib.sha256(json.dumps([str(path), fp]).encode()).hexdigest()[:32]
    cache = Path(os.environ.get("DLLM_CACHE", Path.home() / ".cache" / "dllm-serve")) / "versions"
    try:
        cache.mkdir(parents=True, exist_ok=True)
        lock = open(cache / f".{key}.lock", "w")
    except OSError:                 # no writable cache: compute, keep nothing
        cache, lock = None, None
    try:
        if lock is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
            hit = cache / f"{key}.json"
            if hit.is_file():
                try:
                    return json.loads(hit.read_text())
                except ValueError:
                    pass
        h = hashlib.blake2b(digest_size=16)
        for name, _, _ in fp:
            h.update(name.encode() + b"\0")
            with open(path / name, "rb") as f:
                while chunk := f.read(1 << 24):
                    h.update(chunk)
        version = {"path": str(path), "hash": h.hexdigest()}
        if lock is not None:
            tmp = cache / f".{key}.{os.getpid()}.tmp"
            tmp.write_text(json.dumps(version))
            os.replace(tmp, cache / f"{key}.json")
        return version
    finally:
        if lock is not None:
            lock.close()


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise ValueError(f"unknown dtype {dtype!r}: use float32, bfloat16 or float16")
    return table[dtype]


def resolve_device(device: str | torch.device | None) -> torch.device:
    if isinstance(device, torch.device):
        return device
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but CUDA is not available")
    return dev
