"""The ask_user tool and the validation of the user's answers.

`ask_user(questions)` takes 1-5 questions, each `{id?, question, options?,
multi_select?, allow_other?}` (no options: free text). The run suspends with
the turn `waiting_user` until `POST /api/turns/{id}/answer` brings complete
answers; the tool then returns them.
"""

from __future__ import annotations

from typing import Any

from langgraph.types import interrupt

from yuxi.runtime.tools import Tool, ToolContext, ToolError, register

MAX_QUESTIONS = 5


def normalize_questions(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not 1 <= len(raw) <= MAX_QUESTIONS:
        raise ToolError("invalid_arguments", f"questions must be a list of 1 to {MAX_QUESTIONS}")
    out = []
    for index, q in enumerate(raw):
        if isinstance(q, str):
            q = {"question": q}
        if not isinstance(q, dict) or not isinstance(q.get("question"), str) \
                or not q["question"].strip():
            raise ToolError("invalid_arguments", f"questions[{index}] needs a question text")
        options = q.get("options") or []
        if not isinstance(options, list) or not all(isinstance(o, str) for o in options):
            raise ToolError("invalid_arguments", f"questions[{index}].options must be strings")
        out.append({"id": str(q.get("id") or f"q{index + 1}"), "question": q["question"],
                    "options": options, "multi_select": bool(q.get("multi_select")),
                    "allow_other": bool(q.get("allow_other", not options))})
    if len({q["id"] for q in out}) != len(out):
        raise ToolError("invalid_arguments", "question ids must be unique")
    return out


def answer_errors(questions: list[dict[str, Any]], answers: Any) -> list[dict[str, str]]:
    """What is missing or wrong in `answers` ({question id: value or [values]})."""
    if not isinstance(answers, dict):
        return [{"field": "answers", "message": "must be an object of answers by question id"}]
    errors = []
    for q in questions:
        value = answers.get(q["id"])
        field = f"answers.{q['id']}"
        if value is None or value == "" or value == []:
            errors.append({"field": field, "message": f"missing answer to: {q['question']}"})
            continue
        values = value if isinstance(value, list) else [value]
        if isinstance(value, list) and not q["multi_select"]:
            errors.append({"field": field, "message": "takes one answer"})
        elif not all(isinstance(v, str) and v.strip() for v in values):
            errors.append({"field": field, "message": "answers are non-empty strings"})
        elif q["options"] and not q["allow_other"] and any(v not in q["options"] for v in values):
            errors.append({"field": field, "message": f"must be one of {q['options']}"})
    unknown = set(answers) - {q["id"] for q in questions}
    errors += [{"field": f"answers.{u}", "message": "no such question"} for u in sorted(unknown)]
    return errors


async def ask_user(ctx: ToolContext, args: dict[str, Any]) -> Any:
    questions = normalize_questions(args.get("questions"))
    answers = interrupt({"kind": "questions", "questions": questions})
    return {"answers": answers}


ASK_USER_SCHEMA = {
    "properties": {"questions": {
        "type": "array", "minItems": 1, "maxItems": MAX_QUESTIONS,
        "items": {"type": "object",
                  "properties": {"id": {"type": "string"}, "question": {"type": "string"},
                                 "options": {"type": "array", "items": {"type": "string"}},
                                 "multi_select": {"type": "boolean"},
                                 "allow_other": {"type": "boolean"}},
                  "required": ["question"]}}},
    "required": ["questions"],
}
register("ask_user", Tool(ask_user, schema=ASK_USER_SCHEMA,
                          description="Ask the user 1 to 5 questions (with options or free "
                                      "text) and wait for the answers."))
