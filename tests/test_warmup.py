"""Compiling ahead (fastpe warmup), the compile notice, and the kernel cache commands.

Compiles happen in subprocesses with a fresh NUMBA_CACHE_DIR each, on the cheapest kernels
(the sinusoidal and RoPE tables); the only attention compile is in the test marked slow. A
compile is detected by fastpe's record of the kernels a process compiled (Numba raises its
compile event only on a cache miss), never by timing.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("numba")

from fastpe import _warmup  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
TIMEOUT = 300
NOTICE = "fastpe: compiling CPU kernel"


def run_python(code: str, cache: pathlib.Path, *args: str, **env) -> subprocess.CompletedProcess:
    environ = {**os.environ, "NUMBA_CACHE_DIR": str(cache)}
    environ.pop("FASTPE_QUIET_COMPILE", None)  # the caller's own setting would hide the notice
    environ.update(env)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=environ,
        timeout=TIMEOUT,
        check=False,
    )


def run_cli(*args: str, cache: pathlib.Path) -> subprocess.CompletedProcess:
    return run_python(
        f"import sys; from fastpe.cli import main; sys.exit(main({list(args)!r}))", cache
    )


# the table calls of a real workload: long tables run the parallel kernel, as warmup's do
TABLE_CALLS = """
import json, fastpe
from fastpe.kernels.numba import _runtime
fastpe.sinusoidal_table(4096, 512, backend="numba")
fastpe.rope_table(8192, 128, backend="numba")
print(json.dumps(_runtime.compiled_kernels))
"""


def test_work_item_functions_get_a_signed_index():
    # Numba types a parallel loop's index as int64 when it types the kernel and as uint64 where
    # it outlines the loop body, so a function called with the bare index compiles twice: the
    # attention backward's work item (its largest function) did, at every first backward call.
    import ast

    offenders = []
    for path in sorted((ROOT / "kernels" / "numba").glob("*.py")):
        for loop in ast.walk(ast.parse(path.read_text())):
            if not (
                isinstance(loop, ast.For)
                and isinstance(loop.iter, ast.Call)
                and getattr(loop.iter.func, "id", None) == "prange"
                and isinstance(loop.target, ast.Name)
            ):
                continue
            for call in (n for stmt in loop.body for n in ast.walk(stmt)):
                if isinstance(call, ast.Call) and isinstance(call.func, ast.Name):
                    passed = [*call.args, *(kw.value for kw in call.keywords)]
                    if any(getattr(a, "id", None) == loop.target.id for a in passed):
                        offenders.append(f"{path.name}:{call.lineno} {call.func.id}")
    assert not offenders, f"pass np.int64(index) to these: {offenders}"


def test_arrays_the_kernels_only_read_go_in_read_only():
    # Numba compiles a kernel again for a read-only array where it had a writable one: a table
    # fastpe cached, a broadcast position row or a caller's read-only ids would each cost a
    # compile. Every kernel signature compiled so far in this process has them read-only.
    import numpy as np
    from fastpe.kernels.numba import apply_rope, embed

    import fastpe

    x = np.ones((1, 2, 8, 16), np.float32)
    cos, sin = fastpe.rope_table(64, 16, backend="numpy")
    frozen = cos.copy()
    frozen.flags.writeable = False
    for table, positions in (
        (cos, np.arange(8)[None]),
        (frozen, np.broadcast_to(np.arange(8), (1, 8))),
    ):
        fastpe.apply_rope(x, table, sin, positions=positions, backend="numba")
        fastpe.apply_rope((x, x), table, sin, positions=positions, backend="numba")
        ids = np.arange(8)[None] if table is cos else np.broadcast_to(np.arange(8), (1, 8))
        fastpe.embed(ids, np.ones((16, 32), np.float32), pe="sinusoidal", backend="numba")
    kernels = {
        "apply_rope": (apply_rope._apply_rope_kernel.serial, (1, 2, 3)),
        "apply_rope pair": (apply_rope._apply_rope_pair, (6, 7, 8)),
        "embed": (embed._embed_kernel.serial, (0, 1, 3, 5)),
    }
    for name, (kernel, read) in kernels.items():
        assert kernel.overloads, name
        for signature in kernel.overloads:
            writable = [i for i in read if signature[i].mutable]
            assert not writable, f"{name}: arguments {writable} writable in {signature}"


def test_notice_once_per_compile_and_never_on_a_cache_hit(tmp_path):
    code = """
    import json, fastpe
    from fastpe.kernels.numba import _runtime
    _runtime.NOTICE_AFTER = 0.0  # these kernels compile in about a second: announce them all
    for dtype in ("float32", "float32", "float64"):
        fastpe.sinusoidal_table(8, 16, dtype=dtype, backend="numba")
    print(json.dumps(_runtime.compiled_kernels))
    """
    first = run_python(code, tmp_path)
    assert first.returncode == 0, first.stderr
    compiled = json.loads(first.stdout)
    notices = [line for line in first.stderr.splitlines() if line.startswith(NOTICE)]
    # one compile per dtype, each announced once, naming its kernel, dtype and cache
    assert len(compiled) == 2, compiled
    assert len(notices) == 2, first.stderr
    assert "float32" in notices[0] and "float64" in notices[1]
    for line in notices:
        assert "sinusoidal_table" in line and str(tmp_path) in line and "fastpe warmup" in line
    # a new process with the same cache loads both: nothing compiled, nothing said
    second = run_python(code, tmp_path)
    assert second.returncode == 0, second.stderr
    assert json.loads(second.stdout) == []
    assert NOTICE not in second.stderr


def test_notice_silenced_by_the_environment_and_by_logging(tmp_path):
    code = """
    import json, logging, sys, fastpe
    from fastpe.kernels.numba import _runtime
    _runtime.NOTICE_AFTER = 0.0
    if sys.argv[1:] == ["logging"]:  # an application's logging configuration
        logging.getLogger("fastpe").setLevel(logging.ERROR)
    fastpe.sinusoidal_table(8, 16, backend="numba")
    print(json.dumps(_runtime.compiled_kernels))
    """
    quiet = run_python(code, tmp_path / "a", FASTPE_QUIET_COMPILE="1")
    logged = run_python(code, tmp_path / "b", "logging")
    for result in (quiet, logged):
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)  # it did compile, silently
        assert NOTICE not in result.stderr


@pytest.fixture(scope="module")
def warmed(tmp_path_factory):
    """A cache filled by `fastpe warmup` for the two table ops, on two worker processes."""
    cache = tmp_path_factory.mktemp("warmed")
    result = run_cli(
        "warmup", "--ops", "sinusoidal_table", "rope_table", "--jobs", "2", cache=cache
    )
    return cache, result


def test_warmup_compiles_what_a_later_process_uses(warmed, tmp_path):
    cache, result = warmed
    assert result.returncode == 0, result.stderr
    # progress on stderr, one line per item; the summary on stdout
    assert "[1/2]" in result.stderr and "[2/2]" in result.stderr
    assert "on 2 worker process(es)" in result.stdout
    assert "check: a fresh process loaded every kernel from the cache" in result.stdout
    assert f"cache: {cache}" in result.stdout
    compiles = int(result.stdout.split("; ")[1].split()[0])
    assert compiles >= 2, result.stdout
    # the same calls on a cold cache compile (the counter can see a compile) ...
    cold = run_python(TABLE_CALLS, tmp_path)
    assert cold.returncode == 0, cold.stderr
    assert len(json.loads(cold.stdout)) >= 2
    # ... and after warmup, workload-sized calls in a new process compile nothing
    later = run_python(TABLE_CALLS, cache)
    assert later.returncode == 0, later.stderr
    assert json.loads(later.stdout) == []


def test_warmup_in_process_from_python(tmp_path):
    code = """
    import fastpe
    report = fastpe.warmup(["sinusoidal_table"], ["float64"], jobs=0, progress=False)
    print(report.summary())
    assert report.ok and report.results[0].compiled, report.summary()
    """
    result = run_python(code, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "sinusoidal_table float64" in result.stdout
    assert "in this process; 1 kernel compile(s)" in result.stdout
    assert "check: a fresh process loaded every kernel from the cache" in result.stdout


def test_info_and_cache_clear(warmed):
    cache, _ = warmed
    info = run_cli("info", cache=cache)
    assert info.returncode == 0, info.stderr
    line = next(line for line in info.stdout.splitlines() if "kernel cache" in line)
    assert str(cache) in line and "0 compiled kernels" not in line
    stranger = cache / "not-fastpe.txt"  # a file fastpe did not write stays
    stranger.write_text("keep")
    shown = run_cli("cache", "info", cache=cache)
    kernels = int(shown.stdout.split("(")[1].split()[0])
    assert kernels >= 2, shown.stdout
    cleared = run_cli("cache", "clear", cache=cache)
    assert cleared.returncode == 0, cleared.stderr
    assert cleared.stdout.startswith(f"removed {kernels} compiled kernels"), cleared.stdout
    assert "0 compiled kernels of 0 functions" in run_cli("cache", "info", cache=cache).stdout
    assert stranger.read_text() == "keep"
    # emptied, the cache is refilled by the next compile as usual
    again = run_python(TABLE_CALLS, cache)
    assert again.returncode == 0, again.stderr
    assert len(json.loads(again.stdout)) >= 2


# a generated module as flex_attention writes one (a trivial kernel: the cheapest compile)
VARIANT_CALL = """
import json
from fastpe.kernels.numba import _runtime, flex_attention
module = flex_attention.load_variant(
    "from fastpe.kernels.numba._runtime import njit\\n"
    "@njit(cache=True)\\ndef plus_one(x):\\n    return x + 1\\n"
)
assert module.plus_one(1) == 2
print(json.dumps(_runtime.compiled_kernels))
"""


def test_cache_clear_removes_generated_variants(tmp_path):
    """Generated modules (flex_attention's variants) and their compiled kernels, which Numba
    keeps in a folder of its own, are counted by `cache info` and removed by `cache clear`."""
    cache = tmp_path / "cache"
    made = run_python(VARIANT_CALL, cache)
    assert made.returncode == 0, made.stderr
    assert any("plus_one" in name for name in json.loads(made.stdout)), made.stdout
    numba_files = [p for p in cache.rglob("*") if p.suffix in (".nbi", ".nbc")]
    sources = list(cache.rglob("flex_*.py"))
    assert len(sources) == 1 and numba_files, sorted(cache.rglob("*"))
    shown = run_cli("cache", "info", cache=cache).stdout
    assert "1 generated flex_attention variants" in shown, shown
    cleared = run_cli("cache", "clear", cache=cache)
    assert cleared.returncode == 0, cleared.stderr
    assert "and 1 generated flex_attention variants" in cleared.stdout, cleared.stdout
    left = [p for p in cache.rglob("*") if p.is_file()]
    assert left == [], left  # the module, Numba's files of its kernel and their lock files
    assert (
        "0 compiled kernels of 0 functions, 0 generated"
        in run_cli("cache", "info", cache=cache).stdout
    )


def test_cache_commands_without_a_writable_cache(monkeypatch, capsys):
    # what the runtime reports on a read-only install with no usable NUMBA_CACHE_DIR (made
    # for real in test_numba_runtime.py's read-only test)
    from fastpe.kernels.numba import _runtime

    from fastpe.cli import main

    monkeypatch.setattr(_runtime, "cache_directory", lambda: None)
    assert main(["cache", "clear"]) == 0
    assert "no writable cache directory (nothing to remove)" in capsys.readouterr().out
    assert main(["cache", "info"]) == 0
    assert "set NUMBA_CACHE_DIR to a writable directory" in capsys.readouterr().out
    assert _warmup.cache_stats() == {
        "directory": None,
        "bytes": 0,
        "kernels": 0,
        "functions": 0,
        "variants": 0,
    }


def test_import_stays_light():
    result = subprocess.run(
        [sys.executable, "-c", "import sys, fastpe; fastpe.warmup; print('numba' in sys.modules)"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=True,
    )
    assert result.stdout.strip() == "False"


# ---------------------------------------------------------------- plans from model configs

LLAMA = {
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "hidden_size": 4096,
    "torch_dtype": "bfloat16",
    "sliding_window": None,
}
GPT_OSS = {
    "model_type": "gpt_oss",
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "hidden_size": 2880,
    "sliding_window": 128,
    "torch_dtype": "bfloat16",
}


def write_config(folder: pathlib.Path, config: dict) -> pathlib.Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.json"
    path.write_text(json.dumps(config))
    return path


def test_plan_for_a_llama_config(tmp_path):
    path = write_config(tmp_path / "llama", LLAMA)
    (item,) = _warmup.plan(model_config=str(path))
    assert (item.op, item.dtype, item.features) == ("attention", "bfloat16", ("causal", "decode"))
    assert (item.heads, item.kv_heads, item.head_dim) == (32, 8, 128)
    # a directory holding config.json reads the same; --dtype and --ops override the config's
    assert _warmup.plan(model_config=str(tmp_path / "llama")) == [item]
    items = _warmup.plan(ops=["attention", "apply_rope"], dtypes=["float32"], model_config=path)
    assert [(i.op, i.dtype, i.features) for i in items] == [
        ("attention", "float32", ("causal", "decode")),
        ("apply_rope", "float32", ()),
    ]


def test_plan_for_gpt_oss_and_gemma_configs(tmp_path):
    (item,) = _warmup.plan(model_config=write_config(tmp_path / "oss", GPT_OSS))
    assert item.features == ("causal", "window", "sinks", "decode")
    assert (item.heads, item.kv_heads, item.head_dim, item.window) == (64, 8, 64, 128)
    gemma = {
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "attn_logit_softcapping": 50.0,
        "sliding_window": 4096,
    }
    (item,) = _warmup.plan(model_config=gemma)
    assert (item.dtype, item.features, item.softcap) == (
        "float32",
        ("causal", "window", "softcap", "decode"),
        50.0,
    )
    flash = _warmup.plan(model_config=gemma, flash=True)
    assert [i.op for i in flash] == ["attention_varlen", "attention"]


def test_warmup_cli_dry_run_and_errors(tmp_path, capsys):
    from fastpe.cli import main

    path = write_config(tmp_path / "oss", GPT_OSS)
    assert main(["warmup", "--model-config", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.strip() == (
        "attention bfloat16 causal window sinks decode  (heads 64, kv heads 8, head dim 64)"
    )
    assert (
        main(
            [
                "warmup",
                "--ops",
                "attention",
                "--dtype",
                "fp32",
                "bf16",
                "--features",
                "causal",
                "window",
                "softcap",
                "--dry-run",
            ]
        )
        == 0
    )
    assert (
        capsys.readouterr()
        .out.splitlines()[1]
        .startswith("attention bfloat16 causal window softcap")
    )
    assert main(["warmup", "--model-config", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert "no such config.json" in err and "never downloads" in err
    with pytest.raises(SystemExit):
        main(["warmup", "--features", "teleport"])


def test_workers_only_for_several_attention_items(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert _warmup.default_jobs(_warmup.plan(["sinusoidal_table", "rope_table", "embed"])) == 0
    assert _warmup.default_jobs(_warmup.plan(["attention", "embed"])) == 0
    assert _warmup.default_jobs(_warmup.plan(["attention"], ["float32", "bfloat16"])) == 2
    assert (
        _warmup.default_jobs(
            _warmup.plan(["attention", "attention_varlen"], ["float32", "bfloat16"])
        )
        == 2
    )


def test_item_calls_reach_both_twins_and_decode():
    """Each attention item calls above and below the serial limit (both compiled twins), and
    one-row decode calls with 'decode'; checked on the plan's sizes, without compiling."""
    from fastpe.kernels.numba.attention import SERIAL_WORK

    (item,) = _warmup.plan(["attention"], features=["causal", "decode"])
    sizes = [tuple(int(x) for x in label.split()[1::2]) for label, _ in _warmup._calls(item)]
    work = [item.heads * sq * sk * 2 * item.head_dim for sq, sk in sizes]
    assert min(work) <= SERIAL_WORK < max(work)
    assert any(sq == 1 and w > SERIAL_WORK for (sq, _), w in zip(sizes, work, strict=True))
    assert any(sq == 1 and w <= SERIAL_WORK for (sq, _), w in zip(sizes, work, strict=True))


def test_mask_feature_warms_calls_with_and_without_the_mask(monkeypatch):
    """A padding mask as transformers builds it comes with padded batches only: the 'mask'
    feature makes every attention call with the mask and again without, which runs the kernel
    version without score modifiers (recorded on the float64 oracle: nothing compiles)."""
    import fastpe

    seen = []
    attention = fastpe.attention

    def recording(*args, **kwargs):
        seen.append(("mask" in kwargs, kwargs.get("causal"), tuple(args[0].shape)))
        return attention(*args, **{**kwargs, "backend": "numpy"})

    monkeypatch.setattr(fastpe, "attention", recording)
    (item,) = _warmup.plan(["attention"], features=["causal", "mask", "decode"])
    for _, call in _warmup._calls(item):
        call()
    masked = {(causal, shape) for has_mask, causal, shape in seen if has_mask}
    unmasked = {(causal, shape) for has_mask, causal, shape in seen if not has_mask}
    assert masked and masked == unmasked, seen


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_planned_call_is_a_valid_call(dtype, monkeypatch):
    """Every call of every op's item, with every feature, is accepted by fastpe's validation
    (run on the float64 oracle instead of the kernels: nothing compiles)."""
    if dtype == "bfloat16":
        pytest.importorskip("torch")
    import fastpe

    for name in _warmup.OPS:
        op = getattr(fastpe, name)
        monkeypatch.setattr(
            fastpe, name, lambda *a, _op=op, **kw: _op(*a, **{**kw, "backend": "numpy"})
        )
    features = (
        _warmup.FEATURES
        if dtype == "bfloat16"
        else [f for f in _warmup.FEATURES if f != "backward"]
    )
    for item in _warmup.plan(list(_warmup.OPS), [dtype], features):
        calls = _warmup._calls(item)
        assert calls, item
        for _, call in calls:
            call()


def test_register_warmup_for_a_config_and_on_first_use(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    import fastpe
    from fastpe.integrations import transformers as integration

    calls = []
    monkeypatch.setattr(fastpe, "warmup", lambda **kw: calls.append(kw) or _Done())
    monkeypatch.setattr(integration, "_warmed", set())
    monkeypatch.setattr(integration, "_warm_on_first_use", set())
    path = write_config(tmp_path / "llama", LLAMA)
    integration.register("fastpe_test_warm", warmup=str(path))
    assert calls == [{"model_config": str(path), "flash": False, "check": False}]
    integration.register("fastpe_test_warm", warmup=str(path))  # once per config
    assert len(calls) == 1
    # warmup=True: at the first attention call, for the calling model's config, in the dtype
    # the model runs in
    integration.register("fastpe_test_warm", warmup=True)

    class Module:
        config = dict(LLAMA, num_attention_heads=4, num_key_value_heads=2, hidden_size=64)
        is_causal = True
        training = False

    q = torch.zeros(1, 4, 3, 16)
    k = v = torch.zeros(1, 2, 3, 16)
    monkeypatch.setattr(fastpe, "attention", lambda *a, **kw: q)
    integration.fastpe_attention_forward(Module(), q, k, v, None)
    integration.fastpe_attention_forward(Module(), q, k, v, None)
    assert len(calls) == 2
    config = calls[1]["model_config"]
    assert config["num_attention_heads"] == 4 and config["torch_dtype"] == "float32"


def test_register_flash_warmup_on_first_call_plans_from_the_query(monkeypatch):
    pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    import fastpe
    from fastpe.integrations import transformers as integration

    calls = []
    monkeypatch.setattr(fastpe, "warmup", lambda **kw: calls.append(kw) or _Done())
    monkeypatch.setattr(integration, "_warmed", set())
    monkeypatch.setattr(integration, "_warm_on_first_use", set())
    integration.register_flash("fastpe_flash_test_warm", warmup=True)
    assert calls == []  # nothing until the first call
    monkeypatch.setattr(fastpe, "attention", lambda q, *a, **kw: q)
    q = torch.zeros(1, 5, 6, 32, dtype=torch.bfloat16)  # [B, S, H, D]
    integration._flash_func(q, q[:, :, :2], q[:, :, :2], causal=True)
    integration._flash_func(q, q[:, :, :2], q[:, :, :2], causal=True)
    (call,) = calls
    assert call["flash"] is True
    (item, *rest) = _warmup.plan(model_config=call["model_config"], flash=True)
    assert (item.op, item.dtype, item.heads, item.head_dim) == (
        "attention_varlen",
        "bfloat16",
        6,
        32,
    )
    assert {"causal", "decode", "window", "softcap", "sinks"} <= set(item.features)


class _Done:
    def summary(self):
        return "done"


TINY_LLAMA = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 200,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}


def test_warmup_model_config_then_generate_and_real_calls_compile_nothing(tmp_path):
    """The file's one attention compile: `fastpe warmup --model-config` for a Llama-shaped
    config, then a new process's generate() through register() and real-shaped prefill
    (B1 H8 S256 D64) and decode calls compile nothing."""
    pytest.importorskip("transformers")
    folder = tmp_path / "tiny-llama"
    write_config(folder, TINY_LLAMA)
    result = run_cli("warmup", "--model-config", str(folder), "--no-check", cache=tmp_path)
    assert result.returncode == 0, result.stderr + result.stdout
    assert "attention float32 causal decode" in result.stdout
    later = run_python(
        f"""
        import json, numpy as np, torch, fastpe
        from transformers import LlamaConfig, LlamaForCausalLM
        from fastpe.integrations.transformers import register
        from fastpe.kernels.numba import _runtime
        config = LlamaConfig.from_pretrained({str(folder)!r})
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).eval()
        model.set_attn_implementation(register())
        with torch.no_grad():
            model.generate(torch.randint(0, 200, (1, 12)), max_new_tokens=4, do_sample=False)
        rng = np.random.default_rng(0)
        q, k, v = (rng.standard_normal((1, 8, 256, 64), dtype=np.float32) for _ in range(3))
        fastpe.attention(q, k, v, causal=True)
        fastpe.attention(q[:, :, -1:], k, v, causal=True)  # a decode step
        k, v = (rng.standard_normal((1, 8, 20000, 64), dtype=np.float32) for _ in range(2))
        fastpe.attention(q[:, :, -1:], k, v, causal=True)  # a decode step on a long cache
        print(json.dumps(_runtime.compiled_kernels))
        """,
        tmp_path,
    )
    assert later.returncode == 0, later.stderr
    assert json.loads(later.stdout.splitlines()[-1]) == []
