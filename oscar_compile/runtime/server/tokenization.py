"""vLLM's tokenizer routes at the server root: ``POST /tokenize``, ``POST /detokenize``,
``GET /tokenizer_info``, in vLLM's request and response shapes, and the chat-template
rendering they share with ``/v1/chat/completions``.

lm-eval's ``tokenizer_backend=remote`` (and ``auto``, which probes for them) tokenizes through
these routes, so they must tokenize exactly as generation does: the same tokenizer, the same chat
template (``--chat-template`` or the model's). vLLM serves ``/tokenizer_info`` only behind a flag;
it is served by default here (it tells nothing the model directory does not).
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import Field

from oscar_compile.runtime.core.sampling_params import RequestError
from oscar_compile.runtime.server.protocol import ChatMessage, _Strict, check_chat_template_kwargs
from oscar_compile.runtime.server.tool_protocol import Tool, template_tools


class TokenizeRequest(_Strict):
    """vLLM's two tokenize bodies in one: ``prompt`` (``add_special_tokens`` defaults to true) or
    ``messages`` rendered through the chat template (``add_generation_prompt`` defaults to true,
    ``add_special_tokens`` to false, as for a chat completion)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None  # vLLM's: rendered into the messages' prompt, as a chat request's are

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise RequestError("prompt" if self.prompt is None else "messages",
                               "give either prompt or messages")
        for index, message in enumerate(self.messages or []):
            message.check(index)
        if self.add_generation_prompt and self.continue_final_message and self.messages is not None:
            raise RequestError("continue_final_message", "continue_final_message and add_generation_prompt "
                               "cannot both be true")
        check_chat_template_kwargs(self.chat_template_kwargs)


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


def render_chat(tokenizer, messages: list[ChatMessage], chat_template: str | None,
                template_kwargs: dict[str, Any] | None, add_generation_prompt: bool = True,
                continue_final_message: bool = False, add_special_tokens: bool = False,
                tools: list[dict[str, Any]] | None = None) -> list[int]:
    """The token ids of ``messages`` rendered through ``chat_template`` (None: the tokenizer's),
    with ``tools`` (OpenAI tool objects) in the template's ``tools`` variable."""
    from jinja2.exceptions import TemplateError

    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise RequestError("messages", "this model's tokenizer has no chat template (start the server "
                           "with --chat-template FILE)")
    try:
        text = tokenizer.apply_chat_template(
            [m.as_template_dict() for m in messages], chat_template=chat_template, tokenize=False,
            add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
            tools=tools, **(template_kwargs or {}))
    except TemplateError as err:  # templates raise on what they refuse, e.g. a misplaced system message
        raise RequestError("messages", f"the model's chat template refused the messages: {err}") from None
    except ValueError as err:  # transformers: e.g. continue_final_message on a non-assistant turn
        raise RequestError("messages", f"the messages cannot be rendered: {err}") from None
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def tokenize(tokenizer, req: TokenizeRequest, chat_template: str | None, max_model_len: int) -> dict[str, Any]:
    """vLLM's ``/tokenize`` response: ``{count, max_model_len, tokens, token_strs}``."""
    if req.messages is not None:
        add_special = bool(req.add_special_tokens)
        ids = render_chat(tokenizer, req.messages, chat_template, req.chat_template_kwargs,
                          req.add_generation_prompt, req.continue_final_message, add_special,
                          template_tools(req.tools))
    else:
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = list(tokenizer.encode(req.prompt, add_special_tokens=add_special))
    strs = tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(tokenizer, req: DetokenizeRequest, vocab_size: int) -> dict[str, str]:
    """vLLM's ``/detokenize`` response: ``{prompt}``; ids outside the vocabulary are a 400."""
    for index, token in enumerate(req.tokens):
        if not 0 <= token < vocab_size:
            raise RequestError(f"tokens.{index}", f"tokens.{index}: {token} is not a token id in [0, {vocab_size})")
    return {"prompt": tokenizer.decode(req.tokens)}


def tokenizer_info(tokenizer, chat_template: str | None) -> dict[str, Any]:
    """vLLM's ``/tokenizer_info``: the tokenizer's init settings that JSON can carry (special
    tokens as strings), ``tokenizer_class``, and the chat template the server renders with."""
    info: dict[str, Any] = {}
    for key, value in getattr(tokenizer, "init_kwargs", {}).items():
        value = _jsonable(value)
        if value is not _SKIP:
            info[key] = value
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        info[name] = getattr(tokenizer, name, None)
    info["tokenizer_class"] = type(tokenizer).__name__
    info["chat_template"] = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    return info


_SKIP = object()


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else _SKIP
    if hasattr(value, "content") and isinstance(value.content, str):  # tokenizers.AddedToken
        return value.content
    if isinstance(value, (list, tuple)):
        items = [_jsonable(v) for v in value]
        return _SKIP if any(v is _SKIP for v in items) else items
    return _SKIP
