"""Model weights on the device, in the layout the numba-cuda backend multiplies by: bf16
matrices (fused where one GEMM reads one input), fp32 vectors; from a checkpoint or random
at a config's shapes (seeded, made on the GPU: benchmarks at real Qwen3.5 sizes).

Fusions: in_proj = in_proj_qkv | in_proj_z | in_proj_b | in_proj_a, kv_proj = k | v,
gate_up = gate | up (rows concatenated, so each part is a contiguous row range).
"""

from __future__ import annotations

import attrs
import numpy as np
from numba import cuda

from executor.config import FULL, Qwen35Config
from executor.numba_cuda import attention_prep
from executor.numba_cuda.device import THREADS, bf16_to_f32, f32_to_bf16, lasting, to_device
from executor.safetensors_file import f32_to_bf16 as host_f32_to_bf16
from executor.weights import Weights


@attrs.define(eq=False)
class DeviceWeights:
    """embed, lm_head: bf16 [vocab, hidden] (the same array when tied); norm: f32 [hidden];
    layers: one dict per layer (see `matrix_shapes` and `vector_shapes` for the keys);
    freqs: f64 [rotary_dim / 2] RoPE inverse frequencies."""

    embed: object
    lm_head: object
    norm: object
    layers: list
    freqs: object


def matrix_shapes(config: Qwen35Config, kind: str) -> dict[str, tuple[int, int]]:
    """(N, K) of each bf16 matrix of a layer of this kind, as the backend fuses them."""
    c, h = config, config.hidden_size
    shapes = {"gate_up": (2 * c.intermediate_size, h), "down": (h, c.intermediate_size)}
    if kind == FULL:
        qd = c.num_attention_heads * c.head_dim
        shapes |= {"q_proj": (2 * qd, h), "kv_proj": (2 * c.num_key_value_heads * c.head_dim, h), "o_proj": (h, qd)}
    else:
        vh = c.linear_num_value_heads
        shapes |= {"in_proj": (c.conv_channels + c.linear_value_dim + 2 * vh, h), "out_proj": (h, c.linear_value_dim)}
    return shapes


def vector_shapes(config: Qwen35Config, kind: str) -> dict[str, tuple[int, ...]]:
    """Shapes of each fp32 array of a layer of this kind."""
    c, h = config, config.hidden_size
    shapes = {"in_norm": (h,), "post_norm": (h,)}
    if kind == FULL:
        return shapes | {"q_norm": (c.head_dim,), "k_norm": (c.head_dim,)}
    vh = c.linear_num_value_heads
    return shapes | {"conv": (c.conv_channels, c.linear_conv_kernel_dim), "a_log": (vh,), "dt_bias": (vh,),
                     "norm": (c.linear_value_head_dim,)}


def from_checkpoint(weights: Weights) -> DeviceWeights:
    """Upload a checkpoint's tensors (host) in the backend's layout."""
    c = weights.config

    def bits(name: str) -> np.ndarray:
        if weights.dtypes.get(name, weights.dtypes.get("embed_tokens.weight")) == "bfloat16" and name in weights.tensors:
            return np.ascontiguousarray(weights.tensors[name], dtype=np.uint16)
        return host_f32_to_bf16(weights.float32(name))

    def bf16(*names: str):
        parts = [bits(n) for n in names]
        return to_device(np.concatenate(parts) if len(parts) > 1 else parts[0])

    f32 = lambda name: to_device(weights.float32(name).reshape(-1))  # noqa: E731
    embed = bf16("embed_tokens.weight")
    layers = []
    for i, kind in enumerate(c.layer_types):
        p = f"layers.{i}."
        w = {"in_norm": f32(p + "input_layernorm.weight"), "post_norm": f32(p + "post_attention_layernorm.weight")}
        w["gate_up"] = bf16(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
        w["down"] = bf16(p + "mlp.down_proj.weight")
        if kind == FULL:
            a = p + "self_attn."
            w["q_proj"] = bf16(a + "q_proj.weight")
            w["kv_proj"] = bf16(a + "k_proj.weight", a + "v_proj.weight")
            w["o_proj"] = bf16(a + "o_proj.weight")
            w["q_norm"] = f32(a + "q_norm.weight")
            w["k_norm"] = f32(a + "k_norm.weight")
        else:
            a = p + "linear_attn."
            w["in_proj"] = bf16(a + "in_proj_qkv.weight", a + "in_proj_z.weight", a + "in_proj_b.weight",
                                a + "in_proj_a.weight")
            w["out_proj"] = bf16(a + "out_proj.weight")
            w["conv"] = to_device(weights.float32(a + "conv1d.weight")[:, 0, :])
            w["a_log"] = f32(a + "A_log")
            w["dt_bias"] = f32(a + "dt_bias")
            w["norm"] = f32(a + "norm.weight")
        layers.append(w)
    return DeviceWeights(
        embed=embed, lm_head=embed if c.tie_word_embeddings else bf16("lm_head.weight"), norm=f32("norm.weight"),
        layers=layers, freqs=to_device(attention_prep.inv_freq(c.rope_theta, c.rotary_dim)),
    )


@cuda.jit(device=True, inline=True)
def _uniform(seed, i):
    """A uniform value in [-1, 1) from (seed, i): splitmix64 of the counter."""
    z = np.uint64(i) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(seed)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return np.float32(z >> np.uint64(40)) * np.float32(1.0 / (1 << 23)) - np.float32(1.0)


@cuda.jit
def _fill_bf16_kernel(flat, seed, scale, offset):
    # flat: [n] bf16 (uint16)
    for i in range(cuda.grid(1), flat.shape[0], cuda.gridsize(1)):
        flat[i] = f32_to_bf16(_uniform(seed, i) * scale + offset)


@cuda.jit
def _fill_f32_kernel(flat, seed, scale, offset):
    # flat: [n] f32, values rounded to bf16 (a bf16 checkpoint's vectors are)
    for i in range(cuda.grid(1), flat.shape[0], cuda.gridsize(1)):
        flat[i] = bf16_to_f32(f32_to_bf16(_uniform(seed, i) * scale + offset))


def fill_uniform(array, seed: int, scale: float, offset: float = 0.0, stream=0) -> None:
    """Fill a C-contiguous device array with offset + scale * U[-1, 1) from `seed`
    (uint16 arrays as bf16 bits; float32 arrays with bf16-representable values)."""
    if not array.size:
        return
    if array.dtype not in (np.uint16, np.float32):
        raise ValueError(f"fill_uniform fills uint16 (bf16) or float32 arrays, not {array.dtype}")
    flat = array.reshape(array.size)
    grid = min(132 * 16, (array.size + THREADS - 1) // THREADS)
    kernel = _fill_bf16_kernel if array.dtype == np.uint16 else _fill_f32_kernel
    kernel[grid, THREADS, stream](flat, np.uint64(seed), np.float32(scale), np.float32(offset))


MATRIX_STD = 0.02
"""Standard deviation of random matrix entries (transformers' initializer_range)."""


def random(config: Qwen35Config, seed: int = 0) -> DeviceWeights:
    """Random weights at the config's shapes, made on the GPU from `seed`: matrices
    uniform with std MATRIX_STD, zero-centred norm weights in [-0.1, 0.1), the gated norm
    in [0.9, 1.1), A_log in [0.5, 2.5), dt_bias in [0, 1), conv in [-0.3, 0.3)."""
    c = config
    count = iter(range(1 << 30))
    amp = MATRIX_STD * 3 ** 0.5

    def new(shape, dtype, scale, offset=0.0):
        array = lasting(shape, dtype)
        fill_uniform(array, seed * 1_000_003 + next(count), scale, offset)
        return array

    vector_fill = {"conv": (0.3, 0.0), "a_log": (1.0, 1.5), "dt_bias": (0.5, 0.5), "norm": (0.1, 1.0)}
    embed = new((c.vocab_size, c.hidden_size), np.uint16, amp)
    layers = []
    for kind in c.layer_types:
        w = {name: new(shape, np.uint16, amp) for name, shape in matrix_shapes(c, kind).items()}
        for name, shape in vector_shapes(c, kind).items():
            w[name] = new(shape, np.float32, *vector_fill.get(name, (0.1, 0.0)))
        layers.append(w)
    lm_head = embed if c.tie_word_embeddings else new((c.vocab_size, c.hidden_size), np.uint16, amp)
    return DeviceWeights(
        embed=embed, lm_head=lm_head, norm=new((c.hidden_size,), np.float32, 0.1), layers=layers,
        freqs=to_device(attention_prep.inv_freq(c.rope_theta, c.rotary_dim)),
    )
