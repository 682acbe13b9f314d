"""The straight-then-resumed run that the delayed-sync resume tests share (called inside a rank's worker)."""

import copy

from tests.clock import SimulatedClock


def simulated(channel_factory):
    """A channel built by `channel_factory(clock)` on a fresh `SimulatedClock`, which follows it."""
    clock = SimulatedClock()
    return clock.follow(channel_factory(clock))


def straight_and_resumed(fresh, train_step, *, total_steps: int, save_after: int, step_s: float) -> dict:
    """Run `total_steps` inner steps straight, saving every state after step `save_after` (as torch.save would
    freeze it), then rebuild with `fresh()`, load that state and run the rest.

    `fresh()` returns (model, channel, sync, optimizer), the channel on a `SimulatedClock` it follows (`simulated`);
    `train_step(model, optimizer, step)` runs one inner step, which computes for `step_s` virtual seconds, after
    which the driver calls `sync.after_inner_step(step)`. Returns the outer params and bytes sent of both runs
    (after `flush()`), whether the sync was still in flight when saved, and the virtual seconds saving its state
    took (0 unless saving waited for the link)."""

    def run(model, channel, sync, optimizer, steps, saved=None):
        for step in steps:
            train_step(model, optimizer, step)
            channel.clock.sleep(step_s)
            sync.after_inner_step(step)
            if step == save_after and saved is not None:
                started = channel.clock.now()
                saved["sync"] = copy.deepcopy(sync.state_dict())
                saved["save_s"] = channel.clock.now() - started
                saved["channel"] = channel.state_dict()
                saved["model"] = {k: v.clone() for k, v in model.state_dict().items()}
                saved["optimizer"] = copy.deepcopy(optimizer.state_dict())

    def finish(channel, sync):
        sync.flush()
        result = (sync.outer_params.clone(), channel.stats()["bytes_sent"])
        channel.close()
        return result

    model, channel, sync, optimizer = fresh()
    saved: dict = {}
    run(model, channel, sync, optimizer, range(1, total_steps + 1), saved)
    straight = finish(channel, sync)

    model, channel, sync, optimizer = fresh()  # the resumed run: a new process would build exactly this
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    channel.load_state_dict(saved["channel"])
    in_flight = saved["sync"]["fragments"][0]["pending_seq"] >= channel.num_transfers
    sync.load_state_dict(saved["sync"])
    run(model, channel, sync, optimizer, range(save_after + 1, total_steps + 1))
    return {"straight": straight, "resumed": finish(channel, sync), "in_flight": in_flight, "save_s": saved["save_s"]}
