"""Chat rendering: the built-in renderer equals the shipped jinja template; the rendered
continuation of a reply is a token prefix of the next request and ends on one of its
request starts; the cases real engines got wrong."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from executor.chat import ChatError, ChatRenderer, builtin_template, load_template
from executor.model import random_checkpoint
from executor.tokenizer import default_tokenizer
from tests.executor.qwen_support import small_config

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    },
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {}}}},
]


@pytest.fixture(scope="module")
def tokenizer():
    return default_tokenizer()


@pytest.fixture(scope="module")
def native(tokenizer):
    return ChatRenderer(tokenizer)


@pytest.fixture(scope="module")
def jinja(tokenizer):
    """The built-in template through jinja: a trailing comment makes it another template's text."""
    renderer = ChatRenderer(tokenizer, builtin_template() + "{# rendered by jinja #}")
    assert not renderer.renders_natively
    return renderer


@pytest.fixture(scope="module")
def builtin(tokenizer):
    """What a server with the built-in template (random weights, the tiny model) renders with."""
    renderer = ChatRenderer(tokenizer, builtin_template())
    assert renderer.renders_natively
    return renderer


# ---- strategies -------------------------------------------------------------------

_text = st.lists(
    st.one_of(
        st.text(alphabet=st.characters(blacklist_categories=("Cs", "Cc")), max_size=6),
        st.sampled_from(["\n", " ", "\t", "<think>", "</think>", "{", "}", "中", "😀", "<tool_call>", "\n\n"]),
    ),
    max_size=5,
).map("".join)
_user_text = _text.filter(
    lambda t: not (t.strip().startswith("<tool_response>") and t.strip().endswith("</tool_response>"))
)
_scalar = st.one_of(
    st.text(max_size=8),
    st.integers(-1000, 1000),
    st.floats(allow_nan=False, allow_infinity=False),
    st.booleans(),
    st.none(),
)
_value = st.recursive(
    _scalar,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)),
    max_leaves=6,
)
_arguments = st.dictionaries(st.text(alphabet="abcxyz_", min_size=1, max_size=6), _value, max_size=4)


@st.composite
def _tool_call(draw):
    args = draw(_arguments)
    wire = draw(st.booleans())  # OpenAI wire form: arguments as a JSON string
    function = {
        "name": draw(st.sampled_from(["get_weather", "search", "run_code"])),
        "arguments": json.dumps(args) if wire else args,
    }
    return {"id": "call_1", "type": "function", "function": function}


@st.composite
def _assistant(draw, with_tools: bool):
    message = {"role": "assistant", "content": draw(st.one_of(_text, st.none()))}
    how = draw(st.sampled_from(["none", "field", "inline"]))
    if how == "field":
        message["reasoning_content"] = draw(_text)
    elif how == "inline" and message["content"] is not None:
        message["content"] = f"<think>\n{draw(_text)}\n</think>\n\n{message['content']}"
    if with_tools:
        message["tool_calls"] = draw(st.lists(_tool_call(), min_size=1, max_size=3))
    return message


@st.composite
def conversations(draw):
    messages = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": draw(_text)})
    for _ in range(draw(st.integers(1, 3))):
        messages.append({"role": "user", "content": draw(_user_text)})
        for _ in range(draw(st.integers(0, 2))):
            messages.append(draw(_assistant(True)))
            for _ in range(draw(st.integers(1, 2))):
                messages.append({"role": "tool", "content": draw(_text)})
        messages.append(draw(_assistant(False)))
    tools = draw(st.sampled_from([None, TOOLS]))
    return messages, tools


def _next_request(messages, reply_index, next_user):
    """The messages of the request sent after the reply at reply_index."""
    end = reply_index + 1
    if messages[reply_index].get("tool_calls"):
        while end < len(messages) and messages[end]["role"] == "tool":
            end += 1
        return messages[:end]
    return messages[:end] + [next_user]


# ---- properties ---------------------------------------------------------------------


@settings(max_examples=120, deadline=None)
@given(conv=conversations(), thinking=st.booleans(), generation=st.booleans())
def test_native_equals_jinja_template(native, jinja, builtin, conv, thinking, generation):
    messages, tools = conv
    text = jinja.text(messages, tools, generation, thinking)
    assert native.text(messages, tools, generation, thinking) == text
    assert builtin.text(messages, tools, generation, thinking) == text


@pytest.mark.parametrize(
    "messages",
    [
        [],
        [{"role": "user", "content": "a"}, {"role": "system", "content": "late"}],
        [{"role": "system", "content": "only"}],
        [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
        [{"role": "user", "content": 7}],
    ],
    ids=["no-messages", "late-system", "no-user-query", "unknown-role", "image-part", "int-content"],
)
def test_the_builtin_template_fails_as_jinja_does(native, builtin, jinja, messages):
    """Where the native renderer refuses, the built-in template's renderer gives jinja's error."""
    with pytest.raises(ChatError) as ours:
        builtin.text(messages)
    with pytest.raises(ChatError) as theirs:
        jinja.text(messages)
    with pytest.raises(ChatError) as natives:
        native.text(messages)
    assert str(ours.value) == str(theirs.value)
    assert str(natives.value) != str(theirs.value)  # the native error would read otherwise


@pytest.mark.parametrize("thinking", [True, False, None, 0, 1], ids=["true", "false", "none", "zero", "one"])
def test_the_builtin_template_reads_enable_thinking_as_jinja_does(builtin, jinja, thinking):
    """The template tests `enable_thinking is false`: only False closes the think block."""
    messages = [{"role": "user", "content": "hi"}]
    text = builtin.text(messages, enable_thinking=thinking)
    assert text == jinja.text(messages, enable_thinking=thinking)
    assert text.endswith("<think>\n\n</think>\n\n" if thinking is False else "<think>\n")


@pytest.mark.parametrize("which", ["native", "jinja"])
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(conv=conversations(), data=st.data())
def test_continuation_is_a_prefix_ending_on_a_request_start(native, jinja, which, conv, data):
    native = {"native": native, "jinja": jinja}[which]
    messages, tools = conv
    replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    reply_index = data.draw(st.sampled_from(replies))
    next_user = {"role": "user", "content": data.draw(_user_text)}
    request = _next_request(messages, reply_index, next_user)
    cont = native.render_continuation(messages[:reply_index], messages[reply_index], tools)
    for generation in (True, False):
        full = native.render(request, tools, add_generation_prompt=generation, enable_thinking=data.draw(st.booleans()))
        end = len(cont.token_ids)
        assert full.token_ids[:end] == cont.token_ids
        assert full.text.startswith(cont.text)
        assert end in full.starts
        assert cont.starts == tuple(s for s in full.starts if s < end)
        assert all(s < len(full.token_ids) for s in full.starts)


@pytest.mark.parametrize("which", ["native", "jinja"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(conv=conversations(), data=st.data())
def test_remembered_blocks_give_the_ids_of_the_whole_text(tokenizer, native, jinja, which, conv, data):
    """`encode` tokenizes only blocks it has not seen (the renderers live for the whole
    module, as a server's does): the ids and starts are those of the whole text, for a
    conversation, its continuation and the next request."""
    renderer = {"native": native, "jinja": jinja}[which]
    messages, tools = conv
    replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    reply_index = data.draw(st.sampled_from(replies))
    next_user = {"role": "user", "content": data.draw(_user_text)}
    marker = tokenizer.token_to_id("<|im_start|>")
    for rendered in (renderer.render(messages, tools, enable_thinking=data.draw(st.booleans())),
                     renderer.render_continuation(messages[:reply_index], messages[reply_index], tools),
                     renderer.render(_next_request(messages, reply_index, next_user), tools)):
        ids = tuple(tokenizer.encode(rendered.text, add_special_tokens=False).ids)
        assert rendered.token_ids == ids
        assert rendered.starts == tuple(row for row, t in enumerate(ids) if t == marker)


def test_a_long_history_is_tokenized_once(tokenizer):
    history = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": " the of and" * 1000}]
    renderer = ChatRenderer(tokenizer)
    first = renderer.render(history)
    blocks = renderer._blocks
    assert (blocks.hits, blocks.misses) == (0, 3)
    second = renderer.render([*history, {"role": "assistant", "content": "OK."}, {"role": "user", "content": "More."}])
    assert (blocks.hits, blocks.misses) == (3, 5)  # system, user and the generation prompt were remembered
    assert second.token_ids[: first.starts[-1]] == first.token_ids[: first.starts[-1]]
    assert second.token_ids == tuple(tokenizer.encode(second.text, add_special_tokens=False).ids)


# ---- the cases engines got wrong -------------------------------------------------------


def test_reasoning_is_kept_for_the_current_reply_and_dropped_by_the_next_request(native):
    history = [{"role": "user", "content": "2+2?"}]
    reply = {"role": "assistant", "content": "4", "reasoning_content": "add them"}
    in_flight = native.text([*history, reply], add_generation_prompt=False)
    assert "<think>\nadd them\n</think>\n\n4<|im_end|>" in in_flight
    cont = native.render_continuation(history, reply)
    assert cont.text == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
    nxt = native.render([*history, reply, {"role": "user", "content": "and 3+3?"}])
    assert "add them" not in nxt.text and nxt.token_ids[: len(cont.token_ids)] == cont.token_ids
    # the naive rendering of history + reply is NOT a prefix of the next request
    naive = native.render([*history, reply], add_generation_prompt=False)
    assert nxt.token_ids[: len(naive.token_ids)] != naive.token_ids


def test_tool_call_only_turn_keeps_reasoning_until_the_next_user_query(native):
    history = [{"role": "system", "content": "sys"}, {"role": "user", "content": "weather in Paris?"}]
    reply = {
        "role": "assistant",
        "content": None,
        "reasoning_content": "use the tool",
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
    }
    cont = native.render_continuation(history, reply, TOOLS)
    assert cont.text.endswith(
        "<|im_start|>assistant\n<think>\nuse the tool\n</think>\n\n<tool_call>\n<function=get_weather>\n"
        "<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
    )
    results = [{"role": "tool", "content": "sunny"}, {"role": "tool", "content": "22C"}]
    nxt = native.render([*history, reply, *results], TOOLS)
    assert nxt.token_ids[: len(cont.token_ids)] == cont.token_ids and len(cont.token_ids) in nxt.starts
    assert (
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\n22C\n</tool_response><|im_end|>\n"
        in nxt.text
    )
    later = native.render(
        [*history, reply, *results, {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "thanks"}],
        TOOLS,
    )
    assert "use the tool" not in later.text
    assert "<|im_start|>assistant\n<tool_call>\n<function=get_weather>" in later.text


def test_nested_arguments_keep_their_key_order(native, jinja):
    args = '{"zeta": 1, "alpha": {"y": [1, {"b": 2, "a": 1}], "x": "s"}, "flag": true, "none": null}'
    messages = [
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": "calling",
            "tool_calls": [{"function": {"name": "run_code", "arguments": args}}],
        },
        {"role": "tool", "content": "{}"},
    ]
    text = native.text(messages, TOOLS)
    expected = (
        "calling\n\n<tool_call>\n<function=run_code>\n<parameter=zeta>\n1\n</parameter>\n"
        '<parameter=alpha>\n{"y": [1, {"b": 2, "a": 1}], "x": "s"}\n</parameter>\n'
        "<parameter=flag>\nTrue\n</parameter>\n<parameter=none>\nNone\n</parameter>\n</function>\n</tool_call>"
    )
    assert expected in text
    assert jinja.text(messages, TOOLS) == text
    as_dict = [
        messages[0],
        {**messages[1], "tool_calls": [{"function": {"name": "run_code", "arguments": json.loads(args)}}]},
        messages[2],
    ]
    assert native.text(as_dict, TOOLS) == text


def test_null_arguments_read_as_absent_in_every_renderer(native, jinja, builtin):
    """A tool call with `"arguments": null` renders as one without arguments, natively and
    through a template (whose `|items` would raise on null; a fresh review found the native
    renderer alone accepting it). The API rejects null before rendering; this is the
    library's contract."""
    call = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": None}}]}
    bare = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f"}}]}
    ask = {"role": "user", "content": "hi"}
    expected = native.text([ask, bare])
    assert "<tool_call>\n<function=f>\n</function>\n</tool_call>" in expected
    for renderer in (native, jinja, builtin):
        assert renderer.text([ask, call]) == expected


def test_empty_contents(native, jinja):
    messages = [
        {"role": "system", "content": ""},
        {"role": "user", "content": ""},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "   "},
    ]
    text = native.text(messages, enable_thinking=False)
    assert text == (
        "<|im_start|>system\n<|im_end|>\n<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n<|im_end|>\n"
        "<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert jinja.text(messages, enable_thinking=False) == text
    rendered = native.render(messages)
    assert len(rendered.starts) == 5 and rendered.starts[0] == 0


def test_long_system_prompt(native, jinja):
    system = " ".join(f"rule {i}: be precise." for i in range(1200))
    history = [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]
    reply = {"role": "assistant", "content": "hello", "reasoning_content": "greet"}
    first = native.render(history)
    assert first.starts[1] > 4096
    cont = native.render_continuation(history, reply)
    nxt = native.render([*history, reply, {"role": "user", "content": "bye"}])
    assert nxt.token_ids[: len(cont.token_ids)] == cont.token_ids and len(cont.token_ids) in nxt.starts
    assert nxt.token_ids[: first.starts[2]] == first.token_ids[: first.starts[2]]
    assert jinja.render(history).token_ids == first.token_ids


def test_generation_prompt_thinking_on_and_off(native):
    messages = [{"role": "user", "content": "hi"}]
    assert native.text(messages).endswith("<|im_start|>assistant\n<think>\n")
    assert native.text(messages, enable_thinking=False).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert native.render(messages).starts == (0, 6)  # <|im_start|> user \n hi <|im_end|> \n


@pytest.mark.parametrize(
    "messages, field",
    [
        ([{"role": "user", "content": "a"}, {"role": "system", "content": "late"}], "messages[1].role"),
        ([{"role": "system", "content": "only"}], "no user query"),
        ([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}], "messages[1].role"),
        (
            [
                {"role": "user", "content": "a"},
                {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]},
            ],
            "messages[1].tool_calls[0].function.arguments",
        ),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], "messages[0].content[0]"),
        ([{"content": "no role"}], "messages[0].role"),
    ],
)
def test_errors_name_the_field(native, messages, field):
    with pytest.raises(ChatError, match=field.replace("[", r"\[").replace("]", r"\]")):
        native.render(messages)


def test_checkpoint_template_is_used(tmp_path, tokenizer):
    model_dir = random_checkpoint(small_config(), 0, tmp_path)
    assert load_template(model_dir) == builtin_template()
    (model_dir / "chat_template.jinja").unlink()
    assert load_template(model_dir) is None
    custom = "{% for m in messages %}<|im_start|>{{ m.role }}:{{ m.content }}<|im_end|>{% endfor %}"
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": custom}))
    renderer = ChatRenderer(tokenizer, load_template(model_dir))
    rendered = renderer.render([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    assert rendered.text == "<|im_start|>user:a<|im_end|><|im_start|>assistant:b<|im_end|>"
    assert rendered.starts == (0, rendered.token_ids.index(248045, 1))


def test_user_interrupting_a_tool_call_turn(native):
    history = [{"role": "user", "content": "find it"}]
    reply = {
        "role": "assistant",
        "content": "",
        "reasoning": "look it up",
        "tool_calls": [{"function": {"name": "search", "arguments": {"q": "it"}}}],
    }
    as_tool_turn = native.render_continuation(history, reply)
    assert "<think>\nlook it up\n</think>" in as_tool_turn.text
    cont = native.render_continuation(history, reply, next_role="user")
    nxt = native.render([*history, reply, {"role": "user", "content": "never mind"}])
    assert "look it up" not in cont.text
    assert nxt.token_ids[: len(cont.token_ids)] == cont.token_ids and len(cont.token_ids) in nxt.starts


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=40))
def test_marker_rows_are_every_row_holding_the_marker(ids):
    from executor.chat import marker_rows

    want = tuple(row for row, t in enumerate(ids) if t == 2)
    assert marker_rows(tuple(ids), 2) == want and marker_rows(list(ids), 2) == want
