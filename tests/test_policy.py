"""Routing policies (balancer/policy.py) and the balancer's --routing-policy option."""
import pytest
from click.testing import CliRunner

from balancer.batcher import BatchConfig
from balancer.policy import POLICIES, LeastLoaded, make_policy
from balancer.pool import Worker


def worker(index: int, rows: int = 0, batches: int = 0, last: float = 0.0) -> Worker:
    return Worker(index, f"http://w{index}", inflight_rows=rows, inflight_batches=batches, last_dispatch=last)


def ranked(free: list[Worker]) -> list[int]:
    return [w.index for w in LeastLoaded().rank(free)]


def test_least_loaded_prefers_the_fewest_rows_in_flight():
    # fewer rows wins even with more batches in flight or a more recent dispatch
    assert ranked([worker(0, rows=5, batches=1, last=1.0), worker(1, rows=2, batches=2, last=9.0),
                   worker(2, rows=3, batches=1, last=0.5)]) == [1, 2, 0]


def test_least_loaded_ties_go_to_fewer_batches_then_the_oldest_dispatch():
    assert ranked([worker(0, rows=4, batches=2, last=1.0), worker(1, rows=4, batches=1, last=5.0)]) == [1, 0]
    assert ranked([worker(0, rows=4, batches=1, last=5.0), worker(1, rows=4, batches=1, last=2.0),
                   worker(2, rows=4, batches=1, last=3.0)]) == [1, 2, 0]


def test_least_loaded_keeps_the_given_order_on_a_full_tie():
    assert ranked([worker(2), worker(0), worker(1)]) == [2, 0, 1]


def test_the_default_is_least_loaded():
    assert BatchConfig().routing_policy == "least_loaded"
    assert type(make_policy("least_loaded")) is LeastLoaded
    assert POLICIES["least_loaded"] is LeastLoaded


def test_an_unknown_policy_names_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown routing policy 'fastest'; known: least_loaded"):
        make_policy("fastest")


def test_the_balancer_command_passes_the_policy_into_its_batch_config(monkeypatch):
    import balancer.app
    from dllm_serve.cli import main
    seen = []
    monkeypatch.setattr(balancer.app, "run", lambda cfg: seen.append(cfg) or 0)
    args = ["balancer", "--worker-urls", "http://127.0.0.1:9", "--log-level", "warning"]
    r = CliRunner().invoke(main, [*args, "--routing-policy", "least_loaded"])
    assert r.exit_code == 0, r.output
    assert seen[0].batch.routing_policy == "least_loaded"
    r = CliRunner().invoke(main, [*args, "--routing-policy", "fastest"])
    assert r.exit_code == 2 and "Invalid value for '--routing-policy': 'fastest'" in r.output
    assert len(seen) == 1
