"""Whether zerotrain.deepspeed opened the process group itself (and so closes it at
exit): written by `deepspeed.comm.init_distributed`, read by the engine's exit hook.
Its own module so that comm, zero and engine can all reach it without importing
each other."""

OPENED_GROUP = False
