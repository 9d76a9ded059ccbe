"""The ranker: receives fused payloads (payload.py), checks them against the manifest and
joins them into batches (signature.py, batcher.py), runs the dense program (executor.py) and
replies. `cleave ranker` (cli.py) serves it over the internal protocol; docs/serving.md."""
