"""GGUF layouts undone on loading: what llama.cpp's converter changed in a weight's values or order,
put back the way mlx-lm's classes compute with it (lazily, after conversion, so quantized weights
stay quantized: rows, and whole quantization groups of columns, only move).

- Gemma 3's RMSNorm weights carry the `1 +` of Gemma's norm, which mlx-lm's Gemma norm adds itself
  (Qwen3.5's `+ 1` stays: its mlx-lm norm is a plain RMSNorm, as the converter means it; Gemma 4
  and Qwen3.5's gated norm are stored unshifted).
- A fused expert gate/up stack (`ffn_gate_up_exps`, gate rows first) becomes SwitchGLU's two.
- Qwen3.5's Gated DeltaNet: `ssm_a` is `-exp(A_log)`; the causal conv1d is squeezed to
  `[channels, kernel]` (MLX's Conv1d wants `[channels, kernel, 1]`); the shared expert's gate is a
  vector (mlx-lm's is a `[1, hidden]` linear); and where value heads outnumber key heads, GGUF
  stores them tiled (head `r * k_heads + g` reads key head `g`, for ggml's broadcast) while
  mlx-lm's kernel groups them (head `g * per_k + r` reads key head `g`): every tensor with a value
  head axis is un-tiled along it (the V rows of the fused qkv and their conv channels, z, a, b,
  A_log, dt_bias, and the output projection's columns).
"""

from __future__ import annotations

import re

import mlx.core as mx

from lmserve.engine_mlx.model import FUSED_GATE_UP
from lmserve.engine_mlx.weights import Choice
from lmserve.model.config import LinearAttention, ModelConfig
from lmserve.model.gguf_file import ModelLoadError

Arrays = dict[str, mx.array]
NORM_OFFSET = {"gemma3": 1.0}  # subtracted from every `*norm.weight` the file stores
QUANT_PARTS = (".weight", ".scales", ".biases")  # the arrays one (quantized) weight is made of
_DELTANET = re.compile(r"(.*\.linear_attn\.)A_log$")


def undo_gguf_layout(config: ModelConfig, arrays: Arrays, choices: dict[str, Choice]) -> tuple[Arrays, dict[str, Choice]]:
    """One part's converted arrays and their choices (by MLX weight name), as mlx-lm's parameters."""
    arrays, choices = dict(arrays), dict(choices)
    offset = NORM_OFFSET.get(config.architecture)
    for name in [n for n in arrays if offset and n.endswith("norm.weight")]:
        arrays[name] = arrays[name] - offset
    for name in [n for n in choices if n.endswith(f".{FUSED_GATE_UP}.weight")]:
        _split_gate_up(name.removesuffix(".weight"), arrays, choices)
    for name in [n for n in arrays if n.endswith(".shared_expert_gate.weight") and arrays[n].ndim == 1]:
        arrays[name] = arrays[name][None]
    la = config.linear_attention
    for match in filter(None, map(_DELTANET.match, list(arrays))):
        assert la is not None  # Gated DeltaNet parameters come with their config
        _gated_deltanet(match.group(1), la, arrays, choices)
    return arrays, choices


def _split_gate_up(base: str, arrays: Arrays, choices: dict[str, Choice]) -> None:
    """`...gate_up_proj` (rows: every gate, then every up, per expert) -> `gate_proj`, `up_proj`."""
    choice = choices.pop(base + ".weight")
    for part in QUANT_PARTS:
        if base + part in arrays:
            gate, up = mx.split(arrays.pop(base + part), 2, axis=-2)
            arrays[base.replace(FUSED_GATE_UP, "gate_proj") + part] = gate
            arrays[base.replace(FUSED_GATE_UP, "up_proj") + part] = up
    for half in ("gate_proj", "up_proj"):
        choices[base.replace(FUSED_GATE_UP, half) + ".weight"] = choice


def _gated_deltanet(prefix: str, la: LinearAttention, arrays: Arrays, choices: dict[str, Choice]) -> None:
    arrays[prefix + "A_log"] = mx.log(-arrays[prefix + "A_log"].astype(mx.float32))  # kept float32, as mlx-lm keeps it
    conv = prefix + "conv1d.weight"
    if arrays[conv].ndim == 2:
        arrays[conv] = arrays[conv][..., None]
    per_k = la.v_heads // la.k_heads
    if per_k == 1:
        return
    key_rows = 2 * la.k_heads * la.head_k_dim

    def untile(x: mx.array, axis: int, skip: int = 0) -> mx.array:
        """Along `axis` (past its first `skip` entries, the q and k channels): tiled -> grouped."""
        kept, v = mx.split(x, [skip], axis=axis) if skip else (None, x)
        shape = v.shape
        v = v.reshape(*shape[:axis], per_k, la.k_heads, -1, *shape[axis + 1:])
        v = mx.swapaxes(v, axis, axis + 1).reshape(shape)
        return v if kept is None else mx.concatenate([kept, v], axis=axis)

    for name, skip in (("in_proj_qkv", key_rows), ("in_proj_z", 0), ("in_proj_a", 0), ("in_proj_b", 0)):
        for part in QUANT_PARTS:
            if prefix + name + part in arrays:
                arrays[prefix + name + part] = untile(arrays[prefix + name + part], 0, skip)
    for name in ("A_log", "dt_bias"):
        arrays[prefix + name] = untile(arrays[prefix + name], 0)
    arrays[conv] = untile(arrays[conv], 0, key_rows)
    group = choices[prefix + "out_proj.weight"].group_size
    if group is not None and la.head_v_dim % group:
        raise ModelLoadError(f"{prefix}out_proj: value heads of {la.head_v_dim} columns cannot be reordered "
                             f"inside quantization groups of {group}")
    for part in QUANT_PARTS:  # whole heads of columns: in a quantized weight, whole groups and their scales
        if prefix + "out_proj" + part in arrays:
            arrays[prefix + "out_proj" + part] = untile(arrays[prefix + "out_proj" + part], 1)
