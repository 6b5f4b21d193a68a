"""One model call: streamed, bounded in time, retried when the provider's
failure is transient, abortable in flight.

- Deltas of the text go to `on_delta(message_id, text)` as they arrive (they
  are ephemeral: the durable `message` event holds the whole answer).
- 408, 409, 429, 5xx, connection errors, broken streams and timeouts are
  retried with exponential backoff (honouring `Retry-After`) up to
  `CallPolicy.max_attempts`; a stream that broke mid-answer is never an
  answer: the next attempt starts from scratch and only its deltas make the
  final message.
- Any other status (400, 401, 403, 404, ...) fails at once with
  `ProviderError` ("provider_error: 401 invalid api key (provider x)").
"""

from __future__ import annotations

import asyncio
import logging
import random
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import msgspec
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage

from yuxi.errors import YuxiError

log = logging.getLogger(__name__)

RETRYABLE_STATUS = frozenset({408, 409, 429})
MAX_RETRY_AFTER = 60.0


class ProviderError(YuxiError):
    """A provider refused a call for good (or a transient failure outlived
    its attempts). The text never holds the key."""

    code = "provider_error"

    def __init__(self, provider: str, status: int | None, message: str) -> None:
        text = f"{status} {message}" if status is not None else message
        super().__init__(f"{text} (provider {provider})")
        self.status = status


class CallPolicy(msgspec.Struct, frozen=True):
    provider: str = "replay"
    max_attempts: int = 4
    backoff_seconds: float = 0.5
    max_backoff_seconds: float = 20.0
    timeout_seconds: float = 300.0
    # Values never to show in an error text (the key).
    secrets: tuple[str, ...] = ()
    # A real provider ends a complete answer with a finish_reason: a stream
    # that ends without one was cut off (retried, never an answer).
    require_finish: bool = False


def _redact(text: str, secrets: Sequence[str]) -> str:
    for secret in secrets:
        if secret:
            text = text.replace(secret, "***")
    return text


def _status_message(exc: Any) -> str:
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"]
        if isinstance(err, str):
            return err
    return str(getattr(exc, "message", None) or exc)


def _retry_after(exc: Any) -> float | None:
    response = getattr(exc, "response", None)
    headers = getattr(response, "headers", None) or {}
    for name, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is None:
            continue
        try:
            seconds = float(value) * scale
        except ValueError:
            continue
        if 0 <= seconds <= MAX_RETRY_AFTER:
            return seconds
    return None


def classify(exc: BaseException) -> tuple[bool, int | None]:
    """(transient?, HTTP status if any) of a failed call."""
    status = getattr(exc, "status_code", None)
    if isinstance(status, int):
        return (status in RETRYABLE_STATUS or status >= 500), status
    if isinstance(exc, TimeoutError | ConnectionError):
        return True, None
    module = type(exc).__module__ or ""
    # openai's APIConnectionError/APITimeoutError, a stream cut mid-answer
    # (httpx transport/protocol errors), an error event inside a stream.
    if module.startswith(("openai", "httpx", "httpcore", "h11")):
        return True, None
    return False, None


def _as_message(full: AIMessageChunk, message_id: str) -> AIMessage:
    return AIMessage(content=full.content, tool_calls=full.tool_calls,
                     invalid_tool_calls=full.invalid_tool_calls, id=message_id,
                     usage_metadata=full.usage_metadata,
                     response_metadata=full.response_metadata,
                     additional_kwargs=full.additional_kwargs)


class BrokenStream(ConnectionError):
    """The stream ended before the answer was complete."""


async def stream_once(model: Any, messages: list[BaseMessage],
                      on_delta: Callable[[str, str], Awaitable[None]] | None,
                      require_finish: bool = False) -> AIMessage:
    full: AIMessageChunk | None = None
    message_id: str | None = None
    async for chunk in model.astream(messages):
        if message_id is None:
            # Fixed for the answer: deltas and the final message share it.
            message_id = chunk.id or f"ai-{uuid.uuid4()}"
        full = chunk if full is None else full + chunk
        text = chunk.text if isinstance(chunk.content, str) else ""
        # (A chunk marked no_delta is a whole answer: the replay model's
        # steps that do not stream.)
        if text and on_delta is not None and not chunk.response_metadata.get("no_delta"):
            await on_delta(message_id, text)
    if full is None:
        raise BrokenStream("the model stream ended without an answer")
    if require_finish and not full.response_metadata.get("finish_reason"):
        raise BrokenStream("the model stream ended mid-answer (no finish_reason)")
    return _as_message(full, message_id or f"ai-{uuid.uuid4()}")


async def call_model(model: Any, messages: list[BaseMessage], policy: CallPolicy,
                     on_delta: Callable[[str, str], Awaitable[None]] | None = None,
                     ) -> AIMessage:
    """The model's answer to `messages`, per the module docstring."""
    attempt = 0
    while True:
        attempt += 1
        try:
            async with asyncio.timeout(policy.timeout_seconds):
                return await stream_once(model, messages, on_delta, policy.require_finish)
        except asyncio.CancelledError:
            raise
        except YuxiError:
            raise
        except Exception as exc:
            transient, status = classify(exc)
            if isinstance(exc, TimeoutError):
                detail = f"timed out after {policy.timeout_seconds:g}s"
            elif status is not None:
                detail = _status_message(exc)
            else:
                detail = f"{type(exc).__name__}: {exc}"
            detail = _redact(detail, policy.secrets)
            if not transient:
                if status is None:
                    raise
                raise ProviderError(policy.provider, status, detail) from None
            if attempt >= policy.max_attempts:
                raise ProviderError(policy.provider, status,
                                    f"{detail} (after {attempt} attempts)") from None
            delay = _retry_after(exc)
            if delay is None:
                delay = min(policy.max_backoff_seconds,
                            policy.backoff_seconds * 2 ** (attempt - 1))
                delay *= 0.5 + random.random() / 2
            log.warning("model call to provider %s failed (%s%s); retry %d in %.2fs",
                        policy.provider, f"{status} " if status else "", detail[:200],
                        attempt, delay)
            await asyncio.sleep(delay)
