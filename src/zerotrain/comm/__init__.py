"""Process groups, launcher, collectives (native | ring) over any group, byte counters.

`collectives.Comm` (the only door to the wire; `subgroup` / `split` / `grads`), `ops` (the
collectives as a table), `ring` (zerotrain's own over point-to-point), `traffic` (byte
counters), `handle` (async handles, the comm thread), `lockstep` (where ranks part),
`autograd` (the differentiable all-to-all of sequence parallelism), `dist` / `launch`.
"""
