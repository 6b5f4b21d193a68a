"""The replay model answers from its script and the messages alone."""

import re
import time

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage

from yuxi.runtime.replay import (
    ReplayChatModel,
    ReplayScriptError,
    ReplayTemplateError,
    validate_script,
)

SESSION = {
    "id": "s-1",
    "name": "main",
    "path": "/main",
    "parent_id": None,
    "tree_id": "t-1",
}


def turn_start(text, id):
    """A HumanMessage marked as opening a turn, the way the runtime marks it."""
    return HumanMessage(text, id=id, additional_kwargs={"yuxi": {"turn_start": True}})


def model(script, **fields):
    return ReplayChatModel(script=script, **fields)


SAY = {"say": "x"}


def default(*steps):
    """A script made of a default step list only."""
    return {"default": list(steps)}


def call(*tools, **args):
    """A call step invoking each of ``tools`` with ``args``."""
    return {"call": [{"tool": tool, "args": args} for tool in tools]}


def tool_result(content, call_id="c"):
    return ToolMessage(content, tool_call_id=call_id)


# --- step progression --------------------------------------------------------


async def test_steps_advance_with_each_ai_message_of_the_turn():
    m = model(default(call("ls"), call("cat"), {"say": "done"}))
    history = [SystemMessage("sys"), HumanMessage("go", id="h1")]
    first = await m.ainvoke(history)
    assert first.content == "" and first.tool_calls[0]["name"] == "ls"
    history += [first, tool_result("a", first.tool_calls[0]["id"])]
    second = await m.ainvoke(history)
    assert second.tool_calls[0]["name"] == "cat"
    history += [second, tool_result("b", second.tool_calls[0]["id"])]
    third = await m.ainvoke(history)
    assert third.content == "done" and third.tool_calls == []
    assert third.response_metadata["replay_step"] == 2


def test_earlier_turns_are_ignored():
    m = model(default({"say": "one"}, {"say": "two"}))
    history = [
        turn_start("first", "h1"),
        AIMessage("one"),
        AIMessage("two"),
        turn_start("second", "h2"),
    ]
    assert m.invoke(history).content == "one"
    assert m.invoke([*history, AIMessage("one")]).content == "two"


def test_unmarked_conversation_starts_at_first_human_message():
    m = model(default({"say": "one"}, {"say": "two"}))
    history = [HumanMessage("a"), AIMessage("x"), HumanMessage("b")]
    assert m.invoke(history).content == "two"


def test_past_last_step_repeats_last_say():
    m = model(default({"say": "early"}, {"say": "final"}, call("ls")))
    history = [HumanMessage("go")] + [AIMessage("x")] * 5
    reply = m.invoke(history)
    assert reply.content == "final"
    assert reply.tool_calls == []


def test_past_last_step_without_say_is_empty():
    m = model(default(call("ls")))
    reply = m.invoke([HumanMessage("go"), AIMessage("x")])
    assert reply.content == "" and reply.tool_calls == []


def test_missing_default_says_nothing():
    reply = model({}).invoke([HumanMessage("hi")])
    assert reply.content == "" and reply.tool_calls == []


def test_no_human_message_is_an_error():
    with pytest.raises(ValueError, match="no HumanMessage"):
        model({}).invoke([SystemMessage("sys")])


# --- rule matching -----------------------------------------------------------


RULES = {
    "rules": [
        {"match": r"^weather\b", "steps": [{"say": "sunny"}]},
        {"match": "weather|rain", "steps": [{"say": "maybe rain"}]},
    ],
    "default": [{"say": "no idea"}],
}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("weather today?", "sunny"),  # first matching rule wins
        ("what is the weather?", "maybe rain"),  # re.search, not re.match
        ("hello", "no idea"),
    ],
)
def test_first_matching_rule_else_default(text, expected):
    assert model(RULES).invoke([HumanMessage(text)]).content == expected


def test_rule_is_chosen_by_the_turn_input_not_later_steers():
    m = model(RULES)
    history = [turn_start("hello", "h1"), AIMessage("x"), HumanMessage("weather")]
    assert m.invoke(history).content == "no idea"


# --- template variables ------------------------------------------------------


def test_input_session_model_and_approval_mode():
    template = "{{ input }}|{{ session.path }}|{{ model }}|{{ approval_mode }}"
    m = model(
        default({"say": template}),
        model_name="replay/smart",
        approval_mode="manual",
        session=SESSION,
    )
    assert m.invoke([HumanMessage("hey")]).content == "hey|/main|replay/smart|manual"


def test_inputs_include_steers():
    m = model(default(SAY, {"say": "{{ inputs | join(',') }}"}))
    history = [
        turn_start("old", "h0"),
        AIMessage("x"),
        turn_start("start", "h1"),
        AIMessage("x"),
        HumanMessage("steer"),
    ]
    assert m.invoke(history).content == "start,steer"


def test_input_takes_text_blocks_of_list_content():
    m = model(default({"say": "{{ input }}"}))
    content = [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}]
    assert m.invoke([HumanMessage(content)]).content == "hello world"


def test_results_are_json_decoded_and_last_is_the_latest():
    template = "{{ results[0].n + 1 }} {{ results[1] }} {{ last }}"
    m = model(default(SAY, {"say": template}))
    history = [
        HumanMessage("go"),
        AIMessage("x"),
        tool_result('{"n": 41}'),
        tool_result("plain text"),
        tool_result("[1, 2]"),
    ]
    assert m.invoke(history).content == "42 plain text [1, 2]"


def test_last_is_none_without_results():
    m = model(default({"say": "{{ last is none }} {{ results | length }}"}))
    assert m.invoke([HumanMessage("go")]).content == "True 0"


def test_args_are_rendered_recursively_and_non_strings_pass_through():
    nested = {"list": ["{{ input }}!", None, 1.5]}
    m = model(default({
        "call": [
            {"tool": "a", "args": {"q": "{{ input }}", "n": 3, "flag": True}},
            {"tool": "b", "args": {"nested": nested}},
        ]
    }))
    calls = m.invoke([HumanMessage("hi")]).tool_calls
    assert calls[0]["args"] == {"q": "hi", "n": 3, "flag": True}
    assert calls[1]["args"] == {"nested": {"list": ["hi!", None, 1.5]}}
    assert [c["type"] for c in calls] == ["tool_call", "tool_call"]


def test_plain_text_renders_unchanged():
    text = "line one\nline two\n"
    reply = model(default({"say": text})).invoke([HumanMessage("x")])
    assert reply.content == text


# --- ids ---------------------------------------------------------------------


def test_ids_are_stable_across_reexecution():
    script = default(call("a", "b"))
    history = [turn_start("go", "h1")]
    first = model(script).invoke(history)
    again = model(script).invoke(history)
    assert first.id == again.id
    assert first.id.startswith("ai-") and first.id.endswith("-0")
    ids = [c["id"] for c in first.tool_calls]
    assert ids == [c["id"] for c in again.tool_calls]
    assert ids[0].endswith("-0-0") and ids[1].endswith("-0-1")


def test_ids_differ_between_turns():
    m = model(default(call("a")))
    first = m.invoke([turn_start("go", "h1")])
    second = m.invoke(
        [turn_start("go", "h1"), first, tool_result("r"), turn_start("go", "h2")]
    )
    assert first.id != second.id
    assert first.tool_calls[0]["id"] != second.tool_calls[0]["id"]


def test_ids_without_message_ids_depend_on_text_and_position():
    m = model(default(SAY))
    assert m.invoke([HumanMessage("a")]).id == m.invoke([HumanMessage("a")]).id
    assert m.invoke([HumanMessage("a")]).id != m.invoke([HumanMessage("b")]).id


def test_response_metadata():
    reply = model({}, model_name="replay/x").invoke([HumanMessage("a")])
    assert reply.response_metadata["model_name"] == "replay/x"
    assert reply.response_metadata["replay_step"] == 0


# --- errors ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("template", "error"),
    [
        ("{{ nope }}", "'nope' is undefined"),
        ("{% if %}", "TemplateSyntaxError"),
        ("{{ input.__class__.__mro__ }}", "unsafe"),  # the sandbox refuses
    ],
)
def test_template_errors(template, error):
    m = model(default({"say": template}))
    with pytest.raises(ReplayTemplateError, match=error) as info:
        m.invoke([HumanMessage("x")])
    assert "default[0].say" in str(info.value)


def test_template_error_in_args_names_the_path():
    m = model(default(call("a", p=["{{ session.path }}"])))
    with pytest.raises(ReplayTemplateError, match=re.escape("call[0].args.p[0]")):
        m.invoke([HumanMessage("x")])


@pytest.mark.parametrize(
    ("script", "error"),
    [
        ([], "script: expected an object"),
        ({"defaults": []}, "script: unknown key 'defaults'"),
        ({"rules": {}}, "rules: expected a list"),
        ({"rules": [{"steps": [SAY]}]}, "rules[0].match: expected a string"),
        ({"rules": [{"match": "(", "steps": [SAY]}]}, "rules[0].match: invalid regex"),
        ({"rules": [{"match": "a", "steps": []}]}, "rules[0].steps: expected a non"),
        (
            {"rules": [{"match": "a", "steps": [SAY, {"say": "y", "foo": 1}]}]},
            "rules[0].steps[1]: unknown key 'foo'",
        ),
        (default(), "default: expected a non-empty"),
        (default("hi"), "default[0]: expected an object"),
        (default({}), "default[0]: needs exactly one of"),
        (default({**SAY, **call("a")}), "default[0]: needs exactly one of"),
        (default({"say": 1}), "default[0].say: expected a string"),
        (default({"call": []}), "default[0].call: expected a non-empty"),
        (default({"call": [{"args": {}}]}), "call[0].tool: expected a non-empty"),
        (default({"call": [{"tool": "a", "args": []}]}), "call[0].args: expected an"),
        (default({**SAY, "delay_ms": -1}), "delay_ms: expected a non-negative"),
        (default({**SAY, "delay_ms": True}), "delay_ms: expected a non-negative"),
    ],
)
def test_invalid_scripts_are_refused_at_construction(script, error):
    with pytest.raises(ReplayScriptError, match=re.escape(error)):
        validate_script(script)
    with pytest.raises(ReplayScriptError, match=re.escape(error)):
        ReplayChatModel(script=script)


def test_valid_script_passes():
    validate_script(RULES)
    # "args" may be left out; a zero delay is no delay.
    validate_script(default({"call": [{"tool": "a"}], "delay_ms": 0}))


# --- delays and tools ---------------------------------------------------------


async def test_delay_async():
    m = model(default({**SAY, "delay_ms": 50}))
    started = time.monotonic()
    await m.ainvoke([HumanMessage("x")])
    assert time.monotonic() - started >= 0.05


def test_delay_sync():
    m = model(default({**SAY, "delay_ms": 50}))
    started = time.monotonic()
    m.invoke([HumanMessage("x")])
    assert time.monotonic() - started >= 0.05


def test_bind_tools_returns_the_model():
    m = model({})
    assert m.bind_tools([{"name": "t", "description": "d", "parameters": {}}]) is m


async def test_callbacks_get_the_model_without_its_script():
    # LangChain hands callbacks `_serialized` at every call; its default
    # (dumpd) writes the model out through repr, the script included, for
    # each run's new model. Ours names the class only, and callbacks still
    # see each call.
    from langchain_core.callbacks import AsyncCallbackHandler

    seen: list[dict] = []

    class Seen(AsyncCallbackHandler):
        async def on_chat_model_start(self, serialized, messages, **kwargs):
            seen.append(serialized)

    secret_rule = "a rule nobody should see in a trace " * 20
    model = ReplayChatModel(script={"rules": [{"match": "^zz", "steps": [
        {"say": secret_rule}]}], "default": [{"say": "hi"}]})
    await model.ainvoke([HumanMessage("q")], {"callbacks": [Seen()]})
    assert len(seen) == 1 and seen[0]["id"][-1] == "ReplayChatModel"
    assert "nobody should see" not in str(seen[0])
    # The negative: LangChain's own form holds the script.
    from langchain_core.load import dumpd

    assert "nobody should see" in str(dumpd(model))
