"""What every benchmark shares; an experiment (one file in cleave.bench per `cleave bench`
command) declares its targets and its same-run ratios and leaves the rest here:

* `workload`: the model, its bundle, request bodies in each protocol, expected outputs, the
  default latency budget.
* `target`: a deployment under load (`cleave serve` with a bundle or a plan, or a URL).
* `measurement`: single requests, open-loop probes per rate, the search for the highest rate
  within budget, all through the one client (cleave.bench.loadgen: the Rust load generator,
  and a Python client only where one request at a time is measured).
* `summary`: percentiles, goodput, declared same-run ratios, the table, the JSON.
* `bundles`: synthetic (tables-only) bundles, written through cleave.bundle.manifest.
"""
