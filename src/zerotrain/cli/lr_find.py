"""`zerotrain lr-find`: a learning-rate range test on the run's own model and data.

Takes the same config, flags and overrides as `zerotrain train` (both go through
`run_command.config_command`: our own flags pulled out, the rest config overrides, then
run here or launched on --nproc ranks); the test itself is
`zerotrain.run.lr_find`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from zerotrain.cli.args import Parser, UsageError, command, finite_float, parse_count
from zerotrain.cli.run_command import Job, config_command

if TYPE_CHECKING:
    from zerotrain.config import Config

DEFAULTS = {"--start-lr": 1e-5, "--end-lr": 1.0, "--steps": 100}


def help_text() -> str:
    from zerotrain.run.lr_find import DIVERGENCE, SMOOTHING, SUGGESTION

    p = Parser("lr-find", "Learning-rate range test: train the configured model on its data "
               "for --steps optimizer steps while the lr grows exponentially from --start-lr "
               "to --end-lr; stop when the loss diverges; plot loss against lr and suggest a "
               "peak lr (optimizer.lr) with the rule used. Any ZeRO stage, any --nproc. "
               "Writes only into <logging.run_dir>/lr-find/ (replaced each time); never "
               "saves checkpoints.",
               usage="zerotrain lr-find [--config FILE] [--nproc N] [--start-lr LR] "
                     "[--end-lr LR] [--steps N]\n"
                     "                         [--deepspeed FILE] [--section.key VALUE ...]",
               epilog=f"Rules. Smoothing: {SMOOTHING}. Divergence: {DIVERGENCE}. "
               f"Suggested peak lr: {SUGGESTION}. Background: docs/design.md §schedule.")
    p.add_argument("--config", metavar="FILE", help="YAML or JSON config, as for train")
    p.add_argument("--nproc", metavar="N", help="run on N local ranks, as train does; "
                   "default: this one process")
    p.add_argument("--start-lr", metavar="LR", default=DEFAULTS["--start-lr"],
                   help="lr of the first step")
    p.add_argument("--end-lr", metavar="LR", default=DEFAULTS["--end-lr"],
                   help="lr of the last step, if the loss has not diverged before")
    p.add_argument("--steps", metavar="N", default=DEFAULTS["--steps"],
                   help="optimizer steps of the ramp")
    p.add_argument("--deepspeed", metavar="FILE", help="take the settings from a DeepSpeed "
                   "JSON config, as for train")
    return p.format_help()


def _job(opts: dict[str, str], cfg: Config) -> Job:
    for flag in ("--resume", "--max-restarts"):
        if flag in opts:
            raise UsageError(f"{flag} is a train option; lr-find always starts from the "
                             "configured model's initial (or model.hf pretrained) weights")
    from zerotrain.run.lr_find import MIN_STEPS, check_range, lr_find, range_test_config

    start = finite_float(opts.get("--start-lr", str(DEFAULTS["--start-lr"])), "--start-lr")
    end = finite_float(opts.get("--end-lr", str(DEFAULTS["--end-lr"])), "--end-lr")
    steps = parse_count(opts.get("--steps", str(DEFAULTS["--steps"])), "--steps",
                        minimum=MIN_STEPS)
    check_range(start, end, steps)
    return Job(lambda: lr_find(cfg, start_lr=start, end_lr=end, steps=steps),
               range_test_config(cfg, steps))


@command("lr-find")
def main_lr_find(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:
        print(help_text())
        return 0
    return config_command("lr-find", argv, ("--start-lr", "--end-lr", "--steps", "--resume",
                                            "--max-restarts"), _job,
                          bare=("--resume", "--max-restarts"))  # refused by _job
