"""ModelShape and the byte price of a kept state.

Only the fields of a Qwen3.5 config that size a state live here; parsing a checkpoint's
config.json is the executor's job (`executor.config`), which builds a ModelShape.
"""

from __future__ import annotations

import attrs

from policy.config import _positive


@attrs.frozen(kw_only=True)
class ModelShape:
    """The state-sizing facts of a Qwen3.5 text model (Hugging Face config field names).

    Fields: linear_layers / attention_layers (counts of Gated DeltaNet and full-attention
    layers), linear_num_key_heads x linear_key_head_dim, linear_num_value_heads x
    linear_value_head_dim, linear_conv_kernel_dim (rows of the causal conv), and
    num_key_value_heads x head_dim of the attention layers. Byte widths: recurrent_bytes
    (fp32 = 4), conv_bytes (the conv tail keeps the activation dtype, bf16 = 2), kv_bytes
    (bf16 = 2). Source: `transformers/models/qwen3_5/configuration_qwen3_5.py`.
    """

    linear_layers: int = attrs.field(validator=attrs.validators.ge(0))
    attention_layers: int = attrs.field(validator=attrs.validators.ge(0))
    linear_num_key_heads: int = attrs.field(validator=_positive)
    linear_key_head_dim: int = attrs.field(validator=_positive)
    linear_num_value_heads: int = attrs.field(validator=_positive)
    linear_value_head_dim: int = attrs.field(validator=_positive)
    linear_conv_kernel_dim: int = attrs.field(validator=_positive)
    num_key_value_heads: int = attrs.field(validator=_positive)
    head_dim: int = attrs.field(validator=_positive)
    recurrent_bytes: int = attrs.field(default=4, validator=_positive)
    conv_bytes: int = attrs.field(default=2, validator=_positive)
    kv_bytes: int = attrs.field(default=2, validator=_positive)

    @property
    def conv_channels(self) -> int:
        """Channels of the linear-attention conv: q and k (key heads) plus v (value heads)."""
        return (
            2 * self.linear_num_key_heads * self.linear_key_head_dim
            + self.linear_num_value_heads * self.linear_value_head_dim
        )

    @property
    def recurrent_layer_bytes(self) -> int:
        """Bytes of one linear layer's recurrent matrix [value_heads, key_dim, value_dim]."""
        return (
            self.linear_num_value_heads
            * self.linear_key_head_dim
            * self.linear_value_head_dim
            * self.recurrent_bytes
        )

    @property
    def conv_layer_bytes(self) -> int:
        """Bytes of one linear layer's conv tail [kernel - 1, conv_channels]."""
        return (self.linear_conv_kernel_dim - 1) * self.conv_channels * self.conv_bytes

    @property
    def fixed_bytes(self) -> int:
        """Bytes of a state that do not grow with rows: recurrent + conv of every linear layer."""
        return self.linear_layers * (self.recurrent_layer_bytes + self.conv_layer_bytes)

    @property
    def row_bytes(self) -> int:
        """Bytes of one row of K and V over every attention layer."""
        return self.attention_layers * 2 * self.num_key_value_heads * self.head_dim * self.kv_bytes


def state_bytes(shape: ModelShape, rows: int) -> int:
    """Bytes of a kept state at row `rows` (DESIGN rule 3).

    state_bytes = linear_layers * (V * Dk * Dv * recurrent_bytes
                                   + (conv_kernel - 1) * (2 * K * Dk + V * Dv) * conv_bytes)
                + rows * attention_layers * 2 * kv_heads * head_dim * kv_bytes

    with K/V the linear key/value head counts and Dk/Dv their dims. Qwen3.5-27B:
    48 * (48*128*128*4 + 3*10240*2) + rows * 16*2*4*256*2 = 153,944,064 + 65,536 * rows.

    Raises:
      ValueError: rows < 0.
    """
    if rows < 0:
        raise ValueError(f"rows must be >= 0, got {rows}")
    return shape.fixed_bytes + rows * shape.row_bytes


QWEN35_27B = ModelShape(
    linear_layers=48,
    attention_layers=16,
    linear_num_key_heads=16,
    linear_key_head_dim=128,
    linear_num_value_heads=48,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    num_key_value_heads=4,
    head_dim=256,
)
"""Qwen3.5-27B text config (64 layers, full attention every 4th): the shape of the examples."""
