"""Request parsing: every bad field is a 400 naming the parameter."""
import json
import pytest

from common.protocol import APIError, parse_request


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "top_k": -2}, "top_k"),
    ({"prompt": "x", "min_p": 1.5}, "min_p"),
    ({"prompt": "x", "frequency_penalty": 0.5}, "frequency_penalty"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "logprobs": -1}, "logprobs"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 129}, "n"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": "x", "steps": 0}, "steps"),
    ({"prompt": "x", "temperature": -0.1}, "temperature"),
    ({"prompt": "x", "temperature": True}, "temperature"),
    ({"prompt": "x", "threshold": 1.5}, "threshold"),
    ({"prompt": "x", "remasking": "sideways"}, "remasking"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),      # without stream (vLLM's)
    ({}, "prompt"),
    # the prompt's form is read from its first item, and the offending item is named (the union of forms said
    # "prompt: Input should be a valid string" for all of these)
    ({"prompt": [5, "a"]}, "prompt.1"),
    ({"prompt": ["a", 5]}, "prompt.1"),
    ({"prompt": [[5], [6, "x"]]}, "prompt.1.1"),
    ({"prompt": [5.5]}, "prompt.0"),
    ({"prompt": [True]}, "prompt.0"),
])
def test_completion_errors_name_the_parameter(body, param):
    with pytest.raises(APIError) as e:
        parse_request("completion", body)
    assert e.value.status == 400
    assert e.value.param == param
    # OpenAI's shape: exactly these keys, and a 400's type is invalid_request_error (as OpenAI's and vLLM's)
    assert e.value.body() == {"error": {"message": e.value.message, "type": "invalid_request_error",
                                        "param": param, "code": e.value.code}}


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages.0.content"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, "logprobs"),
])
def test_chat_errors(body, param):
    with pytest.raises(APIError) as e:
        parse_request("chat", body)
    assert e.value.param == param


def test_an_empty_stream_options_passes_without_stream():
    assert parse_request("completion", {"prompt": "x", "stream_options": {}}).include_usage is False
    # null is the default inside stream_options too (a review found a 400 where vLLM takes it)
    req = parse_request("chat", {"messages": [{"role": "user", "content": "x"}], "stream": True,
                                 "stream_options": {"include_usage": None}})
    assert req.include_usage is False


def test_accepted_forms():
    r = parse_request("completion", {"prompt": [[1, 2], [3]], "stop": "x", "top_p": 1, "logprobs": None,
                                     "unknown_field": 1, "steps": 4, "block_length": 2})
    assert r.prompts() == [[1, 2], [3]] and r.stop == ["x"] and r.steps == 4
    assert parse_request("completion", {"prompt": [1, 2]}).prompts() == [[1, 2]]
    assert parse_request("completion", {"prompt": ["a", "b"]}).prompts() == ["a", "b"]
    c = parse_request("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                         {"type": "text", "text": "b"}]}],
                               "max_completion_tokens": 7})
    assert c.messages[0].text() == "a\nb" and c.max_new_tokens == 7
    assert parse_request("completion", {"prompt": "x"}).stop == []


def test_request_metrics_exposition():
    """Lock-free request metrics render as Prometheus counters and cumulative histograms."""
    from prometheus_client import CollectorRegistry, generate_latest

    from common.metrics import RequestMetrics
    m = RequestMetrics("x", (0.1, 1.0))
    reg = CollectorRegistry()
    reg.register(m)
    for secs in (0.05, 0.1, 0.5, 3.0):
        m.observe("/v1/completions", 200, secs)
    m.observe("/v1/completions", 400)
    m.counter("x_tokens", "tokens").inc(7)
    text = generate_latest(reg).decode()
    assert 'x_requests_total{endpoint="/v1/completions",status="200"} 4.0' in text
    assert 'x_requests_total{endpoint="/v1/completions",status="400"} 1.0' in text
    assert 'x_request_latency_seconds_bucket{endpoint="/v1/completions",le="0.1"} 2.0' in text    # le is inclusive
    assert 'x_request_latency_seconds_bucket{endpoint="/v1/completions",le="1.0"} 3.0' in text
    assert 'x_request_latency_seconds_bucket{endpoint="/v1/completions",le="+Inf"} 4.0' in text
    assert 'x_request_latency_seconds_count{endpoint="/v1/completions"} 4.0' in text
    assert 'x_request_latency_seconds_sum{endpoint="/v1/completions"} 3.65' in text
    assert "x_tokens_total 7.0" in text


@pytest.mark.parametrize("body, param", [
    ({"input": []}, "input"),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text"),
    ({"input": "x", "text": {"format": "text"}}, "text"),          # not an object: was a 500
    ({"input": "x", "text": {"format": 5}}, "text"),
    ({"input": "x", "text": "plain"}, "text"),
])
def test_responses_errors(body, param):
    with pytest.raises(APIError) as e:
        parse_request("responses", body)
    assert e.value.status == 400 and e.value.param == param


def test_responses_become_chat_requests():
    r = parse_request("responses", {"input": [{"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]}], "instructions": "sys",
        "max_output_tokens": 7, "temperature": 0.5, "steps": 4, "stream": True, "store": True, "metadata": {"k": "1"}})
    body = r.chat_body()
    assert body["messages"] == [{"role": "system", "content": "sys"},
                                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert body["max_tokens"] == 7 and body["temperature"] == 0.5 and body["steps"] == 4
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert parse_request("chat", body).max_new_tokens == 7
    with pytest.raises(APIError) as e:          # metadata is echoed back: string values only, as OpenAI's
        parse_request("responses", {"input": "x", "metadata": {"k": 1}})
    assert e.value.status == 400 and e.value.param == "metadata.k"


# Issue 29: a neutral-only field takes a JSON number or an empty object/array, never a boolean standing in for one
# (Python's True == 1 and False == 0 let "top_p": true and "best_of": true through as 1).
STRICT = [("top_p", True), ("best_of", True), ("repetition_penalty", True), ("frequency_penalty", False),
          ("presence_penalty", False), ("top_p", "1"), ("logit_bias", False), ("logit_bias", []), ("logit_bias", 0),
          ("tools", False), ("tools", {}), ("functions", 0), ("functions", "")]


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("field, value", STRICT + [("top_logprobs", False)])
def test_neutral_fields_take_numbers_not_booleans(kind, field, value):
    body = {"prompt": "x"} if kind == "completion" else {"messages": [{"role": "user", "content": "x"}]}
    with pytest.raises(APIError) as e:
        parse_request(kind, {**body, field: value})
    assert e.value.status == 400 and e.value.param == field


@pytest.mark.parametrize("field, value", [("top_p", True), ("top_logprobs", False), ("tools", False),
                                          ("reasoning", False), ("reasoning", [])])
def test_responses_neutral_fields_take_numbers_not_booleans(field, value):
    with pytest.raises(APIError) as e:
        parse_request("responses", {"input": "x", field: value})
    assert e.value.status == 400 and e.value.param == field


def test_neutral_values_are_still_accepted():
    for kind, body in (("completion", {"prompt": "x"}), ("chat", {"messages": [{"role": "user", "content": "x"}]})):
        parse_request(kind, {**body, "top_p": 1, "best_of": 1, "repetition_penalty": 1.0, "frequency_penalty": 0,
                             "presence_penalty": 0.0, "logit_bias": {}, "tools": [], "functions": [],
                             "tool_choice": "none", "suffix": None})
    parse_request("completion", {"prompt": "x", "top_logprobs": 0})
    parse_request("responses", {"input": "x", "top_p": 1.0, "top_logprobs": 0, "tools": [], "reasoning": {},
                                "tool_choice": "auto"})
    parse_request("responses", {"input": "x", "reasoning": None})


def test_a_message_needs_content_unless_the_assistants():
    """As OpenAI's: a user, system or developer message without content, or any message with an empty list of parts,
    is a 400 naming the message (they became empty turns; a reviewer's finding); an assistant's may be null."""
    for msgs in ([{"role": "user", "content": None}], [{"role": "user"}], [{"role": "system", "content": None}],
                 [{"role": "user", "content": []}]):
        with pytest.raises(APIError) as e:
            parse_request("chat", {"messages": msgs})
        assert e.value.status == 400 and e.value.param == "messages.0", msgs
    parse_request("chat", {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None}]})


def test_a_bad_item_of_an_input_list_is_named_and_include_is_refused():
    """A review: every malformed item of a Responses `input` list (a part without text, a misspelt part type, a
    refusal part) got "input: Input should be a valid string", the string branch's error; and `include` (logprobs
    on output_text) was accepted and ignored."""
    import pytest as _pytest

    from common.protocol import APIError, parse_request
    ok = {"role": "user", "content": [{"type": "input_text", "text": "x"}]}
    for items, where in (([{"role": "user", "content": [{"type": "input_text"}]}], "input.0.content.0"),
                         ([ok, {"role": "user", "content": [{"type": "input_txt", "text": "y"}]}], "input.1"),
                         ([{"role": "user", "content": 123}], "input.0.content")):
        with _pytest.raises(APIError) as e:
            parse_request("responses", json.dumps({"input": items}).encode())
        assert e.value.status == 400 and (e.value.param or "").startswith(where), (items, e.value.param,
                                                                                    e.value.message)
        assert "valid string" not in e.value.message or "content" in (e.value.param or ""), e.value.message
    with _pytest.raises(APIError) as e:
        parse_request("responses", json.dumps({"input": "x", "include": ["message.output_text.logprobs"]}).encode())
    assert e.value.status == 400 and e.value.param == "include"
    assert parse_request("responses", json.dumps({"input": "x", "include": []}).encode()).input == "x"
    # values naming output this server never makes add nothing: accepted (inspect-ai's openai provider sends the
    # first with every request); an unknown value, or one among them that asks for logprobs, is refused
    ok = ["reasoning.encrypted_content", "file_search_call.results", "message.input_image.image_url"]
    assert parse_request("responses", json.dumps({"input": "x", "include": ok}).encode()).input == "x"
    for bad in (["reasoning.encrypted_content", "message.output_text.logprobs"], ["reasoning"], "reasoning.encrypted_content", [1], [{}], [[1]]):
        with _pytest.raises(APIError) as e:
            parse_request("responses", json.dumps({"input": "x", "include": bad}).encode())
        assert e.value.status == 400 and e.value.param == "include", bad


@pytest.mark.parametrize("field, value", [("min_tokens", 2), ("length_penalty", 0.5),
                                          ("use_beam_search", True), ("allowed_token_ids", [1]), ("bad_words", ["x"]),
                                          ("guided_json", {}), ("guided_regex", "a+"), ("guided_choice", ["a"]),
                                          ("guided_grammar", "g"), ("structured_outputs", {"json": {}}),
                                          ("include_stop_str_in_output", True),
                                          ("truncate_prompt_tokens", 5), ("prompt_logprobs", 1),
                                          ("return_tokens_as_token_ids", True), ("chat_template", "{{ 'x' }}"),
                                          ("documents", [{"text": "d"}])])
def test_vllms_answer_changing_extras_are_refused_on_both_endpoints(field, value):
    """A review: these vLLM fields were ignored (a 200 with the plain answer); each is a 400 naming it unless off."""
    for kind, body in (("completion", {"prompt": "x"}), ("chat", {"messages": [{"role": "user", "content": "x"}]})):
        with pytest.raises(APIError) as e:
            parse_request(kind, json.dumps({**body, field: value}).encode())
        assert e.value.status == 400 and e.value.param == field and field in e.value.message, (kind, e.value.message)
