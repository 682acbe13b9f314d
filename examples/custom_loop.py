"""Your own training loop with dilocox's outer sync: a small MLP, 2 clusters of one rank each, gloo (docs/api.md).

    torchrun --standalone --nproc-per-node 2 examples/custom_loop.py

Each rank is a cluster with its own data. Every H = 10 inner steps the clusters average their int4-compressed
pseudo-gradients over the slow link, with the one-step delay: round t's average travels while round t+1 trains.
"""

import os
import sys

import torch
import torch.distributed as dist

import dilocox

STEPS, H = 100, 10


def batch(teacher: torch.nn.Module, generator: torch.Generator, size: int = 64):
    x = torch.randn(size, 16, generator=generator)  # (batch, 16)
    return x, teacher(x)  # (batch, 4): every cluster learns the same function from its own samples


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # every cluster builds the same teacher and starts from the same model
    teacher = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).requires_grad_(
        False
    )
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
    inner_optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    held_out = batch(teacher, torch.Generator().manual_seed(1234), size=512)
    eval_loss = lambda: torch.nn.functional.mse_loss(model(held_out[0]), held_out[1]).item()  # noqa: E731
    initial = eval_loss()
    data = torch.Generator().manual_seed(1 + rank)  # this cluster's own samples

    # One rank per cluster: the whole world is the slow-link group (with data parallelism inside a cluster,
    # pass one group per replica position as cluster_group and the cluster's replicas as dp_group).
    with dilocox.OuterSync(
        model, inner_optimizer, cluster_group=dist.group.WORLD, inner_steps=H, compression="int4", sync_delay=1
    ) as sync:
        for step in range(1, STEPS + 1):
            x, y = batch(teacher, data)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            inner_optimizer.step()
            inner_optimizer.zero_grad()
            stats = sync.step()  # every H-th step: launch this round's sync, apply the last round's
            if step % H == 0 and rank == 0:
                line = f"step {step:3d}  loss {loss.item():.4f}  outer steps {sync.outer_step}"
                if stats is not None:  # the sync applied now (none yet at the first round's end)
                    line += f"  applied: {stats.bytes_sent:,} B sent (fp32: {stats.cost.dense_bytes:,} B), link"
                    line += f" {stats.link_s * 1e3:.1f} ms, {stats.hidden_fraction or 0:.0%} hidden"
                print(line, flush=True)
    # leaving the block flushed the sync still in flight: every cluster now holds the outer params
    final = eval_loss()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(everyone, flat)
    assert all(torch.equal(everyone[0], other) for other in everyone), "the clusters disagree after the flush"
    assert final < initial, f"held-out loss did not fall: {initial:.4f} -> {final:.4f}"
    if rank == 0:
        print(f"held-out loss {initial:.4f} -> {final:.4f}; {sync.channel.stats()['bytes_sent']:,} B sent by rank 0")
        print(f"final parameters identical on all {world} ranks")
    dist.destroy_process_group()


if __name__ == "__main__":
    if not all(name in os.environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        # each rank is one process that torchrun starts and tells its place (RANK, WORLD_SIZE, MASTER_ADDR, ...)
        sys.exit(f"{sys.argv[0]}: run it with torchrun: torchrun --standalone --nproc-per-node 2 {sys.argv[0]}")
    main()
