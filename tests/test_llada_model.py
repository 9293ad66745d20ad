"""The native LLaDA model against the reference logits, padding, GQA grouping and checkpoint formats."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import TINY_LLADA
from worker.models import CheckpointError, load_model
from worker.models.checkpoint import read_config


def forward_logits(model, ids, pos=None, mask=None):
    ids = torch.as_tensor(ids)
    if pos is None:
        pos = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.inference_mode():
        return model.logits(model(ids, pos, mask))


@pytest.fixture(scope="module")
def model():
    return load_model(TINY_LLADA, "cpu", "float32")


def test_logits_match_reference(model, llada_golden):
    got = forward_logits(model, [llada_golden["logits_input"]])[0]
    ref = torch.tensor(llada_golden["logits"])
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() < 1e-4


def test_left_padding_does_not_change_a_row(model, llada_golden):
    ids = llada_golden["logits_input"]
    pad = 5
    x = torch.tensor([[0] * pad + ids, list(range(1, len(ids) + pad + 1))])
    pos = torch.stack([torch.clamp(torch.arange(x.shape[1]) - pad, min=0), torch.arange(x.shape[1])])
    mask = torch.stack([torch.arange(x.shape[1]) >= pad, torch.ones(x.shape[1], dtype=torch.bool)])[:, None, None, :]
    got = forward_logits(model, x, pos, mask)[0, pad:]
    ref = torch.tensor(llada_golden["logits"])
    assert (got - ref).abs().max().item() < 1e-4
    # Without the key mask the padding leaks in: the mask is what makes the row independent.
    leaked = forward_logits(model, x, pos, None)[0, pad:]
    assert (leaked - ref).abs().max().item() > 1e-3


@pytest.mark.bf16
def test_bfloat16_load_keeps_weights_in_bfloat16(model):
    m16 = load_model(TINY_LLADA, "cpu", "bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in m16.parameters())
    ids = torch.tensor([[1, 2, 3, 4]])
    a = forward_logits(model, ids)
    b = forward_logits(m16, ids).float()
    # bfloat16 keeps ~3 significant digits, and the fixture's random weights amplify rounding: same shape of
    # logits, not the same digits.
    assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.99


def _write_checkpoint(src_sd: dict, cfg: dict, dest, *, shards: int = 1, fmt: str = "safetensors"):
    dest.mkdir(parents=True, exist_ok=True)
    for f in TINY_LLADA.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, dest / f.name)
    (dest / "config.json").write_text(json.dumps(cfg))
    names = sorted(src_sd)
    if fmt == "bin":
        torch.save(src_sd, dest / "pytorch_model.bin")
        return dest
    if shards == 1:
        save_file(src_sd, dest / "model.safetensors", metadata={"format": "pt"})
        return dest
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: src_sd[k] for k in part}, dest / fname, metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
    (dest / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dest


@pytest.fixture(scope="module")
def fixture_sd():
    return load_file(TINY_LLADA / "model.safetensors")


@pytest.mark.parametrize("kind", ["sharded", "bin"])
def test_sharded_and_bin_checkpoints_load_identically(tmp_path, model, fixture_sd, kind):
    cfg = read_config(TINY_LLADA)
    path = _write_checkpoint(fixture_sd, cfg, tmp_path / kind, shards=3 if kind == "sharded" else 1,
                             fmt="bin" if kind == "bin" else "safetensors")
    other = load_model(path, "cpu", "float32")
    ids = torch.tensor([[5, 6, 7, 8, 292, 292]])
    assert torch.equal(forward_logits(model, ids), forward_logits(other, ids))


def test_grouped_query_attention_groups_consecutive_heads(tmp_path, fixture_sd):
    """A GQA checkpoint (n_kv_heads=2) must equal the MHA checkpoint whose kv heads 0,1 and 2,3 are duplicates:
    kv head j serves query heads 2j and 2j+1."""
    cfg = read_config(TINY_LLADA)
    hd = cfg["d_model"] // cfg["n_heads"]
    mha, gqa = dict(fixture_sd), dict(fixture_sd)
    for name, w in fixture_sd.items():
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            heads = w.view(cfg["n_heads"], hd, -1)
            kv = heads[[0, 2]]                         # the two kv heads
            gqa[name] = kv.reshape(2 * hd, -1).contiguous()
            mha[name] = kv.repeat_interleave(2, dim=0).reshape(4 * hd, -1).contiguous()
    m1 = load_model(_write_checkpoint(mha, cfg, tmp_path / "mha"), "cpu", "float32")
    m2 = load_model(_write_checkpoint(gqa, dict(cfg, n_kv_heads=2), tmp_path / "gqa"), "cpu", "float32")
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    assert m2.blocks[0].k_proj.weight.shape[0] == 2 * hd
    assert torch.allclose(forward_logits(m1, ids), forward_logits(m2, ids), atol=1e-5)


def test_missing_tensor_is_named(tmp_path, fixture_sd):
    sd = {k: v for k, v in fixture_sd.items() if "blocks.1.up_proj" not in k}
    path = _write_checkpoint(sd, read_config(TINY_LLADA), tmp_path / "m")
    with pytest.raises(CheckpointError, match=r"Missing tensors: model\.transformer\.blocks\.1\.up_proj\.weight"):
        load_model(path, "cpu")


def test_mismatched_shape_is_named(tmp_path, fixture_sd):
    cfg = dict(read_config(TINY_LLADA), mlp_hidden_size=96)
    path = _write_checkpoint(dict(fixture_sd), cfg, tmp_path / "m")
    with pytest.raises(CheckpointError, match=r"ff_proj\.weight: expected \[96, 64\], found \[128, 64\]"):
        load_model(path, "cpu")


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        load_model(tmp_path, "cpu")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "model_type": "bert"}))
    with pytest.raises(CheckpointError, match="supported families: LLaDA"):
        load_model(tmp_path, "cpu")
    (tmp_path / "config.json").write_text(json.dumps(read_config(TINY_LLADA)))
    with pytest.raises(CheckpointError, match="holds no weights"):
        load_model(tmp_path, "cpu")
    with pytest.raises(CheckpointError, match="not a directory"):
        load_model(tmp_path / "nope", "cpu")


def test_loading_never_imports_code_from_the_checkpoint(tmp_path, fixture_sd):
    path = _write_checkpoint(dict(fixture_sd), read_config(TINY_LLADA), tmp_path / "m")
    marker = tmp_path / "executed"
    for name in ("modeling_llada.py", "configuration_llada.py"):
        (path / name).write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    from worker.engine import Engine
    Engine.from_pretrained(path, device="cpu")
    assert not marker.exists()
