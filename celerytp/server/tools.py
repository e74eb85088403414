"""Structured output and tool calls for the chat endpoint: `response_format`, `tools`,
`tool_choice`, `parallel_tool_calls`.

A request's JSON schema becomes a grammar in its GenSpec (`{"json_schema": ...}`), which rank 0
turns into a token mask with llguidance (worker/grammar.py). Tools reach the model through its
chat template when the template renders `tools`; otherwise (SmolLM2's template does not) their
descriptions go in a system message, as vLLM does for such templates. A forced call
(`tool_choice` "required" or a named function) is constrained to the functions' parameter
schemas, so it always parses; with "auto" the model may answer in text or call a tool by writing
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, which is parsed out of its text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from celerytp.core.grammar import check_grammar
from celerytp.core.validation import bad_request

TOOL_PROMPT = (
    "You may call the functions below. To call one, answer with only\n"
    '<tool_call>{{"name": <function name>, "arguments": <JSON object of its arguments>}}</tool_call>\n'
    "Functions:\n{tools}"
)
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
ANY_OBJECT = {"type": "object"}


def check_schema(schema: Any, field: str) -> None:
    """Refuse (400 naming `field`) a JSON schema llguidance cannot compile."""
    if not isinstance(schema, dict):
        raise bad_request(field, "a JSON schema object is required")
    problem = check_grammar({"json_schema": schema})
    if problem:
        raise bad_request(field, f"not a usable JSON schema: {problem[:300]}")


@dataclass
class ToolMode:
    """How a chat request's answer becomes tool calls: `forced` None (auto), "required" or a name."""

    tools: list[dict[str, Any]]
    forced: str | None
    parallel: bool

    def calls(self, text: str) -> list[dict[str, Any]] | None:
        """OpenAI's `tool_calls` from the model's text, or None when it answered in text."""
        names = {tool["function"]["name"] for tool in self.tools}
        found: list[tuple[str, Any]] = []
        if self.forced not in (None, "required"):
            args = _loads(text)
            found = [(self.forced, args)] if isinstance(args, dict) else []
        else:
            items = _loads(text) if self.forced == "required" else None
            if items is None:
                items = [_loads(block) for block in _TOOL_CALL.findall(text)] or [_loads(text.strip())]
            for item in items if isinstance(items, list) else [items]:
                if isinstance(item, dict) and item.get("name") in names and isinstance(item.get("arguments"), dict):
                    found.append((item["name"], item["arguments"]))
        if not found:
            return None
        if not self.parallel:
            found = found[:1]
        return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                 "function": {"name": name, "arguments": json.dumps(args)}} for name, args in found]


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or ANY_OBJECT


def structure(body: Any, options: dict[str, Any], chat_template: str | None) -> ToolMode | None:
    """Check `body`'s response_format/tools/tool_choice/parallel_tool_calls and put what they
    ask for into the leader's `options` (a grammar, the tools in the prompt); the ToolMode that
    parses the answer, or None when no tools are in play. Raises bad_request naming the field."""
    fmt = getattr(body, "response_format", None)
    tools = [tool.model_dump(exclude_none=True) for tool in getattr(body, "tools", None) or []]
    choice = getattr(body, "tool_choice", None)
    parallel = getattr(body, "parallel_tool_calls", None)
    if getattr(body, "tools", None) is not None and not tools:
        raise bad_request("tools", "at least one function is required (omit tools for none)")
    for i, tool in enumerate(tools):
        check_schema(_parameters(tool), f"tools.{i}.function.parameters")
    names = [tool["function"]["name"] for tool in tools]
    if len(set(names)) != len(names):
        raise bad_request("tools", "function names must be unique")
    if not isinstance(choice, str) and choice is not None:
        choice = choice.function.name
        if choice not in names:
            raise bad_request("tool_choice", f"names a function not in tools: {choice!r}; tools: {names}")
    elif choice in ("required",) and not tools:
        raise bad_request("tool_choice", "'required' needs tools")
    if choice == "none" or not tools:
        tools_in_play = False
    else:
        tools_in_play = True
    if fmt is not None and fmt.type != "text":
        if tools_in_play and choice not in (None, "auto"):
            raise bad_request("response_format", "cannot be combined with a forced tool call")
        if fmt.type == "json_object":
            options["grammar"] = {"json_schema": ANY_OBJECT}
        else:
            if fmt.json_schema is None:
                raise bad_request("response_format.json_schema", "required when type is 'json_schema'")
            check_schema(fmt.json_schema.schema_, "response_format.json_schema.schema")
            options["grammar"] = {"json_schema": fmt.json_schema.schema_}
    if not tools_in_play:
        return None
    mode = ToolMode(tools, None if choice in (None, "auto") else choice, parallel is not False)
    if chat_template is not None and "tools" in chat_template:
        options["tools"] = tools  # the template renders them its own way
    else:
        options["messages"] = with_tool_prompt(options["messages"], tools)
    if mode.forced == "required":
        call = {"anyOf": [{"type": "object", "properties": {"name": {"const": tool["function"]["name"]},
                                                            "arguments": _parameters(tool)},
                           "required": ["name", "arguments"], "additionalProperties": False} for tool in tools]}
        array = {"type": "array", "items": call, "minItems": 1, **({} if mode.parallel else {"maxItems": 1})}
        options["grammar"] = {"json_schema": array}
    elif mode.forced is not None:
        options["grammar"] = {"json_schema": _parameters(next(t for t in tools if t["function"]["name"] == mode.forced))}
    return mode


def with_tool_prompt(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat with the tools described in its system message (added first when it has none)."""
    prompt = TOOL_PROMPT.format(tools="\n".join(json.dumps(tool["function"]) for tool in tools))
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{prompt}"}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def history(messages: list[Any]) -> list[dict[str, Any]]:
    """The chat as the template sees it: an assistant's earlier tool calls written as the model
    writes them, so a conversation that carries tool results reads as it happened."""
    out = []
    for message in messages:
        item = message.as_dict()
        calls = getattr(message, "tool_calls", None) or []
        if calls:
            written = [f"<tool_call>{json.dumps({'name': c.function.name, 'arguments': _loads(c.function.arguments)})}"
                       "</tool_call>" for c in calls]
            item["content"] = "\n".join(filter(None, [item["content"], *written]))
        out.append(item)
    return out


def apply(service: Any, model_id: str, body: Any, options: dict[str, Any]) -> ToolMode | None:
    """`structure` for a request to `model_id` (blocking: it may read the model's tokenizer)."""
    messages = getattr(body, "messages", None) or []
    if any(getattr(m, "tool_calls", None) for m in messages):
        options["messages"] = history(messages)
    template = None
    if getattr(body, "tools", None) and getattr(body, "tool_choice", None) != "none":
        from celerytp.core.tokenizer import load_tokenizer

        template = load_tokenizer(service.models()[model_id]["path"]).chat_template
    return structure(body, options, template)
