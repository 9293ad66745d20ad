"""The ``dllm-serve`` command. Subcommands import their heavy modules lazily, so ``dllm-serve balancer`` never
imports torch."""
from __future__ import annotations

import sys

import click
import orjson


def _int_list(value: str | None) -> list[int] | None:
    if value is None:
        return None
    try:
        return [int(v) for v in value.replace(" ", "").split(",") if v]
    except ValueError:
        raise click.BadParameter("expected comma-separated integers, e.g. 1,2,3")


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
def main() -> None:
    """dllm-serve: OpenAI-compatible serving for masked diffusion language models."""


@main.command()
@click.option("--model-path", required=True, help="Checkpoint directory (config.json, weights, tokenizer).")
@click.option("--prompt", help="Prompt text.")
@click.option("--chat", is_flag=True, help="Wrap --prompt as one user message in the model's chat template.")
@click.option("--prompt-ids", help="Prompt as comma-separated token ids (no template, no special tokens added).")
@click.option("--gen-length", type=int, default=128, show_default=True, help="Tokens to generate.")
@click.option("--block-length", type=int, default=32, show_default=True, help="Semi-autoregressive block size.")
@click.option("--steps", type=int, default=None, help="Denoising steps in all (default: gen-length).")
@click.option("--algorithm", default="basic", show_default=True, help="Generation algorithm (registry name).")
@click.option("--remasking", type=click.Choice(["low_confidence", "random"]), default="low_confidence",
              show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.option("--cfg-scale", type=float, default=0.0, show_default=True, help="Unsupervised classifier-free guidance.")
@click.option("--threshold", type=float, default=None, help="Fast-dLLM confidence threshold (parallel decoding).")
@click.option("--factor", type=float, default=None, help="Fast-dLLM dynamic parallel-decoding factor.")
@click.option("--seed", type=int, default=None)
@click.option("--no-early-exit", is_flag=True, help="Decode the whole canvas even after a stop token.")
@click.option("--device", default="auto", show_default=True, help="cuda, cpu or auto.")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default="auto",
              show_default=True, help="auto: bfloat16 on CUDA, float32 on CPU.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def generate(model_path, prompt, chat, prompt_ids, gen_length, block_length, steps, algorithm, remasking,
             temperature, cfg_scale, threshold, factor, seed, no_early_exit, device, dtype, as_json):
    """Generate offline for one prompt and print the result."""
    from worker.engine import Engine, GenerationParams, ParamError, Request
    from worker.models import CheckpointError
    from worker.tokenizer import apply_chat_template

    if (prompt is None) == (prompt_ids is None):
        raise click.UsageError("give exactly one of --prompt or --prompt-ids")
    if chat and prompt is None:
        raise click.UsageError("--chat needs --prompt")
    try:
        engine = Engine.from_pretrained(model_path, device=device, dtype=dtype)
    except (CheckpointError, ValueError, OSError) as e:
        raise click.ClickException(str(e))
    if prompt_ids is not None:
        ids = _int_list(prompt_ids)
    elif chat:
        ids = apply_chat_template(engine.tokenizer, [{"role": "user", "content": prompt}])
    else:
        ids = engine.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    params = GenerationParams(gen_length=gen_length, block_length=block_length, steps=steps, algorithm=algorithm,
                              temperature=temperature, remasking=remasking, cfg_scale=cfg_scale,
                              threshold=threshold, factor=factor, seed=seed)
    try:
        res = engine.generate([Request(ids, params)], early_exit=not no_early_exit)[0]
    except ParamError as e:
        raise click.ClickException(f"{e.param}: {e.message}")
    text = engine.tokenizer.decode(res.token_ids, skip_special_tokens=True)
    out = {"token_ids": res.token_ids, "text": text, "finish_reason": res.finish_reason, "nfe": res.nfe}
    if no_early_exit:
        out["canvas"] = res.canvas
    if as_json:
        sys.stdout.write(orjson.dumps(out).decode() + "\n")
    else:
        click.echo(text)
        click.echo(f"[finish_reason={res.finish_reason} nfe={res.nfe} tokens={len(res.token_ids)}]", err=True)


if __name__ == "__main__":
    main()
