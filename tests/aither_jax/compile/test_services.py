"""Compile services are the process's: engines share one persistent cache and one code budget,
and engines of one model share its loaded handle (weights, tokenizer, assets)."""

from __future__ import annotations

from aither_jax.compile import cache as compile_cache
from aither_jax.compile.code_maps import CodeMapBudget
from aither_jax.compile.services import CompileServices, services
from aither_jax.core.engine import Engine


def test_two_engines_in_one_process_share_the_compile_services_and_the_model(llm_f32):
    first = llm_f32.engine
    second = Engine(llm_f32.model, max_num_seqs=1, max_model_len=64, num_pages=6, kv_cache_dtype="fp32")
    assert first.compile_services is second.compile_services is services()
    assert second.weights is first.weights and second.tokenizer is first.tokenizer
    budget = CodeMapBudget(limit=10**9)
    old = first.code_budget
    try:
        first.code_budget = budget  # one engine replacing the budget replaces it for both
        assert second.code_budget is budget and second.compiler.code_budget is budget
    finally:
        first.code_budget = old


def test_the_services_turn_the_persistent_cache_on(monkeypatch, tmp_path):
    monkeypatch.setattr(compile_cache, "enable", lambda: str(tmp_path))
    made = CompileServices()
    assert made.cache_dir == str(tmp_path) and isinstance(made.budget, CodeMapBudget)
