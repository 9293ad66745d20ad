"""Request parsing: every bad field is a 400 naming the parameter."""
import pytest

from common.protocol import APIError, parse_request


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "top_p": 0.5}, "top_p"),
    ({"prompt": "x", "logprobs": 3}, "logprobs"),
    ({"prompt": "x", "n": 2}, "n"),
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
    ({}, "prompt"),
])
def test_completion_errors_name_the_parameter(body, param):
    with pytest.raises(APIError) as e:
        parse_request("completion", body)
    assert e.value.status == 400
    assert e.value.param == param
    assert e.value.body()["error"]["param"] == param


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages.0.content"),
    ({"messages": "hi"}, "messages"),
])
def test_chat_errors(body, param):
    with pytest.raises(APIError) as e:
        parse_request("chat", body)
    assert e.value.param == param


def test_accepted_forms():
    r = parse_request("completion", {"prompt": [[1, 2], [3]], "stop": "x", "top_p": 1, "logprobs": None,
                                     "unknown_field": 1, "steps": 4, "block_length": 2})
    assert r.prompts() == [[1, 2], [3]] and r.stop == ["x"] and r.steps == 4
    assert parse_request("completion", {"prompt": [1, 2]}).prompts() == [[1, 2]]
    assert parse_request("completion", {"prompt": ["a", "b"]}).prompts() == ["a", "b"]
    c = parse_request("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                         {"type": "text", "text": "b"}]}],
                               "max_completion_tokens": 7})
    assert c.messages[0].text() == "ab" and c.max_new_tokens == 7
    assert parse_request("completion", {"prompt": "x"}).stop == []
