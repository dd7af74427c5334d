"""End to end: vLLM's real multi-process engine (engine core + worker, spawned) on a tiny
random DeepSeek-V2, our prefill vs vLLM's built-in CPU prefill.

One subprocess runs `python -m mla_plugins.demo.vllm_demo --also-tp 2 --json` (the
session's `demo_result`, shared with test_tp.py; here its one-rank engines: built-in bf16,
ours bf16 selected by the name MLA_PLUGINS, ours fp8 selected as CUSTOM); every test below
reads its results, so the engines start once (about a minute each here).
The trace has one line per prefill call and one "plan" line per batch the adapter planned.
Measured 2026-12-01 on the shared 2-core machine: 514 s for the module (engines 191 / 122 /
107 s); bf16 prompt top-1 99.4%, fp8 97.9%, generated tokens equal in both.
"""

from __future__ import annotations

import pytest

from .conftest import run_python


@pytest.fixture(scope="module")
def demo(demo_result):
    return demo_result


def test_builtin_run_uses_vllms_prefill_and_writes_no_trace(demo):
    run = demo["runs"]["builtin_bf16"]
    assert run["worker"]["layer_prefill_backends"] == ["CPUSDPAMLAPrefillBackend"]
    # every run on CPU_MLA, the MLA backend that calls its prefill backend (not AMX_MLA)
    assert {r["worker"]["layer_attention_impls"][0] for r in demo["runs"].values()} == {"CPUMLAImpl"}
    assert run["trace"] == []


def test_name_mla_plugins_survives_the_spawned_engine(demo):
    """The config holding MLAPrefillBackendEnum.MLA_PLUGINS is unpickled in the engine core
    and the worker (both spawned) and still names our backend there."""
    run = demo["runs"]["ours_bf16"]
    worker = run["worker"]
    assert worker["pid"] != run["main_pid"]
    assert worker["selected_mla_prefill_backend"] == "MLA_PLUGINS"
    assert worker["layer_prefill_backends"] == ["MLAPluginsPrefillBackend"]
    assert demo["runs"]["ours_fp8"]["worker"]["selected_mla_prefill_backend"] == "CUSTOM"


@pytest.mark.parametrize("label,fp8", [("ours_bf16", False), ("ours_fp8", True)])
def test_trace_proves_worker_calls_including_context_chunks(demo, label, fp8):
    run = demo["runs"][label]
    trace = run["trace"]
    assert trace, "no mla_prefill call was traced"
    assert {t["framework"] for t in trace} == {"vllm"}
    assert {t["pid"] for t in trace} == {run["worker"]["pid"]} != {run["main_pid"]}
    assert {t["fp8"] for t in trace} == {fp8}
    assert {t["heads"] for t in trace} == {4}
    entries = {t["entry"] for t in trace}
    assert entries == {"new_tokens", "context_chunk", "plan"}, entries
    # 512-row chunks: two 256-row tiles per call; context chunks read back earlier chunks
    assert max(t["q_tokens"] for t in trace if t["entry"] == "new_tokens") > 256
    assert any(t["k_tokens"] >= 512 for t in trace if t["entry"] == "context_chunk")
    assert run["worker"]["chunked_prefill"] is True


@pytest.mark.parametrize("label", ["ours_bf16", "ours_fp8"])
def test_one_plan_per_batch_in_the_engine(demo, label):
    """The worker planned each batch once (prepare_metadata, a "plan" trace line) and every
    layer's calls reused it: new-token calls = layers x batches, context-chunk calls =
    layers x planned chunks."""
    run = demo["runs"][label]
    per_pid = run["trace_summary"]["per_pid"]
    assert list(per_pid) == [str(run["worker"]["pid"])]
    assert run["one_plan_per_batch"] == {str(run["worker"]["pid"]): True}, per_pid
    (per,) = per_pid.values()
    assert per["batches"] >= 6 and per["planned_chunks"] >= 3, per  # 4 prompts, 2 long ones chunked


def test_bf16_greedy_tokens_equal_builtin(demo):
    ours, base = demo["runs"]["ours_bf16"], demo["runs"]["builtin_bf16"]
    assert ours["tokens"] == base["tokens"]
    assert demo["comparison"]["ours_bf16"]["prompt_top1_agreement"] >= 0.97


def test_fp8_top1_agreement_with_builtin(demo):
    agreement = demo["comparison"]["ours_fp8"]["prompt_top1_agreement"]
    print(f"fp8 top-1 agreement over {sum(demo['prompt_lengths']) - 4} prompt positions: {agreement:.1%}")
    assert agreement >= 0.90


def test_plain_dynamic_name_would_not_survive_spawn():
    """Why register() pickles MLA_PLUGINS by name: a member made by vLLM's own
    register_mla_prefill_backend("NAME", path) pickles by value, and a fresh process (as the
    spawned engine core, which unpickles its config before it loads plugins) cannot
    unpickle it. (The engine run above shows ours does survive.)"""
    dumped = run_python("""
        import pickle, sys
        from vllm.v1.attention.backends.mla.prefill.registry import (
            MLAPrefillBackendEnum as E, register_mla_prefill_backend)
        register_mla_prefill_backend("PLAIN_NAME", "x.y.Z")
        sys.stdout.write(pickle.dumps(E["PLAIN_NAME"]).hex())
    """, env={"VLLM_PLUGINS": ""})
    assert dumped.returncode == 0, dumped.stderr[-3000:]
    loaded = run_python(f"""
        import pickle
        try:
            pickle.loads(bytes.fromhex({dumped.stdout.strip()!r}))
        except ValueError as exc:
            print("PLAIN:", exc)
    """, env={"VLLM_PLUGINS": ""})
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert "PLAIN: 'x.y.Z' is not a valid MLAPrefillBackendEnum" in loaded.stdout


def test_our_member_unpickles_in_a_fresh_process():
    dumped = run_python("""
        import pickle, sys
        from mla_plugins.vllm import register
        register()
        from vllm.v1.attention.backends.mla.prefill.registry import MLAPrefillBackendEnum as E
        sys.stdout.write(pickle.dumps(E["MLA_PLUGINS"]).hex())
    """, env={"VLLM_PLUGINS": ""})
    assert dumped.returncode == 0, dumped.stderr[-3000:]
    loaded = run_python(f"""
        import pickle
        from vllm.v1.attention.backends.mla.prefill.registry import MLAPrefillBackendEnum as E
        assert "MLA_PLUGINS" not in E.__members__
        member = pickle.loads(bytes.fromhex({dumped.stdout.strip()!r}))
        assert member is E["MLA_PLUGINS"], member
        print(member.name, member.get_path())
    """, env={"VLLM_PLUGINS": ""})
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert "MLA_PLUGINS mla_plugins.vllm.prefill.MLAPluginsPrefillBackend" in loaded.stdout
