"""Checkpoints in an object store (`--ckpt-dir s3://BUCKET/PREFIX`), with a directory's guarantees.

- `objects`: what the checkpoint code needs of a bucket (`Objects`: conditional
  puts, ranged gets, listings, multipart uploads) and its errors, which are `OSError`s;
- `s3`: that interface on S3 and S3-compatible servers (boto3), credentials and
  endpoint from the standard environment only;
- `transfer`: a part streamed up in parallel ranges (`PartUpload`) and a
  checkpoint's chunks read back in parallel ranges (`BucketChunks`);
- `bucket_claim`: which job writes a prefix (`writer.json` replaced only by
  conditional writes);
- `bucket`: `BucketStore`, the checkpoint store on a bucket: the same methods
  as a directory's `CheckpointStore`, its commit one manifest object created
  with `If-None-Match: *`; `bucket_reader`: its listing, checked reads and
  verification; `bucket_retention`: what its commit deletes.

The layout, the commit protocol and its invariants are bucket.py's docstring;
docs/object-storage.md is the user's side.
"""
