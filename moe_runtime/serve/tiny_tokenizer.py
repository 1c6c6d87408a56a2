"""A small byte-level BPE tokenizer for the embedded default model, built offline in milliseconds.

Byte-level, so every string round-trips (no unknown tokens); trained on a short built-in text, so
the vocabulary is fixed by this file alone. Saved as ``tokenizer.json`` + ``tokenizer_config.json``
with a ChatML chat template, which ``AutoTokenizer.from_pretrained`` loads without a network.
"""

from __future__ import annotations

import json
from pathlib import Path

BOS_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (BOS_TOKEN, "<|im_start|>", EOS_TOKEN)

# ChatML, as Qwen-family checkpoints use; ``add_generation_prompt`` opens the assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# The training text: written for this file. Its only job is to give the merges something to learn.
_CORPUS = """\
A mixture of experts layer sends every token to a few of its experts. A router scores the experts,
keeps the top ones, and the layer adds their outputs, weighted by the router. Each expert is a small
feed-forward network with a gate projection, an up projection and a down projection.
The runtime plans every layer once, at load time: which backend moves the tokens between ranks,
which backend runs the experts, and why every other backend was turned down. A backend declares
what it can run, and the plan is derived from the declarations, never from a list of names.
The quick brown fox jumps over the lazy dog. The dog sleeps in the sun, and the fox runs home.
Hello, world! How are you today? I am fine, thank you. What is the weather like where you are?
It is sunny and warm here. Tomorrow it may rain, so take an umbrella when you go out.
Once upon a time there was a small model that lived on a laptop. It answered questions, told
stories and counted numbers: one, two, three, four, five, six, seven, eight, nine, ten.
The server listens on a port, reads requests as JSON, and streams tokens back as events.
Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 and symbols ( ) [ ] { } < > = + - * / % # @ & are text too.
"""

VOCAB_SIZE = 512


def build_tokenizer():
    """The ``tokenizers.Tokenizer`` of the default model (deterministic: same text, same merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    return tok


def save_tokenizer(out_dir: str | Path, *, model_max_length: int) -> int:
    """Write the tokenizer files into ``out_dir``; return the vocabulary size (with specials)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": BOS_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(tok.token_to_id(t)): {"content": t, "special": True, "lstrip": False,
                                      "rstrip": False, "normalized": False, "single_word": False}
            for t in SPECIAL_TOKENS
        },
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return tok.get_vocab_size()


def special_token_ids() -> dict[str, int]:
    """Ids of the special tokens (they are added first, so fixed: 0, 1, 2)."""
    return {t: i for i, t in enumerate(SPECIAL_TOKENS)}
