"""The confidence and tie-breaking arithmetic of worker/engine/sampling.py, against the operations the references
use (F.softmax over the whole [B, L, V] logits, torch.topk over the whole sequence)."""
import torch
import torch.nn.functional as F

from worker.engine.sampling import Layout, Softmax, select_factor, select_fixed, select_threshold


def test_softmax_keeps_ulps_that_logsumexp_loses():
    logits = torch.tensor([[20.0, 4.1, 3.9, 0.0]])
    x0 = torch.tensor([0])
    ours = Softmax.MODEL.probability(logits, x0)
    assert ours.item() == F.softmax(logits, -1)[0, 0].item() < 1.0
    assert torch.exp(logits[0, 0] - torch.logsumexp(logits, -1)[0]).item() == 1.0   # what the old code computed


def test_confidence_of_a_position_does_not_depend_on_the_other_positions():
    g = torch.Generator().manual_seed(0)
    for dtype, kind in [(torch.float32, Softmax.MODEL), (torch.float32, Softmax.FLOAT64),
                        (torch.bfloat16, Softmax.MODEL), (torch.bfloat16, Softmax.FLOAT32),
                        (torch.float32, Softmax.EXP_LOG_SOFTMAX)]:
        logits = (torch.randn(3, 37, 1001, generator=g) * 30).to(dtype)
        x0 = logits.argmax(-1)
        if kind is Softmax.EXP_LOG_SOFTMAX:
            full = F.log_softmax(logits, -1).gather(-1, x0[..., None]).squeeze(-1).exp()
        else:
            full = F.softmax(logits.to(kind.dtype(dtype)), -1).gather(-1, x0[..., None]).squeeze(-1)
        bi = torch.tensor([2, 0, 0, 1, 2])
        ki = torch.tensor([36, 0, 17, 5, 3])
        part = kind.probability(logits[bi, ki], x0[bi, ki])
        assert part.dtype == full.dtype
        assert torch.equal(part, full[bi, ki]), (dtype, kind)


def _tied():
    return torch.tensor([1.0, 0.5, 1.0, 1.0, 0.9, 1.0, 1.0, 0.2])


def test_ties_are_broken_by_topk_on_the_reference_vector():
    conf = _tied()
    long = Layout(40, 8)                          # e.g. prompt 8 + canvas 32, the block first
    vec = torch.full((40,), float("-inf"))
    vec[8:16] = conf
    for k in (1, 2, 3, 5):
        assert select_fixed(conf, long, k).tolist() == (torch.topk(vec, k).indices - 8).tolist()
    # the vector's shape matters: a block-only vector ranks the same ties differently
    assert select_fixed(conf, long, 2).tolist() != select_fixed(conf, Layout(8, 0), 2).tolist()


def test_threshold_rule_compares_in_the_confidence_dtype():
    # float32(0.9) < 0.9 as doubles, but the reference compares the float32 confidence with the threshold as float32
    conf = torch.tensor([1.0, 0.9, 0.5], dtype=torch.float32)
    picked = sorted(select_threshold(conf, Layout(3, 0), 3, 0.9).tolist())
    assert picked == [0, 1]
    conf64 = conf.double()
    assert sorted(select_threshold(conf64, Layout(3, 0), 3, 0.9).tolist()) == [0]
    # the first ranked is always committed, even below the threshold
    assert select_threshold(torch.tensor([0.2, 0.3]), Layout(2, 0), 2, 0.9).tolist() == [1]


def test_factor_rule():
    conf = torch.tensor([0.99, 0.95, 0.7, 0.6], dtype=torch.float64)
    masked = torch.ones(4, dtype=torch.bool)
    # cuts 1 - f/(n+1): n=1 -> -1 (forced), n=2 -> 0.6667, n=3 -> 0.75: 0.7 < 0.75 stops at index 2
    assert sorted(select_factor(conf, Layout(4, 0), masked, 1.0).tolist()) == [0, 1]
    # stopping on the last masked position moves one further: all of them
    assert len(select_factor(torch.tensor([0.99, 0.98, 0.97, 0.1], dtype=torch.float64), Layout(4, 0), masked,
                             1.0)) == 4


def test_rows_ranked_together_choose_what_each_row_alone_chooses():
    """sampling._select_grouped (one topk per group of rows) against select_fixed / select_threshold per row, on
    vectors full of exact ties (1.0, -inf), rows of different widths and offsets in their reference vectors, and
    windows whose vector is the candidates themselves: the same picks among the candidates with a finite
    confidence (the others are not masked, and denoise drops them)."""
    import random

    from worker.engine.sampling import NEG_INF, _select_grouped
    rng = random.Random(3)
    for trial in range(300):
        length, k, B = rng.choice([12, 40, 160]), rng.randrange(1, 6), rng.randrange(1, 9)
        widths = [rng.randrange(k, 9) for _ in range(B)]
        window = trial % 3 == 0           # a cached window: the vector is the candidates themselves
        if window:
            length = rng.randrange(k, 9)
            widths = [length] * B
        K = max(widths) + rng.randrange(0, 3)          # a batch's other groups may be wider
        dtype = rng.choice([torch.float32, torch.float64])
        conf = [torch.tensor([rng.choice([1.0, 0.5, NEG_INF, rng.random()]) for _ in range(w)], dtype=dtype)
                for w in widths]
        matrix = torch.full((B, K), NEG_INF, dtype=dtype)
        for b, c in enumerate(conf):
            matrix[b, :widths[b]] = c
        ats = [0] * B if window else [rng.randrange(0, length - w + 1) for w in widths]
        threshold = rng.choice([None, 0.9])
        chosen = torch.zeros(B, K, dtype=torch.bool)
        if threshold is None:
            chosen = _select_grouped(matrix, length, k, None, tuple(ats), tuple(widths))
            want = [select_fixed(conf[b], Layout(length, ats[b]), k) for b in range(B)]
        else:
            m = [int((c > NEG_INF).sum()) for c in conf]
            groups = {}
            for b in range(B):
                groups.setdefault(m[b], []).append(b)
            for n, bs in groups.items():
                chosen[bs] = _select_grouped(matrix[bs], length, n, threshold, tuple(ats[b] for b in bs),
                                             tuple(widths[b] for b in bs))
            want = [select_threshold(conf[b], Layout(length, ats[b]), m[b], threshold) for b in range(B)]
        for b in range(B):
            alone = torch.zeros(K, dtype=torch.bool)
            idx = want[b]
            alone[idx[(idx >= 0) & (idx < widths[b])]] = True
            assert torch.equal(chosen[b], alone & (matrix[b] > NEG_INF)), (trial, b)


def test_block_rows_choose_together_as_each_alone():
    """SDAR's and LLaDA2's rows choose their positions in one pass (block_causal.choose, no read of the device per
    row): the same positions as each row's reference rule alone, with ties (probabilities on a coarse grid), counts
    above the masks left, every strategy, and rows of different counts and strategies in one call."""
    from worker.engine.algorithms.block_causal import choose

    def choose_rows(masked, prob, n, threshold, strategy, only_masked):     # the rows of each block length together
        out = [None] * len(masked)
        for width in {m.shape[0] for m in masked}:
            members = [i for i, m in enumerate(masked) if m.shape[0] == width]
            top = choose(torch.stack([masked[i] for i in members]), torch.stack([prob[i] for i in members]),
                         [n[i] for i in members], [threshold[i] for i in members], [strategy[i] for i in members],
                         only_masked)
            for j, i in enumerate(members):
                out[i] = top[j]
        return out

    def alone(strategy, masked, prob, n, threshold, only_masked):
        out = torch.zeros_like(masked)
        if strategy == "sequential":
            first = int(masked.nonzero()[0, 0])
            out[first:first + n] = True
            return out
        conf = torch.where(masked, prob, float("-inf"))
        if threshold is not None:
            high = conf > threshold
            if int(high.sum()) >= n:
                return high
        out[torch.topk(conf, min(n, int(masked.sum())) if only_masked else n)[1]] = True
        return out

    g = torch.Generator().manual_seed(0)
    for only_masked in (True, False):
        for _ in range(60):
            rows = []
            for _ in range(int(torch.randint(1, 9, (1,), generator=g))):
                width = (4, 8)[int(torch.randint(0, 2, (1,), generator=g))]
                masked = torch.rand(width, generator=g) < 0.6
                masked[int(torch.randint(0, width, (1,), generator=g))] = True
                prob = torch.randint(0, 4, (width,), generator=g).float() / 4
                strategy = ("sequential", "low_confidence_static", "low_confidence_dynamic")[
                    int(torch.randint(0, 3, (1,), generator=g))]
                threshold = (None, 0.5, 0.25)[int(torch.randint(0, 3, (1,), generator=g))]
                if strategy != "low_confidence_dynamic":
                    threshold = None
                n = int(torch.randint(0, width + 1, (1,), generator=g))
                if strategy == "sequential":
                    n = min(n, width)
                rows.append((strategy, masked, prob, n, threshold))
            got = choose_rows([r[1] for r in rows], [r[2] for r in rows], [r[3] for r in rows],
                              [r[4] for r in rows], [r[0] for r in rows], only_masked)
            for r, o in zip(rows, got):
                assert torch.equal(o, alone(*r, only_masked)), (r, o)


def test_window_index_tensors():
    """rows.window: a batch of windows' columns (padded with each row's last), which are real, each column's own
    index or the last real one's, and the flat list of the real ones, built on the host in one copy (windows of one
    width, the usual case, from kept parts and their columns)."""
    import random

    from worker.engine.rows import window
    rng = random.Random(0)
    for i in range(300):
        spans, width = [], rng.randrange(1, 12)
        for _ in range(rng.randrange(1, 9)):
            a = rng.randrange(0, 50)
            spans.append((a, a + (width if i % 3 == 0 else rng.randrange(1, 12))))    # a third of one width
        w = window(spans, "cpu")
        W = max(e - s for s, e in spans)
        assert w.cols.shape == w.valid.shape == w.last.shape == (len(spans), W) and w.valid.dtype == torch.bool
        for b, (s, e) in enumerate(spans):
            assert w.cols[b].tolist() == [min(s + j, e - 1) for j in range(W)]
            assert w.valid[b].tolist() == [j < e - s for j in range(W)]
            assert w.last[b].tolist() == [min(j, e - s - 1) for j in range(W)]
        bi, wi = w.valid.nonzero(as_tuple=True)
        assert torch.equal(w.flat[0], bi) and torch.equal(w.flat[1], wi) and torch.equal(w.flat[2], w.cols[bi, wi])


def test_one_read_helpers_give_what_the_reads_they_replace_give():
    """rows.nonzero_rows: nonzero's (row, column) indices, in its order, and each row's count, from one read of the
    mask; rows.read_with: a matrix and extra values from one read."""
    from worker.engine.rows import nonzero_rows, read_with

    g = torch.Generator().manual_seed(3)
    for B, W in ((1, 1), (3, 7), (8, 40), (5, 0)):
        for p in (0.0, 0.3, 1.0):
            mask = torch.rand(B, W, generator=g) < p
            bi, ci, counts = nonzero_rows(mask)
            want_b, want_c = mask.nonzero(as_tuple=True)
            assert torch.equal(bi, want_b) and torch.equal(ci, want_c) and bi.dtype == want_b.dtype == ci.dtype
            assert counts == mask.sum(1).tolist()
    x = torch.randint(0, 100, (4, 6), generator=g)
    extra = torch.randint(0, 2, (3, 2), generator=g)
    xc, read = read_with(x, extra)
    assert xc == x.tolist() and read == extra.tolist()
    assert read_with(x, None) == (x.tolist(), None)


def test_upload_gives_torch_tensors_values_and_keeps_index_lists():
    """worker.models.layers.upload: torch.tensor's values and dtype for numbers, nested lists and host tensors; a flat
    list of ints is kept (the same tensor again, not copied again), and nothing else is: floats equal to ints (1.0 ==
    1) and bools keep their own dtype."""
    from worker.models.layers import upload

    for data, dtype in (([3, 1, 2], None), ([0.5, 0.25], None), ([[1, 2], [3, 4]], None), ([True, False], None),
                        ([1, 2], torch.float32), (0.95, torch.float32), ([], None), (torch.arange(4), None),
                        (torch.arange(4), torch.float64)):
        got = upload(data, "cpu", dtype)
        want = data.to(dtype=dtype) if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
        assert got.dtype == want.dtype and torch.equal(got, want), (data, dtype)
    assert upload([5, 6, 7], "cpu") is upload([5, 6, 7], "cpu")
    assert upload([5, 6, 7], "cpu", torch.int32).dtype == torch.int32
    assert upload([1.0, 2.0], "cpu").dtype == torch.float32 and upload([1, 2], "cpu").dtype == torch.int64
    assert upload([True], "cpu").dtype == torch.bool
