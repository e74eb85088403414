"""Structured output and tool calls: `response_format` (chat, completions, the Celery task),
`tools`, `tool_choice`, `parallel_tool_calls` (chat and the Celery task with `messages`).

A request's JSON schema becomes a grammar in its GenSpec (`{"json_schema": ...}`), which rank 0
turns into a token mask with llguidance (worker/grammar.py). Tools reach the model through its
chat template when the template renders `tools`; otherwise (SmolLM2's template does not) their
descriptions go in a system message, as vLLM does for such templates. A forced call
(`tool_choice` "required" or a named function) is constrained to the functions' parameter
schemas (followed exactly for a function with `strict: true`, core/grammar.py), so it always
parses; with "auto" (unconstrained, strict or not) the model may answer in text or call a tool by writing
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, which is parsed out of its text.

The answer is read the same way whole or as it streams (ToolMode.scan): a call's `arguments` is
the model's own text of its arguments object, so streamed argument pieces add up to it, and text
whose meaning depends on what follows (a marker's first characters) is held back until decided.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from celerytp.core.grammar import check_grammar, strict_schema
from celerytp.core.secrets import clipped
from celerytp.core.validation import bad_request

TOOL_PROMPT = (
    "You may call the functions below. To call one, answer with only\n"
    '<tool_call>{{"name": <function name>, "arguments": <JSON object of its arguments>}}</tool_call>\n'
    "Functions:\n{tools}"
)
ANY_OBJECT = {"type": "object"}


def check_schema(schema: Any, field: str, strict: bool = False) -> None:
    """Refuse (400 naming `field`) a JSON schema llguidance cannot compile; `strict`, also one with
    a keyword the grammar cannot enforce (core/grammar.py)."""
    if not isinstance(schema, dict):
        raise bad_request(field, "a JSON schema object is required")
    problem = check_grammar(schema_grammar(schema, strict))
    if problem:
        raise bad_request(field, f"not a usable JSON schema: {problem[:300]}")


def schema_grammar(schema: dict[str, Any], strict: bool) -> dict[str, Any]:
    """The GenSpec grammar of a JSON schema: strict, followed exactly (core/grammar.py)."""
    return {"json_schema": schema, "strict": True} if strict else {"json_schema": schema}


MARKER = "<tool_call>"
COMMITTED, UNDECIDED, REJECTED = "committed", "undecided", "rejected"


@dataclass
class Scan:
    """What the model's text says so far: decided content, and the calls (name, arguments text so
    far) it has committed to. As the text grows, both only grow: a stream sends the differences."""

    content: str
    calls: list[tuple[str, str]]


@dataclass
class ToolMode:
    """How a chat request's answer becomes tool calls: `forced` None (auto), "required" or a name.
    A call's `arguments` is the model's own text of its arguments object, so a stream of its pieces
    adds up to the non-streamed answer."""

    tools: list[dict[str, Any]]
    forced: str | None
    parallel: bool

    def answer(self, text: str) -> tuple[str | None, list[dict[str, Any]] | None]:
        """The message's `content` and OpenAI's `tool_calls` (None when it answered in text)."""
        scan = self.scan(text, final=True)
        if not scan.calls:
            return text, None
        return scan.content or None, [{"id": call_id(), "type": "function",
                                        "function": {"name": name, "arguments": args}} for name, args in scan.calls]

    def calls(self, text: str) -> list[dict[str, Any]] | None:
        return self.answer(text)[1]

    def scan(self, text: str, final: bool) -> Scan:
        """`text` so far read as content and calls; text whose meaning depends on what follows
        (the start of a marker, a JSON answer not yet known to be a call) is held back unless `final`."""
        names = {tool["function"]["name"] for tool in self.tools}
        if self.forced not in (None, "required"):
            return Scan("", [(self.forced, text)])  # the grammar makes the whole answer its arguments
        start = _skip_space(text, 0)
        if self.forced == "required" or text[start:start + 1] in ("{", "["):
            calls, state = _calls_at(text, start, names, self.parallel)
            if state == COMMITTED or (state == UNDECIDED and not final):
                return Scan("", calls)
            if self.forced == "required":
                return Scan(text, [])
            return self._scan_markers(text, start + 1, names, final)
        if start == len(text) and not final:
            return Scan("", [])  # only whitespace yet: it may precede a JSON call
        return self._scan_markers(text, 0, names, final)

    def _scan_markers(self, text: str, search: int, names: set[str], final: bool) -> Scan:
        """Content up to the first `<tool_call>` block that names a known function, then the calls."""
        end = len(text)
        while (found := text.find(MARKER, search)) >= 0:
            _, state, _ = _call(text, found + len(MARKER), names)
            if state == COMMITTED:
                return Scan(text[:found].rstrip(), self._marked_calls(text, found, names))
            if state == UNDECIDED and not final:
                end = found
                break
            search = found + len(MARKER)  # not a call: its text is content
        else:
            if not final:
                end -= _marker_prefix(text)
        content = text[:end]
        return Scan(content if final else content.rstrip(), [])  # trailing space waits: it may precede a call

    def _marked_calls(self, text: str, found: int, names: set[str]) -> list[tuple[str, str]]:
        """Every committed `<tool_call>` block from the one at `found` (just that one unless parallel)."""
        out: list[tuple[str, str]] = []
        while found >= 0:
            calls, state, end = _call(text, found + len(MARKER), names)
            out += calls
            if state == UNDECIDED or (calls and (end is None or not self.parallel)):
                break
            found = text.find(MARKER, end or found + len(MARKER))
        return out


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def finish(reason: str, called: bool) -> str:
    """A choice's finish_reason: "tool_calls" for an answer of calls that ended by itself (not cut
    by max_tokens or cancelled)."""
    return "tool_calls" if called and reason == "stop" else reason


class CallStream:
    """Chat chunk deltas of a streamed answer with tools, as OpenAI sends them: content as it is
    decided, then per call a first delta `{index, id, type, function: {name, arguments: ""}}` and
    argument pieces `{index, function: {arguments}}` after it."""

    def __init__(self, mode: ToolMode):
        self.mode = mode
        self.text = ""
        self.sent_content = ""
        self.sent_args: list[str] = []

    @property
    def called(self) -> bool:
        return bool(self.sent_args)

    def feed(self, piece: str, final: bool = False) -> dict[str, Any]:
        """The delta for the answer's next `piece` of text (`final`: the answer ended)."""
        self.text += piece
        scan = self.mode.scan(self.text, final)
        delta: dict[str, Any] = {}
        if len(scan.content) > len(self.sent_content):
            delta["content"] = scan.content[len(self.sent_content):]
            self.sent_content = scan.content
        entries = []
        for index, (name, args) in enumerate(scan.calls):
            if index == len(self.sent_args):  # a new call: its first delta names it (all of it at the end)
                self.sent_args.append(args if final else "")
                entries.append({"index": index, "id": call_id(), "type": "function",
                                "function": {"name": name, "arguments": self.sent_args[index]}})
            elif len(args) > len(self.sent_args[index]):
                entries.append({"index": index, "function": {"arguments": args[len(self.sent_args[index]):]}})
                self.sent_args[index] = args
        if entries:
            delta["tool_calls"] = entries
        return delta


# ---- a JSON reader for calls that may still be arriving ------------------------------------


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _marker_prefix(text: str) -> int:
    """How many characters at the end of `text` could begin a marker."""
    return next((n for n in range(len(MARKER) - 1, 0, -1) if text.endswith(MARKER[:n])), 0)


def _string_end(text: str, i: int) -> int | None:
    """The index after the JSON string starting at `text[i]` (a quote); None if it has not ended."""
    i += 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
        elif text[i] == '"':
            return i + 1
        else:
            i += 1
    return None


def _value_end(text: str, i: int) -> int | None:
    """The index after the JSON value starting at `text[i]`; None if it has not ended."""
    if text[i] == '"':
        return _string_end(text, i)
    if text[i] not in "{[":
        while i < len(text) and text[i] not in ",}] \t\r\n":
            i += 1
        return i if i < len(text) else None
    depth = 0
    while i < len(text):
        if text[i] == '"':
            end = _string_end(text, i)
            if end is None:
                return None
            i = end
            continue
        depth += 1 if text[i] in "{[" else -1 if text[i] in "}]" else 0
        i += 1
        if depth == 0:
            return i
    return None


def _call(text: str, i: int, names: set[str]) -> tuple[list[tuple[str, str]], str, int | None]:
    """The call object `{"name": ..., "arguments": {...}}` at `text[i]` (after space): the call,
    once its name is a known function and its arguments object has begun; whether it is one; the
    index after it (None until it has ended)."""
    i = _skip_space(text, i)
    if i == len(text):
        return [], UNDECIDED, None
    if text[i] != "{":
        return [], REJECTED, None
    name, args = None, None
    i = _skip_space(text, i + 1)
    while i < len(text):  # one `"key": value` a round
        if text[i] == "}":
            return ([(name, args)], COMMITTED, i + 1) if name and args else ([], REJECTED, i + 1)
        if text[i] == ",":
            i = _skip_space(text, i + 1)
            if i == len(text):
                break
        if text[i] != '"':
            return [], REJECTED, None
        key_end = _string_end(text, i)
        colon = _skip_space(text, key_end or len(text))
        value = _skip_space(text, colon + 1)
        if value >= len(text):
            break
        if text[colon] != ":":
            return [], REJECTED, None
        end = _value_end(text, value)
        key = _loads(text[i:key_end])
        if key == "arguments":
            if text[value] != "{":
                return [], REJECTED, None
            args = text[value:end or len(text)]
        elif key == "name" and end is not None:
            name = _loads(text[value:end])
            if not isinstance(name, str) or name not in names:
                return [], REJECTED, None
        if end is None:
            break
        i = _skip_space(text, end)
    return ([(name, args)], COMMITTED, None) if name and args else ([], UNDECIDED, None)


def _calls_at(text: str, i: int, names: set[str], parallel: bool) -> tuple[list[tuple[str, str]], str]:
    """The call object, or JSON list of call objects, at `text[i]`, and whether it is calls."""
    if text[i:i + 1] != "[":
        calls, state, _ = _call(text, i, names)
        return calls, state
    out: list[tuple[str, str]] = []
    while True:
        calls, state, end = _call(text, i + 1, names)
        if state == REJECTED:
            return (out, COMMITTED) if out else ([], REJECTED)
        out += calls
        if end is None or not parallel:
            break
        i = _skip_space(text, end)
        if text[i:i + 1] != ",":
            break
    return out, COMMITTED if out else UNDECIDED


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or ANY_OBJECT


def _strict(tool: dict[str, Any]) -> bool:
    return tool["function"].get("strict") is True


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
        check_schema(_parameters(tool), f"tools.{i}.function.parameters", _strict(tool))
    names = [tool["function"]["name"] for tool in tools]
    if len(set(names)) != len(names):
        raise bad_request("tools", "function names must be unique")
    if not isinstance(choice, str) and choice is not None:
        choice = choice.function.name
        if choice not in names:
            raise bad_request("tool_choice", f"names a function not in tools: {clipped(choice)!r}; tools: {names}")
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
            strict = fmt.json_schema.strict is True
            check_schema(fmt.json_schema.schema_, "response_format.json_schema.schema", strict)
            options["grammar"] = schema_grammar(fmt.json_schema.schema_, strict)
    if not tools_in_play:
        return None
    mode = ToolMode(tools, None if choice in (None, "auto") else choice, parallel is not False)
    if chat_template is not None and "tools" in chat_template:
        options["tools"] = tools  # the template renders them its own way
    else:
        options["messages"] = with_tool_prompt(options["messages"], tools)
    if mode.forced == "required":
        # a strict function's arguments follow its parameters exactly, the others' as JSON Schema reads them
        call = {"anyOf": [{"type": "object", "properties": {
            "name": {"const": tool["function"]["name"]},
            "arguments": strict_schema(_parameters(tool)) if _strict(tool) else _parameters(tool)},
            "required": ["name", "arguments"], "additionalProperties": False} for tool in tools]}
        array = {"type": "array", "items": call, "minItems": 1, **({} if mode.parallel else {"maxItems": 1})}
        options["grammar"] = schema_grammar(array, all(_strict(tool) for tool in tools))
    elif mode.forced is not None:
        tool = next(t for t in tools if t["function"]["name"] == mode.forced)
        options["grammar"] = schema_grammar(_parameters(tool), _strict(tool))
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


def grammar_field(mode: ToolMode | None, options: dict[str, Any]) -> str | None:
    """The request field a request's grammar came from (an error about it names that field, not the
    wire's `grammar`): `tools` for a forced call, else `response_format`; None without a grammar."""
    if "grammar" not in options:
        return None
    return "tools" if mode is not None and mode.forced is not None else "response_format"


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
