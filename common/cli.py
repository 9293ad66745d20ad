"""The ``dllm-serve`` command. Subcommands import their heavy modules lazily, so ``dllm-serve balancer`` never
imports torch."""
from __future__ import annotations

import sys

import click
import orjson

from balancer.policy import DEFAULT as DEFAULT_POLICY, POLICIES   # the standard library only

DTYPES = ["auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16"]   # checked before anything starts


def _int_list(value: str | None) -> list[int] | None:
    if value is None:
        return None
    try:
        return [int(v) for v in value.replace(" ", "").split(",") if v]
    except ValueError:
        raise click.BadParameter("expected comma-separated integers, e.g. 1,2,3")


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="dllm-serve", prog_name="dllm-serve")
def main() -> None:
    """dllm-serve: OpenAI-compatible serving for masked diffusion language models."""


_compile_option = click.option(
    "--compile", "compile_", is_flag=True,
    help="torch.compile the dense half of every block (output projection, RMSNorm, SwiGLU MLP); eager if compiling "
         "fails. Off by default: not yet measured on a GPU (docs/engine.md).")


@main.command()
@click.option("--model-path", default=None, help="Checkpoint directory or hub id (default: the built-in demo model).")
@click.option("--prompt", help="Prompt text.")
@click.option("--chat", is_flag=True, help="Wrap --prompt as one user message in the model's chat template.")
@click.option("--prompt-ids", help="Prompt as comma-separated token ids (no template, no special tokens added).")
@click.option("--gen-length", type=int, default=None,
              help="Tokens to generate (default: the checkpoint's generation_config.json max_new_tokens, else 128).")
@click.option("--block-length", type=int, default=None,
              help="Semi-autoregressive block size (default: 32, or gen-length when shorter).")
@click.option("--steps", type=int, default=None, help="Denoising steps in all (default: gen-length).")
@click.option("--algorithm", default=None, help="Generation algorithm (registry name; default: the model family's).")
@click.option("--remasking", type=click.Choice(["low_confidence", "random"]), default="low_confidence",
              show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.option("--cfg-scale", type=float, default=0.0, show_default=True, help="Unsupervised classifier-free guidance.")
@click.option("--threshold", type=float, default=None, help="Fast-dLLM confidence threshold (parallel decoding).")
@click.option("--factor", type=float, default=None, help="Fast-dLLM dynamic parallel-decoding factor.")
@click.option("--seed", type=int, default=None)
@click.option("--shift-logits", is_flag=True, help="nemotron: position j uses the logit of position j-1.")
@click.option("--algorithm-params", default=None, help='Algorithm-specific parameters as JSON, e.g. \'{"low_threshold": 0.3}\'.')
@click.option("--no-early-exit", is_flag=True, help="Decode the whole canvas even after a stop token.")
@click.option("--device", default="auto", show_default=True, help="cuda, cpu or auto.")
@click.option("--dtype", type=click.Choice(DTYPES), default="auto",
              show_default=True, help="auto: bfloat16 on CUDA, float32 on CPU.")
@_compile_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--requests", "requests_file", type=click.File("rb"), default=None,
              help="Generate for every line of this JSON-lines file (- for stdin) in one batch, one JSON line out per "
                   "request, in order. Each line has prompt, prompt_ids or messages and may override any generation "
                   "option by its name with underscores (gen_length, block_length, steps, algorithm, remasking, "
                   "temperature, cfg_scale, threshold, factor, seed, shift_logits, algorithm_params).")
def generate(model_path, prompt, chat, prompt_ids, gen_length, block_length, steps, algorithm, remasking,
             temperature, cfg_scale, threshold, factor, seed, shift_logits, algorithm_params, no_early_exit, device,
             dtype, compile_, as_json, requests_file):
    """Generate offline for one prompt (or a batch of them, --requests) and print the result."""
    from worker.engine import Engine, GenerationParams, ParamError, Request
    from worker.models import DEFAULT_ALGORITHM, CheckpointError
    from worker.tokenizer import apply_chat_template
    try:
        extra = orjson.loads(algorithm_params) if algorithm_params else {}
    except orjson.JSONDecodeError as e:
        raise click.BadParameter(f"not JSON: {e}", param_hint="--algorithm-params")
    if not isinstance(extra, dict):
        raise click.BadParameter("expected a JSON object", param_hint="--algorithm-params")
    if shift_logits:
        extra["shift_logits"] = True

    if requests_file is not None:
        if prompt is not None or prompt_ids is not None:
            raise click.UsageError("--requests replaces --prompt / --prompt-ids")
    elif (prompt is None) == (prompt_ids is None):
        raise click.UsageError("give exactly one of --prompt or --prompt-ids (or --requests)")
    if chat and prompt is None:
        raise click.UsageError("--chat needs --prompt")
    from common.resolve import ResolveError, resolve_model
    from worker.models.checkpoint import default_max_new_tokens
    try:
        model_path = str(resolve_model(model_path))
        gen_length = gen_length or default_max_new_tokens(model_path, 128)
    except (ResolveError, CheckpointError) as e:
        raise click.ClickException(str(e))
    block_length = block_length or min(32, gen_length)
    try:
        engine = Engine.from_pretrained(model_path, device=device, dtype=dtype, compile=compile_)
    except (CheckpointError, ValueError, OSError) as e:
        raise click.ClickException(str(e))
    defaults = dict(gen_length=gen_length, block_length=block_length, steps=steps,
                    algorithm=algorithm or DEFAULT_ALGORITHM[engine.family], temperature=temperature,
                    remasking=remasking, cfg_scale=cfg_scale, threshold=threshold, factor=factor, seed=seed)

    def tokens(text=None, ids=None, messages=None, as_chat=False):
        if ids is not None:
            return ids
        if messages is not None:
            return apply_chat_template(engine.tokenizer, messages)
        if as_chat:
            return apply_chat_template(engine.tokenizer, [{"role": "user", "content": text}])
        return engine.tokenizer(text, add_special_tokens=False)["input_ids"]

    if requests_file is None:
        reqs = [Request(tokens(prompt, _int_list(prompt_ids), None, chat), GenerationParams(**defaults, extra=extra))]
    else:
        reqs = [_batch_request(n, line, defaults, extra, tokens, chat)
                for n, line in enumerate(requests_file.read().splitlines(), 1) if line.strip()]
        as_json = True
    try:
        results = engine.generate(reqs, early_exit=not no_early_exit)
    except ParamError as e:
        raise click.ClickException(f"{e.param}: {e.message}")
    for res in results:
        text = engine.tokenizer.decode(res.token_ids, skip_special_tokens=True)
        out = {"token_ids": res.token_ids, "text": text, "finish_reason": res.finish_reason, "nfe": res.nfe}
        if no_early_exit:
            out["canvas"] = res.canvas
        if as_json:
            sys.stdout.write(orjson.dumps(out).decode() + "\n")
        else:
            click.echo(text)
            click.echo(f"[finish_reason={res.finish_reason} nfe={res.nfe} tokens={len(res.token_ids)}]", err=True)


_REQUEST_KEYS = {"prompt", "prompt_ids", "messages", "chat", "gen_length", "block_length", "steps", "algorithm",
                 "remasking", "temperature", "cfg_scale", "threshold", "factor", "seed", "shift_logits",
                 "algorithm_params"}


def _batch_request(n: int, line: bytes, defaults: dict, extra: dict, tokens, chat: bool):
    """One line of ``generate --requests``: a Request with the command line's options as defaults."""
    from worker.engine import GenerationParams, Request
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError as e:
        raise click.ClickException(f"--requests line {n}: not JSON: {e}")
    if not isinstance(obj, dict):
        raise click.ClickException(f"--requests line {n}: expected a JSON object")
    unknown = sorted(set(obj) - _REQUEST_KEYS)
    if unknown:
        raise click.ClickException(f"--requests line {n}: unknown key {unknown[0]!r}; known: "
                                   f"{', '.join(sorted(_REQUEST_KEYS))}")
    if sum(k in obj for k in ("prompt", "prompt_ids", "messages")) != 1:
        raise click.ClickException(f"--requests line {n}: give exactly one of prompt, prompt_ids, messages")
    row_extra = dict(extra)
    row_extra.update(obj.get("algorithm_params") or {})
    if obj.get("shift_logits"):
        row_extra["shift_logits"] = True
    params = {**defaults, **{k: obj[k] for k in defaults if k in obj}}
    ids = tokens(obj.get("prompt"), obj.get("prompt_ids"), obj.get("messages"), obj.get("chat", chat))
    return Request(ids, GenerationParams(**params, extra=row_extra))


def _logging(level: str) -> None:
    import logging
    logging.basicConfig(level=getattr(logging, level.upper()), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


_SCORE_OPTIONS = [
    click.option("--score-mc-num", type=click.IntRange(1), default=128, show_default=True,
                 help="Likelihood scoring (echo + logprobs): Monte Carlo samples per estimate when a request gives "
                      "no mc_num (the reference eval_llada.py's default)."),
    click.option("--score-batch-size", type=click.IntRange(1), default=32, show_default=True,
                 help="Likelihood scoring: copies per mini-batch (the reference's batch_size; mc_num must be a "
                      "multiple of it) when a request gives no mc_batch_size."),
    click.option("--score-cfg-scale", type=click.FloatRange(0), default=0.0, show_default=True,
                 help="Likelihood scoring: classifier-free guidance scale when a request gives no cfg_scale."),
    click.option("--score-window", type=click.IntRange(1), default=32, show_default=True,
                 help="Likelihood scoring without context_length: estimate every split in the prompt's last N "
                      "tokens, so lm-eval's sum over any continuation up to N tokens is that continuation's estimate "
                      "(cost: up to N estimates per request; docs/api.md)."),
]


def _score_options(f):
    for o in reversed(_SCORE_OPTIONS):
        f = o(f)
    return f


@main.command()
@click.option("--model-path", required=True, help="Checkpoint directory.")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8001, show_default=True)
@click.option("--batch-size", type=click.IntRange(1), default=8, show_default=True, help="Rows per engine batch.")
@click.option("--max-wait-time", type=click.FloatRange(0), default=0.05, show_default=True,
              help="Seconds a forming batch waits for more requests, from its first request.")
@click.option("--max-queue", type=click.IntRange(1), default=256, show_default=True,
              help="Rows waiting beyond which requests get 429.")
@click.option("--device", default="auto", show_default=True, help="cuda, cuda:N, cpu or auto.")
@click.option("--dtype", type=click.Choice(DTYPES), default="auto",
              show_default=True)
@_compile_option
@click.option("--default-algorithm", default=None,
              help="Algorithm for requests that name none (default: the family's: basic for LLaDA, nemotron for "
                   "Nemotron-Diffusion).")
@click.option("--default-max-tokens", type=click.IntRange(1), default=None,
              help="max_tokens when a request gives none (capped by the context left; default: the checkpoint's "
                   "generation_config.json max_new_tokens, else 256).")
@click.option("--default-block-length", type=click.IntRange(1), default=32, show_default=True)
@_score_options
@click.option("--served-model-name", "served_model_name", multiple=True,
              help="Model id in the API (default: the directory name). Several names: repeat the option or separate "
                   "them with commas; requests may use any, the first is reported.")
@click.option("--api-key", default=None, envvar="DLLM_API_KEY", help="Require 'Authorization: Bearer KEY'.")
@click.option("--request-timeout", type=click.FloatRange(0, min_open=True), default=1800.0, show_default=True,
              help="Seconds before a request is abandoned with 504.")
@click.option("--drain-timeout", type=click.FloatRange(0), default=60.0, show_default=True,
              help="Seconds SIGTERM waits for running work before exiting.")
@click.option("--simulate-device", default=None, metavar="BASE,PER_ROW",
              help="Test double: no model; each batch sleeps BASE + PER_ROW x rows seconds and echoes the prompt "
                   "(load and scaling tests). The model path still provides the tokenizer.")
@click.option("--log-level", default="info", show_default=True)
def worker(model_path, host, port, batch_size, max_wait_time, max_queue, device, dtype, compile_, default_algorithm,
           default_max_tokens, default_block_length, score_mc_num, score_batch_size, score_cfg_scale, score_window,
           served_model_name, api_key, request_timeout, drain_timeout,
           simulate_device, log_level):
    """Serve one model on one device (OpenAI API + the balancer's /worker/batch)."""
    from worker.app import WorkerConfig, run
    _logging(log_level)
    cfg = WorkerConfig(model_path=model_path, host=host, port=port, batch_size=batch_size,
                       max_wait_time=max_wait_time, max_queue=max_queue, device=device, dtype=dtype,
                       compile=compile_, default_algorithm=default_algorithm, default_max_tokens=default_max_tokens,
                       default_block_length=default_block_length, score_mc_num=score_mc_num,
                       score_batch_size=score_batch_size, score_cfg_scale=score_cfg_scale, score_window=score_window,
                       served_model_name=",".join(served_model_name) or None,
                       api_key=api_key, request_timeout=request_timeout, drain_timeout=drain_timeout,
                       simulate_device=_cost_model(simulate_device))
    sys.exit(run(cfg))


def _cost_model(value: str | None) -> tuple[float, float] | None:
    if value is None:
        return None
    try:
        parts = [float(v) for v in value.split(",")]
    except ValueError:
        raise click.BadParameter("expected BASE,PER_ROW seconds, e.g. 0.04,0.003 (or 0 for instant)")
    if len(parts) == 1:
        parts.append(0.0)
    if len(parts) != 2 or min(parts) < 0:
        raise click.BadParameter("expected BASE,PER_ROW seconds, e.g. 0.04,0.003 (or 0 for instant)")
    return parts[0], parts[1]


_http_processes_option = click.option(
    "--http-processes", type=click.IntRange(1), default=1, show_default=True,
    help="Processes accepting client connections on --port (SO_REUSEPORT): the balancer itself plus N-1 front "
         "processes that read and validate requests and hand them to its one queue over a Unix socket. Raise it "
         "when one core of HTTP work is the limit (thousands of requests/s; docs/balancer.md).")

_front_timeout_option = click.option(
    "--front-timeout", type=click.FloatRange(0.1), default=10.0, show_default=True,
    help="With --http-processes > 1: seconds a front process may leave pings unanswered before it is killed and "
         "restarted.")


@main.command()
@click.option("--worker-urls", required=True, help="Comma-separated worker base URLs (http://h:8001,http://h:8002).")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--batch-size", type=click.IntRange(1), default=16, show_default=True,
              help="Most requests per dispatched batch.")
@click.option("--batch-wait-time", type=click.FloatRange(0), default=0.02, show_default=True,
              help="Seconds a forming batch waits for more requests, from its first request.")
@click.option("--max-inflight-per-worker", type=click.IntRange(1), default=2, show_default=True,
              help="Batches in flight per worker (2: the next batch is queued on the worker while one runs).")
@click.option("--routing-policy", type=click.Choice(sorted(POLICIES)), default=DEFAULT_POLICY, show_default=True,
              help="Which free worker gets the next batch. least_loaded: the fewest requests in flight, then the "
                   "fewest batches, then the longest since its last batch.")
@click.option("--max-queue", type=click.IntRange(1), default=4096, show_default=True,
              help="Queued requests beyond which new ones get 429.")
@click.option("--request-timeout", type=click.FloatRange(0, min_open=True), default=1800.0, show_default=True,
              help="Seconds before a request is answered 504.")
@click.option("--max-retries", type=click.IntRange(0), default=2, show_default=True,
              help="Re-dispatches of a request after worker failures.")
@click.option("--health-check-interval", type=click.FloatRange(0.05), default=2.0, show_default=True)
@click.option("--health-timeout", type=click.FloatRange(0.05), default=5.0, show_default=True,
              help="Seconds one /health probe may take.")
@click.option("--unhealthy-threshold", type=click.IntRange(1), default=3, show_default=True,
              help="Failed probes in a row that mark an idle worker unhealthy.")
@click.option("--healthy-threshold", type=click.IntRange(1), default=2, show_default=True,
              help="Good probes in a row that re-admit a worker.")
@click.option("--stall-timeout", type=click.FloatRange(0.1), default=60.0, show_default=True,
              help="Seconds without denoising progress while holding work before a worker is 'stalled' and its "
                   "work re-dispatched.")
@click.option("--connect-timeout", type=click.FloatRange(0.1), default=5.0, show_default=True)
@click.option("--no-worker-grace", type=click.FloatRange(0), default=30.0, show_default=True,
              help="Seconds queued requests wait for a healthy worker before 503.")
@click.option("--drain-timeout", type=click.FloatRange(0), default=60.0, show_default=True)
@_http_processes_option
@_front_timeout_option
@click.option("--api-key", default=None, envvar="DLLM_API_KEY", help="Require 'Authorization: Bearer KEY' on /v1.")
@click.option("--worker-api-key", default=None, envvar="DLLM_WORKER_API_KEY",
              help="Bearer key the balancer sends to workers.")
@click.option("--log-level", default="info", show_default=True)
def balancer(worker_urls, host, port, batch_size, batch_wait_time, max_inflight_per_worker, routing_policy,
             max_queue, request_timeout, max_retries, health_check_interval, health_timeout, unhealthy_threshold,
             healthy_threshold, stall_timeout, connect_timeout, no_worker_grace, drain_timeout, http_processes,
             front_timeout, api_key, worker_api_key, log_level):
    """Centralized batching in front of N workers (never imports torch)."""
    from balancer.app import BalancerConfig, run
    from balancer.batcher import BatchConfig
    from balancer.pool import HealthConfig
    _logging(log_level)
    urls = [u.strip() for u in worker_urls.split(",") if u.strip()]
    if not urls:
        raise click.BadParameter("no worker URL", param_hint="--worker-urls")
    cfg = BalancerConfig(
        worker_urls=urls, host=host, port=port, request_timeout=request_timeout, drain_timeout=drain_timeout,
        http_processes=http_processes, front_timeout=front_timeout, api_key=api_key,
        worker_api_key=worker_api_key,
        batch=BatchConfig(batch_size=batch_size, wait_time=batch_wait_time,
                          max_inflight_per_worker=max_inflight_per_worker, max_queue=max_queue,
                          max_retries=max_retries, connect_timeout=connect_timeout, no_worker_grace=no_worker_grace,
                          routing_policy=routing_policy),
        health=HealthConfig(interval=health_check_interval, timeout=health_timeout,
                            unhealthy_threshold=unhealthy_threshold, healthy_threshold=healthy_threshold,
                            stall_timeout=stall_timeout))
    sys.exit(run(cfg))


def _visible_gpus() -> list[str]:
    """GPUs this process may use, without torch: CUDA_VISIBLE_DEVICES when set, else ``nvidia-smi -L``."""
    import os
    import shutil
    import subprocess
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g.strip() for g in env.split(",") if g.strip()]
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]


def _gpu_ids(gpus: int | None, gpu_ids: str | None, workers: int | None = None) -> list[str] | None:
    """Worker devices: --gpu-ids as given; --gpus N takes the first N of the GPUs this process may use
    (CUDA_VISIBLE_DEVICES when set, as under SLURM), else 0..N-1; --workers N: CPU workers; none of them: every
    visible GPU, or one CPU worker when there is none."""
    import os
    if gpu_ids or gpus:
        visible = _visible_gpus()
        if not visible:
            raise click.BadParameter("this machine shows no GPU (CUDA_VISIBLE_DEVICES unset or empty, no nvidia-smi "
                                     "GPU); use --workers N for CPU workers", param_hint="--gpus/--gpu-ids")
    if gpu_ids:
        return [g.strip() for g in gpu_ids.split(",") if g.strip()]
    if gpus:
        if gpus > len(visible):
            source = "CUDA_VISIBLE_DEVICES lists" if os.environ.get("CUDA_VISIBLE_DEVICES") else "nvidia-smi shows"
            raise click.BadParameter(f"--gpus {gpus} but {source} {len(visible)}", param_hint="--gpus")
        return visible[:gpus]
    if workers is None:
        return _visible_gpus() or None
    return None


def _serve_options(f):
    options = [
        click.option("--local", is_flag=True, help="Run here (else submit the SLURM job in slurm/)."),
        click.option("--model-path", default=None, help="Checkpoint directory or hub id (default: the built-in "
                     "demo model)."),
        click.option("--dcp-path", default=None, help="A torch.distributed.checkpoint directory to serve "
                     "(converted once, with --base-model)."),
        click.option("--base-model", default=None, help="Checkpoint whose config/tokenizer/names a DCP uses."),
        click.option("--gpus", type=click.IntRange(1), default=None, help="One worker per GPU, N GPUs."),
        click.option("--gpu-ids", default=None, help="One worker per listed GPU, e.g. 0,2,4."),
        click.option("--workers", type=click.IntRange(1), default=None,
                     help="N CPU workers. Without --gpus/--gpu-ids/--workers: one worker per visible GPU, or one "
                          "CPU worker when there is no GPU."),
        click.option("--host", default="127.0.0.1", show_default=True, help="Balancer address."),
        click.option("--port", type=int, default=8000, show_default=True),
        click.option("--worker-host", default="127.0.0.1", show_default=True),
        click.option("--worker-base-port", type=int, default=8001, show_default=True),
        click.option("--batch-size", type=click.IntRange(1), default=16, show_default=True,
                     help="Balancer batch size (each worker takes twice that: two batches in flight)."),
        click.option("--max-wait-time", type=click.FloatRange(0), default=0.02, show_default=True,
                     help="Balancer batch wait time in seconds."),
        click.option("--default-algorithm", default=None, help="Default generation algorithm (default: the "
                     "model family's)."),
        click.option("--default-max-tokens", type=click.IntRange(1), default=None,
                     help="max_tokens when a request gives none (default: the checkpoint's generation_config.json "
                          "max_new_tokens, else 256)."),
        click.option("--dtype", type=click.Choice(DTYPES), default="auto",
                     show_default=True, help="auto: bfloat16 on a GPU, float32 on the CPU."),
        *_SCORE_OPTIONS,
        click.option("--served-model-name", "served_model_name", multiple=True,
                     help="Model id in the API (default: the checkpoint directory's name; with --dcp-path, the DCP "
                          "directory's name). Several names: repeat the option or separate them with commas; the "
                          "first is reported."),
        _compile_option,
        _http_processes_option,
        _front_timeout_option,
        click.option("--api-key", default=None, envvar="DLLM_API_KEY",
                     help="Clients must send this Bearer key on /v1 (status endpoints stay open); the workers then "
                          "get a generated key of their own unless --worker-api-key is given."),
        click.option("--worker-api-key", default=None, envvar="DLLM_WORKER_API_KEY",
                     help="Key between balancer and workers (generated per SLURM job)."),
        click.option("--log-dir", default=None, type=click.Path(file_okay=False),
                     help="Worker logs (default: logs/port-PORT, so two servers from one checkout never share one)."),
        click.option("--server-info-file", default=None, type=click.Path(dir_okay=False),
                     help='KEY="VAL" file eval jobs wait on (SERVER_STATUS=running).'),
        click.option("--stagger", type=click.FloatRange(0), default=2.0, show_default=True,
                     help="Seconds between worker starts."),
        click.option("--min-workers", type=click.IntRange(1), default=1, show_default=True,
                     help="Ready workers needed before the balancer serves."),
        click.option("--startup-timeout", type=click.FloatRange(1), default=1800.0, show_default=True),
        click.option("--request-timeout", type=click.FloatRange(0, min_open=True), default=1800.0, show_default=True),
        click.option("--stall-timeout", type=click.FloatRange(0.1), default=60.0, show_default=True),
        click.option("--health-check-interval", type=click.FloatRange(0.05), default=2.0, show_default=True),
        click.option("--drain-timeout", type=click.FloatRange(0), default=60.0, show_default=True),
        click.option("--extra-worker-urls", default=None, help="Workers started elsewhere (multi-node)."),
        click.option("--no-balancer", is_flag=True, help="Workers only (other nodes of a multi-node job)."),
        click.option("--slurm-script", default=None, help="sbatch script for SLURM mode (default: slurm/"
                     "serve_single_node.sbatch)."),
        click.option("--log-level", default="info", show_default=True),
    ]
    for o in reversed(options):
        f = o(f)
    return f


@main.command()
@_serve_options
def serve(local, model_path, dcp_path, base_model, gpus, gpu_ids, workers, host, port, worker_host,
          worker_base_port, batch_size, max_wait_time, default_algorithm, default_max_tokens, dtype, score_mc_num,
          score_batch_size, score_cfg_scale, score_window, served_model_name,
          compile_,
          http_processes, front_timeout, api_key,
          worker_api_key, log_dir, server_info_file, stagger, min_workers, startup_timeout, request_timeout,
          stall_timeout, health_check_interval, drain_timeout, extra_worker_urls, no_balancer, slurm_script,
          log_level):
    """Workers (one per GPU, or CPU workers) plus the balancer, supervised: ``--local``, or a SLURM job."""
    from pathlib import Path
    _logging(log_level)
    if not local:
        from common.slurm import submit
        sys.exit(submit(slurm_script, sys.argv[2:] if len(sys.argv) > 2 else []))
    from balancer.app import BalancerConfig
    from balancer.batcher import BatchConfig
    from balancer.pool import HealthConfig
    from balancer.supervisor import ServeConfig, run
    from common.resolve import ResolveError, resolve_model
    try:
        if dcp_path:
            from common.dcp_launch import ensure_converted
            resolved = ensure_converted(dcp_path, base_model, log=lambda m: click.echo(m, err=True))
        else:
            resolved = resolve_model(model_path)
    except (ResolveError, RuntimeError) as e:
        raise click.ClickException(str(e))
    ids = _gpu_ids(gpus, gpu_ids, workers)
    workers = workers or 1
    worker_args = ["--batch-size", str(batch_size * 2), "--max-wait-time", "0",
                   *(["--default-algorithm", default_algorithm] if default_algorithm else []),
                   *(["--default-max-tokens", str(default_max_tokens)] if default_max_tokens else []),
                   "--dtype", dtype, "--score-mc-num", str(score_mc_num), "--score-batch-size", str(score_batch_size),
                   "--score-cfg-scale", str(score_cfg_scale), "--score-window", str(score_window),
                   "--served-model-name", ",".join(served_model_name) or Path(dcp_path or resolved).resolve().name,
                   *(["--compile"] if compile_ else []),
                   "--request-timeout", str(request_timeout), "--drain-timeout", str(drain_timeout),
                   "--max-queue", str(max(1024, batch_size * 8)), "--log-level", log_level]
    bcfg = BalancerConfig(worker_urls=[], request_timeout=request_timeout, drain_timeout=drain_timeout,
                          http_processes=http_processes, front_timeout=front_timeout, api_key=api_key,
                          batch=BatchConfig(batch_size=batch_size, wait_time=max_wait_time),
                          health=HealthConfig(interval=health_check_interval, stall_timeout=stall_timeout))
    cfg = ServeConfig(model_path=str(resolved), gpu_ids=ids, cpu_workers=workers, host=host, port=port,
                      worker_host=worker_host, worker_base_port=worker_base_port, worker_args=worker_args,
                      worker_api_key=worker_api_key, balancer=bcfg,
                      extra_worker_urls=[u for u in (extra_worker_urls or "").split(",") if u],
                      no_balancer=no_balancer, log_dir=Path(log_dir or f"logs/port-{port}"),
                      server_info_file=Path(server_info_file) if server_info_file else None, stagger=stagger,
                      min_workers=min_workers, startup_timeout=startup_timeout)
    click.echo(f"dllm-serve: model {resolved}; {len(ids) if ids else workers} "
               f"{'GPU' if ids else 'CPU'} worker(s); balancer on http://{host}:{port}; logs in {cfg.log_dir}/",
               err=True)
    sys.exit(run(cfg))


@main.command()
@click.option("--model-path", default=None, help="Checkpoint directory or hub id (default: the built-in demo model).")
@click.option("--prefix-ids", required=True, help="The context, as comma-separated token ids.")
@click.option("--target-ids", required=True, help="The continuation to score, as comma-separated token ids.")
@click.option("--mc-num", type=click.IntRange(1), default=128, show_default=True,
              help="Monte Carlo samples (the LLaDA paper: 128; 1 suffices for single-token answers).")
@click.option("--batch-size", type=click.IntRange(1), default=16, show_default=True,
              help="Samples per forward pass (mc-num must be a multiple).")
@click.option("--cfg-scale", type=click.FloatRange(0), default=0.0, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--device", default="auto", show_default=True, help="cuda, cpu or auto.")
@click.option("--dtype", type=click.Choice(DTYPES), default="auto", show_default=True)
def score(model_path, prefix_ids, target_ids, mc_num, batch_size, cfg_scale, seed, device, dtype):
    """Log-likelihood of a continuation by LLaDA's Monte Carlo estimator, and whether greedy decoding gives it
    (docs/engine.md). Prints one JSON object."""
    from common.resolve import ResolveError, resolve_model
    from worker.engine import Engine
    from worker.engine.likelihood import greedy_suffix, log_likelihood
    from worker.models import CheckpointError
    try:
        engine = Engine.from_pretrained(str(resolve_model(model_path)), device=device, dtype=dtype)
    except (ResolveError, CheckpointError, ValueError, OSError) as e:
        raise click.ClickException(str(e))
    if engine.family != "llada":
        raise click.ClickException(f"likelihood scoring is implemented for LLaDA checkpoints, not {engine.family}")
    prefix, target = _int_list(prefix_ids), _int_list(target_ids)
    try:
        ll = log_likelihood(engine.model, prefix, target, engine.mask_id, mc_num, batch_size, cfg_scale, seed)
    except ValueError as e:
        raise click.UsageError(str(e))
    greedy = greedy_suffix(engine.model, prefix, target, engine.mask_id, cfg_scale)
    click.echo(orjson.dumps({"log_likelihood": ll, "is_greedy": greedy, "mc_num": mc_num, "batch_size": batch_size,
                             "cfg_scale": cfg_scale, "seed": seed}))


@main.command("convert-dcp")
@click.option("--dcp-path", required=True, help="torch.distributed.checkpoint directory (structured or legacy).")
@click.option("--base-model", required=True, help="Checkpoint the DCP was trained from (config, tokenizer, names).")
@click.option("--output", default=None, help="Where to write (default: a cache directory keyed by the DCP path).")
@click.option("--no-cache", is_flag=True, help="Convert straight into --output (no lock, no reuse).")
def convert_dcp(dcp_path, base_model, output, no_cache):
    """Convert a DCP checkpoint into a servable directory (once; reused while unchanged)."""
    if no_cache:
        from worker.dcp import convert
        from worker.models import CheckpointError
        if output is None:
            raise click.UsageError("--no-cache needs --output")
        try:
            convert(dcp_path, base_model, output)
        except CheckpointError as e:
            raise click.ClickException(str(e))
        click.echo(output)
        return
    from common.dcp_launch import ensure_converted
    try:
        click.echo(ensure_converted(dcp_path, base_model, output, log=lambda m: click.echo(m, err=True)))
    except (RuntimeError, ValueError) as e:
        raise click.ClickException(str(e))


@main.command()
@click.option("--url", default="http://127.0.0.1:8000", show_default=True, envvar="DLLM_URL",
              help="The balancer's base URL.")
@click.option("--monitor", is_flag=True, help="Live view, refreshed every --interval seconds (Ctrl-C to quit).")
@click.option("--interval", type=click.FloatRange(0.1), default=2.0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print /worker-status and /stats as JSON.")
def status(url, monitor, interval, as_json):
    """Worker status table. Exit code: 0 all healthy, 1 degraded, 2 down or unreachable."""
    from common.status import main as status_main
    sys.exit(status_main(url, monitor, interval, as_json))


if __name__ == "__main__":
    main()
