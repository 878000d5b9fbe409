"""Makes a tiny random Llama checkpoint SGLang can serve, with nothing from a model hub.

Run with the SGLang venv's Python (it has torch, transformers and tokenizers):

    python make_model.py --corpus FILE [--corpus FILE ...] OUT_DIR:SEED [OUT_DIR:SEED ...]

The tokenizer is a byte-level BPE trained on the given local text files (so any text
round-trips), wrapped as a ``PreTrainedTokenizerFast`` with a ChatML chat template; the model
is a ``LlamaConfig`` of vocabulary 1,024, hidden size 64, 2 layers and 4 heads with weights drawn
from the seed, saved as safetensors (about 0.9 MB). Every checkpoint made in one run has the same
tokenizer and shapes and its own weights, which is what a weight update needs. Random weights
almost never choose the EOS token, so an answer's length is set by ``max_new_tokens``.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

VOCAB = 1024
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def make_tokenizer(out: Path, corpus: list[Path]) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(p) for p in corpus], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL[1:],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


def make_model(out: Path, seed: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        bos_token_id=None,
        eos_token_id=0,
        pad_token_id=0,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    # Wider weights than the default init, so that greedy answers vary from token to token.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    model.save_pretrained(out, safe_serialization=True)
    # The generation defaults SGLang reads: none beyond the EOS id.
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": 0, "pad_token_id": 0}))


def checkpoint(spec: str) -> tuple[Path, int]:
    out, _, seed = spec.rpartition(":")
    if not out or not seed.isdigit():
        raise argparse.ArgumentTypeError(f"{spec!r} is not OUT_DIR:SEED (e.g. /tmp/m1:1)")
    return Path(out), int(seed)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("checkpoints", type=checkpoint, nargs="+", metavar="OUT_DIR:SEED")
    parser.add_argument("--corpus", type=Path, action="append", required=True)
    args = parser.parse_args()
    first: Path | None = None
    for out, seed in args.checkpoints:
        out.mkdir(parents=True, exist_ok=True)
        if first is None:
            make_tokenizer(out, args.corpus)
            first = out
        else:
            for f in first.iterdir():
                if f.name.startswith("tokenizer") or f.name.endswith(".jinja") or f.name == "special_tokens_map.json":
                    shutil.copyfile(f, out / f.name)
        make_model(out, seed)


if __name__ == "__main__":
    main()
