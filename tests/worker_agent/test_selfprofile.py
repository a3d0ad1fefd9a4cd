"""A script's measurement of itself (``worker_agent.selfprofile``): the bytes are the tensors'
as counted here from their shapes, a module that is slow forward or backward is the one the
profile says is, and the profile is one the protocol takes."""

from __future__ import annotations

import time

import torch

from worker_agent import protocol
from worker_agent.selfprofile import StepProfiler

SLOW_S = 0.1


class SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        time.sleep(SLOW_S)
        return grad


class Slow(torch.nn.Module):
    """Sleeps forward (``forward=True``) or backward."""

    def __init__(self, forward: bool) -> None:
        super().__init__()
        self.slow_forward = forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.slow_forward:
            time.sleep(SLOW_S)
            return x * 1.0
        return SlowBackward.apply(x)  # type: ignore[no-any-return]


def measured(model: torch.nn.Module, passes: int = 3) -> list[dict[str, float]]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    profiler = StepProfiler(model)
    profiler.attach()
    for _ in range(passes):
        x = torch.randn(16, 32)
        torch.autograd.backward(model(x).pow(2).mean())
        profiler.pass_done(time.perf_counter())
    profiler.detach()
    optimizer.step()
    message = profiler.message(optimizer, micro_batches=4)
    frame = protocol.Profile(
        seq=1, at=1.0, devices=[0], **message.model_dump(exclude={"t"}, exclude_none=True)
    )
    assert [m.name for m in frame.modules] == [n for n, _ in profiler.modules]
    return [m.model_dump() for m in frame.modules]


def test_the_bytes_are_the_tensors_and_the_saved_activations_each_modules_own() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    first, relu, last = measured(model)
    f32 = 4
    assert first["m_p"] == first["m_g"] == (32 * 64 + 64) * f32
    assert last["m_p"] == (64 + 1) * f32 and relu["m_p"] == relu["m_g"] == 0
    # AdamW: two moments shaped as each parameter, and a one-element step count per tensor
    assert first["m_o"] == 2 * first["m_p"] + 2 * f32
    # a linear layer saves its input (its weight left out), ReLU its output
    assert first["m_a"] == 16 * 32 * f32
    assert relu["m_a"] == 16 * 64 * f32
    assert last["m_a"] == 16 * 64 * f32
    assert all(m["update_s"] >= 0 for m in (first, relu, last))
    assert relu["update_s"] == 0  # no parameters: no share of the step


def test_the_slow_module_is_the_one_measured_slow_forward_and_backward() -> None:
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 32), Slow(forward=True), torch.nn.Linear(32, 32), Slow(forward=False),
        torch.nn.Linear(32, 1),
    )  # fmt: skip
    costs = measured(model)
    forward = [m["fwd_s"] for m in costs]
    backward = [m["bwd_s"] for m in costs]
    assert max(range(5), key=forward.__getitem__) == 1 and forward[1] >= SLOW_S
    assert max(range(5), key=backward.__getitem__) == 3 and backward[3] >= SLOW_S
    assert backward[1] < SLOW_S and forward[3] < SLOW_S


def test_module_lists_count_as_their_members_and_detached_hooks_leave_nothing() -> None:
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(3))
            self.head = torch.nn.Linear(32, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = torch.relu(layer(x))
            return self.head(x)  # type: ignore[no-any-return]

    net = Net()
    costs = measured(net)
    assert len(costs) == 4 and all(m["fwd_s"] > 0 and m["bwd_s"] > 0 for m in costs)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in net.modules())
