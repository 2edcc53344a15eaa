"""`training_data` -> the DataLoader DeepSpeed's `initialize` returns.

The same sampling as DeepSpeed's loader: torch's DistributedSampler with its defaults
(shuffled with seed 0, the same order every epoch unless the script calls
`loader.sampler.set_epoch`), so each rank draws a disjoint part, in DeepSpeed's
order; batches of the config's micro-batch size; `dataloader_drop_last` from the
config. Any map-style dataset (a Hugging Face `datasets.Dataset` too, as DeepSpeed's
DataLoader takes it). Loading runs in the training process (DeepSpeed starts two workers per rank):
the batches are the same.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset


def distributed_loader(dataset: Any, batch_size: int, rank: int, world: int,
                       collate_fn: Callable | None = None, drop_last: bool = False
                       ) -> DataLoader:
    map_style = isinstance(dataset, Dataset) or (hasattr(dataset, "__getitem__")
                                                 and hasattr(dataset, "__len__"))
    if isinstance(dataset, IterableDataset) or not map_style:
        raise ValueError("training_data must be a map-style dataset (a torch.utils.data."
                         "Dataset, a Hugging Face datasets.Dataset, anything with __len__ and "
                         "__getitem__: zerotrain.deepspeed shards it by index), not "
                         f"{type(dataset).__name__}")
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn,
                      drop_last=drop_last)
