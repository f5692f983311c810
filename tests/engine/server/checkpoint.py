"""A tiny Llama checkpoint with a character-level tokenizer and a chat template.

The model is the shared random-weight Llama (`tests.engine.checkpoints.make_hf_model`), saved
with `save_pretrained`; the tokenizer maps each character to one token, so any ASCII text
encodes and the expected text of a generation is easy to compute. `greedy_reference` is the plain
transformers forward, for exact comparisons with what the server returns.
"""

from __future__ import annotations

import string
from pathlib import Path

import torch
from transformers import PreTrainedModel

from harness.cpu_engine import BOS_ID, EOS_ID, SPECIAL_TOKENS, write_char_tokenizer
from tests.engine.checkpoints import make_hf_model

CHARACTERS = string.ascii_lowercase + string.digits + " .,!?'[]:\n"
VOCAB = {token: i for i, token in enumerate(SPECIAL_TOKENS + list(CHARACTERS))}
# A vocabulary that can spell JSON, for structured output
JSON_VOCAB = {token: i for i, token in enumerate(SPECIAL_TOKENS + list(CHARACTERS + '{}"-'))}
MAX_POSITIONS = 96
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}[{{ m['role'] }}]: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]: {% endif %}"
)


def write_tokenizer(path: Path, vocab: dict[str, int] = VOCAB) -> None:
    write_char_tokenizer(path, vocab, chat_template=CHAT_TEMPLATE)


def write_checkpoint(
    path: Path, max_positions: int = MAX_POSITIONS, vocab: dict[str, int] = VOCAB
) -> PreTrainedModel:
    """Write model and tokenizer files into `path`; the model, for reference computations."""
    model = make_hf_model(
        "llama",
        vocab_size=len(vocab),
        max_position_embeddings=max_positions,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    )
    model.save_pretrained(path)
    write_tokenizer(path, vocab)
    return model


def encode(text: str, *, add_bos: bool = True) -> list[int]:
    ids = [VOCAB.get(ch, 0) for ch in text]
    return [BOS_ID, *ids] if add_bos else ids


def decode(token_ids: list[int]) -> str:
    """Text of generated ids as the server shows it: special tokens are skipped."""
    tokens = list(VOCAB)
    return "".join(tokens[t] for t in token_ids if t >= len(SPECIAL_TOKENS))


def chat_prompt(messages: list[dict[str, str]]) -> list[int]:
    text = "".join(f"[{m['role']}]: {m['content']}\n" for m in messages) + "[assistant]: "
    return encode(text)


def greedy_reference(
    model: PreTrainedModel, prompt_ids: list[int], num_tokens: int
) -> tuple[list[int], list[float]]:
    """Greedy continuation by full re-forward (no KV cache): token ids and their logprobs."""
    ids = list(prompt_ids)
    logprobs = []
    with torch.no_grad():
        for _ in range(num_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            token = int(torch.argmax(logits))
            logprobs.append(float(torch.log_softmax(logits, dim=-1)[token]))
            ids.append(token)
    return ids[len(prompt_ids) :], logprobs
