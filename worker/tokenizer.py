"""Tokenizer and stop tokens from a checkpoint directory (no remote code)."""
from __future__ import annotations

import json
import os
from pathlib import Path

from transformers import AutoTokenizer
from transformers.utils import logging as hf_logging

# Tokenizer classes that checkpoints name with remote code (``auto_map``) but that are a transformers class under
# another name: Dream's tokenization_dream.DreamTokenizer is Qwen2's byte-level BPE (vocab.json + merges.txt).
EQUIVALENT_TOKENIZERS = {"DreamTokenizer": "Qwen2Tokenizer"}

# Tokens that end a turn in the chat formats we serve; their ids always come from the tokenizer itself.
# Llama 3, ChatML (Qwen, SDAR, Dream), LLaDA2, Gemma 2/3, DiffusionGemma
END_OF_TURN_TOKENS = ("<|eot_id|>", "<|im_end|>", "<|role_end|>", "<end_of_turn>", "<turn|>")


def load_tokenizer(path: str | os.PathLike):
    """The checkpoint's tokenizer, without running its code (a class of EQUIVALENT_TOKENIZERS is loaded as the
    transformers class it copies)."""
    # transformers warns that it does not know model_type "llada": we only want the tokenizer, so that is expected.
    import warnings
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)     # transformers' notes on config fields it renamed
            cls = _tokenizer_class(path)
            if cls in EQUIVALENT_TOKENIZERS:
                import transformers
                return getattr(transformers, EQUIVALENT_TOKENIZERS[cls]).from_pretrained(str(path))
            return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    finally:
        hf_logging.set_verbosity(level)


def _tokenizer_class(path: str | os.PathLike) -> str | None:
    f = Path(path) / "tokenizer_config.json"
    try:
        return json.loads(f.read_text()).get("tokenizer_class") if f.is_file() else None
    except (OSError, ValueError, AttributeError):
        return None


def _ids(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def stop_token_ids(path: str | os.PathLike, tokenizer, config: dict) -> list[int]:
    """eos from the tokenizer, config.json and generation_config.json, plus end-of-turn tokens the vocabulary has."""
    ids: list[int] = []
    ids += _ids(getattr(tokenizer, "eos_token_id", None))
    ids += _ids(config.get("eos_token_id"))
    gen_cfg = Path(path) / "generation_config.json"
    if gen_cfg.is_file():
        with open(gen_cfg) as f:
            ids += _ids(json.load(f).get("eos_token_id"))
    vocab = tokenizer.get_vocab()
    ids += [vocab[t] for t in END_OF_TURN_TOKENS if t in vocab]
    return sorted(set(ids))


def mask_token_id(tokenizer, config: dict) -> int:
    """The mask id from config.json (``mask_token_id``), else the tokenizer's mask token."""
    if config.get("mask_token_id") is not None:
        return int(config["mask_token_id"])
    if getattr(tokenizer, "mask_token_id", None) is not None:
        return int(tokenizer.mask_token_id)
    for tok in ("<|mdm_mask|>", "<|mask|>"):
        if tok in tokenizer.get_vocab():
            return tokenizer.get_vocab()[tok]
    raise ValueError("the checkpoint names no mask token (config.json mask_token_id or the tokenizer's mask_token)")


def takes_content_parts(tokenizer) -> bool:
    """Whether the tokenizer's chat template reads a message's content as a list of parts (it renders a text part's
    text, not the list's Python form), as vLLM tells templates apart: such a template gets the parts; one that
    takes a string gets them joined by newlines. Found once per tokenizer, by rendering a probe."""
    known = getattr(tokenizer, "_dllm_takes_parts", None)
    if known is None:
        probe = "zqxv-part-probe"
        try:
            out = tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": probe}]}],
                                                tokenize=False, add_generation_prompt=False)
            known = probe in out and "'type'" not in out and '"type"' not in out
        except Exception:            # noqa: BLE001  (a template that refuses a list takes a string)
            known = False
        try:
            tokenizer._dllm_takes_parts = known
        except AttributeError:
            pass
    return known


def apply_chat_template(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                        continue_final_message: bool = False, template_kwargs: dict | None = None) -> list[int]:
    """The messages' token ids by the tokenizer's chat template; ``template_kwargs``: more template variables (a
    request's ``chat_template_kwargs``, e.g. ``enable_thinking``)."""
    extra = {**(template_kwargs or {}), **({"continue_final_message": True} if continue_final_message else {})}
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True, **extra)
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return list(out)


def text_decoder(tokenizer, skip_special_tokens: bool = True):
    """``decode(ids) -> str``, the same text as ``tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)``
    (a request's ``skip_special_tokens``, vLLM's field: true by default).

    For a plain fast tokenizer (no decode override, no clean-up of tokenization spaces) it calls the Rust tokenizer
    directly: transformers' wrapper costs more than the decoding itself for short texts, and the worker decodes
    every row at least once. Anything else keeps the transformers call, marked ``cleans_up`` where the tokenizer
    cleans up tokenization spaces over the whole text."""
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:          # an older transformers: keep its own decode
        TokenizersBackend = None
    cls = type(tokenizer)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (TokenizersBackend is not None and isinstance(tokenizer, TokenizersBackend) and backend is not None
            and cls._decode is TokenizersBackend._decode and cls.decode is PreTrainedTokenizerBase.decode
            and not tokenizer.clean_up_tokenization_spaces):
        fast = backend.decode
        return lambda ids: fast(ids, skip_special_tokens=skip_special_tokens)

    def decode(ids):
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    # the text of a longer prefix may rewrite the end of a shorter one's (streaming holds that end back)
    decode.cleans_up = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
    return decode


def token_pieces(decode, ids: list[int], alternatives: list[list[int]] | None = None
                 ) -> tuple[list[str], list[list[str]]]:
    """Each token's share of ``decode(ids)``, as vLLM's incremental detokenizer gives it: its text in the context of
    the tokens before it (a SentencePiece or byte-level word keeps its leading space; a byte that only begins a
    character gets "", the token that completes the character gets all of it), so the pieces join to the text and
    their lengths give each token's offset in it. ``alternatives[k]``: other ids for position k, whose pieces in the
    same context come back too (a logprobs' top alternatives)."""
    pieces: list[str] = []
    alt_pieces: list[list[str]] = []
    prefix = read = 0           # the context begins at ids[prefix]; the text of ids[:read] is given out
    for k, t in enumerate(ids):
        context = ids[prefix:k]
        before = decode(ids[prefix:read])
        full = decode(context + [t])
        if alternatives is not None:
            alt_pieces.append([decode(context + [a])[len(before):] for a in alternatives[k]])
        if len(full) > len(before) and not full.endswith("\ufffd"):
            pieces.append(full[len(before):])
            prefix, read = read, k + 1
        else:
            pieces.append("")           # held: it ends inside a character (or has no text)
    if read < len(ids):                 # the text ends inside a character: the last token has what is left
        pieces[-1] = decode(ids[prefix:])[len(decode(ids[prefix:read])):]
    return pieces, alt_pieces


def max_token_chars(tokenizer) -> int:
    """The most characters any one token's text can span (its vocabulary string: byte-level BPE writes one
    character per byte, SentencePiece one per character, special tokens their literal text). A text of C characters
    has at least C / this many tokens, before normalisation."""
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return max(1, max(len(p) for p in pieces if p is not None))

