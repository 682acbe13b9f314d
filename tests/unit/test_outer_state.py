"""`sync.outer.state_device`: the outer state on the host computes what it computes on the device."""

import pytest
import torch

from dilocox.compress import CompressionConfig
from dilocox.net.channel import WanChannel
from dilocox.sync import DiLoCoSync, SyncConfig
from dilocox.sync.config import OuterConfig


def _rounds(params_device: str, outer_state_device: str, kind: str = "int4") -> tuple[list[torch.Tensor], DiLoCoSync]:
    """One cluster (no process group), delay 1, 3 rounds of a fixed drift: the outer params after each round."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8).to(params_device)
    outer = OuterConfig(lr=0.7, momentum=0.9, state_device=outer_state_device)
    cfg = SyncConfig(kind="dilocox", inner_steps=2, sync_delay=1, outer=outer)
    with WanChannel(None, bandwidth=None, latency_s=0.0) as channel:
        sync = DiLoCoSync(model.parameters(), cfg, CompressionConfig(kind=kind), channel=channel, dp_group=None)
        trace = []
        for step in range(1, 7):
            with torch.no_grad():
                for index, p in enumerate(model.parameters()):
                    p.add_(0.01 * (index + 1) * torch.ones_like(p))
            sync.after_inner_step(step)
            if sync.is_round_boundary(step):
                trace.append(sync.outer_params.cpu().clone())
        sync.flush()
        trace.append(sync.outer_params.cpu().clone())
    return trace, sync


def test_outer_state_on_cpu_is_the_same_arithmetic():
    on_device, _ = _rounds("cpu", "device")
    on_host, sync = _rounds("cpu", "cpu")
    assert sync.outer_params.device.type == "cpu" and sync.stage.state_device.type == "cpu"
    assert all(torch.equal(a, b) for a, b in zip(on_device, on_host, strict=True))
    assert not torch.equal(on_device[0], on_device[-1])  # the rounds moved the outer params


def test_unknown_outer_state_device_names_the_choices():
    with pytest.raises(ValueError, match="sync.outer.state_device = 'gpu' is not one of: device, cpu"):
        SyncConfig(outer=OuterConfig(state_device="gpu")).validate()


@pytest.mark.gpu
def test_outer_state_stays_on_the_host_while_training_on_a_gpu():
    on_host, sync = _rounds("cuda", "cpu")
    assert sync.outer_params.device.type == "cpu" and sync.fragments[0].round_start.device.type == "cpu"
    assert sync.flat.params[0].device.type == "cuda"
    on_device, _ = _rounds("cuda", "device")
    for a, b in zip(on_host, on_device, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _halfway(steps: int, state: dict | None = None) -> tuple[dict, torch.Tensor]:
    """One cluster, delay 1 with int4 (a sync in flight at every boundary): `steps` steps of a fixed drift from the
    start or from `state`, then the sync's state and the model's parameters."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8)
    cfg = SyncConfig(kind="dilocox", inner_steps=2, sync_delay=1, outer=OuterConfig(lr=1.0, momentum=0.0))
    with WanChannel(None, bandwidth=None, latency_s=0.0) as channel:
        sync = DiLoCoSync(model.parameters(), cfg, CompressionConfig(kind="int4"), channel=channel, dp_group=None)
        first = 1
        if state is not None:
            model.load_state_dict(state["model"])
            sync.load_state_dict(state["sync"])
            first = state["step"] + 1
        for step in range(first, first + steps):
            with torch.no_grad():
                for index, p in enumerate(model.parameters()):
                    p.add_(0.01 * (index + 1) * torch.ones_like(p))
            sync.after_inner_step(step)
        saved = {"model": model.state_dict(), "sync": sync.state_dict(), "step": first + steps - 1}
        return saved, sync.outer_params.clone()


def test_a_one_fragment_state_saved_before_fragments_were_a_list_resumes_to_the_same_result():
    """A checkpoint of the version whose sync state was the one fragment's keys at the top level (no "fragments")
    loads as that fragment: resumed at step 4 with a sync in flight, 4 more steps end where 8 straight steps do."""
    _, straight = _halfway(8)
    saved, _ = _halfway(4)
    (fragment,) = saved["sync"].pop("fragments")
    saved["sync"].update(fragment)  # the flat layout
    _, resumed = _halfway(4, saved)
    assert torch.equal(resumed, straight)
