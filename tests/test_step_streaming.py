"""Step streaming (issue 35): ``"stream_mode": "steps"`` adds a ``diffusion_step`` chunk after every denoising step
of a choice (the positions committed in it, the window when ``stream_canvas`` asks); the text streamed and the
answer are the non-streamed ones."""
import json

import pytest

from common.worker_config import WorkerConfig
from tests.conftest import TINY_LLADA
from tests.test_diffusion_gemma import TINY_DG
from tests.test_worker_app import wait_ready
from worker.app import make_app


async def _client(aiohttp_client, path):
    client = await aiohttp_client(make_app(WorkerConfig(model_path=str(path), device="cpu")))
    await wait_ready(client)
    return client


async def _both(client, kind: str, body: dict) -> tuple[dict, list[dict]]:
    path = "/v1/completions" if kind == "completion" else "/v1/chat/completions"
    plain = await (await client.post(path, json=body)).json()
    r = await client.post(path, json={**body, "stream": True, "stream_mode": "steps", "stream_canvas": True})
    assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in (await r.text()).split("\n") if line.startswith("data: {")]
    return plain, events


def _steps(events: list[dict], index: int = 0) -> list[dict]:
    return [c["diffusion_step"] for e in events for c in e["choices"] if c["index"] == index and "diffusion_step" in c]


@pytest.mark.parametrize("alg", [{"generation_algorithm": "basic", "steps": 16},
                                 {"generation_algorithm": "dual_cache", "threshold": 0.7},
                                 {"generation_algorithm": "dinfer_hierarchy", "threshold": 0.7}])
async def test_every_step_of_a_llada_row_and_what_it_committed(aiohttp_client, alg):
    client = await _client(aiohttp_client, TINY_LLADA)
    body = {"prompt": [[5, 6, 7, 8], [9, 10]], "max_tokens": 16, "block_length": 8, "return_token_ids": True,
            "ignore_eos": True, **alg}
    plain, events = await _both(client, "completion", body)
    for i, choice in enumerate(plain["choices"]):
        steps = _steps(events, i)
        assert [s["step"] for s in steps] == list(range(1, choice["nfe"] + 1))      # one per forward it took part in
        final = {}
        for s in steps:                          # each position committed once, never taken back
            for c in s["committed"]:
                assert c["position"] not in final
                final[c["position"]] = c["token_id"]
            assert all(s["canvas"][p] == t for p, t in final.items()) and s["settled"] == 16
        assert [final[p] for p in range(16)] == choice["token_ids"] == steps[-1]["canvas"]
        text = "".join(c["text"] for e in events for c in e["choices"] if c["index"] == i)
        assert text == choice["text"]
    first = next(e for e in events if _steps([e]))
    assert first["object"] == "text_completion" and first["choices"][0]["text"] == ""


@pytest.mark.slow
async def test_diffusion_gemma_commits_whole_canvases_and_streams_its_guesses(aiohttp_client):
    client = await _client(aiohttp_client, TINY_DG)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 24, "seed": 7, "ignore_eos": True}
    plain, events = await _both(client, "chat", body)
    steps = _steps(events)
    assert len(steps) == plain["choices"][0]["nfe"]
    settled = [s["settled"] for s in steps]
    assert settled == sorted(settled) and {n % 8 for n in settled} == {0}          # whole canvases of 8
    assert {len(s["committed"]) for s in steps} <= {0, 8}
    assert all(None not in s["canvas"][:s["settled"]] for s in steps)
    guessing = [s for s in steps if not s["committed"]]            # mid-canvas: the canvas's current guesses
    assert guessing and all(None not in s["canvas"][s["settled"]:s["settled"] + 8] for s in guessing)
    ends = [s for s in steps if s["committed"]]                    # a canvas committed: nothing guessed beyond
    assert all(set(s["canvas"][s["settled"]:]) <= {None} for s in ends)
    content = "".join((c["delta"].get("content") or "") for e in events for c in e["choices"])
    assert content == plain["choices"][0]["message"]["content"]
    assert all(c["delta"] == {} for e in events for c in e["choices"] if "diffusion_step" in c)


async def test_steps_need_a_stream(aiohttp_client):
    client = await _client(aiohttp_client, TINY_LLADA)
    for extra, param in (({"stream_mode": "steps"}, "stream_mode"), ({"stream": True, "stream_canvas": True},
                                                                     "stream_canvas"),
                         ({"stream": True, "stream_mode": "frames"}, "stream_mode")):
        r = await client.post("/v1/completions", json={"prompt": [5], "max_tokens": 4, **extra})
        assert r.status == 400 and (await r.json())["error"]["param"] == param
