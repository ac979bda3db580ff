"""The NumPy engine on the tiny model of every family (tests/data/fixtures/arch): logits against
transformers and llama.cpp, batched decode against solo decode, sliding windows past their end,
MoE routing reading only the chosen experts, and the refusal of weights that will not fit."""

from __future__ import annotations

import dataclasses
from functools import cache

import numpy as np
import pytest

from lmserve.engine_cpu import CPUEngine
from lmserve.engine_cpu import ops as ops_module
from lmserve.engine_cpu import weights as weights_module
from lmserve.engine_cpu.engine import kernels_available
from lmserve.engine_cpu.qmatrix import ExpertStack, Matrix, MatrixStack, QuantMatrix
from lmserve.engine_cpu.weights import AttentionWeights
from lmserve.model.config import ModelConfig
from lmserve.model.gguf_file import GGUFFile, ModelLoadError
from tests.families import Fixture, check_against_references, fixtures, references

pytestmark = pytest.mark.fast  # in-process: part of `scripts/test.sh -m fast`

NEW_FAMILIES = ("qwen35", "qwen35moe", "gemma4")  # issue 25's: hybrid layers, Gemma 4's per-layer shapes


@cache
def engine(fixture: Fixture) -> CPUEngine:
    """One engine per file for the whole module (they are a few MB each); tests must not change
    its weights."""
    gguf = GGUFFile(fixture.path)
    return CPUEngine(gguf, ModelConfig.from_gguf(gguf))


def token_ids(family: str) -> list[int]:
    return references(family)["token_ids"]


@pytest.mark.parametrize("fixture", fixtures(), ids=lambda f: f.id)
def test_prefill_matches_the_references(fixture: Fixture) -> None:
    e = engine(fixture)
    ids = token_ids(fixture.family)
    logits = e.prefill(e.new_cache(len(ids)), ids, all_logits=True)
    assert logits.shape == (len(ids), e.config.vocab_size) and logits.dtype == np.float32
    check_against_references(fixture, logits)


def test_the_fixtures_exercise_what_they_claim() -> None:
    """The family facts the engine acts on are there to be tested (guards the fixtures)."""
    cfg = {f: engine(Fixture(f, "F16")).config for f in ("qwen3moe", "gemma3", "phi3", "gpt-oss")}
    assert cfg["qwen3moe"].is_moe and not cfg["qwen3moe"].expert_bias
    assert cfg["gemma3"].sliding_window == 16 and cfg["gemma3"].post_norms and cfg["gemma3"].rope_theta_local
    assert cfg["phi3"].fused_qkv and cfg["phi3"].fused_gate_up
    gpt = cfg["gpt-oss"]
    assert gpt.is_moe and gpt.expert_bias and gpt.attn_sinks and gpt.rope_yarn and any(gpt.sliding_layers)


def test_the_new_fixtures_exercise_what_they_claim() -> None:
    """Qwen3.5's hybrid layers with tiled value heads, its output gate and partial rotary; its MoE's
    shared expert; Gemma 4's per-layer heads, keys-as-values, proportional rope, experts beside
    the dense FFN, layer scale and softcapping."""
    cfg = {f: engine(Fixture(f, "F16")).config for f in NEW_FAMILIES}
    for family in ("qwen35", "qwen35moe"):
        c, la = cfg[family], cfg[family].linear_attention
        assert c.is_hybrid and c.attn_output_gate and c.rotary_dims < c.head_dim
        assert la is not None and la.k_heads < la.v_heads
    assert cfg["qwen35moe"].is_moe and engine(Fixture("qwen35moe", "F16")).weights.layers[0].experts.shared
    g = cfg["gemma4"]
    assert len(set(g.layer_head_dims)) == len(set(g.layer_kv_heads)) == 2 and any(g.values_from_keys)
    assert g.has_rope_freqs and g.rope_dims_local and g.final_softcap and g.layer_output_scale
    assert g.is_moe and g.moe_dense_ffn and g.value_norm and g.sliding_window == 16


@pytest.mark.parametrize("family", ["qwen3moe", "gemma3", "gpt-oss", "qwen35", "qwen35moe", "gemma4"])
def test_batched_decode_equals_solo(family: str) -> None:
    e = engine(Fixture(family, "F16"))
    ids = token_ids(family)
    prompts = [ids[:24], ids[30:37]]  # one already past the 16-position window, one not
    caches = [e.new_cache(64) for _ in prompts]
    fed = [[int(e.prefill(c, p).argmax())] for c, p in zip(caches, prompts, strict=True)]
    batched = []
    for _ in range(13):  # the short prompt crosses the window while decoding
        batched.append(e.decode(caches, [tokens[-1] for tokens in fed]))
        for tokens, row in zip(fed, batched[-1], strict=True):
            tokens.append(int(row.argmax()))
    for i, prompt in enumerate(prompts):
        alone = e.new_cache(64)
        e.prefill(alone, prompt)
        solo = np.stack([e.decode([alone], [token])[0] for token in fed[i][:-1]])
        np.testing.assert_allclose(np.stack(batched)[:, i], solo, rtol=1e-5, atol=1e-5)
        assert alone.length == caches[i].length == len(prompt) + len(batched)


@pytest.mark.parametrize("family", ["gemma3", "gpt-oss", "gemma4"])
def test_decode_past_the_sliding_window_matches_prefill_and_reference(family: str) -> None:
    """Prefill 10 tokens (inside the 16-position window), then decode the other 54 one at a
    time: each step sees only its window on the sliding layers, as the prefill's mask does. Within
    1e-4 of the logits' range: where AMX tiles take a prompt pass's attention, its products are
    within about 1e-5 of float32's (lmserve/engine_cpu/amx_attention.py), a decode step's are
    float32's."""
    e = engine(Fixture(family, "F16"))
    ids = token_ids(family)
    assert len(ids) > 3 * e.config.sliding_window
    whole = e.prefill(e.new_cache(len(ids)), ids, all_logits=True)
    c = e.new_cache(len(ids))
    stepped = [e.prefill(c, ids[:10])]
    stepped += [e.decode([c], [token])[0] for token in ids[10:]]
    np.testing.assert_allclose(np.stack(stepped), whole[9:], rtol=1e-4, atol=1e-4 * np.abs(whole).max())
    reference = references(family)["reference"]["top1"][9:]
    assert sum(a == b for a, b in zip(np.argmax(stepped, -1).tolist(), reference, strict=True)) >= len(reference) - 1


@pytest.mark.parametrize("family", ["gemma3", "gpt-oss", "gemma4"])
def test_the_sliding_window_is_what_the_reference_applies(family: str) -> None:
    """The same model with its windows removed sees far too much: past the window it no longer
    agrees with transformers (guards against a window that is computed but never applied)."""
    gguf = GGUFFile(Fixture(family, "F16").path)
    e = CPUEngine(gguf, ModelConfig.from_gguf(gguf))  # its own: the weights are changed here
    window = e.config.sliding_window
    attention = [layer.mixer for layer in e.weights.layers]
    assert all(isinstance(a, AttentionWeights) for a in attention)
    assert [a.window for a in attention] == [window if s else 0 for s in e.config.sliding_layers]
    for a in attention:
        a.window = 0
    ids = token_ids(family)
    top1 = e.prefill(e.new_cache(len(ids)), ids, all_logits=True).argmax(-1).tolist()
    reference = references(family)["reference"]["top1"]
    assert top1[:window] == reference[:window]  # inside the window nothing changes
    assert sum(a == b for a, b in zip(top1[window:], reference[window:], strict=True)) < (len(ids) - window) // 2


@pytest.mark.parametrize("family", ["qwen3moe", "qwen35moe", "gemma4"])
def test_moe_decode_reads_only_the_chosen_experts(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """One decode row runs its k experts per layer, and no other (matrices told apart by their
    data: each expert's slice of the stacked tensor is a fresh view), whether they run one by one
    or in one grouped call."""
    e = engine(Fixture(family, "F16"))
    c = e.new_cache(16)
    e.prefill(c, token_ids(family)[:8])
    read: set[int] = set()
    real = ops_module.linear

    def data(w: Matrix) -> int:
        first = w.parts[0] if isinstance(w, MatrixStack) else w
        return (first.q if isinstance(first, QuantMatrix) else first).__array_interface__["data"][0]

    real_grouped = ExpertStack.times_grouped

    def linear(x: np.ndarray, w: Matrix) -> np.ndarray:
        read.add(data(w))
        return real(x, w)

    def times_grouped(stack: ExpertStack, x: np.ndarray, experts: np.ndarray, firsts: np.ndarray,
                      rows: np.ndarray | None = None) -> np.ndarray:
        read.update(data(stack[e]) for e in experts.tolist())
        return real_grouped(stack, x, experts, firsts, rows)

    monkeypatch.setattr(ops_module, "linear", linear)
    monkeypatch.setattr(ExpertStack, "times_grouped", times_grouped)
    e.decode([c], [5])
    for layer in e.weights.layers:
        assert layer.experts is not None
        for stacked in (layer.experts.gate_up, layer.experts.down):
            pointers = {data(matrix) for matrix in stacked}
            assert len(pointers) == e.config.n_experts
            assert len(pointers & read) == e.config.n_experts_used


def test_refuses_weights_that_do_not_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    fixture = Fixture("gemma3", "Q4_K_M")
    gguf = GGUFFile(fixture.path)
    config = ModelConfig.from_gguf(gguf)
    quantized = kernels_available()
    need = weights_module.weight_bytes(gguf, config, quantized)
    read = []
    monkeypatch.setattr(weights_module._Loader, "run",
                        lambda self, *a: read.append(a) or pytest.fail("read before the check"))
    with pytest.raises(ModelLoadError) as info:
        CPUEngine(gguf, config, available_memory=need - 1)
    message = str(info.value)
    assert message.startswith(f"the NumPy engine needs {need / 2**20:.0f} MiB for this model's weights (")
    assert f"x the {fixture.path.stat().st_size / 2**20:.0f} MiB file) but {(need - 1) / 2**20:.0f} MiB is available" \
        in message
    assert "--engine mlx" in message and "smaller quant" in message and not read

    # None asks psutil, as a test server's --available-memory hook does.
    import psutil

    real = psutil.virtual_memory
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real()._replace(available=need - 1))
    with pytest.raises(ModelLoadError, match=f"but {(need - 1) / 2**20:.0f} MiB is available"):
        CPUEngine(gguf, config)


def test_weight_bytes_count_float32_and_the_kept_quants() -> None:
    """Float32 is 4 bytes a parameter; kept Q4_K matrices are packed nibbles (0.59 bytes with their
    scales), Q6_K six bits (0.91), the rest (norms) float32: 0.645 a parameter in all (0.677 with
    Q6_K as int8)."""
    gguf = GGUFFile(Fixture("gemma3", "Q4_K_M").path)
    config = ModelConfig.from_gguf(gguf)
    assert weights_module.weight_bytes(gguf, config, quantized=False) == 4 * config.n_params
    assert 0.59 * config.n_params < weights_module.weight_bytes(gguf, config, quantized=True) < 0.65 * config.n_params


def test_loads_when_the_weights_fit_exactly() -> None:
    gguf = GGUFFile(Fixture("qwen3moe", "Q8_0").path)
    config = ModelConfig.from_gguf(gguf)
    for quantized in {False, kernels_available()}:
        need = weights_module.weight_bytes(gguf, config, quantized)
        e = CPUEngine(gguf, config, available_memory=need, quantized=quantized)
        assert e.weight_bytes == need


def test_partial_rotary_rotates_the_first_dimensions_only() -> None:
    """Phi-4-mini rotates 3/4 of each head: Hugging Face's form, written out here, on a Phi-3
    engine whose config asks for 32 of 64 dimensions."""
    gguf = GGUFFile(Fixture("phi3", "F16").path)
    config = dataclasses.replace(ModelConfig.from_gguf(gguf), rope_dims=32)
    e = CPUEngine(gguf, config)
    rot = config.rotary_dims
    inv_freq = 1.0 / config.rope_theta ** (np.arange(0, rot, 2) / rot)
    np.testing.assert_allclose(e.weights.rope.inv_freq, inv_freq, rtol=1e-12)
    x = np.random.default_rng(0).standard_normal((5, 3, config.head_dim)).astype(np.float32)
    positions = np.arange(7, 12)
    angles = np.concatenate([np.outer(positions, inv_freq)] * 2, axis=-1)[:, None, :]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    rotate_half = np.concatenate([-x_rot[..., rot // 2:], x_rot[..., :rot // 2]], axis=-1)
    want = np.concatenate([x_rot * np.cos(angles) + rotate_half * np.sin(angles), x_pass], axis=-1)
    got = ops_module.rope(x, *ops_module.rope_tables(positions, e.weights.rope.inv_freq))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    ids = token_ids("phi3")[:20]
    assert np.isfinite(e.prefill(e.new_cache(20), ids)).all()


def test_linear_rope_scaling_stretches_the_global_layers_only() -> None:
    """Gemma 3 4B-27B files say `rope.scaling.type = linear` (factor 8): llama.cpp and
    transformers divide the global layers' frequencies by it, and leave the sliding layers' alone."""
    plain_file, scaled_file = (GGUFFile(Fixture("gemma3", "F16").path) for _ in range(2))
    scaled_file.metadata.update({"gemma3.rope.scaling.type": "linear", "gemma3.rope.scaling.factor": 8.0})
    plain, scaled = (CPUEngine(f, ModelConfig.from_gguf(f)).weights for f in (plain_file, scaled_file))
    assert plain.rope_local is not None and scaled.rope_local is not None
    np.testing.assert_allclose(scaled.rope.inv_freq, plain.rope.inv_freq / 8)
    np.testing.assert_array_equal(scaled.rope_local.inv_freq, plain.rope_local.inv_freq)
