"""The checkpoint's tokenizer (`tokenizer.json`) and chat template (`tokenizer_config.json`).

The chat template is untrusted text shipped with a checkpoint, so it is rendered in jinja2's
immutable sandbox, with the helpers templates in the wild expect (`raise_exception`, `tojson`,
`strftime_now`, loop controls).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from pagekeeper_engine.model.hf_config import CheckpointError, load_eos_token_ids, read_json

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # newer checkpoints keep the template beside


class ChatTemplateError(ValueError):
    """The messages could not be rendered: the template refused them or failed on them."""


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _special_token(value: object) -> str | None:
    """tokenizer_config.json writes a special token as a string or as {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def compile_chat_template(source: str, origin: Path) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise CheckpointError(f"{origin}: chat template line {exc.lineno}: {exc.message}") from exc


def _read_chat_template(
    model_dir: Path, tokenizer_config: Mapping[str, Any]
) -> tuple[str, Path] | None:
    """The template's source and the file it came from, if the checkpoint has one."""
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        # Named templates: [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if isinstance(template, str):
        return template, model_dir / TOKENIZER_CONFIG_FILE
    jinja_path = model_dir / CHAT_TEMPLATE_FILE
    if jinja_path.is_file():
        return jinja_path.read_text(encoding="utf-8"), jinja_path
    return None


class Tokenizer:
    """Text <-> token ids, end-of-sequence ids, and chat rendering for one checkpoint."""

    def __init__(
        self,
        tokenizer: HFTokenizer,
        *,
        eos_token_ids: frozenset[int],
        bos_token: str | None,
        eos_token: str | None,
        chat_template: jinja2.Template | None,
    ):
        self._tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._chat_template = chat_template

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load from a checkpoint directory; a missing or malformed file is named in the error."""
        model_dir = Path(model_dir)
        tokenizer_path = model_dir / TOKENIZER_FILE
        if not tokenizer_path.is_file():
            raise CheckpointError(f"{tokenizer_path}: file not found")
        try:
            tokenizer = HFTokenizer.from_file(str(tokenizer_path))
        except Exception as exc:  # the Rust binding raises a bare Exception on any parse error
            raise CheckpointError(f"{tokenizer_path}: not a valid tokenizer: {exc}") from exc
        config_path = model_dir / TOKENIZER_CONFIG_FILE
        tokenizer_config = read_json(config_path) if config_path.exists() else {}
        bos_token = _special_token(tokenizer_config.get("bos_token"))
        eos_token = _special_token(tokenizer_config.get("eos_token"))

        eos_ids = set(load_eos_token_ids(model_dir))
        if eos_token is not None and (eos_id := tokenizer.token_to_id(eos_token)) is not None:
            eos_ids.add(eos_id)

        found = _read_chat_template(model_dir, tokenizer_config)
        template = compile_chat_template(*found) if found is not None else None
        return cls(
            tokenizer,
            eos_token_ids=frozenset(eos_ids),
            bos_token=bos_token,
            eos_token=eos_token,
            chat_template=template,
        )

    @property
    def vocab_size(self) -> int:
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    @property
    def has_chat_template(self) -> bool:
        return self._chat_template is not None

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. Encode a rendered chat prompt with add_special_tokens=False:
        the template already wrote the BOS token."""
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_batch(
        self, texts: Sequence[str], *, add_special_tokens: bool = True
    ) -> list[list[int]]:
        """`encode` of each text in one call, which releases the GIL and runs on the
        tokenizer's own threads (`PromptEncoder` calls it off the event loop)."""
        encodings = self._tokenizer.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [list(e.ids) for e in encodings]

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def decode_batch(
        self, batch: Sequence[Sequence[int]], *, skip_special_tokens: bool = True
    ) -> list[str]:
        """`decode` of each list, in one call into the tokenizer (the step loop's windows)."""
        return [
            str(text)
            for text in self._tokenizer.decode_batch(
                [list(ids) for ids in batch], skip_special_tokens=skip_special_tokens
            )
        ]

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render messages to the prompt text the model was trained on."""
        if self._chat_template is None:
            raise ChatTemplateError("this model has no chat template; use /v1/completions")
        try:
            return self._chat_template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **template_kwargs,
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template: {exc}") from exc
