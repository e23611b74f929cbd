"""Where checkpoint bytes live and how they are laid out, shared by the workers and the agent.

- `manifest`: names of a checkpoint and its files, the manifest, versions;
- `durable`: files written so a crash leaves the old or the new one, whole;
- `claim`: which job writes a checkpoint directory (writer.json);
- `directory`: a checkpoint directory (`CheckpointStore`): commit protocol, quarantine,
  retention; `directory_reader`: its listing, checked reads and verification;
- `commit`: the one way a checkpoint is committed, by rank 0 and by a snapshot keeper;
- `location`, `stores`: what `--ckpt-dir` names (a directory or `s3://BUCKET/PREFIX`) and its store;
- `object_store`: checkpoints in a bucket (`BucketStore`), committed by a conditional write;
- `chunks`, `sharded`, `tensors_json`: tensor bytes under torch.distributed.checkpoint (shard
  files, crc32c per block; tensors.json, their metadata);
- `parts`, `keeper_address`: in-memory snapshot parts, and where a node's keeper holds them.

This package sits below both sides: the workers (elastic.checkpoint) write and
restore through it, the agent's snapshot keeper (elastic._agent.launcher.keeper)
persists through it. It imports only torch, elastic._shared.common.errors and elastic._shared.common.version
(and boto3, when a bucket is used: object_store/s3.py).
"""
