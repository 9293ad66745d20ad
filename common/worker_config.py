"""The worker's configuration, defined once: fields, defaults and help (``dllm-serve worker`` generates its options
from them; ``dllm-serve serve`` passes the ones it shares on to its workers). Here in ``common`` because it is the
contract between the worker and what launches it (the balancer's supervisor writes a worker's command line from it).
No torch."""
from __future__ import annotations

from dataclasses import dataclass

import click

from common.config import PORT, setting
from common.http import (KEEPALIVE_TIMEOUT, WORKER_BODY_BYTES_IN_FLIGHT, body_timeout_setting,
                         send_timeout_setting)

DTYPES = ["auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16"]   # checked before anything starts


def cost_model(value: str | None) -> tuple[float, float] | None:
    """--simulate-device BASE,PER_ROW -> (base seconds, per-row seconds)."""
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


def names(values) -> str | None:
    """--served-model-name given several times or comma-separated -> "a,b" (None: the default name)."""
    if isinstance(values, str):
        return values
    return ",".join(values or ()) or None


@dataclass
class WorkerConfig:
    model_path: str = setting(help="Checkpoint directory.")
    host: str = setting("127.0.0.1")
    port: int = setting(8001, type=PORT)
    batch_size: int = setting(8, "Rows per engine batch.", type=click.IntRange(1))
    max_wait_time: float = setting(0.05, "Seconds a forming batch waits for more requests, from its first request.",
                                   type=click.FloatRange(0))
    max_queue: int = setting(1024, "Rows waiting beyond which requests get 429 (a request of more rows, prompts x "
                                   "n, than this: 400).", type=click.IntRange(1))
    continuous_batching: bool = setting(True, "Rows join the running batch between denoising steps (in turns by "
                                              "request, within --batch-size and --max-batch-tokens) and leave it "
                                              "when done; off: a batch runs to its end before the next starts.")
    max_batch_tokens: int = setting(0, "Canvas tokens (prompt + max_tokens in whole blocks; twice with cfg_scale) of "
                                       "the rows in a batch, at most (0: no limit beyond --batch-size); bounds "
                                       "device memory.",
                                    type=click.IntRange(0))
    switch_wait: float = setting(1.0, "Continuous batching with tensor parallelism, where a likelihood-scoring "
                                      "request runs in a batch of its own: seconds a queued one lets generation rows "
                                      "join the running batch ahead of it; then the batch drains and it goes next "
                                      "(on one GPU scoring takes turns with generation rows).",
                                 type=click.FloatRange(0))
    max_request_cost: int = setting(1 << 25, "A request implying more token-forwards than this is refused with 400 "
                                             "naming it (0: no limit). A row's nominal cost: its schedule's forwards "
                                             "x (prompt + canvas tokens, at least 64), x2 with cfg_scale; a scoring request's: "
                                             "(splits x mc_num + greedy-check forwards) x its tokens "
                                             "(at least 64); plus 128 for each top log-probability alternative "
                                             "asked for (docs/reliability.md).", type=click.IntRange(0))
    long_row_cost: int = setting(1 << 20, "Rows above this nominal cost (token-forwards) are long: they hold at "
                                          "most --long-row-share of a batch's rows, so short rows are never held "
                                          "behind them (0: no distinction).", type=click.IntRange(0))
    long_row_share: float = setting(0.5, "Share of --batch-size that long rows may hold (at least one row).",
                                    type=click.FloatRange(0, 1))
    device: str = setting("auto", "cuda, cuda:N, cpu or auto.")
    threads: int = setting(0, "Threads for torch's CPU work (intra-op). 0: torch's default, every core this "
                              "process may use; `serve` gives each of its CPU workers an equal share of the cores "
                              "instead (workers sharing cores with all threads each wait on one another: tens of "
                              "times slower).", type=click.IntRange(0))
    tensor_parallel_size: int = setting(1, "Ranks of this worker (torch.distributed: NCCL on CUDA, gloo on the CPU): "
                                           "attention heads, MLP channels and the vocabulary split over them, MoE "
                                           "experts too (expert parallelism). Rank r uses cuda:<the --device index + "
                                           "r> (docs/operations.md, \"Tensor parallelism\").",
                                        type=click.IntRange(1))
    prefix_cache_gb: float = setting(1.0, "GiB of prompt blocks' keys/values kept across requests for the "
                                          "block-causal families (LLaDA2.x, SDAR) and DiffusionGemma's causal "
                                          "prompt encoder, where reusing them is exact; "
                                          "least recently used blocks go first; 0: off; more than 90% of the "
                                          "device's memory: refused at load (docs/engine.md, \"Prefix "
                                          "cache\").", type=click.FloatRange(0))
    rank_timeout: float = setting(300.0, "Tensor parallelism: seconds a rank may wait for the others in a "
                                         "collective before the worker ends itself (a hung rank) to be restarted.",
                                  type=click.FloatRange(0, min_open=True))
    rank_startup_timeout: float = setting(600.0, "Tensor parallelism: seconds rank 0 waits for its follower ranks "
                                                 "to start, join the group and load their shards (at start and at "
                                                 "every new checkpoint) before the load fails.",
                                          type=click.FloatRange(0, min_open=True))
    dtype: str = setting("auto", "auto: bfloat16 on a GPU, float32 on the CPU.", type=click.Choice(DTYPES))
    compile: bool = setting(False, "torch.compile the dense half of every block (output projection, RMSNorm, SwiGLU "
                                   "MLP); eager if compiling fails. Off by default: not yet measured on a GPU "
                                   "(docs/engine.md).")
    cuda_graphs: bool = setting(True, "Replay the model's forward from CUDA graphs (one per shape of a step, "
                                      "captured the second time it is met): the same kernels, launched by the GPU "
                                      "instead of the host; the same tokens, 1.1-3.4x faster steps on an H200 and "
                                      "an H100. CUDA only: the dense families and DiffusionGemma's decoder pass in "
                                      "bfloat16 (not LLaDA-MoE or LLaDA2.x), not with --compile or tensor "
                                      "parallelism (docs/engine.md, \"CUDA graphs\").")
    cuda_graph_max: int = setting(32, "With --cuda-graphs: graphs kept at most (least recently replayed dropped "
                                      "first).", type=click.IntRange(1))
    cuda_graph_max_tokens: int = setting(2048, "With --cuda-graphs: forwards of more tokens (rows x positions) run "
                                               "eagerly (their launches no longer dominate; each graph keeps its "
                                               "output buffer).", type=click.IntRange(1))
    default_algorithm: str | None = setting(None, "Algorithm for requests that name none (default: the family's: "
                                                  "basic for LLaDA and LLaDA-MoE, nemotron for Nemotron-Diffusion, "
                                                  "dream for Dream, sdar for SDAR, llada2 for LLaDA2.x, LLaDA2.1 "
                                                  "included: give llada21 for its editing decoder; diffusion_gemma "
                                                  "for DiffusionGemma).")
    default_max_tokens: int | None = setting(None, "max_tokens when a request gives none (capped by the context "
                                                   "left; default: the checkpoint's generation_config.json "
                                                   "max_new_tokens, else 256).", type=click.IntRange(1))
    default_block_length: int = setting(32, "block_length when a request gives none and the checkpoint names no "
                                            "block_size (SDAR's does).", type=click.IntRange(1))
    score_mc_num: int = setting(128, "Likelihood scoring (echo + logprobs): Monte Carlo samples per estimate when a "
                                     "request gives no mc_num (the reference eval_llada.py's default).",
                                type=click.IntRange(1))
    score_batch_size: int = setting(32, "Likelihood scoring: copies per mini-batch (the reference's batch_size; "
                                        "mc_num must be a multiple of it) when a request gives no mc_batch_size.",
                                    type=click.IntRange(1))
    score_cfg_scale: float = setting(0.0, "Likelihood scoring: classifier-free guidance scale when a request gives "
                                          "no cfg_scale.", type=click.FloatRange(0))
    score_window: int = setting(32, "Likelihood scoring without context_length: estimate every split in the "
                                    "prompt's last N tokens, so lm-eval's sum over any continuation up to N tokens is "
                                    "that continuation's estimate (cost: up to N estimates per request; "
                                    "docs/api.md).", type=click.IntRange(1))
    served_model_name: str | None = setting(None, "Model id in the API (default: the checkpoint directory's "
                                                  "absolute path, its name accepted too). Several names: repeat the "
                                                  "option or separate them with commas; requests may use any, the "
                                                  "first is reported.",
                                            multiple=True, convert=names)
    api_key: str | None = setting(None, "Require 'Authorization: Bearer KEY'.", envvar="DLLM_API_KEY")
    max_body_bytes_in_flight: int = setting(
        WORKER_BODY_BYTES_IN_FLIGHT, "Bytes of request bodies held at once over all requests, /worker/batch "
                                     "included (bodies over 1 MiB may fill three quarters: keep that above the "
                                     "balancer's --max-inflight-per-worker x 128 MiB); past it a request gets 503 "
                                     "+ Retry-After.", type=click.IntRange(1))
    body_timeout: float = body_timeout_setting()
    send_timeout: float = send_timeout_setting()
    keepalive_timeout: float = setting(KEEPALIVE_TIMEOUT, "Seconds a client connection may stay idle between "
                                                          "requests (one whose next request's headers have not all "
                                                          "arrived counts as idle) before it is closed; over 30 "
                                                          "(a balancer lets its idle connections to workers go "
                                                          "after 30 s).", type=click.FloatRange(30, min_open=True))
    request_timeout: float = setting(1800.0, "Seconds before a request is abandoned with 504.",
                                     type=click.FloatRange(0, min_open=True))
    drain_timeout: float = setting(60.0, "Seconds SIGTERM waits for running work; then the connections still "
                                         "open are closed (a balancer re-dispatches what it had not streamed yet) "
                                         "and the process exits within 5 s.",
                                   type=click.FloatRange(0))
    load_timeout: float = setting(600.0, "Seconds POST /worker/load_weights waits for queued and running rows to "
                                         "finish on the old weights before it gives up (503, weights unchanged).",
                                  type=click.FloatRange(0, min_open=True))
    simulate_device: tuple[float, float] | None = setting(
        None, "Test double: no model; each batch sleeps BASE + PER_ROW x rows seconds (each step: "
              "--simulate-per-step) and echoes the prompt (load and scaling tests). The model path still provides "
              "the tokenizer.", metavar="BASE,PER_ROW",
        convert=cost_model, unparse=lambda v: f"{v[0]},{v[1]}")
    simulate_per_step: bool = setting(False, "With --simulate-device: BASE + PER_ROW x rows is the cost of one "
                                             "denoising step and each row takes its schedule's steps, joining and "
                                             "leaving between steps (continuous batching benchmarks).")


def scoring_defaults_problem(mc_num: int, batch_size: int) -> str | None:
    """Why --score-mc-num and --score-batch-size cannot score a request that names neither (every lm-eval request,
    which cannot), or None: mc_num must be a multiple of the batch (the reference's rule)."""
    bs = min(batch_size, mc_num)
    if mc_num % bs:
        return (f"--score-mc-num {mc_num} is not a multiple of --score-batch-size {bs}: every scoring request that "
                f"names neither would be refused")
    return None
