"""A `gated/<name>` model for in-process tests: the replay model, except that
each call announces itself and waits for the test to open its gate. It
replaces only the model, so a test can commit facts at an exact point of a
turn (during a model call) without sleeping."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from yuxi.runtime import models
from yuxi.runtime.replay import ReplayChatModel


class Gate:
    def __init__(self) -> None:
        self.calls: asyncio.Queue[int] = asyncio.Queue()
        self.opened = asyncio.Event()
        self.count = 0

    def pass_waiting(self) -> None:
        """Let the calls waiting now go on; later calls wait again (the
        waiters are woken by set(), clear() only closes it for new ones)."""
        self.opened.set()
        self.opened.clear()


GATE = Gate()


class GatedReplay(ReplayChatModel):
    async def _agenerate(self, messages, stop=None, run_manager=None, **kwargs: Any):
        GATE.count += 1
        GATE.calls.put_nowait(GATE.count)
        await GATE.opened.wait()
        return await super()._agenerate(messages, stop, run_manager, **kwargs)


def _build(name: str, config: dict, *, approval_mode: str, session: dict):
    return GatedReplay(script=config.get("replay") or {}, model_name=name,
                       approval_mode=approval_mode, session=session)


@contextlib.contextmanager
def gated_model():
    """Register the `gated` provider with a fresh, closed gate."""
    global GATE
    GATE = Gate()
    models.PROVIDERS["gated"] = _build
    try:
        yield GATE
    finally:
        GATE.opened.set()
        models.PROVIDERS.pop("gated", None)


async def start_run(pool, checkpoint_pool, scope, config, content="go"):
    """A new session of `config`, an input, and its first run executing in a
    task (the test opens the gate when it is ready)."""
    from tests.integration.helpers import executor, new_session, runs_with_status
    from yuxi.services import sessions

    session = await new_session(pool, scope, config)
    receipt = await sessions.receive_input(pool, scope, session.id, content=content)
    (run_id,) = await runs_with_status(pool, "ready")
    task = asyncio.create_task(executor(pool, checkpoint_pool).execute(run_id))
    return session, receipt, task
