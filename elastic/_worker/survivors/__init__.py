"""Survivors: a group that changes in its own processes after a failure (TORCHREVIVE_SURVIVORS=keep|train-on).

`plugin.Survivors` is what `Run` meets, through the hooks it declares; `healing`
forms the groups, `views` says who is in them (train-on), `regroup` builds a
process group in place.
"""
