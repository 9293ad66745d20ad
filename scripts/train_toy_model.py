#!/usr/bin/env python3
"""Train a tiny LLaDA-architecture diffusion model on three exact tasks (CPU, deterministic for a seed).

Tasks (chat user messages, digits separated by single spaces):
  sort 7 3 9 1      -> 1 3 7 9      (4 to 8 digits)
  reverse 4 8 1 5   -> 5 1 8 4      (4 to 8 digits)
  add 4 7 + 8 5     -> 1 3 2        (operands 10 to 999)

Objective: LLaDA's masked-diffusion SFT. The prompt (chat template) is never masked; the answer is followed by
<|eot_id|> and padded with <|endoftext|> to --answer-length tokens; each example draws t ~ U(eps, 1), masks each answer
token with probability t, and the loss is the cross-entropy on masked positions weighted 1/t, averaged over answer
tokens. The model, config, weight names and tokenizer use LLaDA's published layout, so `dllm-serve` loads the result
like any LLaDA checkpoint.

  python scripts/train_toy_model.py --output worker/demo_model --minutes 55
"""
from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import _venv  # noqa: E402,F401  (re-runs this script with the project's .venv)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

SPECIALS = ["<|startoftext|>", "<|endoftext|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>",
            "<|mdm_mask|>", "<|reserved_0|>"]
WORDS = ["system", "user", "assistant", "sort", "reverse", "add", "+"] + [str(d) for d in range(10)]
CHAT_TEMPLATE = (ROOT / "tests" / "fixtures" / "tiny-llada" / "chat_template.jinja")


# ---------------------------------------------------------------- tasks
TASKS = ["sort", "reverse", "add"]


def make_problem(rng: random.Random, task: str | None = None) -> tuple[str, str, str]:
    task = task or rng.choice(TASKS)
    if task in ("sort", "reverse"):
        digits = [rng.randrange(10) for _ in range(rng.randint(4, 8))]
        answer = sorted(digits) if task == "sort" else digits[::-1]
        return task, f"{task} {' '.join(map(str, digits))}", " ".join(map(str, answer))
    a, b = rng.randint(10, 999), rng.randint(10, 999)
    return task, f"add {' '.join(str(a))} + {' '.join(str(b))}", " ".join(str(a + b))


# ---------------------------------------------------------------- checkpoint files
def write_tokenizer(out: Path) -> dict[str, int]:
    vocab = {w: i for i, w in enumerate(WORDS + SPECIALS)}
    tok = json.loads((ROOT / "tests" / "fixtures" / "tiny-llada" / "tokenizer.json").read_text())
    tok["model"]["vocab"] = vocab
    tok["added_tokens"] = [{"id": vocab[s], "content": s, "single_word": False, "lstrip": False, "rstrip": False,
                            "normalized": False, "special": True} for s in SPECIALS]
    (out / "tokenizer.json").write_text(json.dumps(tok, indent=1))
    shutil.copy(ROOT / "tests" / "fixtures" / "tiny-llada" / "tokenizer_config.json", out / "tokenizer_config.json")
    shutil.copy(CHAT_TEMPLATE, out / "chat_template.jinja")
    return vocab


def llada_config(vocab: dict, d: int, layers: int, heads: int, mlp: int, max_len: int) -> dict:
    base = json.loads((ROOT / "tests" / "fixtures" / "tiny-llada" / "config.json").read_text())
    base.pop("auto_map", None)     # no custom code ships with the model: clients must not be asked to run it
    base.update({"d_model": d, "n_layers": layers, "n_heads": heads, "n_kv_heads": heads, "mlp_hidden_size": mlp,
                 "vocab_size": len(vocab), "embedding_size": len(vocab), "max_sequence_length": max_len,
                 "mask_token_id": vocab["<|mdm_mask|>"], "eos_token_id": vocab["<|endoftext|>"],
                 "pad_token_id": vocab["<|endoftext|>"], "rope_theta": 10000.0})
    return base


# ---------------------------------------------------------------- training
class ChatEncoder:
    """The chat template rendered once around a placeholder; prompts are spliced in (word-level vocabulary)."""

    def __init__(self, tokenizer, vocab):
        from worker.tokenizer import apply_chat_template
        ids = apply_chat_template(tokenizer, [{"role": "user", "content": "placeholder"}])
        i = ids.index(vocab["<|reserved_0|>"])
        self.pre, self.post, self.vocab = ids[:i], ids[i + 1:], vocab

    def __call__(self, prompt: str) -> list[int]:
        return self.pre + [self.vocab[w] for w in prompt.split()] + self.post


def encode_batch(problems, enc: ChatEncoder, vocab, answer_len, device):
    """Left-padded [B, L] ids, positions, key mask, answer mask (positions that may be masked)."""
    eot, eos = vocab["<|eot_id|>"], vocab["<|endoftext|>"]
    seqs, plens = [], []
    for _, prompt, answer in problems:
        p = enc(prompt)
        a = [vocab[w] for w in answer.split()] + [eot]
        a = (a + [eos] * answer_len)[:answer_len]
        seqs.append(p + a)
        plens.append(len(p))
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), eos, dtype=torch.long)
    ans = torch.zeros((len(seqs), L), dtype=torch.bool)
    off = []
    for b, (s, pl) in enumerate(zip(seqs, plens)):
        o = L - len(s)
        ids[b, o:] = torch.tensor(s)
        ans[b, o + pl:] = True
        off.append(o)
    off = torch.tensor(off)
    col = torch.arange(L)
    pos = (col[None, :] - off[:, None]).clamp(min=0)
    key = (col[None, :] >= off[:, None])[:, None, None, :]
    return ids.to(device), pos.to(device), key.to(device), ans.to(device)


def main() -> None:
    from worker.models.llada import LLaDAConfig, LLaDAModel
    from worker.tokenizer import load_tokenizer
    from safetensors.torch import save_file

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output", default=str(ROOT / "worker" / "demo_model"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--minutes", type=float, default=55.0, help="wall-clock training budget")
    ap.add_argument("--max-steps", type=int, default=1_000_000)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--mlp", type=int, default=384)
    ap.add_argument("--answer-length", type=int, default=16,
                    help="answers padded to this many tokens; with --answer-lengths, each step draws one of those")
    ap.add_argument("--answer-lengths", default=None, help="comma-separated answer lengths, one drawn per step "
                                                          "(e.g. 16,32,64,128,256: the model then ends its answer "
                                                          "with padding on canvases up to 256 tokens)")
    ap.add_argument("--init", default=None, help="start from this checkpoint's weights (fine-tuning) instead of a "
                                                 "random initialisation (same shape)")
    ap.add_argument("--warmup", type=int, default=300, help="learning-rate warm-up steps")
    ap.add_argument("--eps", type=float, default=1e-3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--log-every", type=int, default=200)
    ap.add_argument("--task-weights", default="1,1,1", help="sampling weights of sort,reverse,add")
    args = ap.parse_args()

    weights = [float(w) for w in args.task_weights.split(",")]
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    rng = random.Random(args.seed)
    out = Path(args.output)
    tmp = out.with_name(out.name + ".training")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    vocab = write_tokenizer(tmp)
    # RoPE, no learned positions: the table's length changes no weight and no value at a trained position, so the
    # context is LLaDA-8B's 4096 (clients' default prompt and generation lengths fit) though training rows are short
    cfg_dict = llada_config(vocab, args.d_model, args.layers, args.heads, args.mlp, 4096)
    (tmp / "config.json").write_text(json.dumps(cfg_dict, indent=2))
    enc = ChatEncoder(load_tokenizer(tmp), vocab)
    model = LLaDAModel(LLaDAConfig.from_dict(cfg_dict))
    for name, p in model.named_parameters():
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=0.02 if "wte" in name else 1 / math.sqrt(p.shape[1]))
    if args.init:
        from safetensors.torch import load_file
        state = load_file(str(Path(args.init) / "model.safetensors"))
        model.load_state_dict({k.removeprefix("model.transformer."): v for k, v in state.items()})
    model.init_rope()
    lengths = [int(n) for n in args.answer_lengths.split(",")] if args.answer_lengths else None
    # lengths from a generator of their own: the problems drawn are the same sequence as without --answer-lengths
    # (a fine-tune with the same seed sees problems its base run saw: bench/quality.py's held-out set stays held out)
    length_rng = random.Random(args.seed + 1)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    mask_id = vocab["<|mdm_mask|>"]
    print(f"params {n_params / 1e6:.2f}M; vocab {len(vocab)}; seed {args.seed}; budget {args.minutes} min", flush=True)
    t0 = time.monotonic()
    budget = args.minutes * 60
    step, ema = 0, None
    while step < args.max_steps and time.monotonic() - t0 < budget:
        frac = (time.monotonic() - t0) / budget
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
        for g in opt.param_groups:
            g["lr"] = lr
        problems = [make_problem(rng, rng.choices(TASKS, weights)[0]) for _ in range(args.batch_size)]
        answer_len = length_rng.choice(lengths) if lengths else args.answer_length
        ids, pos, key, ans = encode_batch(problems, enc, vocab, answer_len, "cpu")
        t = args.eps + (1 - args.eps) * torch.rand(ids.shape[0])
        masked = ans & (torch.rand(ids.shape) < t[:, None])
        noisy = torch.where(masked, torch.full_like(ids, mask_id), ids)
        logits = model.logits(model(noisy, pos, key))
        ce = F.cross_entropy(logits[masked], ids[masked], reduction="none")
        loss = (ce / t[:, None].expand_as(ids)[masked]).sum() / ans.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        if step % args.log_every == 0:
            print(f"step {step} loss {ema:.4f} lr {lr:.2e} {time.monotonic() - t0:.0f}s", flush=True)
    minutes = (time.monotonic() - t0) / 60
    model.eval()
    save_file({"model.transformer." + k: v.detach().contiguous() for k, v in model.state_dict().items()},
              tmp / "model.safetensors", metadata={"format": "pt"})
    (tmp / "training.json").write_text(json.dumps({"seed": args.seed, "steps": step, "minutes": round(minutes, 1),
                                                   "params": n_params, "final_loss_ema": ema, "args": vars(args)},
                                                  indent=2))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    print(f"saved {out} after {step} steps, {minutes:.1f} min", flush=True)


if __name__ == "__main__":
    main()
