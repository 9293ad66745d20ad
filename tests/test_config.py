"""One source of configuration (common/config.py): the commands' options are generated from the config dataclasses,
parse back into the same configs, and serve's workers get their settings as a generated command line."""
import dataclasses

import click
import pytest

from balancer.app import BalancerConfig
from balancer.batcher import BatchConfig
from balancer.pool import HealthConfig
from balancer.supervisor import ServeConfig
from dllm_serve.cli import balancer as balancer_cmd, worker as worker_cmd
from common.config import build, to_args
from common.worker_config import WorkerConfig


def parse(cmd, args):
    with cmd.make_context(cmd.name, list(args)) as ctx:
        return dict(ctx.params)


def test_worker_options_round_trip():
    cfg = WorkerConfig(model_path="m", port=9001, batch_size=3, dtype="bf16", compile=True, default_max_tokens=7,
                       score_window=5, served_model_name="a,b", simulate_device=(0.5, 0.25), request_timeout=9.0)
    values = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    params = parse(worker_cmd, to_args(WorkerConfig, values))
    params.pop("log_level")
    assert build(WorkerConfig, params) == cfg
    assert build(WorkerConfig, parse(worker_cmd, ["--model-path", "m"])) == WorkerConfig(model_path="m")


def test_balancer_command_builds_the_nested_configs():
    params = parse(balancer_cmd, ["--worker-urls", "http://a:1, http://b:2", "--batch-size", "4",
                                  "--batch-wait-time", "0.5", "--health-check-interval", "0.3",
                                  "--routing-policy", "least_loaded", "--request-timeout", "7"])
    cfg = build(BalancerConfig, params, batch=build(BatchConfig, params), health=build(HealthConfig, params))
    assert cfg.worker_urls == ["http://a:1", "http://b:2"] and cfg.request_timeout == 7
    assert cfg.batch == dataclasses.replace(BatchConfig(), batch_size=4, wait_time=0.5)
    assert cfg.health == dataclasses.replace(HealthConfig(), interval=0.3)
    with pytest.raises(click.BadParameter, match="no worker URL"):
        parse(balancer_cmd, ["--worker-urls", " , "])
    with pytest.raises(click.BadParameter):
        parse(balancer_cmd, ["--worker-urls", "http://a:1", "--routing-policy", "random"])


def test_serve_derives_the_worker_command_from_the_balancer_config():
    """The policy between components lives in ServeConfig, not the CLI: a worker takes the balancer's batches in
    flight (two by default)."""
    cfg = ServeConfig(model_path="/models/LLaDA-8B", balancer=BalancerConfig([], batch=BatchConfig(batch_size=12)),
                      worker={"dtype": "bf16", "score_window": 4, "compile": True, "default_max_tokens": None},
                      log_level="debug")
    params = parse(worker_cmd, ["--model-path", "x", *cfg.worker_command()])
    assert params["log_level"] == "debug"
    w = build(WorkerConfig, params)
    assert (w.batch_size, w.max_wait_time, w.max_queue) == (24, 0, 1024)
    assert (w.dtype, w.score_window, w.compile, w.default_max_tokens) == ("bf16", 4, True, None)
    assert w.served_model_name == "/models/LLaDA-8B,LLaDA-8B"     # its path, then its name
    named = ServeConfig(model_path="/m", worker={"served_model_name": "llada-8b-instruct,x"})
    assert build(WorkerConfig, parse(worker_cmd, ["--model-path", "x", *named.worker_command()])
                 ).served_model_name == "llada-8b-instruct,x"
    assert ServeConfig(model_path="m", port=8123).log_dir.name == "port-8123"
    three = ServeConfig(model_path="/m", balancer=BalancerConfig([], batch=BatchConfig(batch_size=12,
                                                                                       max_inflight_per_worker=3)))
    assert build(WorkerConfig, parse(worker_cmd, ["--model-path", "x", *three.worker_command()])).batch_size == 36


def test_serve_takes_every_balancer_limit_and_timeout():
    """Every timeout and limit of the balancer is a flag of serve too (--max-retries, --no-worker-grace, the health
    thresholds... were the standalone balancer's only)."""
    from dllm_serve.cli import balancer as balancer_command, serve as serve_command

    def flags(cmd):
        return {f for p in cmd.params for f in p.opts if f.startswith("--")}
    missing = flags(balancer_command) - flags(serve_command) - {"--worker-urls"}     # (serve starts its workers)
    assert not missing, sorted(missing)


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_number_settings_refuse_values_that_are_not_finite(value):
    """click's FloatRange takes nan (every comparison with it is false): a --request-timeout of nan never expired,
    and `score --cfg-scale nan` printed a log-likelihood of 0.0 with exit 0."""
    for cmd, args in ((worker_cmd, ["--model-path", "m", "--request-timeout"]),
                      (balancer_cmd, ["--worker-urls", "http://h:1", "--batch-wait-time"])):
        with pytest.raises(click.BadParameter, match="finite|range"):
            parse(cmd, args + [value])


def test_score_refuses_ids_outside_the_vocabulary_and_prompts_past_the_context():
    """They were tracebacks (IndexError) from `dllm-serve score`; the HTTP path already answered 400."""
    from click.testing import CliRunner

    from dllm_serve.cli import main
    from tests.conftest import TINY_LLADA
    base = ["score", "--model-path", str(TINY_LLADA), "--device", "cpu", "--mc-num", "1", "--batch-size", "1"]
    for extra, says in ((["--prefix-ids", "1,-2", "--target-ids", "3"], "--prefix-ids"),
                        (["--prefix-ids", "1", "--target-ids", "99999"], "--target-ids"),
                        (["--prefix-ids", ",".join(["5"] * 4100), "--target-ids", "3"], "maximum sequence length"),
                        (["--prefix-ids", "1", "--target-ids", "3", "--cfg-scale", "nan"], "--cfg-scale")):
        res = CliRunner().invoke(main, base + extra)
        assert res.exit_code == 2 and says in res.output and "Traceback" not in res.output, res.output


def test_generate_requests_lines_of_the_wrong_types_are_one_line_errors():
    """Each was a traceback (TypeError, ValueError, jinja's UndefinedError, manual_seed's RuntimeError)."""
    from click.testing import CliRunner

    from dllm_serve.cli import main
    from tests.conftest import TINY_LLADA
    cmd = ["generate", "--model-path", str(TINY_LLADA), "--device", "cpu", "--requests", "-"]
    for line, says in (('{"prompt": "a", "algorithm_params": [1]}', "algorithm_params must be an object"),
                       ('{"prompt": "a", "algorithm_params": "x"}', "algorithm_params must be an object"),
                       ('{"messages": "hi"}', "messages must be"), ('{"messages": [{"content": "x"}]}', "messages"),
                       ('{"prompt": 5}', "prompt must be a string"), ('{"prompt_ids": [1, "a"]}', "prompt_ids"),
                       ('{"prompt": "a", "seed": "x", "temperature": 1}', "seed must be")):
        res = CliRunner().invoke(main, cmd, input=line + "\n")
        assert res.exit_code == 1 and "--requests line 1: " + says.split(" must")[0] in res.output \
            and says in res.output and "Traceback" not in res.output, (line, res.output)
    res = CliRunner().invoke(main, ["generate", "--prompt", "a", "--seed", str(1 << 70)])
    assert res.exit_code == 2 and "--seed" in res.output


def test_scoring_defaults_that_refuse_every_default_request_are_a_usage_error():
    """--score-mc-num 48 with the default --score-batch-size 32 answered every lm-eval request (which cannot name
    mc_num) with a 400; now the worker and serve refuse to start with it."""
    from click.testing import CliRunner

    from dllm_serve.cli import main
    for cmd in (["worker", "--model-path", "tests/fixtures/tiny-llada"], ["serve", "--local"]):
        res = CliRunner().invoke(main, cmd + ["--score-mc-num", "48"])
        assert res.exit_code == 2 and "not a multiple of --score-batch-size 32" in res.output, res.output
