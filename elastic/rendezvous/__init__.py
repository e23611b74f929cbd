"""torchrun rendezvous plugins. `etcd` holds the `etcd-v3` backend (see its docstring)."""
