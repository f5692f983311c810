from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers, processors

from pagekeeper_engine.frontend.tokenizer import ChatTemplateError, Tokenizer
from pagekeeper_engine.model.hf_config import CheckpointError

VOCAB = {"<unk>": 0, "<s>": 1, "</s>": 2, "<|end|>": 3, "hello": 4, "world": 5, "user": 6}
TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] not in ['user', 'assistant', 'system'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}"
    "{% endif %}"
    "[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)


def write_tokenizer(path: Path, **config: Any) -> Path:
    tokenizer = HFTokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<s>", "</s>", "<|end|>"])
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)]
    )
    tokenizer.save(str(path / "tokenizer.json"))
    tokenizer_config = {
        "bos_token": {"content": "<s>", "special": True},
        "eos_token": "</s>",
        "chat_template": TEMPLATE,
    }
    tokenizer_config.update(config)
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
    (path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    return path


def test_encode_decode(tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(write_tokenizer(tmp_path))
    assert tok.encode("hello world") == [1, 4, 5]
    assert tok.encode("hello world", add_special_tokens=False) == [4, 5]
    assert tok.encode("hello nope") == [1, 4, 0]
    assert tok.decode([1, 4, 5, 2]) == "hello world"
    assert tok.decode([1, 4, 5, 2], skip_special_tokens=False) == "<s> hello world </s>"
    assert tok.vocab_size == 7


def test_eos_ids_from_generation_config_config_and_tokenizer_config(tmp_path: Path) -> None:
    write_tokenizer(tmp_path, eos_token="<|end|>")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [5]}))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.eos_token_ids == frozenset({2, 3, 5})
    assert (tok.bos_token, tok.eos_token) == ("<s>", "<|end|>")


def test_chat_template_renders_with_special_tokens(tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(write_tokenizer(tmp_path))
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    assert tok.apply_chat_template(messages) == (
        "<s>[system] be brief</s>\n[user] hello</s>\n[assistant] "
    )
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == (
        "<s>[system] be brief</s>\n[user] hello</s>\n"
    )


def test_template_exception_becomes_chat_template_error(tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(write_tokenizer(tmp_path))
    with pytest.raises(ChatTemplateError, match="unknown role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_template_is_sandboxed(tmp_path: Path) -> None:
    escape = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    tok = Tokenizer.from_dir(write_tokenizer(tmp_path, chat_template=escape))
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    mutate = "{% set _ = messages.append(1) %}{{ messages | length }}"
    tok = Tokenizer.from_dir(write_tokenizer(tmp_path, chat_template=mutate))
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_template_from_chat_template_jinja_and_named_list(tmp_path: Path) -> None:
    write_tokenizer(tmp_path, chat_template=None)
    assert not Tokenizer.from_dir(tmp_path).has_chat_template
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] | tojson }}")
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.apply_chat_template([{"role": "user", "content": "héllo"}]) == '"héllo"'
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    tok = Tokenizer.from_dir(write_tokenizer(tmp_path, chat_template=named))
    assert tok.apply_chat_template([]) == "D"


def test_no_template_is_a_chat_template_error(tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(write_tokenizer(tmp_path, chat_template=None))
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_missing_or_malformed_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: file not found"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: not a valid tokenizer"):
        Tokenizer.from_dir(tmp_path)
    write_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{")
    with pytest.raises(CheckpointError, match=r"tokenizer_config\.json: malformed JSON"):
        Tokenizer.from_dir(tmp_path)
    write_tokenizer(tmp_path, chat_template="{% for m in messages %}")
    with pytest.raises(CheckpointError, match=r"tokenizer_config\.json: chat template line 1"):
        Tokenizer.from_dir(tmp_path)
    write_tokenizer(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(CheckpointError, match=r"generation_config\.json: eos_token_id"):
        Tokenizer.from_dir(tmp_path)
