"""The server's other decode loops: DFlash speculative decoding (same greedy text as the plain
server on float32 KV, per-request acceptance in the usage block, vLLM's spec-decode counters in
/metrics, a bad --speculative-config refused at start-up) and several decode steps per call
(`--num-scheduler-steps`: the same streamed text and usage)."""

import subprocess
import sys

import httpx

from tests.serving.conftest import EXACT_FLAGS

PROMPTS = ["Name three rivers in Europe.", "Write one sentence about the moon.", "What is 12 times 12?"]


def _chat(url: str, prompt: str, stream: bool = False) -> dict | list[dict]:
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": prompt}], "max_tokens": 32}
    body |= {"temperature": 0.0, "stream": stream}
    if not stream:
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()
    body["stream_options"] = {"include_usage": True}
    import json

    events = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def test_speculative_server_matches_plain_and_reports_acceptance(server, server_factory):
    spec = server_factory(*EXACT_FLAGS, "--speculative-config", '{"method": "dflash", "num_speculative_tokens": 7}')
    for prompt in PROMPTS:
        plain = _chat(server.url, prompt)
        fast = _chat(spec.url, prompt)
        assert fast["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
        sd = fast["usage"]["speculative_decoding"]
        assert sd["num_drafts"] > 0 and 0 <= sd["num_accepted_tokens"] <= sd["num_draft_tokens"]
        assert sd["num_draft_tokens"] <= 7 * sd["num_drafts"]
        assert "speculative_decoding" not in plain["usage"]
    events = _chat(spec.url, PROMPTS[0], stream=True)
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e.get("choices"))
    assert text == _chat(server.url, PROMPTS[0])["choices"][0]["message"]["content"]
    assert events[-1]["usage"]["speculative_decoding"]["num_drafts"] > 0
    m = spec.metrics()
    assert m["vllm:spec_decode_num_drafts_total"] >= 4  # every request drafted
    assert m["vllm:spec_decode_num_accepted_tokens_total"] <= m["vllm:spec_decode_num_draft_tokens_total"]
    per_pos = [m[f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}'] for i in range(7)]
    assert sum(per_pos) == m["vllm:spec_decode_num_accepted_tokens_total"]
    assert per_pos == sorted(per_pos, reverse=True)  # position i+1 is accepted only after i


def test_bad_speculative_config_exits_2():
    cmd = [sys.executable, "-m", "aither_jax.serve", "--speculative-config", '{"method": "dflash", "steps": 0}']
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "steps must be an integer" in r.stderr
    cmd[-1] = '{"method": "dflash", "model": "/nonexistent/draft.npz"}'
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "draft file not found" in r.stderr


def test_multi_step_server_streams_the_plain_text(server, server_factory):
    multi = server_factory(*EXACT_FLAGS, "--num-scheduler-steps", "4")
    for prompt in PROMPTS:
        plain = _chat(server.url, prompt)
        events = _chat(multi.url, prompt, stream=True)
        text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e.get("choices"))
        assert text == plain["choices"][0]["message"]["content"]
        assert events[-1]["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"]
        assert _chat(multi.url, prompt)["choices"][0]["message"]["content"] == text


def test_bad_num_scheduler_steps_exits_2():
    cmd = [sys.executable, "-m", "aither_jax.serve", "--num-scheduler-steps", "0"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--num-scheduler-steps must be in [1, 64]" in r.stderr
    cmd[-1:] = ["4", "--speculative-config", '{"method": "ngram"}']
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "cannot be combined with speculative" in r.stderr
