"""/tokenize, /detokenize and /version in vLLM's request and response shapes.

/tokenize takes `{model?, prompt, add_special_tokens?}` or `{model?, messages,
add_generation_prompt?, add_special_tokens?}` (rendered with the chat template, as chat
completions are) and answers `{count, max_model_len, tokens}` (and `token_strs` when
`return_token_strs` is set); /detokenize takes `{model?, tokens}` and answers `{prompt}`;
/version answers `{version}`. Bad input gets a 400 naming the field.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

from aiohttp import web
from pydantic import Field, ValidationError

from pagekeeper_engine.frontend.chat_protocol import ChatMessage
from pagekeeper_engine.frontend.errors import (
    APIError,
    bad_request,
    from_validation_error,
    read_json_object,
)
from pagekeeper_engine.frontend.protocol import StrictModel
from pagekeeper_engine.frontend.state import ServerState
from pagekeeper_engine.frontend.tokenizer import ChatTemplateError, Tokenizer


class TokenizeCompletion(StrictModel):
    """A prompt to tokenize as /v1/completions would (with the BOS token by default)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChat(StrictModel):
    """Messages to render with the chat template and tokenize as /v1/chat/completions would."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # the template writes the BOS token
    return_token_strs: bool = False


class Detokenize(StrictModel):
    """Token ids to turn back into text (special tokens included, as vLLM does)."""

    model: str | None = None
    tokens: list[int]


def _validate(model: type[Any], body: dict[str, object]) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from exc


def _check_model(name: str | None, state: ServerState) -> None:
    if name is not None and name != state.model_name:
        raise APIError(
            404,
            f"the model {name!r} does not exist; this server serves {state.model_name!r}",
            param="model",
            code="model_not_found",
        )


def _token_strs(tokenizer: Tokenizer, token_ids: list[int]) -> list[str]:
    return [tokenizer.decode([t], skip_special_tokens=False) for t in token_ids]


async def tokenize(request: web.Request, state: ServerState) -> web.Response:
    body = await read_json_object(request)
    _, tokenizer, encoder = state.require_serving()
    req: TokenizeCompletion | TokenizeChat
    if "messages" in body:
        chat: TokenizeChat = _validate(TokenizeChat, body)
        _check_model(chat.model, state)
        messages = [{"role": m.role, "content": m.text} for m in chat.messages]
        try:
            text = tokenizer.apply_chat_template(
                messages, add_generation_prompt=chat.add_generation_prompt
            )
        except ChatTemplateError as exc:
            raise bad_request(str(exc), "messages") from exc
        req = chat
    else:
        completion: TokenizeCompletion = _validate(TokenizeCompletion, body)
        _check_model(completion.model, state)
        text, req = completion.prompt, completion
    token_ids = await encoder.encode(text, add_special_tokens=req.add_special_tokens)
    answer: dict[str, object] = {
        "count": len(token_ids),
        "max_model_len": state.max_model_len,
        "tokens": token_ids,
    }
    if req.return_token_strs:
        answer["token_strs"] = _token_strs(tokenizer, token_ids)
    return web.json_response(answer)


async def detokenize(request: web.Request, state: ServerState) -> web.Response:
    body = await read_json_object(request)
    _, tokenizer, _ = state.require_serving()
    req = _validate(Detokenize, body)
    _check_model(req.model, state)
    vocab_size = tokenizer.vocab_size
    for i, token_id in enumerate(req.tokens):
        if not 0 <= token_id < vocab_size:
            raise bad_request(
                f"token id {token_id} is outside this model's vocabulary of {vocab_size}",
                f"tokens[{i}]",
            )
    return web.json_response({"prompt": tokenizer.decode(req.tokens, skip_special_tokens=False)})


def engine_version() -> str:
    try:
        return metadata.version("pagekeeper")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "0.0.0+unknown"


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": engine_version()})
