"""Converting a torch.distributed.checkpoint (as NeMo-RL training writes it) into a servable checkpoint directory.

Layouts: structured (``weights/`` holding a DCP of ``{"model": state_dict}``, plus ``tokenizer/``) and legacy
(``.metadata`` and ``*.distcp`` at the top). DCP keys are mapped to the base model's tensor names by stripping
leading ``model.`` prefixes (``{"model": sd}`` flattens to ``model.<name>``, and the HF module adds another) or, failing
that, by a unique suffix match. Tensors are cast to the base checkpoint's dtypes; the base config, generation config
and tokenizer (the DCP's own ``tokenizer/`` when present) are copied."""
from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import torch
from safetensors.torch import save_file

from common import dcp_cache
from worker.models.checkpoint import CheckpointError, SAFETENSORS_DTYPES, safetensors_header, weight_files

COPY = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
        "chat_template.jinja", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")
SHARD_BYTES = 5 * 1024 ** 3


def dcp_layout(path: Path) -> tuple[Path, Path | None]:
    """(directory holding .metadata, tokenizer directory or None): common/dcp_cache.py's check."""
    try:
        return dcp_cache.dcp_layout(path)
    except ValueError as e:
        raise CheckpointError(str(e)) from None


def base_tensors(base: Path) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The base checkpoint's tensors: name -> (dtype, shape), read from the files' headers."""
    out = {}
    for f in weight_files(base):
        if f.suffix != ".safetensors":
            sd = torch.load(f, map_location="meta", weights_only=True)
            out.update({k: (v.dtype, tuple(v.shape)) for k, v in sd.items()})
            continue
        header, _ = safetensors_header(f)
        out.update({k: (SAFETENSORS_DTYPES[v["dtype"]], tuple(v["shape"])) for k, v in header.items()})
    return out


def check_shapes(mapping: dict[str, str], dcp_shapes: dict[str, tuple], base: dict[str, tuple]) -> None:
    """Every DCP tensor has its base tensor's shape (a DCP of another model size would otherwise be converted and
    fail only when a worker loads it); raises naming the first ones that differ."""
    wrong = [f"{name}: {list(dcp_shapes[key])} in the DCP, {list(base[name][1])} in the base model"
             for key, name in sorted(mapping.items(), key=lambda kv: kv[1]) if tuple(dcp_shapes[key]) != base[name][1]]
    if wrong:
        raise CheckpointError(f"{len(wrong)} tensors of the DCP checkpoint differ in shape from the base model's "
                              f"(another model size?), e.g. " + "; ".join(wrong[:3]))


def map_keys(dcp_keys: list[str], base_names: set[str]) -> dict[str, str]:
    """DCP key -> base tensor name; raises naming what does not map."""
    mapping, unmapped = {}, []
    for key in dcp_keys:
        k = key
        while k not in base_names and k.startswith("model."):
            k = k[len("model."):]
        if k not in base_names:
            hits = [b for b in base_names if key.endswith("." + b) or key == b]
            k = hits[0] if len(hits) == 1 else None
        if k is None:
            unmapped.append(key)
        else:
            mapping[key] = k
    missing = sorted(base_names - set(mapping.values()))
    if missing:
        raise CheckpointError(f"the DCP checkpoint lacks {len(missing)} tensors of the base model, e.g. {missing[:5]}"
                              + (f"; unmapped DCP keys: {unmapped[:5]}" if unmapped else ""))
    return mapping


def convert(dcp_path: str | Path, base_model: str | Path, output: str | Path) -> Path:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    dcp_path, base, output = Path(dcp_path), Path(base_model), Path(output)
    weights_dir, tok_dir = dcp_layout(dcp_path)
    specs = base_tensors(base)
    dtypes = {name: dtype for name, (dtype, _) in specs.items()}
    reader = FileSystemReader(str(weights_dir))
    meta = reader.read_metadata()
    keys = [k for k, v in meta.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)]
    mapping = map_keys(keys, set(dtypes))
    check_shapes(mapping, {k: tuple(meta.state_dict_metadata[k].size) for k in mapping}, specs)
    state = {k: torch.empty(meta.state_dict_metadata[k].size, dtype=meta.state_dict_metadata[k].properties.dtype)
             for k in mapping}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # "no process group: loading in a single process" is what we want
        dcp.load(state, storage_reader=reader)
    output.mkdir(parents=True, exist_ok=True)
    tensors = {mapping[k]: v.to(dtypes[mapping[k]]).contiguous() for k, v in state.items()}
    del state
    shards, cur, size = [], {}, 0
    for name in sorted(tensors):
        t = tensors[name]
        if cur and size + t.numel() * t.element_size() > SHARD_BYTES:
            shards.append(cur)
            cur, size = {}, 0
        cur[name] = t
        size += t.numel() * t.element_size()
    shards.append(cur)
    if len(shards) == 1:
        save_file(shards[0], output / "model.safetensors", metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, output / fname, metadata={"format": "pt"})
            weight_map.update({n: fname for n in shard})
        (output / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for name in COPY:
        src = (tok_dir / name) if tok_dir is not None and (tok_dir / name).is_file() else base / name
        if src.is_file():
            shutil.copy(src, output / name)
    cfg = json.loads((output / "config.json").read_text())
    if cfg.pop("auto_map", None) is not None:     # the .py files it names are not copied: clients would stop at
        (output / "config.json").write_text(json.dumps(cfg, indent=2))   # "run custom code? [y/N]
    return output
