"""Gemma-3-270M against HF transformers loaded from the same GGUF (float32, CPU): tokenizer,
logits over more than the sliding window, and greedy decoding across the window's edge."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import aither_jax as aj
from models.gguf_file import GGUFFile
from models.llama import _window_reads, window_pages
from models.registry import resolve_model
from models.tokenizer import Tokenizer
from pallas_kernels.paged_attention import paged_attention_reference
from tests.aither_jax.test_quantized_cache import check_calls_against_reference
from tests.conftest import hf_causal_lm, hf_gguf_tokenizer

MODEL = "gemma3-270m"
# Both sides compute in float32 from the same dequantized weights; the differences come from
# summation order. Measured max |diff| is ~2e-4 on these texts (logits of magnitude ~20-40).
LOGIT_ATOL = 2e-3

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Café au lait, naïve façade — 日本語のテキスト 🤖🎉 and emoji.",
]
# Over 512 tokens: past the sliding window of 15 of the 18 layers.
LONG = " ".join(f"Sentence number {i} talks about the weather in city {i * 7 % 13}." for i in range(60))


@pytest.fixture(scope="module")
def gemma_path() -> str:
    return resolve_model(MODEL)


@pytest.fixture(scope="module")
def gemma() -> aj.LLM:
    """float32, unused KV pages NaN (a stray read poisons the output), small pages so the
    window's edge falls inside a page."""
    return aj.LLM(
        MODEL,
        dtype="float32",
        kv_cache_dtype="fp32",
        max_model_len=1024,
        max_num_seqs=4,
        page_size=16,
        max_prefill_chunk=128,
        progress=False,
        _cache_fill_value=float("nan"),
    )


@pytest.fixture(scope="module")
def hf_gemma(gemma_path):
    return hf_causal_lm(gemma_path)


@pytest.fixture(scope="module")
def hf_gemma_tokenizer(gemma_path):
    return hf_gguf_tokenizer(gemma_path)


def test_config_reads_the_gemma3_layout(gemma):
    cfg = gemma.config
    assert (cfg.arch, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        "gemma3",
        18,
        640,
        4,
        1,
        256,
    )
    assert cfg.sliding_window == 512 and cfg.vocab_size == 262144
    assert [i for i in range(18) if cfg.window(i) is None] == [5, 11, 17]
    assert (cfg.layer_rope_base(0), cfg.layer_rope_base(5)) == (10000.0, 1000000.0)
    assert not gemma.engine.runner.shared_prefix_attention


TOKENIZER_TEXTS = [
    *TEXTS,
    "  two leading spaces,\ttabs\t\tand   runs   of spaces  \n\n\n  ",
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "العربية, Ελληνικά, русский, 한국어 👩‍👩‍👧‍👦 ✨ \u0000\x7f\uffff",
    "x" * 300 + " " + "ab" * 80,
    "",
    " ",
]


def test_tokenizer_matches_hf(gemma, hf_gemma_tokenizer):
    tok = gemma.tokenizer
    for text in TOKENIZER_TEXTS:
        ref = hf_gemma_tokenizer(text).input_ids  # BOS first, as the file asks
        assert tok.encode_prompt(text) == ref, text
        assert tok.encode(text) == ref[1:], text
        assert tok.decode(ref) == hf_gemma_tokenizer.decode(ref, skip_special_tokens=True), text
    assert tok.encode("<start_of_turn>")[0] == 105  # a control token stays whole


def test_bos_is_added_once_and_only_where_the_file_asks(gemma, model_path):
    tok = gemma.tokenizer
    assert tok.add_bos and tok.bos_token_id == 2
    assert tok.encode_prompt("<bos>Hi") == tok.encode_prompt("Hi") == [2, *tok.encode("Hi")]
    smol = Tokenizer.from_gguf(GGUFFile(model_path))  # SmolLM2's file asks for none
    assert not smol.add_bos and smol.encode_prompt("Hi") == smol.encode("Hi")


def hf_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


@pytest.mark.parametrize("text", [*TEXTS, LONG], ids=["prose", "code", "unicode", "past-window"])
def test_logits_match_hf(gemma, hf_gemma, text):
    ids = gemma.tokenizer.encode_prompt(text)
    if text is LONG:
        assert 600 < len(ids) < 1000
    ours = gemma.logits(ids)
    ref = hf_logits(hf_gemma, ids)
    assert ours.shape == ref.shape == (len(ids), 262144)
    assert np.isfinite(ours).all()
    np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))
    assert np.abs(ours - ref).max() < LOGIT_ATOL


GREEDY_TOKENS = 32
# The sampled tokens' log-probabilities of each decode step against HF's on the same tokens.
LOGPROB_ATOL = 1e-3


def test_greedy_decoding_matches_hf_past_the_window(gemma, hf_gemma):
    """One batch: two short prompts and one of 600 tokens, whose every decode step sits past
    the sliding window, so its local layers read stored pages partly outside it. Tokens equal
    HF's greedy ones, and each step's log-probability of its token equals HF's."""
    tok = gemma.tokenizer
    prompts = [tok.encode_prompt("Once upon a time"), tok.encode_prompt("import numpy as np\n")]
    prompts.append(tok.encode_prompt(LONG)[:600])
    params = aj.SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True)
    seqs = [gemma.engine.add_request(ids, params, num_logprobs=0) for ids in prompts]
    while gemma.engine.has_unfinished():
        gemma.engine.step()
    for seq in seqs:
        with torch.no_grad():
            out = hf_gemma.generate(
                torch.tensor([seq.prompt_ids]), max_new_tokens=GREEDY_TOKENS, do_sample=False, eos_token_id=None
            )
        assert seq.output_ids == out[0, len(seq.prompt_ids) :].tolist()
        # Teacher-forced over prompt + output: row n - 1 predicts token n.
        ref = torch.log_softmax(hf_gemma(out).logits[0].double(), -1).detach().numpy()
        n = len(seq.prompt_ids)
        want = [ref[n - 1 + i, t] for i, t in enumerate(seq.output_ids)]
        got = [lp for lp, _ in seq.logprobs]
        np.testing.assert_allclose(got, want, atol=LOGPROB_ATOL)


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_windowed_attention_equals_dense_attention_under_the_window(tree):
    """The reference's window against attention computed position by position: stored keys at
    positions 0..ctx-1, new tokens at `positions` (a tree's depths), window 5."""
    rng = np.random.default_rng(0)
    b, t, hq, hkv, dh, sctx, window = 2, 4, 4, 2, 8, 12, 5
    q = rng.standard_normal((b, t, hq, dh)).astype(np.float32)
    k_new, v_new = (rng.standard_normal((b, t, hkv, dh)).astype(np.float32) for _ in range(2))
    k_ctx, v_ctx = (rng.standard_normal((b, sctx, hkv, dh)).astype(np.float32) for _ in range(2))
    ctx_lens, num_new = np.array([9, 12]), np.array([4, 3])
    depth = np.array([[0, 1, 1, 2]] * b) if tree else np.tile(np.arange(t), (b, 1))
    parents = [-1, 0, 0, 1] if tree else [-1, 0, 1, 2]
    ancestors = np.zeros((t, t), bool)
    for i in range(t):
        j = i
        while j >= 0:
            ancestors[i, j], j = True, parents[j]
    positions = ctx_lens[:, None] + depth
    out = paged_attention_reference(
        *(jnp.asarray(a) for a in (q, k_new, v_new, k_ctx, v_ctx, ctx_lens, num_new)),
        new_mask=jnp.asarray(np.broadcast_to(ancestors, (b, t, t))) if tree else None,
        window=window,
        positions=jnp.asarray(positions),
    )
    for r in range(b):
        for i in range(num_new[r]):
            keys = [(j, k_ctx[r, j], v_ctx[r, j]) for j in range(ctx_lens[r])]
            keys += [(positions[r, u], k_new[r, u], v_new[r, u]) for u in range(num_new[r]) if ancestors[i, u]]
            seen = [(k, v) for p, k, v in keys if positions[r, i] - window < p <= positions[r, i]]
            kk, vv = np.stack([k for k, _ in seen]), np.stack([v for _, v in seen])
            for h in range(hq):
                s = kk[:, h // (hq // hkv)] @ q[r, i, h] * dh**-0.5
                p = np.exp(s - s.max())
                want = (p / p.sum()) @ vv[:, h // (hq // hkv)]
                np.testing.assert_allclose(np.asarray(out[r, i, h]), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("t", [1, 5])
def test_windowed_layers_read_only_the_pages_their_window_reaches(t):
    """`_window_reads` against reading the whole block table: the same attention from
    `window_pages` pages per row (window 7, pages of 4: 3 of a 16-page bucket), whatever a
    row's length and its first key's place in a page. Pages no row owns hold NaN."""
    rng = np.random.default_rng(3)
    b, hq, hkv, dh, page, bucket, window = 6, 4, 2, 8, 4, 16, 7
    ctx_lens = np.array([0, 3, 6, 40, 41, 63 - t], np.int32)
    pool_k, pool_v = (rng.standard_normal((1 + b * bucket, page, hkv, dh)).astype(np.float32) for _ in range(2))
    table = 1 + rng.permutation(b * bucket).reshape(b, bucket).astype(np.int32)
    for r, c in enumerate(ctx_lens):
        unused = table[r, -(-c // page) :]
        pool_k[unused], pool_v[unused] = np.nan, np.nan
    q = rng.standard_normal((b, t, hq, dh)).astype(np.float32)
    k_new, v_new = (rng.standard_normal((b, t, hkv, dh)).astype(np.float32) for _ in range(2))
    positions = jnp.asarray(ctx_lens[:, None] + np.arange(t)[None, :], jnp.int32)
    num_new = jnp.full((b,), t, jnp.int32)

    def attend(read, lens, pos):
        k_ctx = jnp.asarray(pool_k)[read].reshape(b, -1, hkv, dh)
        v_ctx = jnp.asarray(pool_v)[read].reshape(b, -1, hkv, dh)
        return np.asarray(
            paged_attention_reference(
                *(jnp.asarray(a) for a in (q, k_new, v_new)), k_ctx, v_ctx, lens, num_new, window=window, positions=pos
            )
        )

    lens = jnp.asarray(ctx_lens)
    read, read_lens, read_pos = _window_reads(jnp.asarray(table), lens, positions, window, page)
    assert read.shape == (b, window_pages(window, page)) == (b, 3)
    whole = attend(jnp.asarray(table), lens, positions)
    assert np.isfinite(whole).all()
    np.testing.assert_allclose(attend(read, read_lens, read_pos), whole, rtol=1e-5, atol=1e-5)


def test_quantized_pages_read_in_the_rotated_domain_keep_the_window(monkeypatch):
    """Gemma's measured TurboQuant format read as `LLM` reads it on CPU ("xla") against every
    layer decoded ("reference"), over a text past the window. Every layer takes the
    rotated-domain path, the 15 windowed ones with their window, each call matching its
    reference twin (decoded and masked by position) on the same inputs. Through the model,
    rounding differences flip rare codes in later layers, so the logits are held to the gap
    quantization itself makes (as tests/aither_jax/test_quantized_cache.py does for SmolLM2)."""
    gaps = check_calls_against_reference(monkeypatch, "tq_paged_attention_xla")

    def logits(kv: str, attention: str) -> np.ndarray:
        llm = aj.LLM(MODEL, dtype="float32", kv_cache_dtype=kv, max_model_len=1024, max_prefill_chunk=512,
                     attention=attention, progress=False)  # fmt: skip
        return llm.logits(llm.tokenizer.encode_prompt(LONG)[:700])

    rotated = logits("turboquant", "xla")
    # 2 chunks x 18 layers: 512 tokens on an empty cache, then 188 past the window reading the
    # stored pages. Layers 0 and 1 output values up to ~80: calls differ by up to 2.1e-4
    # (float32 rounding, 3e-6 of the largest).
    assert len(gaps) == 2 * 18 and max(gaps) < 1e-3
    decoded, exact = logits("turboquant", "reference"), logits("fp32", "reference")
    assert np.isfinite(rotated).all()
    # Measured: the rotated path 1.00x as far from the unquantized logits as the decoded one,
    # 0.66x of that gap from the decoded one, argmax agreement 99.7%. All 18 layers are
    # quantized, so flips cascade further than in the four-layer SmolLM2 test (0.3x there).
    # Windowed layers read without their window: 4.5x, 4.3x and 93%.
    gap = np.abs(decoded - exact).mean()
    assert np.abs(rotated - exact).mean() < 1.15 * gap
    assert np.abs(rotated - decoded).mean() < gap
    assert (rotated.argmax(-1) == decoded.argmax(-1)).mean() > 0.98
