"""Sizing a deployment for a target rate and latency (docs/sizing.md): `cleave profile`
measures what one request costs on the machine at hand (profile.py), `cleave size` turns a
profile and a catalog of machine kinds with prices (catalog.py) into the cheapest mix of
hosts that meets the rate at the p99 with one host to spare (queueing.py, search.py), and
writes it as a plan (plan.py): `cleave size` decides how much, the planner decides where."""
