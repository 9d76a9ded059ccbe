"""The ranker: receives fused payloads (payload.py), checks them against the manifest and
joins them into batches (signature.py, batcher.py), runs the dense program (executor.py) and
replies. `cleave ranker` (cli.py) serves it over the internal protocol; docs/serving.md."""

# Requests a ranker queues at most (`cleave ranker --max-queue`); one more is answered
# `overloaded` at once. Requests, not rows: with the default --max-batch of 256 rows a full
# queue is several batches of work, enough to keep the program busy; beyond that, waiting
# only turns into `deadline` drops, while a refusal lets the router try another ranker.
from cleave.settings import RankerConfig, default

DEFAULT_MAX_QUEUE = default(RankerConfig, "max_queue")
DEFAULT_MAX_BATCH = default(RankerConfig, "max_batch")
