"""The MLX engine (mlx-lm's own model classes) on the tiny model of every family in
tests/data/fixtures/arch: logits against transformers and llama.cpp, Llama 3's rope_freqs and
Gemma 4's proportional rotary, teacher-forced decoding of several rows at once against each row
alone and against a prefill (MoE routing, sliding windows crossed mid-decode, Qwen3.5's recurrent
layers), expert stacks kept quantized, and the refusal of what mlx-lm's classes would compute
wrongly; rope scalings (linear, gpt-oss's unrounded YaRN, Phi's LongRoPE) and MXFP4 experts. On
Linux this is MLX's CPU backend."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter
from gguf import quants as gguf_quants

mx = pytest.importorskip("mlx.core")

from lmserve.engine_mlx import MLXEngine  # noqa: E402
from lmserve.engine_mlx import engine as engine_module  # noqa: E402
from lmserve.engine_mlx.model import build_model, gguf_names  # noqa: E402
from lmserve.engine_mlx.weights import convert, reads_natively  # noqa: E402
from lmserve.model import families  # noqa: E402
from lmserve.model.config import ModelConfig  # noqa: E402
from lmserve.model.gguf_file import GGUFFile, ModelLoadError  # noqa: E402
from tests.families import Fixture, check_against_references, fixtures, references  # noqa: E402

pytestmark = pytest.mark.fast  # in-process: part of `scripts/test.sh -m fast`


class Engines:
    """One engine per file for the module, converted weights cached in a temporary directory
    (never the user's); tests must not change an engine's weights."""

    def __init__(self, weights_dir: Path) -> None:
        self.weights_dir = weights_dir
        self.loaded: dict[Fixture, MLXEngine] = {}

    def __call__(self, fixture: Fixture) -> MLXEngine:
        if fixture not in self.loaded:
            gguf = GGUFFile(fixture.path)
            self.loaded[fixture] = MLXEngine(gguf, ModelConfig.from_gguf(gguf), cache_dir=self.weights_dir)
        return self.loaded[fixture]


@pytest.fixture(scope="module")
def load(tmp_path_factory: pytest.TempPathFactory) -> Engines:
    return Engines(tmp_path_factory.mktemp("mlx-weights"))


def ids_of(family: str) -> list[int]:
    return references(family)["token_ids"]


@pytest.mark.parametrize("fixture", fixtures(), ids=lambda f: f.id)
def test_every_position_agrees_with_the_references(fixture: Fixture, load: Engines) -> None:
    engine = load(fixture)
    assert engine.weights_from.endswith("(native)") == (fixture.quant != "Q4_K_M")
    everything = engine.prefill(engine.new_cache(64), ids_of(fixture.family), all_logits=True)
    assert everything.dtype == np.float32 and everything.shape == (64, 512)
    check_against_references(fixture, everything)


def test_llama3_rotates_by_the_rope_freqs_tensor(load: Engines) -> None:
    """Each pair's period is base^(2i/d) times the file's divisor; with plain periods the model
    falls back below the acceptance floor (60/64: what ignoring rope_freqs gave)."""
    fixture = Fixture("llama3", "F16")
    engine, gguf = load(fixture), GGUFFile(fixture.path)
    config = engine.config
    divisors = gguf.dequantize("rope_freqs.weight")
    assert config.has_rope_freqs and (divisors > 1).any()
    plain = config.rope_theta ** (np.arange(0, config.head_dim, 2) / config.head_dim)
    rope = engine.model.layers[0].self_attn.rope
    np.testing.assert_allclose(np.array(rope._freqs), plain * divisors, rtol=1e-5)
    unscaled = MLXEngine(gguf, config)  # its own: its ropes are changed here
    for layer in unscaled.model.layers:
        layer.self_attn.rope._freqs = mx.array(plain, mx.float32)
    top1 = unscaled.prefill(unscaled.new_cache(64), ids_of("llama3"), all_logits=True).argmax(-1)
    assert sum(top1 == np.array(references("llama3")["reference"]["top1"])) < 63


def test_linear_rope_scaling_stretches_gemma3_global_layers() -> None:
    """`rope.scaling.type = linear` (Gemma 3 4B-27B, factor 8), which ModelConfig does not carry:
    positions of the global layers are divided by it, the sliding layers keep their own base."""
    gguf = GGUFFile(Fixture("gemma3", "F16").path)
    gguf.metadata.update({"gemma3.rope.scaling.type": "linear", "gemma3.rope.scaling.factor": 8.0})
    config = ModelConfig.from_gguf(gguf)
    ropes = [layer.self_attn.rope for layer in build_model(config, gguf).layers]
    assert [(r.base, r.scale) for r in ropes] == [(10_000.0, 1.0)] * 5 + [(config.rope_theta, 1 / 8)]


def test_gemma4_global_layers_rotate_a_quarter_of_their_dims(load: Engines) -> None:
    """Gemma 4's global layers use "proportional" rope (a quarter of the head rotated, frequencies
    over the whole head): llama.cpp's file says so with rope_freqs entries of 1e30 for the pairs
    left still, which become the periods of mlx-lm's ProportionalRoPE; the sliding layers rotate
    all their dims with their own base."""
    from mlx_lm.models.rope_utils import ProportionalRoPE

    engine = load(Fixture("gemma4", "F16"))
    sliding, full = (layer.self_attn.rope for layer in engine.model.layers)
    d = engine.config.head_size(1)
    theirs = ProportionalRoPE(d, d // 4, base=engine.config.rope_theta)
    periods = np.array(full._freqs)
    np.testing.assert_allclose(periods[:d // 8], np.array(theirs._freqs)[:d // 8], rtol=1e-6)
    assert (periods[d // 8:] > 1e29).all()
    assert (sliding.dims, sliding.base) == (engine.config.head_size(0), engine.config.rope_theta_local)


def test_gpt_oss_yarn_range_is_left_unrounded(load: Engines) -> None:
    """gpt-oss's YaRN blends inverse frequencies over an unrounded correction range (its config's
    `truncate: false`), mlx-lm's YarnRoPE over a rounded one: the engine gives it transformers'."""
    engine = load(Fixture("gpt-oss", "F16"))
    yarn, d, base = engine.config.rope_yarn, engine.config.head_dim, engine.config.rope_theta
    assert yarn is not None and not yarn.truncate
    low, high = (d * math.log(yarn.original_context / (b * 2 * math.pi)) / (2 * math.log(base))
                 for b in (yarn.beta_fast, yarn.beta_slow))
    low, high = max(low, 0), min(high, d - 1)  # here 0 and 8.09, where rounding makes 9
    kept = 1 - np.clip((np.arange(d // 2) - low) / (high - low), 0, 1)  # the original frequency's share
    inv_freq = base ** -(np.arange(0, d, 2) / d) * (kept + (1 - kept) / yarn.factor)
    rope = engine.model.layers[0].self_attn.rope
    np.testing.assert_allclose(1 / np.array(rope._freqs), inv_freq, rtol=1e-5)
    assert rope.mscale == pytest.approx(0.1 * math.log(yarn.factor) + 1)


def test_phi3_longrope_factors_become_mlx_lm_su_scaled_rope() -> None:
    """Phi-3.5 / Phi-4-mini files carry LongRoPE factors as tensors, which ModelConfig does not
    know: each layer gets mlx-lm's SuScaledRoPE over the long factors (here a stand-in: the first
    values of a norm weight), with its attention factor for context / original length."""
    gguf = GGUFFile(Fixture("phi3", "F16").path)
    norm = gguf.tensors["blk.0.attn_norm.weight"]
    for i, name in enumerate(("rope_factors_long.weight", "rope_factors_short.weight")):
        gguf.tensors[name] = dataclasses.replace(norm, name=name, shape=(32,), offset=norm.offset + 128 * i, nbytes=128)
    gguf.metadata["phi3.rope.scaling.original_context_length"] = 64
    config = ModelConfig.from_gguf(gguf)
    model = build_model(config, gguf)
    rope = model.layers[1].self_attn.rope
    periods = gguf.dequantize("rope_factors_long.weight") * config.rope_theta ** (np.arange(0, 64, 2) / 64)
    np.testing.assert_allclose(np.array(rope._freqs), periods, rtol=1e-5)
    assert rope._scale == pytest.approx(math.sqrt(1 + math.log(256 / 64) / math.log(64)))
    assert "rope_factors_long.weight" not in gguf_names(model, config, gguf.tensors).values()
    engine = MLXEngine(gguf, config)
    assert np.isfinite(engine.prefill(engine.new_cache(8), ids_of("phi3")[:8])).all()


def teacher_forced(engine: MLXEngine, prompts: list[list[int]], feeds: list[list[int]]) -> np.ndarray:
    """`[steps, rows, vocab]`: the prompts prefilled one by one, then every row decoded together,
    step t feeding each row its own `feeds[row][t]`."""
    caches = [engine.new_cache(64) for _ in prompts]
    for cache, prompt in zip(caches, prompts, strict=True):
        engine.prefill(cache, prompt)
    return np.stack([engine.decode(caches, [feed[t] for feed in feeds]) for t in range(len(feeds[0]))])


# MoE routing per row; a 16-position window; recurrent states per row; Gemma 4's window, its experts
@pytest.mark.parametrize("family", ["qwen3moe", "gemma3", "qwen35", "gemma4"])
def test_rows_decoded_together_equal_each_alone_and_a_prefill(family: str, load: Engines) -> None:
    engine, ids = load(Fixture(family, "F16")), ids_of(family)
    spans = [(0, 21), (40, 45), (10, 13)]  # past the window already, crossing it mid-decode, never
    prompts = [ids[a:b] for a, b in spans]
    feeds = [ids[b:b + 12] for _, b in spans]
    together = teacher_forced(engine, prompts, feeds)
    for row, (prompt, feed) in enumerate(zip(prompts, feeds, strict=True)):
        alone = teacher_forced(engine, [prompt], [feed])[:, 0]
        np.testing.assert_allclose(together[:, row], alone, atol=1e-4)
        whole = engine.prefill(engine.new_cache(64), prompt + feed, all_logits=True)[len(prompt):]
        np.testing.assert_allclose(alone, whole, atol=1e-4)


@pytest.mark.parametrize("family", ["gemma3", "gpt-oss", "gemma4", "qwen35"])  # qwen35: conv windows across chunks
def test_prefill_in_chunks_shorter_than_the_window(family: str, load: Engines, monkeypatch: pytest.MonkeyPatch) -> None:
    engine, ids = load(Fixture(family, "F16")), ids_of(family)
    whole = engine.prefill(engine.new_cache(64), ids, all_logits=True)
    monkeypatch.setattr(engine_module, "FORWARD_CHUNK", 5)
    np.testing.assert_allclose(engine.prefill(engine.new_cache(64), ids, all_logits=True), whole, atol=1e-4)
    np.testing.assert_allclose(engine.prefill(engine.new_cache(64), ids), whole[-1], atol=1e-4)


def test_expert_stacks_stay_quantized_one_expert_slice_each(load: Engines) -> None:
    """Q4_K experts become 4-bit MLX weights holding the file's values, expert by expert (GGUF's
    [experts, out, in] is SwitchGLU's layout); Q6_K ones are re-quantized; the converted stacks
    come back from the weight cache."""
    fixture = Fixture("qwen3moe", "Q4_K_M")
    engine, gguf = load(fixture), GGUFFile(fixture.path)
    experts = engine.model.layers[1].mlp.switch_mlp
    assert gguf.tensors["blk.1.ffn_down_exps.weight"].qtype.name == "Q6_K"
    assert (experts.gate_proj.bits, experts.up_proj.bits, experts.down_proj.bits) == (4, 4, 8)
    source = gguf.dequantize("blk.1.ffn_gate_exps.weight")
    for e in range(engine.config.n_experts):
        back = mx.dequantize(experts.gate_proj.weight[e], experts.gate_proj.scales[e],
                             experts.gate_proj.biases[e], group_size=32, bits=4)
        np.testing.assert_allclose(np.array(back), source[e], atol=1e-6 * np.abs(source).max())
    warm = MLXEngine(gguf, engine.config, cache_dir=load.weights_dir)
    assert warm.weights_from.startswith("cache") and warm.quant_summary == engine.quant_summary
    ids = ids_of("qwen3moe")[:9]
    np.testing.assert_array_equal(warm.prefill(warm.new_cache(9), ids), engine.prefill(engine.new_cache(9), ids))


def test_mxfp4_experts_load_as_mlx_mxfp4(tmp_path: Path) -> None:
    """gpt-oss downloads store their experts as MXFP4: MLX's own mxfp4 with the nibbles moved,
    loaded without conversion, and a quantized SwitchGLU projection computes with the file's values."""
    from mlx_lm.models.switch_layers import SwitchLinear

    experts = np.random.default_rng(0).standard_normal((3, 8, 64)).astype(np.float32)
    writer = GGUFWriter(tmp_path / "experts.gguf", "gpt-oss")
    writer.add_tensor("blk.0.ffn_up_exps.weight", gguf_quants.quantize(experts, GGMLQuantizationType.MXFP4),
                      raw_dtype=GGMLQuantizationType.MXFP4)
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()
    gguf = GGUFFile(tmp_path / "experts.gguf")
    name = "model.layers.0.mlp.experts.up_proj.weight"
    assert reads_natively(gguf, ["blk.0.ffn_up_exps.weight"])
    arrays, choices = convert(gguf, {name: "blk.0.ffn_up_exps.weight"}, mx.float32)
    assert choices[name].label() == "MXFP4 -> 4-bit g32 mxfp4 (exact)"
    layer = SwitchLinear(64, 8, 3, bias=False).to_quantized(group_size=32, bits=4, mode="mxfp4")
    layer.load_weights([("weight", arrays[name]), ("scales", arrays[name.replace("weight", "scales")])])
    x, chosen = np.random.default_rng(1).standard_normal((5, 1, 1, 64)).astype(np.float32), [2, 0, 1, 2, 0]
    got = layer(mx.array(x), mx.array(np.array(chosen)[:, None]))
    want = np.einsum("bd,bod->bo", x[:, 0, 0], gguf.dequantize("blk.0.ffn_up_exps.weight")[chosen])
    np.testing.assert_allclose(np.array(got)[:, 0, 0], want, rtol=1e-4, atol=1e-4)


def test_refuses_what_the_mlx_lm_class_would_compute_wrongly() -> None:
    gguf = GGUFFile(Fixture("phi3", "F16").path)
    config = ModelConfig.from_gguf(gguf)
    for changed, complaint in ((dict(activation=families.GELU_TANH), "activation gelu_tanh"),
                               (dict(attn_scale=0.5), "attention scale 0.5"),
                               (dict(sliding_window=16, sliding_layers=(True, False)), "sliding-window layers"),
                               (dict(embed_scale=16.0), "embedding scale 16")):
        with pytest.raises(ModelLoadError, match=complaint):
            build_model(dataclasses.replace(config, **changed))
    stray = {**gguf.tensors, "blk.0.attn_q_norm.weight": gguf.tensors["blk.0.attn_norm.weight"]}
    with pytest.raises(ModelLoadError, match="no place for the tensors blk.0.attn_q_norm.weight"):
        gguf_names(build_model(config), config, stray)
    with pytest.raises(ModelLoadError, match="attention output gate, final logit softcap"):
        build_model(dataclasses.replace(config, attn_output_gate=True, final_softcap=30.0))
    qwen35 = ModelConfig.from_gguf(GGUFFile(Fixture("qwen35", "F16").path))
    with pytest.raises(ModelLoadError, match="lack of attention output gate"):
        build_model(dataclasses.replace(qwen35, attn_output_gate=False))
    with pytest.raises(ModelLoadError, match="one full-attention layer every n layers"):
        build_model(dataclasses.replace(qwen35, recurrent_layers=(True, True, False) + (True,) * 4 + (False,)))
