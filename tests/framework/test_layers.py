"""dtgen/layers: the options each model relies on (its parity tests check the models whole)."""
from dataclasses import dataclass

import pytest
import torch

from dtgen.layers.config import config_values
from dtgen.layers.norms import RMSNorm, rms_norm
from dtgen.layers.rope import apply_rope, grid_positions, rope_angles


def test_rms_norm_roundings_differ_only_where_they_round():
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    w32 = 1 + 0.1 * torch.randn(32, generator=torch.Generator().manual_seed(1))
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    got = {r: rms_norm(x, w32, 1e-6, r) for r in ("input", "weight", "half_weight")}
    # float32 weight: "weight" and "half_weight" keep float32 rows; "input" rounds them to bf16 first.
    assert torch.equal(got["weight"], w32 * normed) and torch.equal(got["half_weight"], w32 * normed)
    assert torch.equal(got["input"], w32 * normed.to(torch.bfloat16))
    assert not torch.equal(got["input"], got["weight"])
    # bf16 weight: "half_weight" rounds like "weight".
    wb = w32.to(torch.bfloat16)
    assert torch.equal(rms_norm(x, wb, 1e-6, "half_weight"), rms_norm(x, wb, 1e-6, "weight"))
    with pytest.raises(ValueError, match="rounding"):
        RMSNorm(32, rounding="fp32")


def test_rope_pair_layouts_rotate_the_same_pairs():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 6, 3, 8, generator=g)
    angles = rope_angles(torch.arange(6)[:, None], (8,), 10000.0)      # [6, 4]
    adjacent = apply_rope(x, angles.cos(), angles.sin(), pairs="adjacent")
    torch.testing.assert_close(apply_rope(x, angles.cos(), angles.sin(), pairs="complex"), adjacent)
    # "halves" pairs channel d with d + 4: the same rotation on a permuted head.
    perm = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])
    twice = torch.cat([angles, angles], dim=-1)
    halves = apply_rope(x[..., perm], twice.cos(), twice.sin(), pairs="halves")
    torch.testing.assert_close(halves, adjacent[..., perm])
    with pytest.raises(ValueError, match="pairs"):
        apply_rope(x, angles.cos(), angles.sin(), pairs="interleaved")


def test_grid_positions_are_row_major():
    pos = grid_positions(torch.arange(2), torch.arange(3))
    assert pos.tolist() == [[0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2]]


@dataclass(frozen=True)
class _Cfg:
    a: int = 1
    b: tuple = (1, 2)


def test_config_values_refuses_unknown_keys_and_keeps_metadata_out():
    assert config_values(_Cfg, {"_class_name": "X", "a": 3, "b": [4]}, "cfg", tuples=("b",)) == {"a": 3, "b": (4,)}
    with pytest.raises(ValueError, match=r"^cfg: unknown key\(s\) \['c'\]$"):
        config_values(_Cfg, {"a": 3, "c": 1}, "cfg")
    assert config_values(_Cfg, {"a": None, "c": 1}, "cfg", refuse_unknown=False, skip_none=True) == {}
