"""A tiny real tokenizer, built offline, for the ``huggingface/`` folder of sample checkpoints.

A word-level model trained on a few sentences, wrapped in ``PreTrainedTokenizerFast`` so that
``AutoTokenizer.from_pretrained`` loads it like any Hub tokenizer, chat template included.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

# The trainer gives special tokens the first ids, in this order, so model configs can name them.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>")
PAD_TOKEN, EOS_TOKEN, UNK_TOKEN = "<|endoftext|>", "<|im_end|>", "<unk>"
PAD_TOKEN_ID = SPECIAL_TOKENS.index(PAD_TOKEN)
EOS_TOKEN_ID = SPECIAL_TOKENS.index(EOS_TOKEN)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = (
    "The trainer saves a checkpoint every few steps.",
    "Each rank writes its own shard of the model weights.",
    "A merge joins the shards into one Hugging Face folder.",
    "What is the reward for this answer? The answer is correct.",
    "Solve the problem step by step and give the final answer.",
    "The actor and the critic are trained together with PPO.",
    "Large language models learn from feedback and rewards.",
    "The system prompt says: the assistant answers the user, please be brief.",
)


def write_tokenizer(out_dir: Path, *, vocab_size: int) -> None:
    """Train the tokenizer, keeping at most ``vocab_size`` tokens, and ``save_pretrained`` it. Ids the
    corpus leaves free up to ``vocab_size`` are filler words (``w123``), so every row of the model's
    embedding decodes to a word: a random model's generated text reads as words, not as ``''``."""
    if vocab_size < len(SPECIAL_TOKENS) + 1:
        raise ValueError(f"vocab_size {vocab_size} cannot hold the special tokens and one word")
    trained = Tokenizer(models.WordLevel(unk_token=UNK_TOKEN))
    trained.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS))
    trained.train_from_iterator(_CORPUS, trainer=trainer)
    vocab = trained.get_vocab()
    vocab |= {f"w{i}": i for i in range(len(vocab), vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        additional_special_tokens=["<|im_start|>"],
        chat_template=CHAT_TEMPLATE,
    )
    wrapped.save_pretrained(out_dir)
