"""The application: one training run, from a config to a finished run folder.

`zerotrain train` and `zerotrain lr-find` (in `zerotrain.cli`) call into here; the library
below (engine, ZeRO strategies, collectives, models, data) knows nothing of it.

- `setup.py`: config -> data -> engine; resume or start fresh; the launcher's checks
- `loop.py`: the training loop, one step, evaluation, the end of a run
- `report.py`: what the user sees: progress, metric records, the text of every line
- `trackers.py`: where metric records go (jsonl, csv, TensorBoard, W&B)
- `curves.py` / `fit.py`: curves.png, and the train–validation gap and its verdict
- `run_dir.py`: one run per folder; what --resume means
- `lifecycle.py`: preemption, dying with the launcher, injected faults, a full disk
- `lr_find.py`: the learning-rate range test

Nothing is imported here, so a command that needs one module does not pay for the rest.
"""
