"""`cleave rollout NAME --version V --percent P` and `cleave rollback NAME`: move a model's
unversioned traffic between its versions through the router's admin API (docs/repository.md,
"Rollout"). The router keeps the state and persists it; these commands only ask."""

from __future__ import annotations

import argparse
import json
import os
import urllib.error
import urllib.request

from cleave.errors import CleaveError, UsageError


def add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="the model's name")
    parser.add_argument("--url", required=True, help="the router's URL (http://HOST:PORT)")
    parser.add_argument(
        "--token-env",
        help="environment variable holding the admin token (the router's admin_token_env)",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common(parser)
    parser.add_argument("--version", required=True, help="the version to send traffic to")
    parser.add_argument(
        "--percent",
        type=float,
        required=True,
        help="share of the model's unversioned requests it gets, 0..100; 100 promotes it to "
        "the default, 0 ends the canary",
    )


def run(args: argparse.Namespace) -> int:
    if not 0 <= args.percent <= 100:
        raise UsageError(f"--percent: expected 0..100, got {args.percent}")
    body = {"model": args.model, "version": args.version, "percent": args.percent}
    print(json.dumps(admin_call(args, "rollout", body)))
    return 0


def admin_call(args: argparse.Namespace, what: str, body: dict) -> dict:
    """POSTs `body` to the router's /admin/v1/{what}; the router's answer, or its error."""
    headers = {"content-type": "application/json"}
    if args.token_env:
        token = os.environ.get(args.token_env, "")
        if not token:
            raise UsageError(f"--token-env {args.token_env}: that variable is unset or empty")
        headers["authorization"] = f"Bearer {token}"
    url = f"{args.url.rstrip('/')}/admin/v1/{what}"
    request = urllib.request.Request(url, json.dumps(body).encode(), headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as err:
        detail = err.read().decode(errors="replace")
        try:
            detail = json.loads(detail)["error"]
        except (ValueError, KeyError, TypeError):
            pass
        raise CleaveError(f"{url}: {err.code}: {detail}") from None
    except (urllib.error.URLError, OSError) as err:
        raise CleaveError(f"{url}: no answer: {err}") from None
