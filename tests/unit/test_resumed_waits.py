"""Which calls a resume re-executes without recording their start again
(yuxi.runtime.executor.resumed_waits): the wait calls its interrupts name,
never a call that acts after an approval."""

from __future__ import annotations

from langgraph.types import Interrupt

from yuxi.runtime.executor import resumed_waits


def test_only_wait_interrupts_that_name_their_call():
    interrupts = [
        # An approval names its call too, but the call acts once approved:
        # its start keeps the cancel check.
        Interrupt(value={"kind": "approval", "call_id": "act", "tool": "add_note"}, id="1"),
        Interrupt(value={"kind": "questions", "questions": []}, id="2"),
        Interrupt(value={"kind": "inputs", "targets": [], "call_id": "w1"}, id="3"),
        Interrupt(value={"kind": "sessions", "targets": [], "call_id": "w2"}, id="4"),
        # Saved before interrupts named their call: started again, as new.
        Interrupt(value={"kind": "inputs", "targets": []}, id="5"),
    ]
    assert resumed_waits(interrupts) == ["w1", "w2"]
