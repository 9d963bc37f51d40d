"""A row-split linear with a bias: the plan check refuses one that adds its bias inside; a
`dtgen.layers.linear.Linear` leaves it to the controller, which adds it once after the sum
(on 2 gloo ranks: the TP2 output equals one process's, and the bias is in the matmul again
after a switch back to a phase without TP)."""
import pytest
import torch
from torch import nn

from dtgen.build import ModelAdapter, build, plan_problem
from dtgen.launch import RankPool
from dtgen.layers.linear import Linear
from dtgen.plan import Output, PhasePlan, Plan, Rule

DIM = 8


class MLP(nn.Module):
    def __init__(self, linear):
        super().__init__()
        self.up = linear(DIM, 4 * DIM)
        self.down = linear(4 * DIM, DIM)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class MLPAdapter(ModelAdapter):
    def __init__(self, linear=Linear):
        self.linear = linear

    def build_on_meta(self):
        return MLP(self.linear)

    def attention_heads(self, model):
        return {}


def tp_plan(size: int) -> Plan:
    grid = (("tp", size),) if size > 1 else ()
    tp = ("tp",) if size > 1 else ()
    return Plan(f"tp{size}", grid, {"split": PhasePlan(tp=tp), "whole": PhasePlan(replicate=tp)},
                params={"up.*": Rule.COLUMN, "down.weight": Rule.ROW, "down.bias": Rule.REPLICATE},
                outputs={"down": Output.PARTIAL_SUM})


def test_a_partial_sum_module_that_adds_its_bias_inside_is_refused_before_any_byte():
    problem = plan_problem(MLPAdapter(nn.Linear), tp_plan(2), world_size=2)
    assert problem is not None and "plan output 'down' is a partial sum under TP" in problem
    assert "dtgen.layers.linear.Linear" in problem
    assert plan_problem(MLPAdapter(Linear), tp_plan(2), world_size=2) is None


def job_tp2(ctx):
    built = build(MLPAdapter(), tp_plan(2), reader=None, rank=ctx.rank, world_size=ctx.world_size)
    x = torch.randn(3, DIM, generator=torch.Generator().manual_seed(0))
    model, ctl = built.model, built.controller
    with ctl.phase("whole"):
        assert not model.down.defer_bias
        whole = model(x)
        up, down = model.up, model.down
        # "whole" replicates: the bias is in the matmul, no hook
        expected = torch.nn.functional.linear(torch.relu(up(x)), down.weight, down.bias)
        torch.testing.assert_close(whole, expected, rtol=0, atol=0)
    with ctl.phase("split"):
        assert model.down.defer_bias
        split = model(x)
    torch.testing.assert_close(split, whole, rtol=1e-6, atol=1e-6)
    with ctl.phase("whole"):
        assert not model.down.defer_bias
        torch.testing.assert_close(model(x), whole, rtol=0, atol=0)
    return True


def test_tp2_adds_the_bias_once_after_the_sum():
    with RankPool(2, timeout_s=120) as pool:
        assert pool.run(job_tp2) == [True, True]


def test_an_fp8_linear_defers_its_bias_as_a_linear_does():
    from dtgen.fp8 import quantize_linears_
    model = MLP(nn.Linear)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    quantize_linears_(model, ["down"], impl="reference")
    x = torch.randn(3, 4 * DIM, generator=torch.Generator().manual_seed(1))
    with_bias = model.down(x)
    model.down.defer_bias = True
    torch.testing.assert_close(model.down(x) + model.down.bias, with_bias)


def test_an_fp8_option_on_a_model_that_names_nothing_is_refused_in_one_line():
    plan = tp_plan(1)
    with pytest.raises(ValueError, match="--dense-dtype fp8: MLPAdapter names no linears to store in FP8"):
        build(MLPAdapter(), plan, reader=None, dense_dtype="fp8")
    with pytest.raises(ValueError, match="--attention-dtype fp8: MLPAdapter names no attention to run in FP8"):
        build(MLPAdapter(), plan, reader=None, attention_dtype="fp8")
