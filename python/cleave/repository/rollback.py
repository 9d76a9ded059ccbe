"""`cleave rollback NAME`: a canary ends, or, with none, the previous default version serves
again, at once (docs/repository.md, "Rollout")."""

from __future__ import annotations

import argparse
import json

from cleave.repository.rollout import add_common, admin_call


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common(parser)


def run(args: argparse.Namespace) -> int:
    print(json.dumps(admin_call(args, "rollback", {"model": args.model})))
    return 0
