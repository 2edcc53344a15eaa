from torch.distributed.elastic.multiprocessing.errors import record

from zerotrain.cli import main

# `record` writes an uncaught exception to torchrun's error file, so the launcher can
# name the failing rank and show its traceback.
raise SystemExit(record(main)())
