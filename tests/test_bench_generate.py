"""The opt-in end-to-end benchmark (``fastpe bench --ops generate``), on a tiny Llama."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from fastpe.benchmarking.generate import IMPLEMENTATIONS, run_generate  # noqa: E402

TINY = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 96,
    "max_position_embeddings": 128,
}


def test_generate_rows_compare_with_sdpa_on_the_same_tokens():
    from transformers.models.llama import modeling_llama

    import fastpe.integrations.transformers_rope as tr

    original = modeling_llama.apply_rotary_pos_emb
    rows = run_generate(
        shape=TINY, sizes={"prefill": 40, "context": 24, "new_tokens": 5}, progress=lambda m: None
    )
    assert modeling_llama.apply_rotary_pos_emb is original and not tr._originals  # unpatched
    assert [(r["case"], r["impl"]) for r in rows] == [
        (case, impl) for impl in IMPLEMENTATIONS for case in ("prefill 40", "5 new after 24")
    ]
    for r in rows:
        assert r["same_tokens"], r
        assert r["max_abs_error"] < 1e-4, r  # float32 logits of fastpe vs SDPA
        assert r["median_s"] > 0 and r["throughput"] > 0
        assert (r["speedup_vs_best_baseline"] is None) == (r["impl"] == "sdpa")


def test_generate_is_not_in_the_default_grids():
    import fastpe.benchmarking as bm

    assert all(c.op != "generate" for c in bm.FULL_GRID + bm.QUICK_GRID)


def test_cli_runs_generate_only_when_asked(monkeypatch, tmp_path, capsys):
    import json

    import fastpe.benchmarking.generate as generate
    from fastpe import cli
    from fastpe.benchmarking import runner

    monkeypatch.setattr(runner, "measure_peaks", lambda: {"sgemm_gflops": 1.0, "copy_gbps": 1.0})
    monkeypatch.setattr(generate, "LLAMA_SHAPE", TINY)
    monkeypatch.setattr(generate, "SIZES", {"prefill": 24, "context": 16, "new_tokens": 3})
    out = tmp_path / "bench.json"
    argv = ["bench", "--device", "cpu", "--ops", "generate", "--json", str(out), "--plot", ""]
    assert cli.main(argv) == 0
    rows = json.loads(out.read_text())["results"]
    assert {r["op"] for r in rows} == {"generate"} and len(rows) == 2 * len(IMPLEMENTATIONS)
    assert "16 new after" not in capsys.readouterr().out  # the tiny sizes were used
