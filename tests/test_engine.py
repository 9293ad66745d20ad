"""The generation engine against the reference code's outputs, and its batching properties."""
import random

import pytest
from click.testing import CliRunner
import orjson

from dllm_serve.cli import main as cli
from tests.conftest import TINY_LLADA
from worker.engine import GenerationParams, ParamError, Request


def case_params(c: dict, **kw) -> GenerationParams:
    return GenerationParams(gen_length=c["gen_length"], block_length=c["block_length"], steps=c["steps"],
                            algorithm=c["algorithm"], cfg_scale=c.get("cfg_scale", 0.0),
                            threshold=c.get("threshold"), **kw)


def basic_cases(golden):
    return [c for c in golden["cases"] if c["algorithm"] == "basic"]


def first_stop(ids, stops):
    return next((i for i, t in enumerate(ids) if t in stops), len(ids))


def test_every_basic_golden_case_is_exact(llada_engine, llada_golden):
    cases = basic_cases(llada_golden)
    assert len(cases) == 20
    for c in cases:
        res = llada_engine.generate([Request(c["prompt"], case_params(c))], early_exit=False)[0]
        assert res.canvas == c["output"], c
        if c["nfe"] is not None:
            assert res.nfe == c["nfe"]
        cut = first_stop(c["output"], llada_engine.stop_ids)
        assert res.token_ids == c["output"][:cut]
        assert res.finish_reason == ("stop" if cut < len(c["output"]) else "length")


def test_early_exit_is_exact_and_saves_steps(llada_engine, llada_golden):
    saved = 0
    for c in basic_cases(llada_golden):
        full = llada_engine.generate([Request(c["prompt"], case_params(c))], early_exit=False)[0]
        fast = llada_engine.generate([Request(c["prompt"], case_params(c))])[0]
        assert fast.token_ids == full.token_ids and fast.finish_reason == full.finish_reason
        assert fast.nfe <= full.nfe
        saved += full.nfe - fast.nfe
    assert saved > 0   # some golden rows stop early in a multi-block schedule


def mixed_requests(golden):
    reqs = [Request(c["prompt"], case_params(c)) for c in basic_cases(golden)]
    rng = random.Random(0)
    for i in range(8):
        prompt = [rng.randrange(0, 287) for _ in range(rng.randrange(1, 20))]
        reqs.append(Request(prompt, GenerationParams(
            gen_length=rng.choice([5, 8, 12, 24]), block_length=rng.choice([4, 8, 16]), steps=rng.choice([None, 4, 9]),
            temperature=rng.choice([0.0, 0.7, 1.3]), remasking=rng.choice(["low_confidence", "random"]),
            cfg_scale=rng.choice([0.0, 0.5]), seed=1000 + i,
            threshold=rng.choice([None, 0.6]) if i % 2 else None, factor=1.0 if i == 4 else None)))
    return reqs


@pytest.mark.parametrize("early_exit", [False, True])
def test_a_row_does_not_depend_on_its_batch(llada_engine, llada_golden, early_exit):
    reqs = mixed_requests(llada_golden)
    alone = [llada_engine.generate([r], early_exit=early_exit)[0] for r in reqs]
    shuffled = list(range(len(reqs)))
    random.Random(1).shuffle(shuffled)
    together = llada_engine.generate([reqs[i] for i in shuffled], early_exit=early_exit)
    for j, i in enumerate(shuffled):
        assert together[j].token_ids == alone[i].token_ids, (i, reqs[i])
        assert together[j].nfe == alone[i].nfe
        if not early_exit:
            assert together[j].canvas == alone[i].canvas


def test_seed_reproducible_and_seed_dependent(llada_engine):
    p = GenerationParams(gen_length=24, block_length=8, steps=12, temperature=1.0, remasking="random", seed=7)
    a = llada_engine.generate([Request([10, 20, 30], p)], early_exit=False)[0]
    b = llada_engine.generate([Request([4, 4], p), Request([10, 20, 30], p)], early_exit=False)[1]
    assert a.canvas == b.canvas
    others = {tuple(llada_engine.generate([Request([10, 20, 30], GenerationParams(
        gen_length=24, block_length=8, steps=12, temperature=1.0, remasking="random", seed=s))],
        early_exit=False)[0].canvas) for s in range(8, 12)}
    assert len(others | {tuple(a.canvas)}) > 1


def test_rounding_gen_length_up_to_blocks(llada_engine, llada_golden):
    """max_tokens 20 with block_length 8 runs a 24-token canvas (3 blocks) and returns its first 20 tokens."""
    c = next(c for c in basic_cases(llada_golden) if c["block_length"] == 8 and "threshold" not in c)
    ref = llada_engine.generate([Request(c["prompt"], GenerationParams(gen_length=24, block_length=8, steps=12))],
                                early_exit=False)[0]
    got = llada_engine.generate([Request(c["prompt"], GenerationParams(gen_length=20, block_length=8, steps=12))],
                                early_exit=False)[0]
    assert got.canvas == ref.canvas
    cut = first_stop(ref.canvas[:20], llada_engine.stop_ids)
    assert got.token_ids == ref.canvas[:cut]


def test_stop_ids_come_from_the_checkpoint(llada_engine):
    vocab = llada_engine.tokenizer.get_vocab()
    assert llada_engine.stop_ids == sorted({vocab["<|endoftext|>"], vocab["<|eot_id|>"]})
    assert llada_engine.mask_id == vocab["<|mdm_mask|>"] == 292


@pytest.mark.parametrize("params, param", [
    (dict(gen_length=4090), "max_tokens"),
    (dict(gen_length=0), "max_tokens"),
    (dict(steps=0), "steps"),
    (dict(block_length=-1), "block_length"),
    (dict(remasking="sideways"), "remasking"),
    (dict(temperature=-1.0), "temperature"),
    (dict(threshold=1.5), "threshold"),
    (dict(threshold=0.5, factor=1.0), "factor"),
    (dict(algorithm="nope"), "generation_algorithm"),
])
def test_bad_parameters_are_named(llada_engine, params, param):
    with pytest.raises(ParamError) as e:
        llada_engine.generate([Request([1, 2, 3, 4, 5, 6, 7, 8, 9], GenerationParams(**params))])
    assert e.value.param == param


def test_bad_prompt_tokens(llada_engine):
    with pytest.raises(ParamError, match=r"\[0, 295\)") as e:
        llada_engine.plan([1, 99999], GenerationParams())
    assert e.value.param == "prompt"
    with pytest.raises(ParamError):
        llada_engine.plan([], GenerationParams())


def test_cli_generate_reproduces_every_basic_golden_case(llada_golden):
    runner = CliRunner()
    for c in basic_cases(llada_golden):
        args = ["generate", "--model-path", str(TINY_LLADA), "--prompt-ids", ",".join(map(str, c["prompt"])),
                "--gen-length", str(c["gen_length"]), "--block-length", str(c["block_length"]),
                "--steps", str(c["steps"]), "--device", "cpu", "--dtype", "float32", "--json", "--no-early-exit"]
        if c.get("cfg_scale"):
            args += ["--cfg-scale", str(c["cfg_scale"])]
        if c.get("threshold") is not None:
            args += ["--threshold", str(c["threshold"])]
        res = runner.invoke(cli, args)
        assert res.exit_code == 0, res.output
        out = orjson.loads(res.stdout)
        assert out["canvas"] == c["output"]
        assert set(out) >= {"token_ids", "text", "finish_reason", "nfe"}
        if c["nfe"] is not None:
            assert out["nfe"] == c["nfe"]


def test_cli_generate_chat_and_errors():
    runner = CliRunner()
    res = runner.invoke(cli, ["generate", "--model-path", str(TINY_LLADA), "--prompt", "di vo", "--chat",
                              "--gen-length", "8", "--block-length", "8", "--json"])
    assert res.exit_code == 0, res.output
    assert orjson.loads(res.stdout)["nfe"] <= 8
    # --chat with --requests: the default of every line that does not set chat (it was refused: "--chat needs
    # --prompt"); a line with prompt_ids or chat=false is left as it is
    lines = [{"prompt": "di vo"}, {"prompt": "di vo", "chat": False}, {"prompt_ids": [1, 2]}]
    common = ["generate", "--model-path", str(TINY_LLADA), "--gen-length", "8", "--block-length", "8", "--no-early-exit",
              "--requests", "-"]
    chat = runner.invoke(cli, common + ["--chat"], input=b"\n".join(orjson.dumps(x) for x in lines))
    plain = runner.invoke(cli, common, input=b"\n".join(orjson.dumps(x) for x in lines))
    assert chat.exit_code == 0 and plain.exit_code == 0, chat.output + plain.output
    chat, plain = ([orjson.loads(x) for x in r.stdout.splitlines()] for r in (chat, plain))
    assert chat[1:] == plain[1:] and chat[0] != plain[0]
    one = runner.invoke(cli, common[:-2] + ["--prompt", "di vo", "--chat", "--json"])
    assert chat[0] == orjson.loads(one.stdout)                  # as --prompt "di vo" --chat gives it
    res = runner.invoke(cli, ["generate", "--model-path", str(TINY_LLADA), "--prompt-ids", "1,2", "--chat"])
    assert res.exit_code == 2 and "--chat needs --prompt or --requests" in res.output
    res = runner.invoke(cli, ["generate", "--model-path", str(TINY_LLADA), "--prompt-ids", "1,2", "--steps", "0"])
    assert res.exit_code != 0 and "steps" in res.output
    res = runner.invoke(cli, ["generate", "--model-path", "/nonexistent", "--prompt", "x"])
    assert res.exit_code != 0 and "no such directory" in res.output


def test_the_final_prefix_ends_at_the_first_mask_or_stop_token():
    """Finisher.final_prefix (searched with list.index) against the rule read position by position, on random
    windows with masks and stop tokens anywhere, a stop id equal to the mask id and none at all."""
    import random
    from types import SimpleNamespace

    from worker.engine.rows import Finisher
    row = SimpleNamespace(plan=SimpleNamespace(gen_length=12), params=SimpleNamespace(ignore_eos=False,
                                                                                      stop_token_ids=frozenset()))
    fin = Finisher(mask_id=9, stop_ids=[], early_exit=True, hooks=None)

    def by_position(gen, stops):
        window = gen[:12]
        for i, t in enumerate(window):
            if t == 9 or t in stops:
                return window[:i], t != 9
        return window, False
    rng = random.Random(0)
    for _ in range(3000):
        gen = [rng.choice([0, 1, 2, 3, 9, 9, 5]) for _ in range(rng.randrange(0, 16))]
        for stops in ([1, 2], [], [9], [1, 9, 3]):
            fin.stop_ids = frozenset(stops)
            assert fin.final_prefix(row, gen) == by_position(gen, set(stops)), (gen, stops)
