"""dInfer's decoders (worker/engine/algorithms/dinfer.py): their transfer rules on hand-made confidences, and the
algorithms on the fixture (per-request thresholds in one batch, vicinity refresh and warm-up)."""
import torch

from tests.test_algorithms import golden_cases
from worker.engine import GenerationParams, Request
from worker.engine.algorithms.dinfer import Credit, Hierarchy, select_dinfer_threshold, select_hierarchy


def test_threshold_rule_commits_at_least_the_best_and_skips_mask_proposals():
    conf = torch.tensor([0.5, 0.95, 0.3, 0.92])
    masked = torch.tensor([True, True, True, True])
    x0 = torch.tensor([1, 2, 3, 4])
    assert select_dinfer_threshold(conf, x0, masked, 0.9, mask_id=9).tolist() == [False, True, False, True]
    # a threshold above every confidence: the best one alone (>= best - 1e-5)
    assert select_dinfer_threshold(conf, x0, masked, 0.99, mask_id=9).tolist() == [False, True, False, False]
    # the best proposes the mask token itself: left out, the next best leads
    assert select_dinfer_threshold(conf, torch.tensor([1, 9, 3, 4]), masked, 0.99, mask_id=9).tolist() == \
        [False, False, False, True]


def test_hierarchy_rule_takes_each_masked_runs_best():
    conf = torch.tensor([0.3, 0.6, 0.9, 0.5, 0.45])
    masked = torch.tensor([True, True, False, True, True])       # runs: [0, 1] and [3, 4]; 2 is decided
    assert select_hierarchy(conf, masked, 0.95, 0.4).tolist() == [False, True, False, True, False]
    assert select_hierarchy(conf, masked, 0.95, 0.55).tolist() == [False, True, False, False, False]
    assert select_hierarchy(conf, masked, 0.4, 0.55).tolist() == [False, True, False, True, True]
    rule = Hierarchy(0.95, 0.4)
    assert rule.select(conf, None, masked, None, None, 0).tolist() == [False, True, False, True, False]


def test_credit_rule_accumulates_within_a_block_and_resets():
    rule = Credit(0.9, extra={"credit_alpha": 0.7, "boost_gamma": 0.2, "decay_beta": 0.8})
    logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 0.0, 3.0]])
    masked = torch.tensor([True, False])
    first = rule.transform(logits, masked)
    p_top = torch.softmax(logits[0], -1).max()
    assert torch.allclose(rule.credit[0, 0], p_top ** 0.2) and rule.credit[1].sum() == 0   # masked positions only
    assert torch.allclose(first, logits + 0.7 * torch.log(rule.credit + 1))
    before = rule.credit.clone()
    rule.transform(logits, masked)
    assert torch.allclose(rule.credit[0, 0], before[0, 0] * 0.8 + p_top ** 0.2)          # decayed, then gained
    rule.start_block()
    assert rule.credit is None


def test_per_request_threshold_is_honoured_in_one_batch(llada_engine, llada_golden):
    c = golden_cases(llada_golden, ("dual_cache",))[0]
    reqs = [Request(c["prompt"], GenerationParams(gen_length=32, block_length=8, algorithm=alg, threshold=t))
            for alg in ("dual_cache", "dinfer_blockwise", "dinfer_credit", "dinfer_hierarchy") for t in (0.3, 0.99)]
    res = llada_engine.generate(reqs, early_exit=False)
    for lo, hi in zip(res[::2], res[1::2]):
        assert lo.nfe < hi.nfe          # a lower threshold commits more per step: fewer forwards
        assert lo.nfe < 32 and hi.nfe <= 32 * 4

def test_vicinity_refresh_and_warmup_change_the_work_done(llada_engine, llada_golden):
    c = golden_cases(llada_golden, ("dual_cache",))[1]
    forwarded = []      # tokens per forward pass
    hook = llada_engine.model.register_forward_pre_hook(lambda m, args: forwarded.append(args[0].numel()))

    def run(**extra):
        forwarded.clear()
        r = llada_engine.generate([Request(c["prompt"], GenerationParams(
            gen_length=32, block_length=8, algorithm="dinfer_blockwise", threshold=0.99, extra=extra))],
            early_exit=False)[0]
        return r, list(forwarded)
    try:
        (_, plain_fw), (_, look_fw) = run(), run(prefix_look=4, after_look=4)
        (warm, warm_fw), (no_cache, no_cache_fw) = run(warmup_steps=8), run(warmup_steps=1000)
    finally:
        hook.remove()
    full = len(c["prompt"]) + 32
    # plain dual cache: one full forward per block, then block-only windows (8 tokens)
    assert sorted(set(plain_fw)) == [8, full] and plain_fw.count(full) == 4
    # the vicinity refresh widens every cached window by 4 + 4 (clipped at the canvas end for the last block)
    assert look_fw.count(full) == 4 and set(look_fw) - {full} <= {16, 12} and 16 in look_fw
    assert sum(look_fw) > sum(plain_fw)
    # warm-up for the whole block (8 steps of 8 tokens) = full forwards every step = the cache never used
    assert set(warm_fw) == {full} and set(no_cache_fw) == {full}
    assert (warm.canvas, warm.nfe) == (no_cache.canvas, no_cache.nfe) and warm.nfe == len(warm_fw)


def test_rows_chosen_together_match_each_row_alone():
    """The threshold and hierarchy rules' whole-batch choice (select_rows, what sampling.denoise calls for a batch)
    is each row's own select: rows of different widths padded as denoise pads them, confidences full of ties,
    proposals equal to the mask token, rows without masks."""
    from worker.engine.algorithms.dinfer import DInferThreshold, Hierarchy
    from worker.engine.sampling import NEG_INF
    g = torch.Generator().manual_seed(3)
    mask_id = 9
    for trial in range(60):
        R, K = int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(1, 9, (1,), generator=g))
        widths = torch.randint(1, K + 1, (R,), generator=g).tolist()
        conf = torch.randint(0, 4, (R, K), generator=g).float() / 4       # ties everywhere
        if trial % 2 == 0:          # and values just inside / outside the threshold rule's 1e-5 of the best
            conf = conf + torch.randint(0, 3, (R, K), generator=g).float() * 6e-6
        x0 = torch.randint(7, 11, (R, K), generator=g)                      # sometimes the mask token
        masked = torch.rand(R, K, generator=g) < [0.7, 0.0, 1.0][trial % 3]
        for b, w in enumerate(widths):
            conf[b, w:], masked[b, w:] = NEG_INF, False
        conf = torch.where(masked, conf, torch.full_like(conf, NEG_INF)) if trial % 2 else conf
        for rules in ([DInferThreshold(0.6 + 0.4 * float(t)) for t in torch.rand(R, generator=g)],
                      [Hierarchy(0.5, 0.25)] * R, [Hierarchy(None, None)] * R, [Hierarchy(0.6, None)] * R):
            got = type(rules[0]).select_rows(rules, conf, x0, masked, mask_id)
            for b, w in enumerate(widths):
                alone = rules[b].select(conf[b, :w], x0[b, :w], masked[b, :w], None, None, mask_id)
                assert torch.equal(got[b, :w], alone), (trial, rules[0], b)
                assert not got[b, w:].any()


def test_credit_fused_together_matches_each_row_alone():
    """Credit.transform_rows (the credit fusion of a batch's rows at once) gives each row's fused logits and leaves
    each row's credit matrix as Credit.transform row by row does, over several steps (decay, a new block, equal and
    unequal widths)."""
    from worker.engine.algorithms.dinfer import Credit
    g = torch.Generator().manual_seed(11)
    extra = {"decay_beta": 0.7, "boost_gamma": 0.5, "credit_alpha": 0.3}
    R, K, V = 3, 5, 7
    for widths in ([5, 5, 5], [5, 3, 4]):
        alone = [Credit(0.9, extra=dict(extra)) for _ in range(R)]
        together = [Credit(0.9, extra=dict(extra)) for _ in range(R)]
        for step in range(4):
            if step == 2:
                alone[1].start_block()
                together[1].start_block()
            logits = torch.randn(R, K, V, generator=g)
            masked = torch.rand(R, K, generator=g) < 0.6
            got = Credit.transform_rows(together, logits, masked, widths)
            for b, w in enumerate(widths):
                want = alone[b].transform(logits[b, :w], masked[b, :w])
                assert torch.equal(got[b, :w], want), (widths, step, b)
                assert torch.equal(together[b].matrix(), alone[b].matrix())
