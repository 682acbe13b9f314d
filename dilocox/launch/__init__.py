"""Start the ranks of a run: all `C x D x P` of them on this machine, or this one rank under `torchrun`.

    dilocox train ...                          # spawns C x D x P local processes (gloo over loopback)
    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-endpoint HOST:29400 -m dilocox train ...   # one rank each

One concept per module (docs/design.md §7):

    preflight.py   every check that can fail on user input, before anything is written or any rank starts
    rundir.py      the run directory: its lock, then config.toml and tokenizer.json
    processes.py   what every launcher shares: exit codes, a forked rank's start, a rank's user error, stopping
    local.py       a static run's C x D x P ranks on this machine (launch_local)
    elastic.py     an elastic run's clusters on this machine, started again when they die (launch_elastic)
    status.py      ClusterStatus and the ClusterBoard the elastic launcher shares with its ranks
    torchrun.py    the one rank torchrun started (launch_torchrun)
"""
