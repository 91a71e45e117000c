"""state_bytes: the byte price of a kept state, checked against hand-computed numbers."""

from __future__ import annotations

import pytest

from policy.shape import QWEN35_27B, ModelShape, state_bytes

# Qwen3.5-27B text config, by hand:
#   recurrent, per linear layer: 48 value heads x 128 key dim x 128 value dim x 4 B = 3,145,728
#   conv tail, per linear layer: (4 - 1) rows x (2 x 16 x 128 + 48 x 128) channels x 2 B = 61,440
#   fixed: 48 linear layers x (3,145,728 + 61,440) = 153,944,064
#   per row: 16 attention layers x (K and V) 2 x 4 KV heads x 256 x 2 B = 65,536
RECURRENT_LAYER = 48 * 128 * 128 * 4
CONV_LAYER = 3 * (2 * 16 * 128 + 48 * 128) * 2
FIXED = 48 * (RECURRENT_LAYER + CONV_LAYER)
ROW = 16 * 2 * 4 * 256 * 2


def test_hand_numbers():
    assert RECURRENT_LAYER == 3_145_728
    assert CONV_LAYER == 61_440
    assert FIXED == 153_944_064
    assert ROW == 65_536


def test_qwen35_27b_config():
    s = QWEN35_27B
    assert s.linear_layers + s.attention_layers == 64
    assert (s.linear_layers, s.attention_layers) == (48, 16)
    assert (s.num_key_value_heads, s.head_dim) == (4, 256)
    assert (s.linear_num_value_heads, s.linear_num_key_heads) == (48, 16)
    assert (s.linear_key_head_dim, s.linear_value_head_dim) == (128, 128)
    assert s.conv_channels == 10_240
    assert s.recurrent_layer_bytes == RECURRENT_LAYER
    assert s.conv_layer_bytes == CONV_LAYER
    assert s.fixed_bytes == FIXED
    assert s.row_bytes == ROW


@pytest.mark.parametrize(
    ("rows", "expected"),
    [
        (0, 153_944_064),
        (1, 153_944_064 + 65_536),
        (63, 153_944_064 + 63 * 65_536),
        (4095, 153_944_064 + 268_369_920),
        (4096, 153_944_064 + 268_435_456),
        (4097, 153_944_064 + 268_500_992),
        (32768, 153_944_064 + 2_147_483_648),
    ],
    ids=["0-rows", "1-row", "63-rows", "4095-rows", "4096-rows", "4097-rows", "32768-rows"],
)
def test_state_bytes_qwen35_27b(rows, expected):
    assert state_bytes(QWEN35_27B, rows) == expected == FIXED + rows * ROW


def test_state_bytes_at_32k_is_about_2_15_gib():
    assert state_bytes(QWEN35_27B, 32768) == 2_301_427_712


def test_state_bytes_rejects_negative_rows():
    with pytest.raises(ValueError, match="rows must be >= 0"):
        state_bytes(QWEN35_27B, -1)


def test_tiny_shape_by_hand():
    shape = ModelShape(
        linear_layers=2, attention_layers=1, linear_num_key_heads=1, linear_key_head_dim=2,
        linear_num_value_heads=3, linear_value_head_dim=4, linear_conv_kernel_dim=2,
        num_key_value_heads=1, head_dim=8,
    )
    # recurrent 3*2*4*4 = 96; conv (2-1)*(2*1*2 + 3*4)*2 = 32; fixed 2*(96+32) = 256
    # row: 1 layer * 2 * 1 head * 8 * 2 B = 32
    assert (shape.fixed_bytes, shape.row_bytes) == (256, 32)
    assert state_bytes(shape, 10) == 256 + 320


@pytest.mark.parametrize(
    "field", ["linear_num_key_heads", "head_dim", "num_key_value_heads", "kv_bytes"],
)
def test_shape_validation_names_the_field(field):
    values = dict(
        linear_layers=48, attention_layers=16, linear_num_key_heads=16, linear_key_head_dim=128,
        linear_num_value_heads=48, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        num_key_value_heads=4, head_dim=256,
    )
    values[field] = 0
    with pytest.raises(ValueError, match=field):
        ModelShape(**values)
