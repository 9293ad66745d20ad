"""The worker's fast text decoder gives exactly what ``tokenizer.decode(ids, skip_special_tokens=True)`` gives."""
import random

import pytest

from common.resolve import DEMO_MODEL
from tests.conftest import TINY_LLADA, TINY_NEMOTRON
from worker.tokenizer import load_tokenizer, text_decoder


@pytest.mark.parametrize("path", [TINY_LLADA, TINY_NEMOTRON, DEMO_MODEL], ids=["llada", "nemotron", "demo"])
def test_text_decoder_matches_transformers(path):
    tok = load_tokenizer(path)
    decode = text_decoder(tok)
    rng = random.Random(0)
    n = len(tok)
    cases = [[], list(range(min(n, 300)))] + [[rng.randrange(n) for _ in range(rng.randrange(1, 40))]
                                              for _ in range(200)]
    cases += [tok.all_special_ids + c[:5] for c in cases[:20]]           # special tokens are skipped
    for ids in cases:
        assert decode(ids) == tok.decode(ids, skip_special_tokens=True), ids


def test_text_decoder_keeps_transformers_for_clean_up():
    tok = load_tokenizer(TINY_LLADA)
    tok.clean_up_tokenization_spaces = True          # the wrapper's post-processing is needed: no shortcut
    calls = []
    orig = tok.decode
    tok.decode = lambda ids, **kw: calls.append(ids) or orig(ids, **kw)
    text_decoder(tok)([5, 6])
    assert calls == [[5, 6]]


def test_a_gemma_end_of_turn_stops_without_generation_config(tmp_path):
    """DiffusionGemma's end of turn (`<turn|>`) came only from its generation_config.json: a checkpoint without the
    file would not stop at the end of its answer (a reviewer's finding). Gemma's end-of-turn tokens are among those
    the vocabulary is searched for."""
    import shutil

    from tests.conftest import fixture_path
    from worker.models.checkpoint import read_config
    from worker.tokenizer import load_tokenizer, stop_token_ids
    path = shutil.copytree(fixture_path("tiny-diffusion-gemma"), tmp_path / "dg")
    (path / "generation_config.json").unlink()
    tok = load_tokenizer(path)
    assert tok.get_vocab()["<turn|>"] in stop_token_ids(path, tok, read_config(path))
