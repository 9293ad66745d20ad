"""The ``dllm-serve`` command. Subcommands import their heavy modules lazily, so ``dllm-serve balancer`` never
imports torch."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import click
import orjson

from balancer.app import BalancerConfig           # the configs: no torch (tests/test_docs.py checks)
from balancer.batcher import BatchConfig
from balancer.pool import HealthConfig
from balancer.supervisor import ServeConfig
from common.config import FiniteFloatRange, build, options
from common.worker_config import DTYPES, WorkerConfig


def _int_list(value: str | None, option: str) -> list[int] | None:
    if value is None:
        return None
    try:
        return [int(v) for v in value.replace(" ", "").split(",") if v]
    except ValueError:
        raise click.BadParameter("expected comma-separated integers, e.g. 1,2,3", param_hint=option)


class _Commands(click.Group):
    """Every usage error (a missing or invalid option of any command) is one line naming the option, exit code 2;
    a command's own failure (click.ClickException) is one line, its exit code (1). No traceback, no usage dump."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        one_line_errors(lambda: super(_Commands, self).main(args, prog_name, complete_var, standalone_mode=False,
                                                            **extra))


def one_line_errors(run) -> None:
    """``run()`` (a click command's main, standalone_mode=False) with its errors as one line each (_Commands);
    exits with its code."""
    try:
        rv = run()
    except click.UsageError as e:
        if type(e).__name__ == "NoArgsIsHelpError":     # a bare group: its help (click >= 8.2), exit 2
            click.echo(e.format_message(), err=True)
            sys.exit(e.exit_code)
        path = e.ctx.command_path if e.ctx is not None else "dllm-serve"
        click.echo(f"{path}: error: {e.format_message()} (see '{path} --help')", err=True)
        sys.exit(e.exit_code)
    except click.ClickException as e:
        click.echo(f"dllm-serve: error: {e.format_message()}", err=True)
        sys.exit(e.exit_code)
    except click.Abort:
        click.echo("dllm-serve: aborted", err=True)
        sys.exit(1)
    sys.exit(rv if isinstance(rv, int) else 0)


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="dllm-serve", prog_name="dllm-serve")
def main() -> None:
    """dllm-serve: OpenAI-compatible serving for masked diffusion language models."""


@main.command()
@click.option("--model-path", default=None, help="Checkpoint directory or hub id (default: the built-in demo model).")
@click.option("--prompt", help="Prompt text.")
@click.option("--chat", is_flag=True, help="Wrap --prompt as one user message in the model's chat template (with "
                                          "--requests: every line's prompt, unless the line sets chat).")
@click.option("--prompt-ids", help="Prompt as comma-separated token ids (no template, no special tokens added).")
@click.option("--gen-length", type=click.IntRange(1), default=None,
              help="Tokens to generate (default: the checkpoint's generation_config.json max_new_tokens, else 128).")
@click.option("--block-length", type=click.IntRange(1), default=None,
              help="Semi-autoregressive block size (default: the checkpoint's own block size where it has one, as SDAR's "
                   "block_size or DiffusionGemma's canvas length; else 32, or gen-length when shorter).")
@click.option("--steps", type=click.IntRange(1), default=None, help="Denoising steps in all (default: gen-length).")
@click.option("--algorithm", default=None, help="Generation algorithm (registry name; default: the model family's).")
@click.option("--remasking", type=click.Choice(["low_confidence", "random"]), default="low_confidence",
              show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.option("--cfg-scale", type=float, default=0.0, show_default=True, help="Unsupervised classifier-free guidance.")
@click.option("--threshold", type=float, default=None, help="Fast-dLLM confidence threshold (parallel decoding).")
@click.option("--factor", type=float, default=None, help="Fast-dLLM dynamic parallel-decoding factor.")
@click.option("--seed", type=click.IntRange(0, (1 << 63) - 1), default=None)
@click.option("--shift-logits", is_flag=True, help="nemotron: position j uses the logit of position j-1.")
@click.option("--algorithm-params", default=None, help='Algorithm-specific parameters as JSON, e.g. \'{"low_threshold": 0.3}\'.')
@click.option("--no-early-exit", is_flag=True, help="Decode the whole canvas even after a stop token.")
@click.option("--device", default="auto", show_default=True, help="cuda, cpu or auto.")
@click.option("--dtype", type=click.Choice(DTYPES), default="auto",
              show_default=True, help="auto: bfloat16 on CUDA, float32 on CPU.")
@options(WorkerConfig, only=("compile",), prefix="with_")
@options(WorkerConfig, only=("tensor_parallel_size", "rank_timeout", "rank_startup_timeout", "prefix_cache_gb",
                             "cuda_graphs",
                             "cuda_graph_max", "cuda_graph_max_tokens"))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--requests", "requests_file", type=click.File("rb"), default=None,
              help="Generate for every line of this JSON-lines file (- for stdin) in one batch, one JSON line out per "
                   "request, in order. Each line has prompt, prompt_ids or messages and may override any generation "
                   "option by its name with underscores (gen_length, block_length, steps, algorithm, remasking, "
                   "temperature, cfg_scale, threshold, factor, seed, shift_logits, algorithm_params).")
def generate(model_path, prompt, chat, prompt_ids, gen_length, block_length, steps, algorithm, remasking,
             temperature, cfg_scale, threshold, factor, seed, shift_logits, algorithm_params, no_early_exit, device,
             dtype, with_compile, tensor_parallel_size, rank_timeout, rank_startup_timeout, prefix_cache_gb,
             cuda_graphs, cuda_graph_max,
             cuda_graph_max_tokens, as_json, requests_file):
    """Generate offline for one prompt (or a batch of them, --requests) and print the result."""
    from worker.engine import Engine
    from worker.models import CheckpointError
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
    if chat and prompt is None and requests_file is None:
        raise click.UsageError("--chat needs --prompt or --requests")
    _check_device(device)
    from common.resolve import ResolveError, resolve_model
    from worker.models.checkpoint import default_max_new_tokens
    try:
        model_path = str(resolve_model(model_path))
        gen_length = gen_length or default_max_new_tokens(model_path, 128)
    except (ResolveError, CheckpointError) as e:
        raise click.UsageError(str(e))
    try:
        engine = Engine.from_pretrained(model_path, device=device, dtype=dtype, compile=with_compile,
                                        tensor_parallel=tensor_parallel_size, rank_timeout=rank_timeout,
                                        rank_startup_timeout=rank_startup_timeout,
                                        prefix_cache_gb=prefix_cache_gb, cuda_graphs=cuda_graphs,
                                        cuda_graph_max=cuda_graph_max, cuda_graph_max_tokens=cuda_graph_max_tokens)
    except (CheckpointError, ValueError, OSError, RuntimeError) as e:     # (RuntimeError: a tensor-parallel rank)
        raise click.ClickException(str(e))
    try:
        _generate(engine, prompt, chat, prompt_ids, gen_length, block_length, steps, algorithm, remasking,
                  temperature, cfg_scale, threshold, factor, seed, extra, no_early_exit, as_json, requests_file)
    finally:
        engine.close()


def _generate(engine, prompt, chat, prompt_ids, gen_length, block_length, steps, algorithm, remasking, temperature,
              cfg_scale, threshold, factor, seed, extra, no_early_exit, as_json, requests_file):
    from worker.engine import GenerationParams, ParamError, Request
    from worker.models import DEFAULT_ALGORITHM
    from worker.tokenizer import apply_chat_template
    block_length = block_length or engine.default_block_length or min(32, gen_length)
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
        ids = _int_list(prompt_ids, "--prompt-ids")
        reqs = [Request(tokens(prompt, ids, None, chat), GenerationParams(**defaults, extra=extra))]
    else:
        reqs = [_batch_request(n, line, defaults, extra, tokens, chat)
                for n, line in enumerate(requests_file.read().splitlines(), 1) if line.strip()]
        as_json = True
    try:
        results = engine.generate(reqs, early_exit=not no_early_exit)
    except ParamError as e:     # a generation option the model or algorithm refuses: a usage error naming it
        flag = _PARAM_FLAGS.get(e.param, "--" + (e.param or "option").replace("_", "-"))
        raise click.UsageError(f"{flag}: {e.message}")
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


# the API parameter a ParamError names -> the generate option that sets it
_PARAM_FLAGS = {"generation_algorithm": "--algorithm", "max_tokens": "--gen-length", "algorithm_params":
                "--algorithm-params", "prompt": "--prompt/--prompt-ids"}

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
    def bad(key: str, want: str):
        raise click.ClickException(f"--requests line {n}: {key} must be {want}")
    if "prompt" in obj and not isinstance(obj["prompt"], str):
        bad("prompt", "a string")
    if "prompt_ids" in obj and not (isinstance(obj["prompt_ids"], list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in obj["prompt_ids"])):
        bad("prompt_ids", "a list of token ids")
    if "messages" in obj and not (isinstance(obj["messages"], list) and obj["messages"] and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in obj["messages"])):
        bad("messages", 'a non-empty list of {"role": ..., "content": ...} strings')
    if not isinstance(obj.get("algorithm_params") or {}, dict):
        bad("algorithm_params", "an object")
    seed = obj.get("seed")
    if seed is not None and not (isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed < 1 << 63):
        bad("seed", "an integer from 0 to 2**63 - 1")
    for key in ("chat", "shift_logits"):
        if key in obj and not isinstance(obj[key], bool):
            bad(key, "true or false")
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


@main.command()
@options(WorkerConfig)
@click.option("--log-level", default="info", show_default=True)
def worker(log_level, **values):
    """Serve one model on one device (OpenAI API + the balancer's /worker/batch)."""
    from common.resolve import ResolveError, resolve_model
    try:        # checked before anything listens: a bad option is one line and exit 2, never a half-started worker
        resolve_model(values["model_path"])
    except ResolveError as e:
        raise click.UsageError(str(e))
    _check_device(values["device"])
    from common.worker_config import scoring_defaults_problem
    why = scoring_defaults_problem(values["score_mc_num"], values["score_batch_size"])
    if why:
        raise click.UsageError(why)
    from worker.app import run
    _logging(log_level)
    sys.exit(run(build(WorkerConfig, values)))


def _check_device(device: str) -> None:
    """--device: auto, cpu, cuda or cuda:N, and a CUDA device only where torch sees it."""
    import re
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", device):
        raise click.BadParameter(f"{device!r}: expected auto, cpu, cuda or cuda:N", param_hint="--device")
    if device.startswith("cuda"):
        import torch
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(device[5:] or 0)
        if index >= n:
            raise click.BadParameter(f"{device!r}: this process sees {n} CUDA device(s)", param_hint="--device")


@main.command()
@options(BalancerConfig, only=("worker_urls", "host", "port"))
@options(BatchConfig)
@options(HealthConfig)
@options(BalancerConfig, exclude=("worker_urls", "host", "port"))
@click.option("--log-level", default="info", show_default=True)
def balancer(log_level, **values):
    """Centralized batching in front of N workers (never imports torch)."""
    from balancer.app import files_root, run
    _logging(log_level)
    cfg = build(BalancerConfig, values, batch=build(BatchConfig, values), health=build(HealthConfig, values))
    _writable_dir(files_root(cfg), "--files-dir")
    sys.exit(run(cfg))


def _writable_dir(path: Path, flag: str) -> None:
    """Make ``path`` (a directory) or refuse ``flag`` with one line, before anything starts."""
    import os
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise click.BadParameter(f"cannot make the directory {str(path)!r}: {e.strerror or e}", param_hint=flag)
    if not os.access(path, os.W_OK | os.X_OK):
        raise click.BadParameter(f"the directory {str(path)!r} is not writable", param_hint=flag)


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
    if gpus and gpu_ids is not None:
        raise click.UsageError("give --gpus or --gpu-ids, not both")
    if workers is not None and (gpus or gpu_ids is not None):
        raise click.UsageError("--workers is for CPU workers: give it without --gpus/--gpu-ids")
    if gpu_ids is not None or gpus:
        visible = _visible_gpus()
        if not visible:
            raise click.BadParameter("this machine shows no GPU (CUDA_VISIBLE_DEVICES unset or empty, no nvidia-smi "
                                     "GPU); use --workers N for CPU workers", param_hint="--gpus/--gpu-ids")
    if gpu_ids is not None:
        ids = [g.strip() for g in gpu_ids.split(",")]
        if not ids or "" in ids:
            raise click.BadParameter(f"{gpu_ids!r}: expected GPU ids separated by commas, e.g. 0,2,4",
                                     param_hint="--gpu-ids")
        if len(set(ids)) < len(ids):
            raise click.BadParameter(f"{gpu_ids!r} names a GPU twice", param_hint="--gpu-ids")
        missing = [g for g in ids if g not in visible]
        if missing:
            source = "CUDA_VISIBLE_DEVICES lists" if os.environ.get("CUDA_VISIBLE_DEVICES") else "nvidia-smi shows"
            raise click.BadParameter(f"GPU {missing[0]} is not one of those {source} ({','.join(visible)})",
                                     param_hint="--gpu-ids")
        return ids
    if gpus:
        if gpus > len(visible):
            source = "CUDA_VISIBLE_DEVICES lists" if os.environ.get("CUDA_VISIBLE_DEVICES") else "nvidia-smi shows"
            raise click.BadParameter(f"--gpus {gpus} but {source} {len(visible)}", param_hint="--gpus")
        return visible[:gpus]
    if workers is None:
        return _visible_gpus() or None
    return None


# serve's own flags; every other option of serve is a setting of ServeConfig, BalancerConfig, BatchConfig,
# HealthConfig or WorkerConfig, generated from it (common/config.py)
SERVE_WORKER = ("default_algorithm", "default_max_tokens", "dtype", "score_mc_num", "score_batch_size",
                "score_cfg_scale", "score_window", "served_model_name", "compile", "continuous_batching",
                "max_batch_tokens", "switch_wait", "max_request_cost", "long_row_cost", "long_row_share",
                "tensor_parallel_size", "rank_timeout", "rank_startup_timeout", "prefix_cache_gb", "threads", "cuda_graphs", "cuda_graph_max",
                "cuda_graph_max_tokens")


@main.command()
@click.option("--local", is_flag=True, help="Run here (else submit the SLURM job in slurm/).")
@click.option("--model-path", default=None, help="Checkpoint directory or hub id (default: the built-in demo model).")
@click.option("--dcp-path", default=None, help="A torch.distributed.checkpoint directory to serve (converted once, "
                                               "with --base-model).")
@click.option("--base-model", default=None, help="Checkpoint whose config/tokenizer/names a DCP uses.")
@click.option("--gpus", type=click.IntRange(1), default=None, help="One worker per GPU, N GPUs.")
@click.option("--gpu-ids", default=None, help="One worker per listed GPU, e.g. 0,2,4.")
@click.option("--workers", type=click.IntRange(1), default=None,
              help="N CPU workers. Without --gpus/--gpu-ids/--workers: one worker per visible GPU, or one CPU worker "
                   "when there is no GPU.")
@options(ServeConfig, only=("host", "port", "worker_host", "worker_base_port"))
@options(BatchConfig, overrides={
    "batch_size": {"help": "Balancer batch size (each worker takes --max-inflight-per-worker times that: two "
                           "batches in flight by default)."},
    "wait_time": {"help": "Balancer batch wait time in seconds.", "flags": ("--max-wait-time", "--batch-wait-time")}})
@options(WorkerConfig, only=SERVE_WORKER, prefix="worker_", overrides={
    "default_algorithm": {"help": "Default generation algorithm (default: the model family's)."},
    "tensor_parallel_size": {"flags": ("--tensor-parallel-size", "--worker-tensor-parallel-size"),
                             "help": "GPUs (ranks) per worker: --gpus 8 --tensor-parallel-size 2 gives 4 workers of "
                                     "2 GPUs each (CUDA_VISIBLE_DEVICES pairs); CPU workers get that many ranks "
                                     "each. Heads, MLP channels, vocabulary and MoE experts split over the ranks "
                                     "(docs/operations.md, \"Tensor parallelism\")."},
    "rank_timeout": {"flags": ("--rank-timeout", "--worker-rank-timeout")},
    "rank_startup_timeout": {"flags": ("--rank-startup-timeout", "--worker-rank-startup-timeout")},
    "prefix_cache_gb": {"flags": ("--prefix-cache-gb", "--worker-prefix-cache-gb")},
    "threads": {"help": "torch CPU threads per CPU worker (0: the cores this process may use, shared equally "
                        "among the CPU workers)."},
    "default_max_tokens": {"help": "max_tokens when a request gives none (default: the checkpoint's "
                                   "generation_config.json max_new_tokens, else 256)."},
    "served_model_name": {"help": "Model id in the API (default, as vLLM: a checkpoint directory's absolute path, "
                                  "a hub id as given, so clients on this machine find the tokenizer under the id; "
                                  "its last component, e.g. demo_model, is accepted too; with --dcp-path, the DCP "
                                  "directory's name). Several names: repeat the option or separate them with commas; "
                                  "the first is reported."}})
@options(BalancerConfig, only=("http_processes", "front_timeout", "front_startup_timeout", "front_restart_backoff",
                               "front_restart_backoff_max", "api_key"), overrides={
    "api_key": {"help": "Clients must send this Bearer key on /v1 (status endpoints stay open); the workers then get "
                        "a generated key of their own unless --worker-api-key is given."}})
@options(ServeConfig, only=("worker_api_key", "log_dir", "server_info_file", "stagger", "min_workers",
                            "startup_timeout", "worker_start_timeout", "restart_backoff", "restart_backoff_max",
                            "crash_loop", "crash_window",
                            "stop_timeout"))
@options(BalancerConfig, only=("request_timeout", "max_body_bytes_in_flight", "body_timeout", "keepalive_timeout",
                               "send_timeout",
                               "files_dir", "max_file_bytes", "batch_concurrency", "max_running_batches",
                               "min_free_disk_bytes", "batch_retry_max", "weight_load_timeout", "weight_sync_retry",
                               "weight_sync_retry_max", "models_cache_ttl"))
@options(HealthConfig)
@options(BalancerConfig, only=("drain_timeout",))
@options(ServeConfig, only=("extra_worker_urls", "no_balancer"))
@click.option("--slurm-script", default=None, help="sbatch script for SLURM mode (default: "
                                                   "slurm/serve_single_node.sbatch, with --nodes N > 1 "
                                                   "slurm/serve_multi_node.sbatch).")
@click.option("--nodes", type=click.IntRange(1), default=None,
              help="SLURM mode: nodes of the job (sbatch --nodes); more than one runs slurm/serve_multi_node.sbatch "
                   "(the balancer on the first node, --gpus or --workers per node).")
@click.option("--slurm-cpus", type=click.IntRange(1), default=None,
              help="SLURM mode: cores to ask for on each node (sbatch --cpus-per-task) [default: 4 per worker "
                   "(per GPU of --gpus, or per --workers) plus 2].")
@click.option("--log-level", default="info", show_default=True)
def serve(local, model_path, dcp_path, base_model, gpus, gpu_ids, workers, slurm_script, nodes, slurm_cpus, log_level,
          **values):
    """Workers (one per GPU, or CPU workers) plus the balancer, supervised: ``--local``, or a SLURM job."""
    from common.worker_config import scoring_defaults_problem
    _logging(log_level)
    why = scoring_defaults_problem(values["worker_score_mc_num"], values["worker_score_batch_size"])
    if why:
        raise click.UsageError(why)
    if local and (nodes is not None or slurm_cpus is not None):
        raise click.UsageError(f"{'--nodes' if nodes is not None else '--slurm-cpus'} is for SLURM mode (without "
                               f"--local); --local runs on this machine only")
    if not local:
        from dllm_serve.slurm import submit
        sys.exit(submit(slurm_script, sys.argv[2:] if len(sys.argv) > 2 else []))
    from balancer.supervisor import run, write_failed_info
    try:
        cfg = _local_serve_config(model_path, dcp_path, base_model, gpus, gpu_ids, workers, log_level, values)
    except click.ClickException as e:      # (a SLURM job's wait loop reads the server-info file: it says "failed")
        if values["server_info_file"] is not None:
            write_failed_info(Path(values["server_info_file"]).absolute(), e.format_message())
        raise
    sys.exit(run(cfg))


def _local_serve_config(model_path, dcp_path, base_model, gpus, gpu_ids, workers, log_level, values) -> ServeConfig:
    """``serve --local``'s checks (usage errors, exit 2; a DCP that does not convert, exit 1) and its config."""
    from common.resolve import ResolveError, resolve_model
    if dcp_path:                 # usage errors (exit 2), as --model-path's are; a DCP that cannot convert is exit 1
        if model_path:
            raise click.UsageError("give --model-path or --dcp-path (with --base-model), not both")
        if not base_model:
            raise click.UsageError("--dcp-path needs --base-model (the checkpoint whose config, tokenizer and tensor "
                                   "names it uses)")
        if not Path(dcp_path).is_dir():
            raise click.BadParameter(f"{dcp_path!r} is not a directory", param_hint="--dcp-path")
    try:
        if dcp_path:
            from common.dcp_cache import ensure_converted
            resolved = ensure_converted(dcp_path, base_model, log=lambda m: click.echo(m, err=True))
        else:
            resolved = resolve_model(model_path)
    except ResolveError as e:
        raise click.UsageError(str(e))
    except RuntimeError as e:
        raise click.ClickException(str(e))
    ids = _gpu_ids(gpus, gpu_ids, workers)
    tp = values["worker_tensor_parallel_size"]
    if ids and tp > 1:          # one worker per group of tp GPUs: CUDA_VISIBLE_DEVICES "0,1", "2,3", ...
        if len(ids) % tp:
            raise click.UsageError(f"{len(ids)} GPUs cannot be split into workers of --tensor-parallel-size {tp}")
        ids = [",".join(ids[i:i + tp]) for i in range(0, len(ids), tp)]
    worker = {name: values["worker_" + name] for name in SERVE_WORKER}
    worker.update(request_timeout=values["request_timeout"], drain_timeout=values["drain_timeout"])
    if dcp_path and not worker["served_model_name"]:
        worker["served_model_name"] = Path(dcp_path).resolve().name    # the DCP's name, not its cache directory's
    elif not worker["served_model_name"]:     # a hub id is served as the hub id, not its cache snapshot's path
        from common.resolve import served_names
        worker["served_model_name"] = ",".join(served_names(model_path or resolved))
    bcfg = build(BalancerConfig, values, exclude=("worker_urls",), worker_urls=[],
                 batch=build(BatchConfig, values), health=build(HealthConfig, values))
    cfg = build(ServeConfig, values, model_path=str(resolved), gpu_ids=ids, cpu_workers=workers or 1, worker=worker,
                balancer=bcfg, log_level=log_level)
    last = cfg.worker_base_port + (len(ids) if ids else cfg.cpu_workers) - 1
    if last > 65535:
        raise click.BadParameter(f"{cfg.worker_base_port}: the last worker's port would be {last}, past 65535",
                                 param_hint="--worker-base-port")
    _writable_dir(cfg.log_dir, "--log-dir")
    if cfg.server_info_file is not None:
        _writable_dir(cfg.server_info_file.parent, "--server-info-file")
    if not cfg.no_balancer:
        from balancer.app import files_root
        _writable_dir(files_root(bcfg), "--files-dir")
    where = "no balancer (workers only)" if cfg.no_balancer else f"balancer on http://{cfg.host}:{cfg.port}"
    click.echo(f"dllm-serve: model {resolved}; {len(ids) if ids else cfg.cpu_workers} "
               f"{'GPU' if ids else 'CPU'} worker(s){f' of {tp} ranks' if tp > 1 else ''}; {where}; logs in "
               f"{cfg.log_dir}/", err=True)
    return cfg


@main.command()
@click.option("--model-path", default=None, help="Checkpoint directory or hub id (default: the built-in demo model).")
@click.option("--prefix-ids", required=True, help="The context, as comma-separated token ids.")
@click.option("--target-ids", required=True, help="The continuation to score, as comma-separated token ids.")
@click.option("--mc-num", type=click.IntRange(1), default=128, show_default=True,
              help="Monte Carlo samples (the LLaDA paper: 128; 1 suffices for single-token answers).")
@click.option("--batch-size", type=click.IntRange(1), default=16, show_default=True,
              help="Samples per forward pass (mc-num must be a multiple).")
@click.option("--cfg-scale", type=FiniteFloatRange(0, 100), default=0.0, show_default=True)
@click.option("--seed", type=click.IntRange(0, (1 << 63) - 1), default=0, show_default=True)
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
        path = resolve_model(model_path)
    except ResolveError as e:
        raise click.UsageError(str(e))
    _check_device(device)
    try:
        engine = Engine.from_pretrained(str(path), device=device, dtype=dtype)
    except (CheckpointError, ValueError, OSError) as e:
        raise click.ClickException(str(e))
    if engine.family != "llada":
        raise click.ClickException(f"likelihood scoring is implemented for LLaDA checkpoints, not {engine.family}")
    prefix, target = _int_list(prefix_ids, "--prefix-ids"), _int_list(target_ids, "--target-ids")
    vocab = len(engine.tokenizer)
    for ids, flag in ((prefix, "--prefix-ids"), (target, "--target-ids")):
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise click.BadParameter(f"{bad} is not a token id of this model (0 to {vocab - 1})", param_hint=flag)
    if not target:
        raise click.BadParameter("the continuation needs at least one token", param_hint="--target-ids")
    if len(prefix) + len(target) > engine.max_sequence_length:
        raise click.BadParameter(f"{len(prefix)} + {len(target)} tokens exceed the model's maximum sequence length "
                                 f"({engine.max_sequence_length})", param_hint="--target-ids")
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
        from common.dcp_cache import PARENT_ENV
        parent = os.environ.get(PARENT_ENV)
        if parent:                          # converting for a launch: not past its end
            from balancer.supervisor import die_with_parent
            die_with_parent()
            if str(os.getppid()) != parent:
                raise click.ClickException("the process that started this conversion has exited")
        from worker.dcp import convert
        from worker.models import CheckpointError
        if output is None:
            raise click.UsageError("--no-cache needs --output")
        try:
            convert(dcp_path, base_model, output)
        except (CheckpointError, OSError) as e:
            raise click.ClickException(str(e))
        except Exception as e:              # a checkpoint still being written (an empty .metadata: EOFError), ...
            raise click.ClickException(f"cannot read the DCP checkpoint {dcp_path}: {type(e).__name__}: {e}")
        click.echo(output)
        return
    from common.dcp_cache import ensure_converted
    try:
        click.echo(ensure_converted(dcp_path, base_model, output, log=lambda m: click.echo(m, err=True)))
    except (RuntimeError, ValueError) as e:
        raise click.ClickException(str(e))


@main.command("run-batch")
@click.option("-i", "--input", "input_path", required=True, type=click.Path(dir_okay=False, exists=True),
              help="Requests in the OpenAI batch file format (JSONL: custom_id, method, url, body).")
@click.option("-o", "--output", "output_path", required=True, type=click.Path(dir_okay=False),
              help="Results (JSONL, OpenAI's batch output format), appended as they come; an existing file is "
                   "resumed: lines with a final result are not sent again.")
@click.option("--url", default=None, envvar="DLLM_URL",
              help="A running server's base URL [default: http://127.0.0.1:8000].")
@click.option("--model-path", default=None, help="Instead of --url: serve this model for the run (dllm-serve serve "
                                                 "--local on free ports, stopped at the end).")
@click.option("--serve-args", default="", help="More `serve` flags with --model-path, e.g. \"--gpus 8\".")
@click.option("--api-key", envvar="DLLM_API_KEY", default=None, help="The server's API key, if it has one.")
@click.option("--concurrency", type=click.IntRange(1), default=64, show_default=True,
              help="Requests in flight at once.")
@click.option("--timeout", type=FiniteFloatRange(0, min_open=True), default=3600.0, show_default=True,
              help="Seconds one request may take before it is recorded as unanswered.")
@click.option("--startup-timeout", type=FiniteFloatRange(0, min_open=True), default=1800.0, show_default=True,
              help="With --model-path: seconds for the server to become ready.")
@click.option("--retry-wait-max", type=FiniteFloatRange(0.05), default=10.0, show_default=True,
              help="Longest wait between two tries of a request the server was too busy for (429, 503: after its "
                   "Retry-After, else a wait from 0.5 s doubling), within --timeout.")
def run_batch(input_path, output_path, url, model_path, serve_args, api_key, concurrency, timeout,
              startup_timeout, retry_wait_max):
    """Run a file of requests (OpenAI batch format) with a progress bar; resumable, every line accounted for.
    Exit 0 when every line has a final result, 1 when some got no answer (run again to resume them)."""
    import shlex
    from dllm_serve.batch import run
    if url and model_path:
        raise click.UsageError("give --url or --model-path, not both")
    if model_path and Path(model_path).exists():     # the server for the run starts in the project's directory
        model_path = str(Path(model_path).resolve())
    try:
        code = run(input_path, output_path, url, model_path, shlex.split(serve_args), api_key, concurrency, timeout,
                   startup_timeout, lambda m: click.echo(m, err=True), retry_wait_max)
    except RuntimeError as e:                        # the server for the run did not start: its log says why
        raise click.ClickException(str(e))
    sys.exit(code)


@main.command("load-weights")
@click.option("--url", default=None, envvar="DLLM_URL",
              help="The balancer's base URL [default: http://127.0.0.1:8000, or the server-info file's].")
@click.option("--server-info-file", type=click.Path(dir_okay=False, exists=True), default=None,
              help="A job's server-info file (SLURM: $DLLM_SERVER_INFO_DIR/server-info-<job>): its SERVER_BASE_URL.")
@click.option("--model-path", default=None, help="The new weights: a checkpoint directory (or hub id) of the served "
                                                 "model's family, config and tokenizer.")
@click.option("--dcp-path", default=None, help="The new weights as a DCP checkpoint (converted once, with "
                                               "--base-model).")
@click.option("--base-model", default=None, help="Checkpoint the DCP was trained from.")
@click.option("--mode", type=click.Choice(["rolling", "pause"]), default="rolling", show_default=True,
              help="rolling: one worker at a time (capacity N-1); pause: new requests wait, every worker at once.")
@click.option("--timeout", type=FiniteFloatRange(0, min_open=True), default=None,
              help="Seconds for in-flight batches to finish before a worker loads [default: the balancer's "
                   "--request-timeout].")
@click.option("--answer-timeout", type=FiniteFloatRange(0, min_open=True), default=3600.0, show_default=True,
              help="Seconds to wait for the server's answer (the whole update); past it the command exits 1 (the "
                   "update may still be running: /stats `weights` says how it ends).")
@click.option("--api-key", envvar="DLLM_API_KEY", default=None, help="The balancer's API key (required by it).")
def load_weights(url, server_info_file, model_path, dcp_path, base_model, mode, timeout, answer_timeout, api_key):
    """New weights on a running server without a restart (POST /v1/load_weights; docs/operations.md)."""
    import urllib.error
    import urllib.request
    if (model_path is None) == (dcp_path is None):
        raise click.UsageError("give --model-path, or --dcp-path with --base-model")
    if dcp_path is not None and base_model is None:
        raise click.UsageError("--dcp-path needs --base-model")
    if url is None and server_info_file is not None:
        info = dict(line.split("=", 1) for line in Path(server_info_file).read_text().splitlines() if "=" in line)
        url = info.get("SERVER_BASE_URL", "").strip('"') or None
        if url is None:
            raise click.UsageError(f"{server_info_file} has no SERVER_BASE_URL")
    url = (url or "http://127.0.0.1:8000").rstrip("/")
    body = {"mode": mode}
    for k, v in (("model_path", model_path), ("dcp_path", dcp_path), ("base_model", base_model),
                 ("timeout", timeout)):
        if v is not None:
            body[k] = str(Path(v).resolve()) if k in ("model_path", "dcp_path", "base_model") and Path(v).exists() \
                else v
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    req = urllib.request.Request(url + "/v1/load_weights", data=orjson.dumps(body), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=answer_timeout) as r:
            click.echo(r.read().decode())
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            msg = orjson.loads(raw)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            msg = raw[:500].decode(errors="replace")
        click.echo(f"dllm-serve load-weights: {e.code}: {msg}", err=True)
        sys.exit(1)
    except TimeoutError:
        click.echo(f"dllm-serve load-weights: no answer from {url} within --answer-timeout ({answer_timeout:g} s); "
                   f"the update may still be running: see {url}/stats (weights)", err=True)
        sys.exit(1)
    except OSError as e:
        click.echo(f"dllm-serve load-weights: cannot reach {url}: {e}", err=True)
        sys.exit(1)


@main.command()
@click.option("--url", default="http://127.0.0.1:8000", show_default=True, envvar="DLLM_URL",
              help="The balancer's base URL.")
@click.option("--monitor", is_flag=True, help="Live view, refreshed every --interval seconds (Ctrl-C to quit).")
@click.option("--interval", type=FiniteFloatRange(0.1), default=2.0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print /worker-status and /stats as JSON.")
def status(url, monitor, interval, as_json):
    """Worker status table. Exit code: 0 all healthy, 1 degraded, 2 down, draining or unreachable."""
    from dllm_serve.status import main as status_main
    sys.exit(status_main(url, monitor, interval, as_json))


if __name__ == "__main__":
    main()
