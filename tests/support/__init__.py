"""What the tests share (docs/testing.md): processes and their logs (`processes`), one
readiness wait (`waiting`), served reference models (`served`), HTTP requests and load
(`client`), synthetic shard bundles and raw frames (`shards`), a dense ranker module
(`dense`), a router in front of real shards and a ranker (`router`), the Helm chart
(`helm`). Fixtures are in tests/conftest.py; test modules import from here, never from each
other (tests/test_layers_tests.py checks it)."""
