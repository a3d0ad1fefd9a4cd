"""A plain PyTorch DDP loop under the Pitstop agent: it reports every step and obeys pause,
resume and stop; it refuses new plans (the reference trainer, worker_agent/trainer, takes them).

    python -m worker_agent run ... --devices 0,1 --store HOST:PORT --serve-store \
        -- python -m examples.ddp_under_the_agent      (from the repository, WORLD_SIZE=2 set)
"""

import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from worker_agent.link import LinkError, TrainerLink

link = TrainerLink.from_env()  # without an agent every call does nothing
rank, world = link.device or 0, int(os.environ.get("WORLD_SIZE", "1"))
host, _, port = (link.store or "127.0.0.1:0").rpartition(":")
store = dist.TCPStore(host, int(port), world, is_master=link.store is None, wait_for_workers=False)
group = dist.PrefixStore(link.generation, store)
dist.init_process_group("gloo", store=group, rank=rank, world_size=world)
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
model = DistributedDataParallel(net)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
step, paused = 0, False
link.set_state("training")
while step < int(os.environ.get("STEPS", "100")) and not link.agent_gone:
    command = link.poll_command(0.1 if paused else 0)
    if command is not None:
        if command.action in ("pause", "resume"):
            paused = command.action == "pause"
            link.set_state("paused" if paused else "training")
            link.done(command.id)
        elif command.action == "stop":
            link.done(command.id)
            break
        else:  # apply_plan, restore: a fixed DDP world cannot change its plan
            link.done(command.id, ok=False, error=LinkError(message="a plain DDP loop"))
    if paused:
        continue
    began = time.monotonic()
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(step * world + rank))
    loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    step += 1
    link.report_step(step, loss.item(), time.monotonic() - began, samples=16 * world)
# Leave together: a rank that tears its group down while a peer is still in a collective
# aborts the peer (gloo calls std::terminate); under the agent, stop reaches every rank. Then
# exit without tearing the group down: gloo's teardown still aborted a rank whose peer had
# closed its sockets first ("terminate called without an active exception"); the OS closes them.
dist.barrier()
sys.stdout.flush()
os._exit(0)
