"""The shipped demo model (worker/demo_model, trained by scripts/train_toy_model.py) still reaches its documented
accuracy on a small held-out sample (problems the training run never drew), with the reference `basic` algorithm."""
import functools
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "worker" / "demo_model"
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "scripts"))


@pytest.fixture(scope="module")
def demo():
    if not (MODEL / "training.json").exists():
        pytest.skip("worker/demo_model is not a trained model")
    from worker.engine import Engine
    return Engine.from_pretrained(MODEL, device="cpu", dtype="float32"), json.loads((MODEL / "accuracy.json").read_text())


@pytest.fixture
def seen() -> set[str]:
    """Every prompt the training run drew: its 766k draws replayed once per process (5 s) for this module's tests,
    which run in one pytest-xdist process (the xdist_group marks; scripts/test.sh runs with --dist loadgroup)."""
    return _training_problems()


@functools.lru_cache(maxsize=1)
def _training_problems() -> frozenset[str]:
    from quality import training_problems
    return frozenset(training_problems(MODEL))


@pytest.mark.xdist_group("demo_training")
def test_documented_accuracy_on_a_held_out_sample(demo, seen):
    from quality import held_out
    from worker.engine import GenerationParams, Request
    from worker.tokenizer import apply_chat_template
    engine, documented = demo
    problems = held_out(90, seed=4242, seen=seen)
    reqs = [Request(apply_chat_template(engine.tokenizer, [{"role": "user", "content": prompt}]),
                    GenerationParams(gen_length=16, block_length=16, steps=16)) for _, prompt, _ in problems]
    results = engine.generate(reqs)
    right = {"sort": 0, "reverse": 0, "add": 0}
    for (task, _, answer), r in zip(problems, results):
        right[task] += engine.tokenizer.decode(r.token_ids, skip_special_tokens=True).strip() == answer
    overall = sum(right.values()) / len(problems)
    # 90 problems: allow 5 points of sampling noise below the figure measured on the full held-out set
    assert overall >= documented["basic_steps16"]["accuracy"] - 0.05, (right, documented)
    for task, n in right.items():
        assert n / 30 >= documented["basic_steps16"][task] - 0.1, (task, right)


@pytest.mark.xdist_group("demo_training")          # (with the test above: one load of the model)
def test_the_demo_answers_the_readme_example(demo):
    from worker.engine import GenerationParams, Request
    from worker.tokenizer import apply_chat_template
    engine, _ = demo
    ids = apply_chat_template(engine.tokenizer, [{"role": "user", "content": "sort 5 2 8 1"}])
    r = engine.generate([Request(ids, GenerationParams(gen_length=16, block_length=16, steps=16))])[0]
    assert engine.tokenizer.decode(r.token_ids, skip_special_tokens=True).strip() == "1 2 5 8"


@pytest.mark.xdist_group("demo_training")
def test_the_lm_eval_tasks_are_held_out_problems_with_right_answers(seen):
    """bench/lm_eval_tasks (docs/api.md's lm-eval commands): problems the training run never drew, each answer right
    and the candidate at `label`."""
    rows = [json.loads(line) for line in (ROOT / "bench" / "lm_eval_tasks" / "demo_problems.jsonl").open()]
    assert len(rows) == 24 and not {r["prompt"] for r in rows} & seen
    for r in rows:
        task, *words = r["prompt"].split()
        if task == "add":
            plus = words.index("+")
            right = str(int("".join(words[:plus])) + int("".join(words[plus + 1:])))
        else:
            right = "".join(sorted(words) if task == "sort" else words[::-1])
        assert r["answer"] == " ".join(right) and r["choices"][r["label"]] == r["answer"], r
        assert len(set(r["choices"])) == 3
