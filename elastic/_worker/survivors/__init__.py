"""Survivors: a group that changes in its own processes after a failure (TORCHREVIVE_SURVIVORS=keep|train-on).

`plugin.Survivors` is what `Run` meets, through the hooks it declares; `changes` walks a change
through the phases of `lifecycle`; `healing` forms the groups from one module per mechanism:
`regroup` (membership: leave, wait for a heal, form a group in place), `ddp_rebind` (void steps, DDP's
reducer on the new group), `catch_up` (who holds the newest state; the checkpoint package's live
restore takes it), `views` and `joiners` (who is in a group, train-on).
"""
