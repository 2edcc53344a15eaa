"""`zerotrain launch [--nproc N] script.py ARGS...`: DeepSpeed's `deepspeed` launcher in
shape, for a script of your own (typically one using `zerotrain.deepspeed`).

torchrun underneath, with the launcher guarantees of `zerotrain train --nproc`
(comm/launch.py): the job's outcome in one line naming the failed rank, ranks that die
with the launcher (ranks that call `zerotrain.deepspeed.init_distributed` or
`initialize` arrange it), and `--max-restarts K`. As torchrun does, the ranks find
RANK, LOCAL_RANK and WORLD_SIZE in their environment; no `--local_rank` argument is
added to the script's own. The script's `import deepspeed` (and that of transformers,
Accelerate or TRL inside it) resolves to `zerotrain.deepspeed` (zerotrain/hf), so a
DeepSpeed or Hugging Face Trainer script runs unchanged; nothing outside the run changes.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from zerotrain.cli.args import Parser, UsageError, command, parse_count


def _parser() -> Parser:
    p = Parser("launch", "Run a training script on N local ranks (torchrun underneath), as "
               "`deepspeed --num_gpus N script.py ARGS` does.",
               usage="zerotrain launch [--nproc N] [--max-restarts K] script.py [ARGS ...]")
    p.add_argument("--nproc", "--num_gpus", metavar="N", default=None,
                   help="ranks to start; default: one per visible GPU, else 1")
    p.add_argument("--max-restarts", metavar="K", default="0",
                   help="restart all ranks up to K times after a failure")
    p.add_argument("script", metavar="script.py", help="the training script")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    return p


@command("launch")
def main_launch(argv: list[str]) -> int:
    try:
        a = _parser().parse_args(argv)
    except UsageError as e:
        if "required: script.py" not in str(e):
            raise
        raise UsageError("give the training script to run: zerotrain launch [--nproc N] "
                         "script.py [ARGS ...]") from None
    if Path(a.script).is_dir():
        raise UsageError(f"script '{a.script}' is a directory: give the training script in it "
                         "(zerotrain launch [--nproc N] script.py [ARGS ...])")
    if not Path(a.script).is_file():
        raise UsageError(f"script '{a.script}' does not exist")
    if a.nproc is None:
        import torch

        nproc = max(1, torch.cuda.device_count())
    else:
        nproc = parse_count(a.nproc, "--nproc")
    restarts = parse_count(a.max_restarts, "--max-restarts", minimum=0)
    from zerotrain.comm.launch import launch_local

    # the ranks run the script through zerotrain.hf: its `import deepspeed` (and that of
    # transformers / Accelerate) resolves to zerotrain.deepspeed, for this run only
    return launch_local(nproc, [a.script, *a.args], module="zerotrain.hf",
                        max_restarts=restarts)
