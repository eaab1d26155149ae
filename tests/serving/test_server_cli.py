"""`python -m aither_jax.serve` as a user meets it: `make run`'s command and the README's client
calls, the flags' errors, API keys as tenants, a pinned prompt file, and /health once the
engine loop has died."""

from __future__ import annotations

import functools
import json
import pathlib
import re
import shlex
import shutil
import subprocess
import sys

import httpx
import pytest

from aither_jax import serve
from serving.api import ServerConfig
from tests.serving.conftest import BASE_FLAGS, Server

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m"


def make_run_argv() -> list[str]:
    """The arguments `make run` passes to `python -m aither_jax.serve`."""
    recipe = re.search(r"^run:.*\n\t(.+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    words = shlex.split(recipe)
    return words[words.index("aither_jax.serve") + 1 :]


def readme_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


# -- make run and the README ----------------------------------------------------------------


def test_make_run_serves_the_default_model_on_loopback_port_8000():
    assert make_run_argv() == ["--model", MODEL, "--host", "127.0.0.1", "--port", "8000", "--compile-first-requests"]
    defaults = serve.build_parser().parse_args([])
    assert (defaults.model, defaults.host, defaults.port) == ([MODEL], "127.0.0.1", 8000)
    assert serve.build_parser().parse_args(["--model", "a", "--model", "b"]).model == ["a", "b"]


def test_the_readmes_client_calls_work_against_make_runs_server(tmp_path):
    """The curl and `openai` snippets of the README, run as written against a server started
    with `make run`'s flags (on a free port instead of 8000)."""
    curl = next(b for b in readme_blocks("sh") if b.lstrip().startswith("curl"))
    client = next(b for b in readme_blocks("python") if "from openai import OpenAI" in b)
    # Without --compile-first-requests: what it compiles up front is checked on its own
    # (tests/aither_jax/compile/test_step_shapes.py); here the requests compile what they use.
    argv = [a for a in make_run_argv() if a != "--compile-first-requests"]
    at = argv.index("--port")
    server = Server(*argv[:at], *argv[at + 2 :])  # on a free port
    try:
        here = "http://127.0.0.1:8000"
        assert here in curl and here in client
        if shutil.which("curl") is None:
            pytest.skip("curl is not installed")
        out = subprocess.run(
            ["bash", "-c", curl.replace(here, server.url)], capture_output=True, text=True, timeout=300, check=True
        )
        reply = json.loads(out.stdout)
        assert reply["object"] == "chat.completion" and reply["choices"][0]["message"]["content"]
        assert reply["usage"]["completion_tokens"] >= 1
        script = tmp_path / "client.py"
        script.write_text(client.replace(here, server.url))
        out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        first, _, streamed = out.stdout.partition("CompletionUsage(")
        assert first.strip() and "completion_tokens=" in streamed
        assert len(streamed.split(")", 1)[-1].strip()) > 10  # the streamed story
    finally:
        server.stop()


# -- flags ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--port", "70000"], "--port must be in [0, 65535]"),
        (["--host"], "--host: expected one argument"),
        (["--max-model-len", "0"], "--max-model-len must be >= 2"),
        (["--max-model-len", "100000", "--kv-cache-dtype", "fp32"], "exceeds the model's context length 8192"),
        (["--max-num-seqs", "0"], "--max-num-seqs must be in [1, 1024]"),
        (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens must be >= 1"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be in (0, 1]"),
        (["--gpu-memory-utilization", "0.5"], "pass --num-pages instead"),
        (["--kv-cache-dtype", "tq99"], "unknown kv cache dtype 'tq99'"),
        (["--api-key", ""], "--api-key must not be empty"),
        (["--api-key", "good", "--api-key", " padded"], "no surrounding spaces"),
        (["--seed", "-1"], "--seed must be in [0, 4294967295]"),
        (["--model", "nosuchmodel"], "unknown model 'nosuchmodel': use one of [gemma3-270m, smollm2-135m]"),
        (["--chat-template", "{% bad %}", "--kv-cache-dtype", "fp32"], "chat template does not compile"),
        (["--dtype", "float8"], "invalid choice: 'float8'"),
        (["--pin-prompt-file", "/nonexistent/system.txt"], "--pin-prompt-file: no such file"),
        (["--kv-offloading-size", "-1"], "--kv-offloading-size must be in [0, "),
        (["--kv-disk-size", "1"], "--kv-disk-size needs --kv-cache-dir"),
        (["--kv-cache-dir", "/tmp", "--no-enable-prefix-caching"], "need prefix caching"),
        (["--kv-offloading-size", "1e-9", "--kv-cache-dtype", "fp32"], "holds less than one KV page"),
        (["--kv-cache-dir", "/proc/none"], "--kv-cache-dir: /proc/none cannot be created"),
        (["--kv-low-watermark", "1.5"], "--kv-low-watermark must be in [0, 1]"),
        (
            ["--kv-offloading-size", "1", "--kv-high-watermark", "0.3", "--kv-low-watermark", "0.5"],
            "kv_low_watermark (0.5) must not exceed kv_high_watermark (0.3)",
        ),
        (["--eviction-policy", "graph"], "invalid choice: 'graph'"),
        (["--max-protected-fraction", "2"], "--max-protected-fraction must be in [0, 1]"),
        (["--eviction-policy", "advisor", "--no-enable-prefix-caching"], "needs prefix caching"),
        (["--max-protected-fraction", "0.25", "--kv-cache-dtype", "fp32"], "leaving less than one request's 512"),
        (["--eviction-policy", "advisor", "--advisor-weights", '{"speed": 1}'], "unknown advisor weight 'speed'"),
        (["--eviction-policy", "lru", "--advisor-weights", '{"age": 1}'], "apply to the advisor only"),
        (["--max-resident-tokens", "0"], "--max-resident-tokens must be >= 1"),
        (["--kv-cache-dir", ""], "--kv-cache-dir must name a directory, got an empty path"),
        (["--max-resident-tokens", "64", "--kv-cache-dtype", "fp32"], "raise max_resident_tokens to at least"),
        (["--residency-scorer", "h2o"], "invalid choice: 'h2o'"),
        (["--model", "smollm2-135m", "--model", "smollm2-135m"], "each model once"),
        (["--model-options", 'gemma3-270m={"num_pages": 8}'], "'gemma3-270m' is not a served --model"),
        (["--model-options", 'smollm2-135m={"speed": 1}'], "unknown key 'speed'"),
        (["--model-options", "smollm2-135m=[1]"], "expected a JSON object"),
        (["--model-options", 'smollm2-135m={"speculative_config": "nope"}'], "speculative method must be one of"),
        (["--model-options", 'smollm2-135m={"kv_cache_dtype": "tq99"}'], "unknown kv cache dtype 'tq99'"),
        (["--model-options", "smollm2-135m"], "takes NAME=JSON"),
        (["--default-model", "auto"], "routes between several models"),
        (["--default-model", "llama"], "'llama' is not a served model"),
        (["--route-threshold", "9"], "--route-threshold must be in [1, 5]"),
        (["--kv-balloon"], "moves KV pages between models: give --model twice"),
        (["--kv-balloon-step", "8"], "--kv-balloon-step sets the balloon's moves: it needs --kv-balloon"),
        (["--kv-balloon-min-move", "0"], "--kv-balloon-min-move must be >= 1, got 0"),
        (["--model", "smollm2-135m", "--model", "gemma3-270m"], "several models need a memory budget"),
        (["--model", "smollm2-135m", "--model", "gemma3-270m", "--num-pages", "64"], "give each its own"),
        (
            ["--model", "smollm2-135m", "--model", "gemma3-270m", "--memory-budget", "2", "--served-model-name", "x"],
            "--served-model-name names the one model served; with several, give each its own",
        ),
        (
            ["--model", "smollm2-135m", "--model", "gemma3-270m", "--memory-budget", "2", "--route-heavy", "llama"],
            "--route-heavy 'llama' is not a served model (smollm2-135m, gemma3-270m)",
        ),
        (
            [
                "--model",
                "smollm2-135m",
                "--model",
                "gemma3-270m",
                "--memory-budget",
                "2",
                "--model-options",
                'gemma3-270m={"served_model_name": "smollm2-135m"}',
                "--model-options",
                'smollm2-135m={"served_model_name": "small"}',
            ],
            "gemma3-270m's served name 'smollm2-135m' is another --model",
        ),
        (["--model-options", 'smollm2-135m={"served_model_name": "auto"}'], "'auto' is routing by effort"),
        (
            ["--model", "smollm2-135m", "--model", "gemma3-270m", "--memory-budget", "0.1", "--kv-cache-dtype", "fp32"],
            "does not hold the weights of smollm2-135m",
        ),
    ],
)
def test_bad_flags_exit_2_with_a_message_naming_the_problem(argv, message, capsys, monkeypatch):
    monkeypatch.delenv("AITHER_API_KEY", raising=False)
    # A small engine where one is built before the error (flags given later win).
    sized = "--gpu-memory-utilization" in argv or argv.count("--model") > 1  # sized otherwise
    small = ["--max-num-seqs", "1"] + ([] if sized else ["--num-pages", "64"])
    try:
        code = serve.main([*small, *argv])
    except SystemExit as e:  # argparse's errors
        code = e.code
    assert code == 2
    assert message in capsys.readouterr().err


def test_the_balloon_flags_reach_the_fleet(monkeypatch):
    import aither_jax.fleet.fleet as fleet_module

    seen = []

    def fleet(models, **kwargs):
        seen.append({k: kwargs[k] for k in ("balloon", "balloon_step", "min_move_pages")})
        raise ValueError("stopped before loading the models")

    monkeypatch.setattr(fleet_module, "Fleet", fleet)
    monkeypatch.delenv("AITHER_API_KEY", raising=False)
    two = ["--model", "smollm2-135m", "--model", "gemma3-270m", "--memory-budget", "2"]
    assert serve.main([*two, "--kv-balloon", "--kv-balloon-step", "12", "--kv-balloon-min-move", "5"]) == 2
    assert serve.main([*two, "--kv-balloon"]) == 2
    assert seen == [
        {"balloon": True, "balloon_step": 12, "min_move_pages": 5},
        {"balloon": True, "balloon_step": None, "min_move_pages": None},
    ]


def test_route_heavy_and_default_model_take_a_model_by_its_served_name_or_its_model_flag(monkeypatch, capsys):
    import aither_jax.fleet.fleet as fleet_module

    heavy = []

    def fleet(models, **kwargs):
        heavy.append(kwargs["heavy"])
        raise ValueError("stopped before loading the models")

    monkeypatch.setattr(fleet_module, "Fleet", fleet)
    monkeypatch.delenv("AITHER_API_KEY", raising=False)
    two = ["--model", "smollm2-135m", "--model", "gemma3-270m", "--memory-budget", "2"]
    named = ["--model-options", 'gemma3-270m={"served_model_name": "big"}']
    for pick in (["--route-heavy", "big"], ["--route-heavy", "gemma3-270m"], ["--default-model", "gemma3-270m"]):
        assert serve.main([*two, *named, *pick]) == 2
        assert "stopped before loading the models" in capsys.readouterr().err, pick
    assert heavy == ["gemma3-270m", "gemma3-270m", None]


def test_api_keys_from_the_environment(monkeypatch):
    seen = []

    def build_server(args):
        seen.append(args.api_key)
        raise ValueError("stopped before loading the model")

    monkeypatch.setattr(serve, "build_server", build_server)
    monkeypatch.setenv("AITHER_API_KEY", "k1,k2")
    assert serve.main([]) == 2
    assert serve.main(["--api-key", "flag"]) == 2  # the flag wins
    monkeypatch.delenv("AITHER_API_KEY")
    assert serve.main([]) == 2
    assert seen == [["k1", "k2"], ["flag"], None]


def test_each_api_key_is_its_own_tenant_and_each_model_names_its_own_chains():
    config = ServerConfig(("alpha", "beta"), secret=b"s" * 32)
    salts = {config.salt("", 0), config.salt("", 1), config.salt("t", 0), config.salt("t", 1)}
    assert len(salts) == 4
    assert config.root_salts() == [config.salt("", 0), config.salt("", 1)]
    assert ServerConfig(secret=b"s" * 32).root_salts() == [ServerConfig(secret=b"s" * 32).salt("")]
    assert config.salt("t", 0, "model-a") != config.salt("t", 0, "model-b")  # no page is shared across models
    assert config.root_salts("model-a") == [config.salt("", 0, "model-a"), config.salt("", 1, "model-a")]


# -- keys, tenants and a pinned prompt file on a real server -----------------------------------

PINNED = "You answer questions about the city library: its hours, its rooms and its rules. " * 4


def complete(server: Server, prompt: str, key: str, tenant: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {key}"} | ({"X-Tenant-Id": tenant} if tenant else {})
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    r = httpx.post(server.url + "/v1/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    pin_file = tmp_path_factory.mktemp("pins") / "system.txt"
    pin_file.write_text(PINNED)
    s = Server(
        *BASE_FLAGS,
        "--kv-cache-dtype", "fp32",
        "--max-num-seqs", "2",
        "--num-pages", "65",
        "--max-pinned-fraction", "0.25",
        "--api-key", "alpha",
        "--api-key", "beta",
        "--pin-prompt-file", str(pin_file),
    )  # fmt: skip
    yield s
    s.stop()


def test_a_pinned_prompt_file_is_cached_for_every_key(keyed_server, tokenizer_pages):
    m = keyed_server.metrics(headers={"Authorization": "Bearer beta"})
    pages = tokenizer_pages(PINNED)
    assert m["aither:pinned_pages_capacity"] == int(0.25 * m["aither:kv_pages_total"]) == 16
    assert m["aither:pinned_pages"] == 2 * pages  # one chain per key
    for key in ("alpha", "beta"):
        usage = complete(keyed_server, PINNED + "When do you open?", key)
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 16 * pages
    # Only requests without a tenant header share the pinned chain.
    usage = complete(keyed_server, PINNED + "When do you close?", "alpha", tenant="someone")
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0


def test_requests_under_different_keys_share_no_pages(keyed_server):
    prompt = "A question about astronomy that is long enough to fill a couple of pages. " * 3
    assert complete(keyed_server, prompt, "alpha")["prompt_tokens_details"]["cached_tokens"] == 0
    assert complete(keyed_server, prompt, "alpha")["prompt_tokens_details"]["cached_tokens"] >= 32
    assert complete(keyed_server, prompt, "beta")["prompt_tokens_details"]["cached_tokens"] == 0
    bad = httpx.post(keyed_server.url + "/v1/chat/completions", json={"messages": []}, timeout=30)
    assert bad.status_code == 401


@pytest.fixture(scope="module")
def tokenizer_pages():
    from models.gguf_file import GGUFFile
    from models.registry import resolve_model
    from models.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(GGUFFile(resolve_model(MODEL)))
    return lambda text: len(tok.encode(text)) // 16


# -- the host and disk tiers across a restart ---------------------------------------------------


def test_a_restarted_server_serves_each_tenant_its_own_pages_from_disk(tmp_path):
    """The device pool keeps almost nothing; a clean stop writes the host tier to disk; after a
    restart the same tenant's prompt starts from its pages on disk, another tenant's does not."""
    flags = (*BASE_FLAGS, "--kv-cache-dtype", "fp32", "--max-num-seqs", "1", "--num-pages", "12")
    tiers = ("--kv-offloading-size", "0.01", "--kv-cache-dir", str(tmp_path))
    prompt = "A question about the tides and the moon, long enough to fill several pages of the cache. " * 4
    first = Server(*flags, *tiers)
    try:
        key = "none"
        before = complete(first, prompt, key, tenant="ann")
        complete(first, "Something else entirely, to push the first prompt's pages out of the pool. " * 8, key)
        assert first.metrics()["aither:kv_host_pages"] > 0
    finally:
        assert first.stop() == 0
    assert (tmp_path / "tenant_secret").stat().st_mode & 0o777 == 0o600
    second = Server(*flags, *tiers)
    try:
        again = complete(second, prompt, key, tenant="ann")
        assert again["prompt_tokens_details"]["cached_tokens"] >= 16 * 3
        assert again["completion_tokens"] == before["completion_tokens"]
        assert complete(second, prompt, key, tenant="bob")["prompt_tokens_details"]["cached_tokens"] == 0
        m = second.metrics()
        assert m['aither:kv_tier_hits_total{tier="disk"}'] >= 3 and m["aither:kv_disk_pages"] > 0
        assert m['aither:kv_reload_decisions_total{choice="reload"}'] == 1  # ann's second request
        assert m["aither:kv_prefetched_pages_total"] == 0  # nothing waited for a slot
        assert m['aither:kv_disk_files_total{outcome="torn"}'] == 0
        assert 'aither:kv_tier_moved_bytes_total{direction="device_to_host"}' in m
    finally:
        second.stop()


# -- the eviction advisor -------------------------------------------------------------------


def test_the_advisor_keeps_a_persona_and_shows_its_graph():
    """With --eviction-policy advisor on a small pool: a persona's system pages stay cached
    through other conversations; the graph, metrics and 404 without the advisor."""
    flags = (*BASE_FLAGS, "--max-model-len", "256", "--kv-cache-dtype", "fp32", "--max-num-seqs", "1")
    server = Server(*flags, "--num-pages", "48", "--eviction-policy", "advisor", "--max-pinned-fraction", "0.1")
    persona = {"role": "system", "content": "You are Aither. You study tides, waves and the moon. " * 6}

    def chat(messages) -> dict:
        body = {"model": MODEL, "messages": messages, "max_tokens": 2, "temperature": 0}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["usage"]

    try:
        chat([persona, {"role": "user", "content": "Who are you?"}])
        for i in range(4):  # other conversations fill the pool
            chat([{"role": "user", "content": f"Story {i}: " + "the sea rolls on and on. " * 30}])
        again = chat([persona, {"role": "user", "content": "What do you study?"}])
        assert again["prompt_tokens_details"]["cached_tokens"] >= 64
        graph = httpx.get(server.url + "/debug/kv_graph", timeout=10).json()
        assert graph["num_edges"]["temporal"] > 0 and graph["num_edges"]["prefix_share"] >= 1
        tags = {n.get("tag") for n in graph["nodes"]}
        assert {"system", "user"} <= tags
        m = server.metrics()
        assert m["aither:kv_protected_pages"] > 0 and m['aither:kv_evictions_total{tag="user"}'] > 0
        assert 'aither:kv_evictions_total{tag="system"}' not in m
        # Six new conversations: trust halves with each, but the second under a prompt only one
        # chain continued so far counts as a return (it looks like a follow-up diverging).
        assert m["aither:kv_advisor_trust"] < 0.1
    finally:
        server.stop()


# -- /health once the engine loop has died ----------------------------------------------------


def test_health_names_a_dead_engine_and_the_other_model_keeps_serving(monkeypatch):
    from starlette.testclient import TestClient

    import aither_jax as aj
    from aither_jax.fleet.router import Router
    from serving.api import ServedModel, build_app
    from serving.async_engine import AsyncEngine
    from serving.metrics import Metrics

    settings = dict(dtype="float32", kv_cache_dtype="fp32", max_model_len=256, max_num_seqs=2, num_pages=32)
    broken, healthy = (aj.LLM(MODEL, **settings, _num_layers=2, progress=False) for _ in range(2))

    def broken_step(*args, **kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(broken.engine, "step", broken_step)
    engines = [AsyncEngine(llm.engine, Metrics(name), max_waiting=4) for llm, name in ((broken, "a"), (healthy, "b"))]
    served = [ServedModel(name, e, broken.tokenizer, 256) for name, e in zip("ab", engines, strict=True)]
    app = build_app(served, ServerConfig(secret=b"s" * 32), router=Router("b", "a"))  # "a" is the heavy one
    for e in engines:
        e.start()
    try:
        client = TestClient(app)
        assert client.get("/health").json() == {"models": {"a": "alive", "b": "alive"}}
        body = {"model": "a", "prompt": "Hello", "max_tokens": 4}
        r = client.post("/v1/completions", json=body)  # its first step raises
        assert r.status_code == 503 and "device lost" in r.json()["error"]["message"]
        health = client.get("/health")
        assert health.status_code == 503
        assert "device lost" in health.json()["models"]["a"] and health.json()["models"]["b"] == "alive"
        r = client.post("/v1/completions", json=body)  # refused up front now
        assert r.status_code == 503 and r.json()["error"]["code"] == 503
        r = client.post("/v1/completions", json=body | {"model": "b"})  # the other model still serves
        assert r.status_code == 200 and r.json()["model"] == "b" and r.json()["usage"]["completion_tokens"] == 4
        # A request routed to the dead model is served by the live one.
        heavy = {"model": "auto", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
        chat = functools.partial(client.post, "/v1/chat/completions")
        r = chat(json=heavy | {"reasoning_effort": "high"}, headers={"X-Tenant-Id": "t1", "X-Session-Id": "u"})
        assert r.status_code == 200 and r.json()["model"] == "b"
        # Its session carries its effort for the tenant that had it, not for another one.
        light = heavy | {"messages": [{"role": "user", "content": "ok"}]}
        for tenant in ("t2", "t1"):
            assert chat(json=light, headers={"X-Tenant-Id": tenant, "X-Session-Id": "u"}).status_code == 200
        routed = {line for line in client.get("/metrics").text.splitlines() if line.startswith("aither:routed")}
        for effort, reason in (("5", "reasoning_effort"), ("1", "scored"), ("5", "carried")):
            assert f'aither:routed_requests_total{{effort="{effort}",model_name="b",reason="{reason}"}} 1.0' in routed
        tool = [{"role": "user", "content": "find me a flight"}, {"role": "tool", "content": "LH123 at 9:40"}]
        assert chat(json=light | {"model": "b", "messages": tool}).status_code == 200
        metrics = client.get("/metrics").text  # still scrapeable: one family header, a series per model
        assert metrics.count("# TYPE vllm:num_requests_running gauge") == 1
        assert 'vllm:num_requests_running{model_name="a"}' in metrics
        assert 'vllm:num_requests_running{model_name="b"}' in metrics
        # Routes that take one model: `auto` is not offered, and a request naming none goes to
        # the server's default model (`b` here: caching off, where the dead `a` answers 503).
        r = client.get("/v1/models/auto")
        assert r.status_code == 404 and "or `auto`" not in r.json()["error"]["message"]
        r = client.post("/v1/completions", json=body | {"model": "llama"})
        assert r.status_code == 404 and "or `auto`" in r.json()["error"]["message"]
        for default, status, fragment in (("b", 400, "prefix caching is off"), ("auto", 400, "name the model")):
            other = TestClient(
                build_app(served, ServerConfig(secret=b"s" * 32, default_model=default), router=Router("b", "a"))
            )
            r = other.post("/v1/unpin", json={"prompt": "Hello"})
            assert r.status_code == status and fragment in r.json()["error"]["message"], default
    finally:
        for e in engines:
            e.stop()


def test_a_models_recommended_sampling_fills_the_fields_a_request_leaves_unset():
    from starlette.testclient import TestClient

    import aither_jax as aj
    from serving.api import ServedModel, build_app
    from serving.async_engine import AsyncEngine
    from serving.metrics import Metrics

    assert aj.LLM(MODEL, _num_layers=1, progress=False, num_pages=8, max_model_len=64).sampling_defaults == {
        "temperature": 0.2,
        "top_p": 0.9,
    }  # SmolLM2's card
    llm = aj.LLM(MODEL, dtype="float32", kv_cache_dtype="fp32", max_model_len=128, num_pages=32, _num_layers=2)
    engine = AsyncEngine(llm.engine, Metrics("m"), max_waiting=4)
    # A stand-in recommendation that shows: greedy unless the request says otherwise.
    app = build_app([ServedModel("m", engine, llm.tokenizer, 128, sampling={"temperature": 0.0})], ServerConfig())
    engine.start()
    try:
        client = TestClient(app)

        def text(**fields) -> str:
            body = {"prompt": "The weather today", "max_tokens": 12, "seed": 3, "ignore_eos": True} | fields
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        assert text() == text(temperature=0.0)  # unset: the model's value
        assert text(temperature=1.0) != text()  # set: the request's
    finally:
        engine.stop()


def test_a_bounded_server_answers_prompts_longer_than_its_pool():
    """--max-resident-tokens 512 on a 47-page pool (752 tokens): a 1,200-token prompt, which
    needs 75 pages, is answered (prefix caching on), and again from the cache."""
    flags = (*BASE_FLAGS, "--max-model-len", "2048", "--kv-cache-dtype", "fp32", "--max-num-seqs", "1")
    server = Server(*flags, "--num-pages", "48", "--max-resident-tokens", "512")
    prompt = " ".join(f"Note {i}: the tide rose at dawn and fell at dusk." for i in range(80))
    try:
        for _ in range(2):
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0}
            r = httpx.post(server.url + "/v1/completions", json=body, timeout=300)
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
            assert usage["prompt_tokens"] > 1100 and usage["completion_tokens"] == 8
    finally:
        server.stop()
