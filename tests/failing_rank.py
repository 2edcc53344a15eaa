"""Entry point for test_launch: rank 1 raises, rank 0 waits for it."""

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


@record
def main() -> None:
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        raise RuntimeError("rank one exploded on purpose")
    dist.barrier()


if __name__ == "__main__":
    main()
