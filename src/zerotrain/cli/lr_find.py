"""`zerotrain lr-find`: a learning-rate range test on the run's own model and data.

Takes the same config, flags and overrides as `zerotrain train` (our own flags are
pulled out the same way, everything else is a config override); the test itself is
`zerotrain.run.lr_find`.
"""

from __future__ import annotations

import math

from zerotrain.cli.args import Parser, UsageError, command
from zerotrain.cli.train import _drop_flag, _load, _nproc, _split_known

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


def _number(flag: str, text: str | bool) -> float:
    try:
        x = float(text)
    except ValueError:
        raise UsageError(f"{flag} must be a number, got {text!r}") from None
    if not math.isfinite(x):
        raise UsageError(f"{flag} must be finite, got {text!r}")
    return x


def _steps(text: str | bool) -> int:
    try:
        return int(text)
    except ValueError:
        raise UsageError(f"--steps must be a whole number, got {text!r}") from None


@command("lr-find")
def main_lr_find(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:
        print(help_text())
        return 0
    flags = {"--config": True, "--nproc": True, "--deepspeed": True, "--start-lr": True,
             "--end-lr": True, "--steps": True, "--resume": True, "--max-restarts": True}
    opts, overrides = _split_known(argv, flags)
    for flag in ("--resume", "--max-restarts"):
        if flag in opts:
            raise UsageError(f"{flag} is a train option; lr-find always starts from the "
                             "configured model's initial (or model.hf pretrained) weights")
    for flag, value in opts.items():
        if value == "":
            raise UsageError(f"{flag} needs a value (see 'zerotrain lr-find --help')")
    start = _number("--start-lr", opts.get("--start-lr", DEFAULTS["--start-lr"]))
    end = _number("--end-lr", opts.get("--end-lr", DEFAULTS["--end-lr"]))
    steps = _steps(opts.get("--steps", DEFAULTS["--steps"]))
    nproc = _nproc(opts["--nproc"]) if "--nproc" in opts else 1
    from zerotrain.run.lr_find import check_range, lr_find, range_test_config

    check_range(start, end, steps)
    cfg = _load(opts, overrides, nproc)  # validate before launching
    from zerotrain.comm.dist import launched_by_torchrun

    if launched_by_torchrun():
        from zerotrain.run.lifecycle import die_with_parent

        die_with_parent()
    elif nproc > 1:
        from zerotrain.comm.launch import launch_local
        from zerotrain.run.setup import launch_checked

        with launch_checked(range_test_config(cfg, steps), None, nproc):
            return launch_local(nproc, ["lr-find", *_drop_flag(argv, "--nproc")])
    lr_find(cfg, start_lr=start, end_lr=end, steps=steps)
    return 0
