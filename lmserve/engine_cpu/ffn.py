"""A block's feed-forward half: a dense gated FFN, a mixture of experts, or (Gemma 4's MoE layers)
both side by side, each with its own norms, their outputs summed."""

from __future__ import annotations

import numpy as np

from lmserve.engine_cpu import ops
from lmserve.engine_cpu.moe import Activation, mixture
from lmserve.engine_cpu.weights import LayerWeights
from lmserve.model.config import ModelConfig


def feed_forward(h: np.ndarray, layer: LayerWeights, cfg: ModelConfig, activation: Activation) -> np.ndarray:
    """What the FFN adds to the residual stream `h` `[n, hidden]` (post-norm included)."""
    eps = cfg.rms_eps
    x = ops.rms_norm(h, layer.ffn_norm, eps)
    out = None
    if layer.gate_up is not None and layer.down is not None:
        out = ops.gated_ffn(x, layer.gate_up, layer.down, activation)
        if layer.dense_post_norm is not None:
            out = ops.rms_norm(out, layer.dense_post_norm, eps)
    if layer.experts is not None:
        m = layer.experts
        inputs = x if m.norm is None else ops.rms_norm(h, m.norm, eps)
        routed = mixture(inputs, h, m, cfg.n_experts_used, cfg.router, activation, eps)
        if m.post_norm is not None:
            routed = ops.rms_norm(routed, m.post_norm, eps)
        out = routed if out is None else out + routed
    if layer.post_ffn_norm is not None:
        out = ops.rms_norm(out, layer.post_ffn_norm, eps)
    return out
